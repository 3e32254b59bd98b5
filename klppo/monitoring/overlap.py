"""``perf/overlap_ratio``: how much of a phase's compute time its communication would need.

Measured from the PyTorch profiler on the first micro-batch of the update phases of
distributed runs: the self times of collective operations (NCCL kernels on CUDA; gloo
collectives and FSDP2's all-gather and reduce-scatter on CPU) over the self times of
everything else, capped at 1. Below 1, FSDP2's prefetching can hide the communication behind
compute; at 1 it cannot. One micro-batch holds every block's all-gather (forward) and
reduce-scatter (backward), so it shows the ratio at a fraction of the cost of profiling the
whole update: the profiler records every operation (on CPU it tripled an update's time) and
on CUDA every kernel, and reading the events back grows with their number.
"""

from __future__ import annotations

import os
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, schedule

COMM_MARKERS = ("nccl", "c10d::", "gloo", "FSDP::all_gather", "FSDP::post_backward_reduce", "reduce_scatter",
                "all_reduce", "allreduce")
NOT_COMM = ("copy",)  # FSDP::all_gather_copy_in/out are local copies


def is_communication(name: str) -> bool:
    return any(m in name for m in COMM_MARKERS) and not any(m in name for m in NOT_COMM)


def comm_and_compute_seconds(times: Iterable[tuple[str, float]]) -> tuple[float, float]:
    """(communication, compute) seconds from (operation name, self time in microseconds) pairs."""
    comm = compute = 0.0
    for name, micros in times:
        if is_communication(name):
            comm += micros
        else:
            compute += micros
    return comm / 1e6, compute / 1e6


def overlap_ratio(comm_s: float, compute_s: float) -> float:
    return min(1.0, comm_s / compute_s) if compute_s > 0 else 1.0


@dataclass
class OverlapMeasure:
    comm_s: float = 0.0
    compute_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"perf/overlap_ratio": overlap_ratio(self.comm_s, self.compute_s),
                "perf/comm_time_s": self.comm_s, "perf/compute_time_s": self.compute_s}


def _no_profile() -> None:
    pass


@contextmanager
def profiled(device: torch.device, measure: OverlapMeasure, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Add the communication and compute time of the ``with`` block's first micro-batch to ``measure``
    (device time on CUDA). The block calls the function it is given after each micro-batch
    (``update``'s ``after_micro_batch``); the profiler stops recording at the first call.
    """
    if not enabled:
        yield _no_profile
        return
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else Kineto prints two lines per profile to stderr
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    recording = ExitStack()
    with warnings.catch_warnings():  # started here, so that its warnings about itself are not the block's
        # no warm-up step: an update may have a single micro-batch
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        # torch 2.11 says at every start that a cycle's events replace the last's: there is one cycle
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        prof = recording.enter_context(
            profile(activities=activities, schedule=schedule(wait=0, warmup=0, active=1, repeat=1)))
    with recording:
        yield prof.step
    attr = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    # ProfilerStep#N is the schedule's own marker around the recorded micro-batch, not an operation.
    times = ((e.key, getattr(e, attr)) for e in prof.key_averages() if not e.key.startswith("ProfilerStep"))
    comm, compute = comm_and_compute_seconds(times)
    measure.comm_s += comm
    measure.compute_s += compute
