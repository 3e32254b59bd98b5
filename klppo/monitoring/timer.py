"""Wall-clock timers for the phases of a step (verl's ``timing_s/<phase>`` metrics)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per named phase; ``metrics()`` returns ``{"timing_s/<name>": s}``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # host-device sync: time the kernels, not their launch
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": s for name, s in self.seconds.items()}
