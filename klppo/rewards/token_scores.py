"""Turn one scalar score per response into token-level scores."""

from __future__ import annotations

import torch


def scores_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, T) zeros with each score at its response's last real token (the policy's
    last token of a multi-turn response, whose mask has gaps where tools replied).

    A response with no real token (all-False mask row) gets its score at position 0, so no
    score is ever dropped.
    """
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, 0).amax(-1)  # (B,)
    token_scores[torch.arange(len(scores), device=response_mask.device), last] = scores.float()
    return token_scores
