"""Validation: generate for held-out prompts and score them (verl's ``val-core`` metrics), compare
them with reference texts, and check the policy's preferences against held-out rankings."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import torch

from klppo.data.ranked import RankedRecord, ranked_pairs
from klppo.data.rl_dataset import PromptRecord, tokenize_responses
from klppo.monitoring.text_metrics import bleu, rouge_l
from klppo.rollout.batch import RolloutBatch, assemble_batch, right_pad
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.trainer.score import compute_log_prob, decode_responses


def reference_of(record: PromptRecord) -> Optional[str]:
    """The reference answer of a prompt: ``extra_info.reference``, else ``extra_info.answer``
    (where verl's GSM8K preprocessing keeps the worked solution)."""
    value = record.extra_info.get("reference", record.extra_info.get("answer"))
    return value if isinstance(value, str) and value else None


def validate(
    actor,
    records: list[PromptRecord],
    tokenizer,
    scorer: Callable[[RolloutBatch], torch.Tensor],
    params: SamplingParams,
    *,
    batch_size: int | None = None,
    synced_gpus: bool = False,
) -> dict[str, float]:
    """Mean reward per data source over ``params.n`` responses per prompt, and text similarity.

    Keys: ``val-core/<data_source>/reward/mean@<n>`` (with the gsm8k rule this is accuracy),
    ``val-aux/response_length/mean``, and where prompts carry a reference text
    ``val-aux/bleu`` and ``val-aux/rougeL``. Sampling uses a private generator seeded per call,
    so validation never shifts the training run's random stream.
    """
    per_source: dict[str, list[float]] = defaultdict(list)
    lengths: list[float] = []
    hypotheses, references = [], []
    step = batch_size or len(records)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for start in range(0, len(records), step):
            part = records[start : start + step]
            batch = hf_rollout(actor, part, tokenizer, params, synced_gpus=synced_gpus)
            scores = scorer(batch).sum(-1)  # (B,) from the (B, T) token-level scores
            for source, score in zip(batch.data_sources, scores.tolist()):
                per_source[source].append(score)
            lengths.extend(batch.response_mask.sum(-1).tolist())
            refs = [reference_of(r) for r in part for _ in range(params.n)]
            for text, ref in zip(decode_responses(batch, tokenizer), refs):
                if ref is not None:
                    hypotheses.append(text)
                    references.append(ref)
    metrics = {f"val-core/{s}/reward/mean@{params.n}": sum(v) / len(v) for s, v in per_source.items()}
    metrics["val-aux/response_length/mean"] = sum(lengths) / len(lengths)
    if hypotheses:
        metrics["val-aux/bleu"] = bleu(hypotheses, references)
        metrics["val-aux/rougeL"] = rouge_l(hypotheses, references)
    return metrics


@torch.no_grad()
def response_log_likelihoods(actor, record: RankedRecord, tokenizer, max_response_length: int) -> torch.Tensor:
    """(K,) summed log-probability of each recorded response of ``record`` under ``actor``."""
    ids, _ = tokenize_responses(record.responses, tokenizer, max_response_length)
    response_ids, response_mask = right_pad(ids, tokenizer.pad_token_id)
    as_prompt = PromptRecord(record.index, "ranked", record.raw_prompt, record.prompt_ids, None, {})
    batch = assemble_batch([as_prompt], len(ids), tokenizer.pad_token_id, response_ids, response_mask)
    log_prob = compute_log_prob(actor, batch.to(next(actor.parameters()).device), micro_batch_rows=None,
                                temperature=1.0)
    return (log_prob * batch.response_mask.to(log_prob.device)).sum(-1)


def preference_agreement(actor, records: list[RankedRecord], tokenizer, max_response_length: int) -> dict[str, float]:
    """``val-core/preference_agreement``: the share of held-out ranked pairs (better, worse) to
    which the policy gives the better response the higher log-likelihood."""
    agree = total = 0
    for record in records:
        loglik = response_log_likelihoods(actor, record, tokenizer, max_response_length)
        for better, worse in ranked_pairs(record.rankings):
            agree += int(loglik[better] > loglik[worse])
            total += 1
    return {"val-core/preference_agreement": agree / max(total, 1)}


def sampled_kl_to_ref(
    actor, ref, records: list[PromptRecord], tokenizer, params: SamplingParams, *, batch_size: int | None = None,
    synced_gpus: bool = False,
) -> dict[str, float]:
    """``val-aux/kl_to_ref``: KL(policy || reference) per token, estimated on responses *sampled
    from the policy* (k1 is unbiased only there; on recorded offline responses it is not a KL)."""
    total, tokens = 0.0, 0
    step = batch_size or len(records)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for start in range(0, len(records), step):
            batch = hf_rollout(actor, records[start : start + step], tokenizer, params, synced_gpus=synced_gpus)
            batch = batch.to(next(actor.parameters()).device)
            log_ratio = (compute_log_prob(actor, batch, micro_batch_rows=None, temperature=params.temperature)
                         - compute_log_prob(ref, batch, micro_batch_rows=None, temperature=params.temperature))
            total += float((log_ratio * batch.response_mask).sum())  # host sync
            tokens += int(batch.response_mask.sum())
    return {"val-aux/kl_to_ref": total / max(tokens, 1)}
