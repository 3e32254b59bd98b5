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
    """Drop records after ``last_step`` (what a crashed run logged after its last checkpoint)."""
    if path.exists():
        kept = [r for r in read_jsonl(path) if r["step"] <= last_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def set_aside(run_dir: Path, names: tuple[str, ...], print_fn=print) -> None:
    """A fresh run never appends to an earlier run's logs: those are kept as ``<name>.prev``."""
    for name in names:
        path = Path(run_dir) / name
        if path.exists():
            path.replace(path.with_name(name + ".prev"))
            print_fn(f"an earlier run's {name} was moved to {name}.prev")
