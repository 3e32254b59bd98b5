"""The no-grad scoring phases: old and reference log-probs, values, and rule rewards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from klppo.data.batching import restore_order
from klppo.models.forward import response_logprobs, response_values, sequence_scores
from klppo.rewards.score import score_responses
from klppo.rollout.batch import RolloutBatch
from klppo.trainer.update import chunks, micro_batches


@dataclass(frozen=True)
class ForwardSettings:
    """How a no-grad forward splits a batch; the keyword arguments of ``compute_log_prob`` / ``compute_values``."""

    micro_batch_rows: int | None = None  # rows per forward; None = the whole batch
    max_token_len: int | None = None  # token budget per forward (use_dynamic_bsz); wins over micro_batch_rows
    use_remove_padding: bool = False  # each forward as one packed row
    budget_key: str = "log_prob_max_token_len_per_gpu"  # config key an over-long sequence error names


def _forward_in_parts(batch: RolloutBatch, forward: Callable, micro_batch_rows, max_token_len, budget_key,
                      max_over_ranks: Callable[[int], int] | None = None) -> torch.Tensor:
    """``forward(micro) -> (b, T)`` over the batch's micro-batches, rows back in the batch's order.

    ``max_over_ranks`` (``klppo.distributed.all_reduce_max_int``) gives every rank the same number of
    forwards, which FSDP2's collectives need.
    """
    plan = micro_batches(batch, micro_batch_rows, max_token_len, budget_key, max_over_ranks)
    parts = [forward(batch.select(idx)) for idx in plan]
    return restore_order(torch.cat(parts), [i for idx in plan for i in idx])


@torch.no_grad()
def compute_log_prob(
    model,
    batch: RolloutBatch,
    *,
    micro_batch_rows: int | None,
    temperature: float,
    max_token_len: int | None = None,
    use_remove_padding: bool = False,
    budget_key: str = "log_prob_max_token_len_per_gpu",
    max_over_ranks: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """(B, T) response log-probs under ``model``, a micro-batch (rows or token budget) at a time."""
    model.eval()

    def forward(micro: RolloutBatch) -> torch.Tensor:
        log_prob, _ = response_logprobs(
            model, micro.input_ids, micro.attention_mask, micro.response_length, temperature=temperature,
            packed=use_remove_padding, max_tokens=max_token_len,
        )
        return log_prob

    return _forward_in_parts(batch, forward, micro_batch_rows, max_token_len, budget_key, max_over_ranks)


@torch.no_grad()
def compute_values(
    critic,
    batch: RolloutBatch,
    *,
    micro_batch_rows: int | None,
    max_token_len: int | None = None,
    use_remove_padding: bool = False,
    budget_key: str = "critic.ppo_max_token_len_per_gpu",
    max_over_ranks: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """(B, T) critic values, a micro-batch (rows or token budget) at a time."""
    critic.eval()

    def forward(micro: RolloutBatch) -> torch.Tensor:
        return response_values(critic, micro.input_ids, micro.attention_mask, micro.response_length,
                               packed=use_remove_padding, max_tokens=max_token_len)

    return _forward_in_parts(batch, forward, micro_batch_rows, max_token_len, budget_key, max_over_ranks)


def decode_responses(batch: RolloutBatch, tokenizer) -> list[str]:
    """The text of each response (its real tokens, special tokens dropped)."""
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids.cpu(), batch.response_mask.cpu())
    ]


def compute_scores(batch: RolloutBatch, tokenizer, reward_fn: Callable) -> torch.Tensor:
    """(B,) each response's rule reward."""
    texts = decode_responses(batch, tokenizer)
    scores = score_responses(reward_fn, batch.data_sources, texts, batch.ground_truths, batch.extra_infos)
    return torch.tensor(scores, dtype=torch.float32, device=batch.response_mask.device)


@torch.no_grad()
def compute_rm_scores(reward_model, batch: RolloutBatch, *, micro_batch_rows: int | None) -> torch.Tensor:
    """(B,) reward-model scores of prompt + response, read at each response's last token."""
    reward_model.eval()
    parts = []
    for idx in chunks(len(batch), micro_batch_rows or len(batch)):
        micro = batch.select(idx)
        parts.append(sequence_scores(reward_model, micro.input_ids, micro.attention_mask))
    return torch.cat(parts)
