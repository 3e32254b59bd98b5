"""Responses recorded in the data: offline RLHF with no generation at all."""

from __future__ import annotations

from typing import Optional

import torch

from klppo.data.rl_dataset import PromptRecord, tokenize_responses
from klppo.rollout.batch import RolloutBatch, assemble_batch, right_pad


def offline_rollout(
    records: list[PromptRecord], *, n: int, tokenizer, max_response_length: int
) -> RolloutBatch:
    """The first ``n`` recorded responses of each prompt, as a batch of ``len(records) * n`` rows.

    Rows are grouped by prompt (prompt 0's n responses, then prompt 1's, ...). Recorded
    ``scores`` (when every prompt has them) travel along and become the reward; recorded
    behaviour log-probs (``rollout_log_probs``, when any prompt has them) too, cut with their
    responses.
    """
    texts, scores = [], []
    for record in records:
        # build.check_enough_responses has verified every prompt up front.
        assert record.responses is not None and len(record.responses) >= n
        texts.extend(record.responses[:n])
        if record.scores is not None:
            scores.extend(record.scores[:n])
    response_lists, _ = tokenize_responses(texts, tokenizer, max_response_length)
    response_ids, response_mask = right_pad(response_lists, tokenizer.pad_token_id)
    recorded = torch.tensor(scores, dtype=torch.float32) if len(scores) == len(texts) else None
    behaviour = _behaviour_log_probs(records, n, response_mask)
    return assemble_batch(records, n, tokenizer.pad_token_id, response_ids, response_mask, recorded, behaviour)


def _behaviour_log_probs(records: list[PromptRecord], n: int, response_mask: torch.Tensor
                         ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(B, T) float log-probs (0 on padding and on rows without) and (B,) bool rows with them."""
    if all(record.rollout_log_probs is None for record in records):
        return None
    log_probs = torch.zeros(response_mask.shape, dtype=torch.float32)
    has = torch.zeros(response_mask.shape[0], dtype=torch.bool)
    for i, record in enumerate(records):
        if record.rollout_log_probs is None:
            continue
        for j, values in enumerate(record.rollout_log_probs[:n]):
            row, length = i * n + j, int(response_mask[i * n + j].sum())
            # The reader matched each list to its tokenised response; a cut response cuts its list.
            assert len(values) >= length, "rollout_log_probs shorter than the response the reader checked"
            log_probs[row, :length] = torch.tensor(values[:length], dtype=torch.float32)
            has[row] = True
    return log_probs, has
