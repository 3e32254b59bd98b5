"""Validation: generate for held-out prompts and score them (verl's ``val-core`` metrics)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from klppo.data.rl_dataset import PromptRecord
from klppo.rollout.batch import RolloutBatch
from klppo.rollout.hf import SamplingParams, hf_rollout


def validate(
    actor,
    records: list[PromptRecord],
    tokenizer,
    scorer: Callable[[RolloutBatch], torch.Tensor],
    params: SamplingParams,
    *,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Mean reward per data source over ``params.n`` responses per prompt.

    Keys: ``val-core/<data_source>/reward/mean@<n>`` (with the gsm8k rule this is accuracy)
    and ``val-aux/response_length/mean``. Sampling uses a private generator seeded per call
    when ``params.do_sample``, so validation never shifts the training run's random stream.
    """
    per_source: dict[str, list[float]] = defaultdict(list)
    lengths: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for start in range(0, len(records), batch_size or len(records)):
            batch = hf_rollout(actor, records[start : start + (batch_size or len(records))], tokenizer, params)
            scores = scorer(batch).sum(-1)  # (B,) from the (B, T) token-level scores
            for source, score in zip(batch.data_sources, scores.tolist()):
                per_source[source].append(score)
            lengths.extend(batch.response_mask.sum(-1).tolist())
    metrics = {f"val-core/{s}/reward/mean@{params.n}": sum(v) / len(v) for s, v in per_source.items()}
    metrics["val-aux/response_length/mean"] = sum(lengths) / len(lengths)
    return metrics
