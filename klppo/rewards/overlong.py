"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13; verl's dapo reward
manager): a response that runs into the last ``buffer`` tokens before ``max_length`` loses a share
of ``factor`` that grows linearly with the tokens it spent there, all of it at ``max_length``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongPenalty:
    max_length: int  # reward_kwargs.max_resp_len (data.max_response_length by default)
    buffer: int  # overlong_buffer_cfg.len
    factor: float  # overlong_buffer_cfg.penalty_factor
    log: bool = False  # overlong_buffer_cfg.log: the penalty as reward components


def overlong_rewards(lengths: torch.Tensor, penalty: OverlongPenalty) -> torch.Tensor:
    """(B,) float: min(-(length - (max_length - buffer)) / buffer x factor, 0) for responses of
    ``lengths`` tokens: 0 up to max_length - buffer tokens, -factor at max_length."""
    exceed = lengths.to(torch.float32) - (penalty.max_length - penalty.buffer)
    return torch.clamp(-exceed / penalty.buffer * penalty.factor, max=0.0)


def overlong_components(rewards: torch.Tensor) -> list[dict[str, float]]:
    """Each response's penalty as verl logs it (``overlong_buffer_cfg.log``): overlong_reward, and
    overlong (1 where penalised)."""
    return [{"overlong_reward": value, "overlong": float(value < 0)} for value in rewards.tolist()]
