"""Optimiser and learning-rate schedule, built from flat arguments."""

from __future__ import annotations

import math

import torch


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights get no weight decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))


def warmup_steps(total_steps: int, lr_warmup_steps: int, lr_warmup_steps_ratio: float) -> int:
    """verl's rule: an explicit step count wins; -1 means a ratio of the total."""
    if lr_warmup_steps >= 0:
        return lr_warmup_steps
    return int(lr_warmup_steps_ratio * total_steps)


def lr_multiplier(step: int, *, warmup: int, total_steps: int, style: str, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then constant or cosine decay to ``min_lr_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    lr_warmup_steps: int,
    lr_warmup_steps_ratio: float,
    warmup_style: str,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A schedule stepped once per training step."""
    warmup = warmup_steps(total_steps, lr_warmup_steps, lr_warmup_steps_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup=warmup, total_steps=total_steps, style=warmup_style, min_lr_ratio=min_lr_ratio
        ),
    )
