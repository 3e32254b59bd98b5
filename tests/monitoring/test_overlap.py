"""perf/overlap_ratio: communication self time over compute self time, from profiler events."""

import pytest
import torch

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
