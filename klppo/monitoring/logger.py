"""Where metrics go: ``<run dir>/metrics.jsonl`` always; the console, TensorBoard and W&B when asked.

Only rank 0 writes: the other ranks hold the same (all-reduced) numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import torch

from klppo.monitoring.backends import build_backends
from klppo.monitoring.generations import GENERATIONS_KEY, generations_text
from klppo.monitoring.jsonl import read_jsonl

METRICS_FILE = "metrics.jsonl"


def to_floats(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """0-dim tensors and numbers -> plain floats, in the same order: one host-device copy per device
    for all of its tensors (a step logs about a hundred; ``.item()`` on each was a copy each). Read
    as float64, which holds every fp32, bf16 and small integer value exactly, as ``.item()`` did."""
    tensors: dict[torch.device, list[str]] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            tensors.setdefault(v.device, []).append(k)
    out = {k: v for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    for keys in tensors.values():
        values = torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()  # host sync
        out.update(zip(keys, values))
    return {k: float(out[k]) for k in metrics}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics records of a run, one dict per logged step, in file order."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)


# What the console shows of a PPO step (everything goes to metrics.jsonl), grouped by prefix.
PPO_CONSOLE_KEYS = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_to_ref",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "critic/score/mean",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "response_length/mean",
    "perf/throughput",
    "perf/time_per_step",
)
CONSOLE_WIDTH = 96  # fits a 100-column terminal
VALUE_WIDTH = 10


def _format_value(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4g}"


def console_table(step: int, record: Mapping[str, float], keys: tuple[str, ...], total: int | None = None) -> str:
    """A header line, then one row of aligned ``name value`` cells per metric group (actor, critic, ...).

    ``keys`` that ``record`` lacks are left out; validation scores (``val-core/...``) always show.
    """
    shown = [k for k in keys if k in record] + [k for k in record if k.startswith("val-core/") and k not in keys]
    groups: dict[str, list[tuple[str, str]]] = {}
    for key in shown:
        group, _, name = key.partition("/")
        groups.setdefault(group if name else "", []).append((name or key, _format_value(record[key])))
    where = f"step {step}/{total} " if total else f"step {step} "
    lines = [where + "-" * max(0, CONSOLE_WIDTH - len(where))]
    label_width = max((len(g) for g in groups), default=0) + 2
    for group, cells in groups.items():
        name_width = max(len(name) for name, _ in cells)
        cell_width = name_width + 1 + VALUE_WIDTH + 2
        per_row = max(1, (CONSOLE_WIDTH - label_width) // cell_width)
        for i in range(0, len(cells), per_row):
            row = "".join(f"{name:<{name_width}} {value:>{VALUE_WIDTH}}  " for name, value in cells[i:i + per_row])
            lines.append(f"{group if i == 0 else '':<{label_width}}{row}".rstrip())
    return "\n".join(lines)


class MetricsLogger:
    """Appends one JSON object per step (with a ``step`` key) and fans it out to the asked backends.

    ``backends`` is ``trainer.logger``: ``console`` prints a table per step, ``jsonl`` changes
    nothing (metrics.jsonl is always written), ``tensorboard``, ``wandb`` and ``mlflow`` need their
    packages and raise a ``UserError`` naming the ``pip install`` here, before any step runs. Set
    ``console`` to switch the table off and on between steps. ``close()`` ends the TensorBoard /
    W&B / MLflow runs; each step is flushed as it is logged, so a run that never closes loses nothing.
    """

    def __init__(
        self, run_dir: str | Path, backends: list[str], print_fn=print, console_keys: tuple[str, ...] = PPO_CONSOLE_KEYS,
        *, rank: int = 0, project_name: str = "klppo", experiment_name: str = "run", config: Mapping | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.console_keys = console_keys
        self.rank = rank
        self.console = "console" in backends and rank == 0
        self.print_fn = print_fn
        self.backends = []
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.backends = build_backends(list(backends), self.path.parent, project_name, experiment_name, config)

    def log(self, step: int, metrics: Mapping[str, float | torch.Tensor], total: int | None = None) -> dict[str, float]:
        """Write one step's metrics (rank 0 only); returns them as plain floats with their ``step``.

        Validation responses under ``GENERATIONS_KEY`` (``trainer.log_val_generations``) are shown
        as text (console, TensorBoard, W&B) and are neither written to metrics.jsonl nor returned."""
        generations = metrics.get(GENERATIONS_KEY)
        record = {"step": step, **to_floats({k: v for k, v in metrics.items() if k != GENERATIONS_KEY})}
        if self.rank != 0:
            return record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for backend in self.backends:
            backend.log(step, record)
            if generations:
                backend.log_generations(step, generations)
        if self.console:
            self.print_fn(console_table(step, record, self.console_keys, total))
            if generations:
                self.print_fn(generations_text(step, generations))
        return record

    def close(self) -> None:
        """End the TensorBoard / W&B runs; calling it again does nothing."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
