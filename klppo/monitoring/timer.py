"""Wall-clock timers for the phases of a step (verl's ``timing_s/<phase>`` metrics)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimer:
    """Accumulates seconds per named phase; ``metrics()`` returns ``{"timing_s/<name>": s}``.

    With a ``progress`` (``klppo.monitoring.progress.Progress``), each phase but the whole
    "step" is also named on the progress bar while it runs.
    """

    def __init__(self, progress=None) -> None:
        self.seconds: dict[str, float] = {}
        self.progress = progress

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        shown = self.progress.phase(name) if self.progress is not None and name != "step" else nullcontext()
        try:
            with shown:
                yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # host-device sync: time the kernels, not their launch
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": s for name, s in self.seconds.items()}
