"""Peak memory of a phase: the device's (CUDA) or the process's resident set (CPU).

On CUDA the peak is ``torch.cuda.max_memory_allocated``, reset with
``reset_peak_memory_stats``. On Linux CPUs it is the kernel's high-water mark of the resident
set (``VmHWM`` in ``/proc/self/status``), which writing ``5`` to ``/proc/self/clear_refs``
resets to the current resident set; where that file is missing (macOS, some sandboxes) the
peak is the process's lifetime maximum (``ru_maxrss``) and phases cannot be told apart.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
GB = 2**30
# Freed memory glibc keeps at its heap's top for the next allocations (``run.setup.return_freed_memory``
# sets it in every run): a CPU phase's resident set holds it once the run has allocated it.
HEAP_TOP_PAD = 512 << 20


def _vm_hwm_bytes() -> int | None:
    """The resident set's high-water mark from /proc, or None where there is none."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def _reset_vm_hwm() -> bool:
    """Reset VmHWM to the current resident set; False where the kernel does not allow it."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss if sys.platform == "darwin" else rss * 1024


class PeakMemory:
    """The peak memory (GiB) since the last ``reset`` on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = device.type == "cuda" or (_vm_hwm_bytes() is not None and _reset_vm_hwm())

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_vm_hwm()

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / GB
        hwm = _vm_hwm_bytes() if self.resettable else None
        return (hwm if hwm is not None else _max_rss_bytes()) / GB


def available_bytes(device: torch.device) -> int:
    """Memory free for this process: the device's free memory (CUDA), or the machine's available
    memory (``MemAvailable``) shared by the ranks on this node (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except OSError:
        pass
    return 0
