"""What the run report's modules share: a run's files as read, step lists as ranges, config look-ups.

Its own module so that ``report`` (the document) and ``health_report`` (its health section)
both build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from klppo.monitoring.plots import series


@dataclass
class Run:
    path: Path
    records: list[dict]  # metrics.jsonl, in step order
    events: list[dict]  # events.jsonl: {"step", "kind", "message", ...numbers}
    config: dict  # config.yaml, {} when absent


def config_value(config: dict, dotted: str):
    """``config["a"]["b"]`` for "a.b"; None where a part is missing."""
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def step_ranges(steps: Sequence[int], most: int = 8) -> str:
    """[10, 11, 12, 30] -> '10-12, 30' (consecutive integers form a range); ranges past ``most`` are counted."""
    parts, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    more = f" and {len(parts) - most} more" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def steps_word(steps: Sequence[int]) -> str:
    """[4] -> 'step 4'; [4, 5, 9] -> 'steps 4-5, 9'."""
    return f"step{'s' if len(steps) > 1 else ''} {step_ranges(steps)}"


def training(run: Run, key: str) -> tuple[list[int], list[float]]:
    """The steps and values of ``key`` over the training steps (step 0 is the validation before training)."""
    s = series([r for r in run.records if r["step"] >= 1], key)
    return s.steps, s.values
