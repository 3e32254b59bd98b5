"""The no-grad scoring phases: old and reference log-probs, values, and rule rewards."""

from __future__ import annotations

from typing import Callable

import torch

from klppo.models.forward import response_logprobs, response_values
from klppo.rewards.score import score_responses
from klppo.rewards.token_scores import scores_at_last_token
from klppo.rollout.batch import RolloutBatch
from klppo.trainer.update import chunks


@torch.no_grad()
def compute_log_prob(model, batch: RolloutBatch, *, micro_batch_rows: int | None, temperature: float) -> torch.Tensor:
    """(B, T) response log-probs under ``model``, computed ``micro_batch_rows`` rows at a time."""
    model.eval()
    parts = []
    for idx in chunks(len(batch), micro_batch_rows or len(batch)):
        micro = batch.select(idx)
        log_prob, _ = response_logprobs(
            model, micro.input_ids, micro.attention_mask, micro.response_length, temperature=temperature
        )
        parts.append(log_prob)
    return torch.cat(parts)


@torch.no_grad()
def compute_values(critic, batch: RolloutBatch, *, micro_batch_rows: int | None) -> torch.Tensor:
    """(B, T) critic values, computed ``micro_batch_rows`` rows at a time."""
    critic.eval()
    parts = []
    for idx in chunks(len(batch), micro_batch_rows or len(batch)):
        micro = batch.select(idx)
        parts.append(response_values(critic, micro.input_ids, micro.attention_mask, micro.response_length))
    return torch.cat(parts)


def decode_responses(batch: RolloutBatch, tokenizer) -> list[str]:
    """The text of each response (its real tokens, special tokens dropped)."""
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids.cpu(), batch.response_mask.cpu())
    ]


def compute_scores(batch: RolloutBatch, tokenizer, reward_fn: Callable) -> torch.Tensor:
    """(B, T) token-level scores: each response's rule reward at its last token."""
    texts = decode_responses(batch, tokenizer)
    scores = score_responses(reward_fn, batch.data_sources, texts, batch.ground_truths, batch.extra_infos)
    scores = torch.tensor(scores, dtype=torch.float32, device=batch.response_mask.device)
    return scores_at_last_token(scores, batch.response_mask)
