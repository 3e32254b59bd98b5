"""Each phase gets its own peak memory; an enclosing phase gets the largest of its own and its phases'."""

import torch

from klppo.monitoring.memory import PeakMemory
from klppo.monitoring.timer import PhaseTimer
from klppo.monitoring.memory import HEAP_TOP_PAD


class ScriptedMemory:
    """A PeakMemory whose readings are scripted: ``level`` is the memory in use, the peak its high-water mark."""

    def __init__(self):
        self.level, self.peak = 1.0, 1.0

    def use(self, gb: float) -> None:
        self.level = gb
        self.peak = max(self.peak, gb)

    def reset(self) -> None:
        self.peak = self.level

    def peak_gb(self) -> float:
        return self.peak


def test_each_phase_has_its_own_peak_and_the_step_the_largest():
    memory = ScriptedMemory()
    timer = PhaseTimer(memory=memory)
    with timer.phase("step"):
        memory.use(3.0)  # before any inner phase: the step's own
        memory.use(1.0)
        with timer.phase("gen"):
            memory.use(5.0)
            memory.use(2.0)
        with timer.phase("update"):
            memory.use(4.0)
            memory.use(1.5)
    peaks = timer.peak_metrics()
    assert peaks == {"perf/peak_memory_gb/gen": 5.0, "perf/peak_memory_gb/update": 4.0,
                     "perf/peak_memory_gb/step": 5.0}


def test_a_phase_entered_twice_keeps_its_larger_peak():
    memory = ScriptedMemory()
    timer = PhaseTimer(memory=memory)
    for gb in (2.0, 6.0, 3.0):
        with timer.phase("forward"):
            memory.use(gb)
        memory.use(1.0)
    assert timer.peak_metrics() == {"perf/peak_memory_gb/forward": 6.0}


def test_the_process_peak_is_reset_between_phases_on_linux():
    memory = PeakMemory(torch.device("cpu"))
    if not memory.resettable:
        return  # no /proc/self/clear_refs here: the lifetime peak is all there is
    timer = PhaseTimer(memory=memory)
    # Larger than the memory glibc may keep resident for reuse (klppo's HEAP_TOP_PAD, set by any
    # earlier run in this process): a block that fits there would not raise the resident set.
    size = HEAP_TOP_PAD + 64 * 2**20
    with timer.phase("big"):
        block = torch.ones(size // 4)  # touched
        del block
    with timer.phase("small"):
        torch.ones(1024).sum()
    peaks = timer.peak_metrics()
    assert peaks["perf/peak_memory_gb/big"] - peaks["perf/peak_memory_gb/small"] > 0.9 * size / 2**30
