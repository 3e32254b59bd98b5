"""Responses recorded in the data: offline RLHF with no generation at all."""

from __future__ import annotations

import torch

from klppo.data.rl_dataset import PromptRecord, tokenize_responses
from klppo.rollout.batch import RolloutBatch, assemble_batch, right_pad


def offline_rollout(
    records: list[PromptRecord], *, n: int, tokenizer, max_response_length: int
) -> RolloutBatch:
    """The first ``n`` recorded responses of each prompt, as a batch of ``len(records) * n`` rows.

    Rows are grouped by prompt (prompt 0's n responses, then prompt 1's, ...). Recorded
    ``scores`` (when every prompt has them) travel along and become the reward.
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
    return assemble_batch(records, n, tokenizer.pad_token_id, response_ids, response_mask, recorded)
