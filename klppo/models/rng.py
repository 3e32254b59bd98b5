"""Seeded random streams that leave the run's own streams as they were.

``torch.manual_seed`` reseeds the CPU generator AND every CUDA generator of the process
(``torch.cuda.manual_seed_all``; queued until CUDA starts if it has not yet). Inside
``torch.random.fork_rng(devices=[])`` only the CPU state is restored afterwards, so each
such block would leave every GPU's stream reseeded: after loading a critic all ranks would
sample the same stream, and every validation would reset it. ``seeded`` forks the CPU and
the device in use and seeds exactly those two, nothing else.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def forked_devices(device: torch.device) -> list[int]:
    """The CUDA device indices ``seeded`` forks for work on ``device``: its own, or none off CUDA."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Inside the block the CPU generator and ``device``'s (a CUDA device) start from ``seed``;
    after it both continue exactly where they were. Other devices' generators are not touched."""
    cuda = forked_devices(device)
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)  # CPU only, unlike torch.manual_seed
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
