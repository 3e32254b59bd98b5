"""Forwards over prompt + response sequences: per-token log-probs, entropies and values.

Legend: B batch, P prompt length (left-padded), T response length (right-padded), L = P + T,
V vocab. A sequence is ``cat(prompt_ids, response_ids)``; the logits at position ``i`` predict
the token at ``i + 1``, so the response's log-probs come from positions ``P - 1 .. L - 2``.
"""

from __future__ import annotations

import torch

from klppo.algo import entropy_from_logits, logprobs_from_logits


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool -> (B, L) long positions counting real tokens only (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of the response tokens under ``model``, and optionally entropies (B, T).

    Logits are divided by the sampling ``temperature`` first, as verl does, so the log-probs
    are those of the distribution the responses were sampled from.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = out.logits[:, -response_length - 1 : -1, :].float()  # (B, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    responses = input_ids[:, -response_length:]  # (B, T)
    log_probs = logprobs_from_logits(logits, responses)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def response_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """Values (B, T): V(s_t) of the state before each response token (verl's convention)."""
    out = critic(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits[:, -response_length - 1 : -1, 0].float()
