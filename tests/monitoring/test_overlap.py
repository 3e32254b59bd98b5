"""perf/overlap_ratio: communication self time over compute self time, from profiler events."""

import pytest
import torch

from klppo.monitoring import overlap
from klppo.monitoring.overlap import OverlapMeasure, comm_and_compute_seconds, is_communication, overlap_ratio, profiled


@pytest.mark.parametrize("name, comm", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", True),
    ("c10d::_allgather_base_", True),
    ("FSDP::all_gather (model.layers.0)", True),
    ("FSDP::post_backward_reduce (model.layers.1)", True),
    ("FSDP::all_gather_copy_out (model.layers.0)", False),
    ("aten::mm", False),
    ("aten::sum", False),
])
def test_collectives_are_told_from_compute(name, comm):
    assert is_communication(name) is comm


def test_seconds_and_ratio_from_self_times():
    comm, compute = comm_and_compute_seconds([("c10d::_allgather_base_", 2_000.0), ("aten::mm", 6_000.0),
                                              ("aten::add", 2_000.0)])
    assert (comm, compute) == (0.002, 0.008)
    assert overlap_ratio(comm, compute) == 0.25
    assert overlap_ratio(3.0, 1.0) == 1.0 and overlap_ratio(0.0, 0.0) == 1.0


def test_a_profiled_block_without_communication_measures_compute_only(capfd):
    measure = OverlapMeasure()
    with profiled(torch.device("cpu"), measure):
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert measure.comm_s == 0.0 and measure.compute_s > 0.0
    assert measure.metrics()["perf/overlap_ratio"] == 0.0
    assert "USDT" not in capfd.readouterr().err  # Kineto's start/stop lines are silenced


def test_profiling_warns_nothing_about_itself_and_leaves_the_blocks_warnings_alone():
    """torch 2.11 warns at every profiler start that one cycle's events replace the last's (once per
    process, in the first update of every distributed run); a warning the block raises still comes."""
    import warnings

    from torch.profiler import profiler

    profiler._WARNINGS_SHOWN.clear()  # what torch 2.11 warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with profiled(torch.device("cpu"), OverlapMeasure()) as micro_done:
            warnings.warn("the block's own", UserWarning)
            micro_done()
    assert [str(w.message) for w in caught] == ["the block's own"]


def test_only_the_first_micro_batch_of_a_profiled_update_is_recorded(monkeypatch):
    # Micro-batch 0 multiplies matrices, the later ones batched matrices: only aten::mm may be seen.
    recorded, real = [], overlap.comm_and_compute_seconds

    def recording(times):
        recorded.extend(times)
        return real(recorded)

    monkeypatch.setattr(overlap, "comm_and_compute_seconds", recording)
    a, b = torch.randn(32, 32), torch.randn(2, 32, 32)
    measure = OverlapMeasure()
    with profiled(torch.device("cpu"), measure) as micro_done:
        torch.mm(a, a)
        micro_done()
        for _ in range(3):
            torch.bmm(b, b)
            micro_done()
    names = {name for name, _ in recorded}
    assert "aten::mm" in names and "aten::bmm" not in names
    assert not any(name.startswith("ProfilerStep") for name in names)  # the schedule's marker is no operation
    assert measure.compute_s > 0.0


def test_an_update_that_is_not_measured_is_handed_a_no_op():
    measure = OverlapMeasure()
    with profiled(torch.device("cuda"), measure, enabled=False) as micro_done:
        micro_done()
    assert (measure.comm_s, measure.compute_s) == (0.0, 0.0)
