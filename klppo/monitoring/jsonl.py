"""JSON-lines files of a run (one record per line, each with a ``step``): append, read, truncate."""

from __future__ import annotations

import json
from pathlib import Path

EVENTS_FILE = "events.jsonl"  # guard actions: {"step", "kind", "message", ...numbers}


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (what a crashed run logged after its last checkpoint).

    Never fails on the file's content, since it runs after the resume target was checked:
    a last line cut short (a process killed while appending it; it came after the checkpoint)
    is dropped, and any other line that is not a record with an integer ``step`` is kept as it
    was, bytes included (``klppo report`` names it). The file is replaced whole, atomically.
    """
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    lines = text.split("\n")
    if lines[-1].strip() and _step(lines[-1]) is None:  # no newline after it and not a record: torn
        lines.pop()
    kept = [line for line in lines if line.strip() and (_step(line) is None or _step(line) <= last_step)]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8", errors="surrogateescape")
    partial.replace(path)


def _step(line: str) -> int | None:
    """The integer ``step`` of a JSON-lines record, None for a line that is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if type(step) is int else None


def set_aside(run_dir: Path, names: tuple[str, ...], print_fn=print) -> None:
    """A fresh run never appends to an earlier run's logs: those are kept as ``<name>.prev``."""
    for name in names:
        path = Path(run_dir) / name
        if path.exists():
            path.replace(path.with_name(name + ".prev"))
            print_fn(f"an earlier run's {name} was moved to {name}.prev")
