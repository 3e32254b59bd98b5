"""Parameters and optimiser state kept on CPU between the phases that use them.

``fsdp_config.param_offload`` / ``optimizer_offload`` (verl's keys): a model's parameters (its
FSDP2 shards) come to the accelerator for the phases that need them (generation, a forward,
its update, saving and export) and go back to CPU afterwards, freeing accelerator memory for
the other models; the same for an optimiser's state around its update. On a CPU run there is
nothing to move. ``fsdp_config.offload_policy`` is the other way: FSDP2 itself keeps the
parameters on CPU and copies each block in for its computation.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

CPU = torch.device("cpu")


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every state tensor of ``optimizer`` to ``device``, except Adam's step counts (they stay on CPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@dataclass
class _Held:
    model: torch.nn.Module
    params: bool  # param_offload
    optimizer: Optional[torch.optim.Optimizer] = None
    optimizer_state: bool = False  # optimizer_offload


@dataclass
class Offloader:
    """Which models (by role) live on CPU between phases, and the device they visit."""

    device: torch.device
    held: dict[str, _Held] = field(default_factory=dict)

    def register(self, role: str, model: torch.nn.Module, *, param_offload: bool,
                 optimizer: Optional[torch.optim.Optimizer] = None, optimizer_offload: bool = False) -> None:
        """Track ``model`` (and ``optimizer``) under ``role``; what is offloaded moves to CPU now."""
        if not (param_offload or optimizer_offload) or self.device.type == "cpu":
            return
        self.held[role] = _Held(model, param_offload, optimizer, optimizer_offload)
        self._move(self.held[role], CPU)

    def _move(self, held: _Held, device: torch.device) -> None:
        if held.params:
            held.model.to(device)
        if held.optimizer_state and held.optimizer is not None:
            move_optimizer_state(held.optimizer, device)

    @contextmanager
    def resident(self, *roles: str) -> Iterator[None]:
        """The models of ``roles`` on the device for the ``with`` block, back on CPU after it.

        Their device memory goes back to PyTorch's caching allocator, where the next model moved in
        and the next phase's tensors find it; emptying the cache after every phase waited for the
        device and gave the driver blocks that were allocated again moments later (a vLLM engine,
        the one user of memory outside that allocator, empties it before it wakes)."""
        moved = [self.held[role] for role in roles if role in self.held]
        for held in moved:
            self._move(held, self.device)
        try:
            yield
        finally:
            for held in moved:
                self._move(held, CPU)
