"""Wall-clock timers and peak memory for the phases of a step (verl's ``timing_s/<phase>`` metrics)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

from klppo.monitoring.memory import PeakMemory

PEAK_MEMORY = "perf/peak_memory_gb"  # perf/peak_memory_gb/<phase>: the phase's own peak


class PhaseTimer:
    """Accumulates seconds per named phase; ``metrics()`` returns ``{"timing_s/<name>": s}``,
    ``peak_metrics()`` the phases' peak memory.

    With a ``progress`` (``klppo.monitoring.progress.Progress``), each phase but the whole
    "step" is also named on the progress bar while it runs. With a ``memory``
    (``PeakMemory``), the high-water mark is reset as each phase starts, so each phase gets
    its own peak (``perf/peak_memory_gb/<name>``); a phase that encloses others (the "step")
    gets the largest of theirs and its own.

    ``device``: where the phases compute (default: ``memory``'s device). Only on CUDA does a phase
    wait for its kernels at its end; a CPU run never calls into CUDA, which on a GPU host would
    create a CUDA context (hundreds of MiB of a GPU that another job may be using).
    """

    def __init__(self, progress=None, memory: PeakMemory | None = None, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}
        self.progress = progress
        self.memory = memory
        self.device = device if device is not None else getattr(memory, "device", None)
        self._open: list[str] = []  # phases entered and not left, outermost first

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self._track(enter=name)
        shown = self.progress.phase(name) if self.progress is not None and name != "step" else nullcontext()
        try:
            with shown:
                yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host-device sync: time the kernels, not their launch
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self._track(leave=name)

    def _track(self, enter: str | None = None, leave: str | None = None) -> None:
        """The peak so far belongs to every open phase; a phase that starts begins from a reset mark."""
        if self.memory is None:
            return
        peak = self.memory.peak_gb()
        for name in self._open:
            self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), peak)
        if enter is not None:
            self.memory.reset()
            self._open.append(enter)
        if leave is not None:
            self._open.remove(leave)

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": s for name, s in self.seconds.items()}

    def peak_metrics(self) -> dict[str, float]:
        """``perf/peak_memory_gb/<phase>`` of every phase (with a ``memory``; {} without)."""
        return {f"{PEAK_MEMORY}/{name}": gb for name, gb in self.peak_gb.items()}
