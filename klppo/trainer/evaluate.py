"""Validation: generate for held-out prompts and score them (verl's ``val-core`` metrics), compare
them with reference texts, and check the policy's preferences against held-out rankings."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, NamedTuple, Optional

import torch

from klppo.algo import importance_weighted_kl, kl_penalty
from klppo.data.batching import MicroBatching
from klppo.data.ranked import RankedRecord, ranked_pairs
from klppo.data.rl_dataset import PromptRecord, tokenize_responses
from klppo.distributed import SINGLE_PROCESS, DistEnv, all_gather_objects, all_reduce_sum
from klppo.models.forward import HeadSettings
from klppo.models.rng import seeded
from klppo.monitoring.generations import (
    GENERATIONS_KEY, Generation, batch_generations, pick_generations, write_generations,
)
from klppo.monitoring.text_metrics import bleu, rouge_l
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch, assemble_batch, right_pad
from klppo.rollout.hf import DYNAMIC, Decoding, SamplingParams, hf_rollout
from klppo.rollout.multi_turn import MultiTurn
from klppo.trainer.forwards import (
    compute_log_prob, compute_rm_scores, compute_scores, decode_responses, reference_model, response_scores, token_scores,
)
from klppo.trainer.responses import (
    VALIDATION, engine_seeds, generation_decoding, generation_model, sync_engine_weights, turns_together,
)
from klppo.distributed import same_on_every_rank
from klppo.safety.guards import RunGuard

if TYPE_CHECKING:
    from klppo.run.build import PPOParts

WHOLE = MicroBatching()  # validation forwards take each batch at once
CPU = torch.device("cpu")

# How a rank samples responses for its part of a validation batch (records, params) -> batch on CPU.
Sample = Callable[[list[PromptRecord], SamplingParams], RolloutBatch]


@contextmanager
def validation_sampler(parts: PPOParts) -> Iterator[tuple[Sample, int]]:
    """(how this rank samples, as training does: the vLLM engine fed the actor's current weights or
    the actor (or its gathered copy) through HF generate; how many ranks sample each part together)."""
    if parts.engine is not None:
        sync_engine_weights(parts)  # the actor's current weights

        def with_engine(records: list[PromptRecord], params: SamplingParams) -> RolloutBatch:
            if not parts.engine.holds_weights:  # free_cache_engine: the last generation's sleep released them
                sync_engine_weights(parts)
            seeds = engine_seeds(parts, records, params.n, VALIDATION)
            return parts.engine.generate(records, params, seeds, parts.tokenizer, parts.multi_turn)

        yield with_engine, parts.settings.engine.tensor_parallel_size
        return
    with generation_model(parts) as (model, sharded):
        yield hf_sampler(model, parts.tokenizer, parts.env, sharded, generation_decoding(parts, sharded),
                         parts.multi_turn), 1


def hf_sampler(model, tokenizer, env: DistEnv, sharded: bool, decoding: Decoding = DYNAMIC,
               multi_turn: Optional[MultiTurn] = None) -> Sample:
    """Sampling with ``model.generate`` on the rank's device (``sharded``: every rank steps together),
    decoding as ``decoding`` says; conversations with tools with ``multi_turn``, as training samples."""
    return lambda records, params: hf_rollout(model, records, tokenizer, params, synced_gpus=sharded,
                                              device=env.device, decoding=decoding, multi_turn=multi_turn,
                                              keep_going=turns_together(sharded))


def validation_metrics(parts: PPOParts, step: int) -> dict[str, float]:
    """Everything a PPO run measures on held-out data (its models resident on the device):
    rewards of generated responses, the sampled KL to the reference, and preference agreement
    with held-out rankings. The responses as text go where ``trainer.validation_data_dir`` and
    ``trainer.log_val_generations`` say (``monitoring.generations``)."""
    s, metrics = parts.settings, {}
    generations = [] if s.generations.of_validation else None
    if parts.val_records:

        def scorer(batch: RolloutBatch, places: list[str]) -> torch.Tensor:
            scores, batch.reward_components = response_scores(parts, batch, places)  # components: for the texts
            return token_scores(s.reward, batch, scores, validation=True)

        with validation_sampler(parts) as (sample, group_size):  # as training samples (responses.py)
            metrics.update(validate(None, parts.val_records, parts.tokenizer, scorer, s.val_sampling,
                                    batch_size=s.val_batch_size, env=parts.env, sample=sample, group_size=group_size,
                                    gold_scorer=gold_scorer(parts), generations=generations))
            if s.uses_reference:  # one sample per held-out prompt, k3: unbiased, never negative, low variance
                metrics["val-aux/kl_to_ref"] = sampled_kl_to_ref(
                    parts.actor, lambda: reference_model(parts), parts.val_records, parts.tokenizer,
                    dataclasses.replace(s.sampling, n=1), batch_size=s.val_batch_size, env=parts.env,
                    head=s.forwards.head, sample=sample, group_size=group_size, estimator="low_var_kl")
    if parts.val_ranked:
        metrics.update(preference_agreement(parts.actor, parts.val_ranked, parts.tokenizer, s.response_length,
                                            env=parts.env, head=s.forwards.head))
    if generations:
        if s.generations.validation_dir is not None and parts.env.rank == 0:
            write_generations(s.generations.validation_dir, step, generations)
        if s.generations.log_val:  # shown by the loggers, never written to metrics.jsonl
            metrics[GENERATIONS_KEY] = pick_generations(generations, s.generations.log_val)
    return metrics


def gold_scorer(parts: PPOParts) -> Optional[Callable[[RolloutBatch, list[str]], torch.Tensor]]:
    """(B,) the held-out gold reward of each validation response (``trainer.gold_reward``: a reward
    function or a reward model), or None without one. Validation is its only caller: the gold
    reward never reaches a training batch."""
    if parts.gold_reward_model is not None:
        rm = parts.settings.forwards.reward_model
        return lambda batch, places: compute_rm_scores(parts.gold_reward_model, batch, rm)
    if parts.gold_reward_fn is None:
        return None
    return lambda batch, places: same_on_every_rank(
        lambda: compute_scores(batch, parts.tokenizer, parts.gold_reward_fn, places)[0])


def reference_of(record: PromptRecord) -> Optional[str]:
    """The reference answer of a prompt: ``extra_info.reference``, else ``extra_info.answer``
    (where verl's GSM8K preprocessing keeps the worked solution)."""
    value = record.extra_info.get("reference", record.extra_info.get("answer"))
    return value if isinstance(value, str) and value else None


def rank_parts(records: list, batch_size: int, env: DistEnv, group_size: int = 1) -> Iterator[tuple[list, int]]:
    """This rank's part of each validation batch of ``batch_size`` records (verl's global
    ``data.val_batch_size``), and how many of its records are real.

    Every rank gets parts of the same size, so sharded models run their forwards in step; a
    short share is filled up with stand-in records of the same batch whose results are dropped.
    ``group_size`` consecutive ranks (a tensor-parallel engine's) share one part; only the
    group's first rank counts it (the others' ``n_real`` is 0).
    """
    groups, group = env.world_size // group_size, env.rank // group_size
    counts = env.rank % group_size == 0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        size = -(-len(chunk) // groups)
        mine = chunk[group * size : (group + 1) * size]
        yield mine + chunk[: size - len(mine)], len(mine) if counts else 0


def validate(
    actor,
    records: list[PromptRecord],
    tokenizer,
    scorer: Callable[[RolloutBatch, list[str]], torch.Tensor],
    params: SamplingParams,
    *,
    batch_size: int | None = None,
    env: DistEnv = SINGLE_PROCESS,
    sharded: bool | None = None,
    sample: Sample | None = None,
    group_size: int = 1,
    gold_scorer: Callable[[RolloutBatch, list[str]], torch.Tensor] | None = None,
    generations: list[Generation] | None = None,
) -> dict[str, float]:
    """Mean reward per data source over ``params.n`` responses per prompt, and text similarity.

    Keys: ``val-core/<data_source>/reward/mean@<n>`` (with the gsm8k rule this is accuracy),
    ``val-aux/response_length/mean``, and where prompts carry a reference text
    ``val-aux/bleu`` and ``val-aux/rougeL``. Sampling uses a private generator seeded per call
    (and rank), so validation never shifts the training run's random streams (CPU and the
    device's). Each rank validates its share of the records; the results are gathered. The
    scorer gets its batch on ``env.device`` (where every phase's batch lives) and where each of its
    prompts came from (for the reward function's errors). ``sharded``:
    whether ``actor`` is sharded over the ranks (default: when there is a process group).
    ``sample`` (instead of ``actor``): how this rank samples (``validation_sampler``), with
    ``group_size`` ranks sampling each part together.

    ``gold_scorer`` (``trainer.gold_reward``): (B,) a held-out gold reward of the same responses,
    logged beside the training reward as ``val-gold/<data_source>/reward/mean@<n>``,
    ``val-gold/reward/mean`` and ``/std`` (all responses), and the training reward's
    ``val-core/reward/mean`` and ``/std`` over the same responses, what the divergence guard
    compares (each reward's change in units of its own spread).

    ``generations``, when given, gets every response as text (all ranks', in record order).
    """
    sample = sample or hf_sampler(actor, tokenizer, env, env.is_distributed if sharded is None else sharded)
    rows: list[ValidationRow] = []
    texts_of = []  # ((record index, sample), Generation) per response, with ``generations``
    with seeded(env.rank, env.device):
        for part, n_real in rank_parts(records, batch_size or len(records), env, group_size):
            batch = sample(part, params)
            on_device = batch.to(env.device)
            part_rows, scores = _scored_rows(batch, on_device, part, params.n, tokenizer, scorer, gold_scorer)
            real = n_real * params.n  # the rest repeat records to even out the ranks' parts
            rows += part_rows[:real]
            if generations is not None:
                samples = [(r.index, j) for r in part for j in range(params.n)]
                texts_of += zip(samples[:real], batch_generations(on_device, tokenizer, scores)[:real])
    rows = [row for rank_rows in all_gather_objects(rows) for row in rank_rows]
    if generations is not None:
        generations += [g for _, g in sorted((t for rank in all_gather_objects(texts_of) for t in rank),
                                             key=lambda t: t[0])]
    return response_metrics(rows, params.n, gold=gold_scorer is not None)


def _scored_rows(batch: RolloutBatch, on_device: RolloutBatch, part: list[PromptRecord], n: int, tokenizer,
                 scorer: Callable, gold_scorer: Callable | None) -> tuple[list[ValidationRow], list[float]]:
    """(a row per response of ``part``'s sampled ``batch``, the scores): what the metrics read of each.
    Lengths and texts are read on ``batch`` as the sampler returned it (on the CPU); the scorers get
    ``on_device``, the same batch where every phase's batch lives."""
    lengths = batch.response_attention.sum(-1).tolist()
    refs = [reference_of(r) for r in part for _ in range(n)]
    texts = decode_responses(batch, tokenizer) if any(refs) else [None] * len(refs)
    places = [r.where for r in part]
    scores = scorer(on_device, places).sum(-1).tolist()  # (B,) host sync
    golds = gold_scorer(on_device, places).tolist() if gold_scorer else [None] * len(scores)  # host sync
    rows = [ValidationRow(src, score, length, text if ref else None, ref, gold)
            for src, score, length, text, ref, gold in zip(batch.data_sources, scores, lengths, texts, refs, golds)]
    return rows, scores


class ValidationRow(NamedTuple):
    """One validation response: what its metrics read."""

    data_source: str
    score: float
    length: int  # response tokens
    text: Optional[str]  # the response, where its prompt carries a reference text
    reference: Optional[str]
    gold: Optional[float]  # trainer.gold_reward's score


def response_metrics(rows: list[ValidationRow], n: int, gold: bool) -> dict[str, float]:
    """``validate``'s metrics of every rank's responses: rewards per data source (and the gold reward's),
    response length, and text similarity where prompts carry a reference."""
    metrics = per_source_means(rows, "score", f"val-core/{{}}/reward/mean@{n}")
    if gold:
        metrics.update(per_source_means(rows, "gold", f"val-gold/{{}}/reward/mean@{n}"))
        for prefix, field in (("val-core", "score"), ("val-gold", "gold")):
            metrics[f"{prefix}/reward/mean"], metrics[f"{prefix}/reward/std"] = mean_and_std(
                [getattr(row, field) for row in rows])
    metrics["val-aux/response_length/mean"] = sum(row.length for row in rows) / len(rows)
    with_ref = [row for row in rows if row.reference is not None]
    if with_ref:
        metrics["val-aux/bleu"] = bleu([row.text for row in with_ref], [row.reference for row in with_ref])
        metrics["val-aux/rougeL"] = rouge_l([row.text for row in with_ref], [row.reference for row in with_ref])
    return metrics


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """(mean, population standard deviation) of a non-empty list."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def per_source_means(rows: list[ValidationRow], field: str, key: str) -> dict[str, float]:
    """``key.format(data_source)`` -> the mean of each row's ``field`` over each data source's rows."""
    per_source: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        per_source[row.data_source].append(getattr(row, field))
    return {key.format(source): sum(v) / len(v) for source, v in per_source.items()}


@torch.no_grad()
def response_log_likelihoods(actor, record: RankedRecord, tokenizer, max_response_length: int,
                             head: HeadSettings = HeadSettings(), device: torch.device = CPU) -> torch.Tensor:
    """(K,) summed log-probability of each recorded response of ``record`` under ``actor`` (run on ``device``)."""
    ids, _ = tokenize_responses(record.responses, tokenizer, max_response_length)
    response_ids, response_mask = right_pad(ids, tokenizer.pad_token_id)
    as_prompt = PromptRecord(record.index, "ranked", record.raw_prompt, record.prompt_ids, None, {})
    batch = assemble_batch([as_prompt], len(ids), tokenizer.pad_token_id, response_ids, response_mask)
    batch = batch.to(device)
    log_prob = compute_log_prob(actor, batch, WHOLE, temperature=1.0, head=head)
    return (log_prob * batch.response_mask).sum(-1)


def preference_agreement(actor, records: list[RankedRecord], tokenizer, max_response_length: int,
                         env: DistEnv = SINGLE_PROCESS, head: HeadSettings = HeadSettings()) -> dict[str, float]:
    """``val-core/preference_agreement``: the share of held-out ranked pairs (better, worse) to
    which the policy gives the better response the higher log-likelihood (ranks share the records)."""
    agree = total = 0
    for part, n_real in rank_parts(records, env.world_size, env):
        for record in part:  # a stand-in record runs its forward too, uncounted
            loglik = response_log_likelihoods(actor, record, tokenizer, max_response_length, head, env.device).tolist()
            pairs = ranked_pairs(record.rankings) if n_real else []
            agree += sum(int(loglik[better] > loglik[worse]) for better, worse in pairs)
            total += len(pairs)
    agree, total = all_reduce_sum(torch.tensor([agree, total], dtype=torch.float64)).tolist()
    return {"val-core/preference_agreement": agree / max(total, 1)}


def sampled_kl_to_ref(
    actor, reference: Callable[[], ContextManager], records: list[PromptRecord], tokenizer, params: SamplingParams,
    *, batch_size: int | None = None, env: DistEnv = SINGLE_PROCESS, head: HeadSettings = HeadSettings(),
    sampler=None, sharded: bool | None = None, seed: int = 1, estimator: str = "kl", replicated: bool = False,
    sample: Sample | None = None, group_size: int = 1, decoding: Decoding = DYNAMIC,
) -> float:
    """KL(policy || reference) per token, estimated on responses *sampled from the policy* (k1 is
    unbiased only there; on recorded offline responses it is not a KL). ``reference()``: a context
    giving the reference model (``forwards.reference_model``: the frozen reference, or a LoRA
    actor holding its reference adapter values, ``ref.lora_reference``). ``estimator``: a
    ``kl_penalty`` name; "kl" (k1), or "low_var_kl" (k3, also unbiased on the policy's samples,
    never negative, lower variance) as validation and the offline probe use.

    ``sampler``: the model that samples (the actor's gathered copy; default the actor itself),
    ``sharded`` whether it is sharded (default: when there is a process group), ``decoding`` how it
    decodes (``responses.generation_decoding``). Sampling draws
    from a private stream seeded with ``seed`` (and the rank), so training's streams never move.
    ``replicated``: every rank samples all ``records`` from the same stream (a small probe whose
    value must not depend on the number of ranks) instead of its share. ``sample`` (instead of
    ``sampler``): how this rank samples (``validation_sampler``), ``group_size`` ranks together.
    """
    sample = sample or hf_sampler(sampler or actor, tokenizer, env, env.is_distributed if sharded is None else sharded,
                                  decoding)
    total = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    parts = [(records, len(records))] if replicated else rank_parts(records, batch_size or len(records), env, group_size)
    with seeded(seed + (0 if replicated else env.rank), env.device):
        for part, n_real in parts:
            batch = sample(part, params).to(env.device)
            log_prob = compute_log_prob(actor, batch, WHOLE, temperature=params.temperature, head=head)
            with reference() as ref:
                kl = kl_penalty(log_prob, compute_log_prob(ref, batch, WHOLE, temperature=params.temperature,
                                                           head=head), estimator)
            mask = batch.response_mask[: n_real * params.n]
            total += float((kl[: n_real * params.n] * mask).sum())  # host sync
            tokens += float(mask.sum())
    if not replicated:
        total, tokens = all_reduce_sum(torch.stack([total, tokens])).tolist()
    return float(total) / max(float(tokens), 1.0)


def importance_weighted(parts: PPOParts, batch: RolloutBatch) -> bool:
    """Whether an offline step's KL is importance-weighted on its recorded responses (``offline_kl``
    importance_weighted, or auto and every row carries behaviour log-probs) rather than sampled."""
    mode = parts.settings.kl.offline_kl
    recorded = batch.rollout_log_probs is not None and bool(batch.has_rollout_log_probs.all())  # host sync
    return mode == "importance_weighted" or (mode == "auto" and recorded)


def offline_kl_due(parts: PPOParts, batch: RolloutBatch, step: int, guard: RunGuard) -> bool:
    """Whether offline step ``step`` measures KL(pi_old || ref) (``offline_policy_kl``).

    The sampled probe runs every ``algorithm.kl_ctrl.probe_every`` steps from the first, and also
    on the step after a checkpoint that the KL guard has yet to certify (``RunGuard.awaits_kl``):
    the checkpoint holds the weights that step samples with, so its KL says whether a rollback may
    return there, whatever save_freq is. The importance-weighted KL costs no forward: every step.
    """
    return (step - 1) % parts.settings.kl.probe_every == 0 or guard.awaits_kl() or importance_weighted(parts, batch)


def sampled_offline_kl(parts: PPOParts, batch: RolloutBatch, records: list[PromptRecord], step: int, guard: RunGuard,
                       timer: PhaseTimer) -> tuple[float, dict] | None:
    """An offline step's KL(pi_old || ref) measured on responses the policy samples (``offline_policy_kl``), on
    the steps that measure it and have no behaviour log-probs to weight; None on the others. The trainer
    asks before the updates' forwards (``forwards.forwards_first``): no other forward of the actor, nor
    a LoRA actor's adapters set to the reference's, may come between those and their backward."""
    if (parts.settings.rollout != "offline" or batch.ref_log_prob is None or importance_weighted(parts, batch)
            or not offline_kl_due(parts, batch, step, guard)):
        return None
    with timer.phase("kl_probe"):
        return offline_policy_kl(parts, batch, records, step)


def offline_policy_kl(parts: PPOParts, batch: RolloutBatch, records: list[PromptRecord], step: int
                      ) -> tuple[float, dict[str, torch.Tensor | float]]:
    """KL(pi_old || ref) of an offline step (``algorithm.kl_ctrl.offline_kl``) and its metrics.

    Importance-weighted on the recorded responses when they carry the behaviour policy's
    log-probs (``actor/kl_to_ref_importance_weighted``, with the weights' effective sample size),
    else measured on responses the policy samples (``rollout.n`` each) for the step's first
    ``probe_prompts`` prompts with the low-variance estimator (``actor/kl_to_ref_sampled``).
    """
    s = parts.settings
    if importance_weighted(parts, batch):
        assert bool(batch.has_rollout_log_probs.all()), "build.behaviour_log_probs_need makes every row carry them"
        kl, ess = importance_weighted_kl(batch.old_log_prob, batch.ref_log_prob, batch.rollout_log_probs,
                                         batch.response_mask)
        return float(kl), {"actor/kl_to_ref_importance_weighted": kl, "actor/kl_is_effective_sample_size": ess}
    probe = records[: s.kl.probe_prompts]
    # The probe samples with the actor and scores with it and the reference, all offloaded since scoring.
    with parts.offloader.resident("actor", "ref"), generation_model(parts) as (sampler, sharded):
        kl = sampled_kl_to_ref(parts.actor, lambda: reference_model(parts), probe, parts.tokenizer, s.sampling,
                               env=parts.env, head=s.forwards.head, sampler=sampler, sharded=sharded, seed=1000 * step,
                               estimator="low_var_kl", replicated=True, decoding=generation_decoding(parts, sharded))
    return kl, {"actor/kl_to_ref_sampled": kl}
