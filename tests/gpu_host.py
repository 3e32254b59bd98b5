"""Making a process look like one on a GPU host, where calls that create a CUDA context fail.

A CUDA context takes hundreds of MiB of a GPU that another job may be using: a CPU run must
make none. ``pretend_gpu_host`` makes ``torch.cuda.is_available()`` say True and turns every
call that would create one into an AssertionError naming it.
"""

from typing import Callable

import torch

# torch.cuda.manual_seed_all is not among them: it waits until CUDA starts.
CUDA_CONTEXT_CALLS = ("init", "synchronize", "set_device", "current_device", "set_rng_state", "get_rng_state",
                      "empty_cache", "reset_peak_memory_stats", "max_memory_allocated", "mem_get_info")


def _refused(name: str) -> Callable:
    def call(*args, **kwargs):
        raise AssertionError(f"a CPU run called {name}, which creates a CUDA context on a GPU host")
    return call


def pretend_gpu_host(set_attr: Callable = setattr) -> None:
    """``set_attr``: ``setattr``, or pytest's ``monkeypatch.setattr`` to undo it after a test."""
    set_attr(torch.cuda, "is_available", lambda: True)
    # What every optimiser step asks once CUDA is available (Optimizer._accelerator_graph_capture_health_check):
    # on a GPU host it answers False without creating a context where none exists; a CUDA build of
    # torch on a machine without a driver would raise instead.
    set_attr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name in CUDA_CONTEXT_CALLS:
        set_attr(torch.cuda, name, _refused(f"torch.cuda.{name}"))
    set_attr(torch.Tensor, "pin_memory", _refused("Tensor.pin_memory"))
