"""Where metrics go: ``<run dir>/metrics.jsonl`` always, and the console when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import torch

METRICS_FILE = "metrics.jsonl"


def to_floats(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """0-dim tensors and numbers -> plain floats (one host-device sync per tensor)."""
    return {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics records of a run, one dict per logged step, in file order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: str | Path, last_step: int) -> None:
    """Drop records after ``last_step`` (steps a crashed run logged but never checkpointed)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


# What the console shows of a PPO step (everything goes to metrics.jsonl).
PPO_CONSOLE_KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "response_length/mean",
    "perf/throughput",
)


def _format_value(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4g}"


class MetricsLogger:
    """Appends one JSON object per step (with a ``step`` key) and prints selected metrics."""


    def __init__(
        self, run_dir: str | Path, backends: list[str], print_fn=print, console_keys: tuple[str, ...] = PPO_CONSOLE_KEYS
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.console_keys = console_keys
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = "console" in backends
        self.print_fn = print_fn

    def log(self, step: int, metrics: Mapping[str, float | torch.Tensor], total: int | None = None) -> dict[str, float]:
        record = {"step": step, **to_floats(metrics)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            shown = [f"{k}={_format_value(record[k])}" for k in self.console_keys if k in record]
            shown += [f"{k}={_format_value(v)}" for k, v in record.items() if k.startswith("val-core/")]
            where = f"step {step}/{total}" if total else f"step {step}"
            self.print_fn(f"{where} | " + " | ".join(shown))
        return record
