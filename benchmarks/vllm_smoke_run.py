"""The vLLM run of ``gpu_smoke.py``, in a process of its own (vLLM changes the process around it):
``python benchmarks/vllm_smoke_run.py OUT.json KEY=VALUE ...`` runs ``klppo ppo`` with the
overrides and writes what the engine was asked to do to OUT.json.

Two things only a GPU with sleep mode shows (#32 items 1 and 2), watched from inside:

- every generation has the actor's weights, loaded since the level-2 sleep that ended the one
  before (validation generates once per batch and again for its KL probe; the engine refuses a
  generation without weights, failing the run): ``generations``, ``loads``;
- every wake finds PyTorch's cache holding what the phases before left in it. Each wake is made
  to find nearly all of the free device memory in the cache (a block allocated and freed just
  before, as a training step's activations and optimiser buffers are), so a wake that did not
  empty the cache first would run out of memory: ``wakes`` and ``cached_before_wake_gib`` (the
  largest such block).
"""

from __future__ import annotations

import json
import sys

import torch

from klppo.rollout.vllm import VLLMEngine

MARGIN = 64 << 20  # what the held block leaves free: less than any wake maps


def fill_cache(device: torch.device) -> int:
    """Allocate and free a block of nearly all free device memory, so PyTorch's cache holds it; its bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    size = free - MARGIN
    while size > MARGIN:
        try:
            block = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:  # fragmentation: a smaller block
            size //= 2
            continue
        del block  # back to the cache, not to the device
        return size
    return 0


def watch(record: dict) -> None:
    """Wrap the engine's wake, weight load and generation to count them and fill the cache before each wake."""
    wake, load, generate = VLLMEngine.wake, VLLMEngine.load_weights, VLLMEngine.generate

    def watched_wake(self, tag):
        if tag in self.released:
            held = fill_cache(self.device)
            record["wakes"] += 1
            record["cached_before_wake_gib"] = max(record["cached_before_wake_gib"], held / 2**30)
        return wake(self, tag)

    def watched_load(self, tensors):
        record["loads"] += 1
        return load(self, tensors)

    def watched_generate(self, *args, **kwargs):
        record["generations"] += 1
        return generate(self, *args, **kwargs)

    VLLMEngine.wake, VLLMEngine.load_weights, VLLMEngine.generate = watched_wake, watched_load, watched_generate


def main(out: str, *overrides: str) -> int:
    from klppo.commands.main_ppo import main as ppo

    record = {"wakes": 0, "cached_before_wake_gib": 0.0, "loads": 0, "generations": 0}
    watch(record)
    code = ppo(list(overrides))
    with open(out, "w") as f:
        json.dump({**record, "exit": code}, f)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
