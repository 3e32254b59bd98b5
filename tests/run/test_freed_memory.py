"""return_freed_memory: blocks of a step reuse resident memory, and large freed memory goes back.

The probe runs in a process of its own (mallopt changes the allocator of the whole process), once
for both tests.
"""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = textwrap.dedent("""
    import resource
    import torch
    from klppo.run.setup import return_freed_memory

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    if not return_freed_memory():
        print("SKIP not glibc"); raise SystemExit
    # A first forward: blocks under 1 MiB (which grow the heap) and one of 16 MiB.
    small = [torch.ones(1 << 16) for _ in range(64)]
    torch.ones(16 << 18).sum()
    rounds = []
    for _ in range(2):  # the fewer of two rounds: a one-off mapping elsewhere in the process is not the blocks'
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):  # the activations of 20 more forwards: 16 MiB each, freed after use
            torch.ones(16 << 18).sum()
        rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    faults = min(rounds)
    before = rss_mib()
    held = [torch.ones(16 << 18) for _ in range(64)]  # 1 GiB live at once, then freed
    peak = rss_mib()
    del held
    print(faults, peak - before, rss_mib() - before)
""")


@pytest.fixture(scope="module")
def probe() -> tuple[int, float, float]:
    """(page faults of the 20 blocks after the first, MiB the 1 GiB raised the resident set, MiB left after freeing it)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    if out.startswith("SKIP"):
        pytest.skip(out)
    faults, grown, kept = out.split()
    return int(faults), float(grown), float(kept)


def test_a_steps_blocks_reuse_resident_memory(probe):
    """A fixed mmap threshold alone maps each 16 MiB block afresh: 4,096 page faults a block. With
    the heap's top pad, blocks after the first come from memory already resident."""
    faults, _, _ = probe
    assert faults < 4096, f"{faults} page faults for 20 blocks of 16 MiB after the first"


def test_freed_memory_beyond_the_pad_goes_back_to_the_os(probe):
    from klppo.monitoring.memory import HEAP_TOP_PAD

    _, grown, kept = probe
    assert grown > 900  # 1 GiB was resident
    assert kept < HEAP_TOP_PAD / 2**20 + 64, f"{kept:.0f} MiB of 1 GiB freed stayed resident"
