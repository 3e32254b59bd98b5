"""Turn one scalar score per response into token-level scores."""

from __future__ import annotations

import torch


def scores_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, T) zeros with each score at its response's last real token.

    A response with no real token (all-False mask row) gets its score at position 0, so no
    score is ever dropped.
    """
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)  # (B,)
    token_scores[torch.arange(len(scores), device=response_mask.device), last] = scores.float()
    return token_scores
