"""Step 2 of a PPO iteration: the step's responses, the whole batch on every rank.

Offline runs read the recorded responses. Online runs sample: with vLLM (``rollout.name:
vllm``) each tensor-parallel group of ranks for its share of the prompts, after the actor's
weights were streamed into its engine; with Hugging Face generate (``hf``) each rank for its
share. Then the responses are gathered. With hf an FSDP2-wrapped actor (several ranks, or one
process's group of one) either gives a plain model of its weights, gathered once per generation,
that decodes without any FSDP2 hook or collective (``rollout.generation_weights: gathered``; on
one process computing in fp32 the plain model shares the actor's parameters, no copy at all), or
is used sharded, running FSDP2's hooks (and on several ranks an all-gather) in every layer for
every generated token but needing no second copy (``sharded``); ``auto`` picks the plain model
where what it adds fits in half the memory free on every rank. The plain model decodes as
``rollout.hf_decoding`` says (a static KV cache, compiled on CUDA).

A LoRA actor's copy is made also in one process. In fp32 it has its adapters merged into the
weights (once per step): decoding through peft's adapter layers ran 1.15x (a 512-wide, 8-layer
model) to 1.9x (the tiny model) slower on CPU than a merged copy, merging included
(``benchmarks/README.md``, "LoRA"). Under a half-precision ``fsdp_config.dtype`` the copy keeps
its adapters and computes exactly as the actor does (its log-probs are the actor's, bit for
bit): the merged weight W + dW, rounded to bf16, loses most of an early update (after 3 steps at
lr 1e-5 the tiny model's merged copy was as far from the actor, 1e-3 in log-prob, as the base
model was), so the sampler would not be the pi_old whose log-probs PPO uses. With ``sharded``
the adapters decode in place.

With a static KV cache (``hf_decoding`` static or compiled: CUDA's default) the generation model and
its caches are kept from one generation to the next (``keeps_generation_model``): the copy is built
once and the actor's weights are written into it in place before each generation, so that compiled
decoding replays its CUDA graphs on the same addresses rather than recording them again every step
(``rollout.hf``). It costs the copy and the caches held through the other phases, which ``klppo
plan`` counts; ``hf_decoding=dynamic`` frees them between generations, as does an offloaded actor.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Container, Iterator, Optional

import torch

from klppo.data.rl_dataset import PromptRecord
from klppo.distributed import (
    all_gather_groups, all_gather_objects, all_gather_padded, inference_copy, inference_copy_bytes, is_sharded,
    load_in_place, max_over_ranks, plain_copy, shard_range, tied_aliases, whole_parameters,
)
from klppo.models.lora import add_adapters_like, has_adapters
from klppo.monitoring.memory import available_bytes
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch, assemble_batch
from klppo.rollout.hf import DYNAMIC, Decoding, SamplingParams, hf_rollout
from klppo.rollout.offline import offline_rollout
from klppo.rollout.vllm import request_seed
from klppo.run.adapters import merged_weights

if TYPE_CHECKING:
    from klppo.run.build import PPOParts


def step_responses(parts: PPOParts, records: list[PromptRecord], timer: PhaseTimer, step: int,
                   draw: int = 0) -> RolloutBatch:
    """The step's whole batch on every rank: recorded responses, or sampled by the ranks and gathered.

    ``draw``: which generation batch of the step this is (dynamic sampling draws several); vLLM's
    request seeds differ between them, Hugging Face generate draws on from torch's RNG.
    """
    s, tokenizer = parts.settings, parts.tokenizer
    if parts.engine is not None:
        if draw == 0 or not parts.engine.holds_weights:  # the step's new weights; or a sleep released them
            sync_engine_weights(parts, timer)
        with timer.phase("gen"):
            return engine_responses(parts, records, s.sampling, step, draw)
    with timer.phase("gen"):
        if s.rollout == "offline":
            return offline_rollout(records, n=s.n, tokenizer=tokenizer, max_response_length=s.response_length)
        return _hf_responses(parts, records, s.sampling)


def greedy_responses(parts: PPOParts, records: list[PromptRecord], timer: PhaseTimer, step: int) -> RolloutBatch:
    """ReMax's baseline: one greedy response to each of ``records`` (``timing_s/gen_max``, verl's
    name), from the weights that just sampled the step's responses; the whole batch on every rank.
    Greedy decoding draws no random number, so the run's random streams are those of a run without it."""
    params = replace(parts.settings.sampling, n=1, do_sample=False)
    if parts.engine is not None:
        if not parts.engine.holds_weights:  # a sleep released the step's weights
            sync_engine_weights(parts, timer)
        with timer.phase("gen_max"):
            return engine_responses(parts, records, params, step)
    with timer.phase("gen_max"):
        return _hf_responses(parts, records, params)


def _hf_responses(parts: PPOParts, records: list[PromptRecord], params: SamplingParams) -> RolloutBatch:
    """``records``' responses from Hugging Face generate: each rank samples its share, all gathered."""
    env, tokenizer = parts.env, parts.tokenizer
    mine = records[shard_range(len(records), env)]
    with parts.offloader.resident("actor"), generation_model(parts) as (model, sharded):
        local = hf_rollout(model, mine, tokenizer, params, synced_gpus=sharded, device=env.device,
                           decoding=generation_decoding(parts, sharded), multi_turn=parts.multi_turn,
                           keep_going=turns_together(sharded))
    if not env.is_distributed:
        return local
    turns = None
    if local.response_attention_mask is not None:  # multi-turn: every rank's conversations have them
        turns = (all_gather_padded(local.response_attention_mask, 0), all_gather_padded(local.num_turns[:, None], 0)[:, 0])
    return assemble_batch(records, params.n, tokenizer.pad_token_id,
                          all_gather_padded(local.response_ids, tokenizer.pad_token_id),
                          all_gather_padded(local.response_mask, 0), turns=turns,
                          tool_extra_fields=gathered_rows(local.tool_extra_fields))


def turns_together(sharded: bool) -> Optional[Callable[[bool], bool]]:
    """Multi-turn rollouts on a sharded actor: every rank generates another turn while any rank has a
    conversation left (``synced_gpus`` needs each rank's ``generate`` calls to line up); None where
    each rank decodes alone."""
    if not sharded:
        return None
    return lambda active: max_over_ranks({"active": float(active)})["active"] > 0


def gathered_rows(values: Optional[list], group_size: int = 1) -> Optional[list]:
    """Every rank's per-row ``values`` (picklable), in rank order, one copy per group of ``group_size``
    consecutive ranks that hold the same rows; None where the ranks have none (collective otherwise)."""
    if values is None:
        return None
    return [value for rank_values in all_gather_objects(values)[::group_size] for value in rank_values]


# ---- vLLM ----

VALIDATION = -1  # the "step" of validation's request seeds: every validation samples the same way


def engine_seeds(parts: PPOParts, records: list[PromptRecord], n: int, step: int, draw: int = 0) -> list[int]:
    """One seed per request (record, sample) of generation batch ``draw`` of ``step``: the same on any
    number of ranks and after a resume. A prompt drawn twice in one step (dynamic sampling across an
    epoch's end) is sampled afresh; the first draw keeps the seeds runs without dynamic sampling have."""
    seed, later = parts.settings.engine.seed, (draw,) if draw else ()
    return [request_seed(seed, step, record.index, k, *later) for record in records for k in range(n)]


def engine_responses(parts: PPOParts, records: list[PromptRecord], params: SamplingParams, step: int,
                     draw: int = 0) -> RolloutBatch:
    """``records``' responses from the engines, the whole batch on every rank: each tensor-parallel
    group samples its share (every member the same), and one copy per group is gathered."""
    env, tokenizer, tp = parts.env, parts.tokenizer, parts.settings.engine.tensor_parallel_size
    mine = records[shard_range(len(records), env, tp)]
    local = parts.engine.generate(mine, params, engine_seeds(parts, mine, params.n, step, draw), tokenizer,
                                  parts.multi_turn)
    if not env.is_distributed:
        return local
    pad, log_probs, turns = tokenizer.pad_token_id, None, None
    if local.rollout_log_probs is not None:  # every row has them
        log_probs = (all_gather_groups(local.rollout_log_probs, 0.0, tp),
                     torch.ones(len(records) * params.n, dtype=torch.bool))
    if local.response_attention_mask is not None:  # multi-turn: every rank's conversations have them
        turns = (all_gather_groups(local.response_attention_mask, 0, tp),
                 all_gather_groups(local.num_turns[:, None], 0, tp)[:, 0])
    return assemble_batch(records, params.n, pad, all_gather_groups(local.response_ids, pad, tp),
                          all_gather_groups(local.response_mask, 0, tp), rollout_log_probs=log_probs, turns=turns,
                          tool_extra_fields=gathered_rows(local.tool_extra_fields, tp))


def sync_engine_weights(parts: PPOParts, timer: PhaseTimer | None = None) -> None:
    """Stream the actor's current weights into the engine (``timing_s/weight_sync``): whole tensors a
    decoder block at a time on every rank, a LoRA actor's adapters merged on the way in fp32. Before
    a step's generation, so updates, rollbacks and resumes all reach it, and before any generation
    after a sleep released them (``VLLMEngine.holds_weights``)."""
    phase = timer.phase("weight_sync") if timer is not None else nullcontext()
    engine = parts.engine
    with phase, parts.offloader.resident("actor"):
        engine.load_weights(engine_weights(parts.actor, parts.settings.engine.dtype, parts.env.device,
                                           engine.parameter_names))


def engine_weights(actor: torch.nn.Module, dtype: torch.dtype, device: torch.device, takes: Container[str]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, whole tensor in ``dtype`` on ``device``) of every weight the engine needs
    (``adapters.merged_weights``); collective.

    A tied parameter comes under each of its names that the engine's model ``takes`` (its parameter
    names, ``VLLMEngine.parameter_names``): vLLM's CPU backend repacks the LM head's weight for its
    own matmul, so loading the embeddings alone left a model whose head kept the engine's start-up
    weights (log-probs off by up to 1.1 nats on the tiny model); but a model whose vLLM class has no
    LM head of its own (Gemma2 computes its logits with the embeddings) refuses the name, and the
    first sync would raise.
    """
    aliases = tied_aliases(actor)
    for name, tensor in merged_weights(actor, dtype, device, copies=False, saved=True):  # the engine copies them in
        yield name, tensor
        for alias in aliases.get(name, ()):
            if alias in takes:
                yield alias, tensor


# ---- Hugging Face generate ----


def uses_gathered_copy(parts: PPOParts) -> bool:
    """Whether this step generates with a plain model of the actor's weights (``generation_copy``)
    rather than the actor itself (``generation_weights``).

    An FSDP2-wrapped actor runs its hooks in every layer's forward, for every generated token, on
    any number of ranks: one process's group of one (bf16 mixed precision, offload_policy) too. So
    it always gets the plain model, unless ``sharded`` is asked for, or ``auto`` finds that what the
    plain model adds (``inference_copy_bytes``: nothing for one process computing in fp32, whose
    plain model shares the actor's parameters; the cast copy under bf16) does not fit in half the
    memory free on some rank. A LoRA actor always gets its copy (adapters merged or kept); a plain
    actor (one process, no process group) decodes as it is.
    """
    s, env = parts.settings, parts.env
    if s.generation_weights == "sharded" or not (is_sharded(parts.actor) or s.actor_lora):
        return False
    if s.generation_weights == "gathered" or parts.kept_generation_model is not None:
        return True
    needed = generation_copy_bytes(parts.actor, s.actor.compute_dtype, env.device)
    too_big = float(needed > available_bytes(env.device) // 2)
    fits = max_over_ranks({"too_big": too_big})["too_big"] == 0.0  # every rank decides the same
    if not fits and env.rank == 0:
        warnings.warn(f"rollout.generation_weights=auto: a plain copy of the actor for generation "
                      f"({needed / 2**30:.2f} GiB) does not fit in half the free memory, so generation runs "
                      "through the sharded actor, with FSDP2's hooks (and on several ranks an all-gather) in "
                      "every layer for every token: slow. Free memory (param_offload, smaller batches), or set "
                      "generation_weights=sharded.",
                      stacklevel=2)
    return fits


def generation_copy_bytes(actor: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes ``generation_copy`` allocates on this rank: a LoRA actor's merged fp32 copy is new memory
    whole; otherwise what ``inference_copy`` cannot share with the actor."""
    if merges_adapters(actor, dtype):
        return sum(p.numel() for p in actor.parameters()) * 4
    return inference_copy_bytes(actor, dtype, device)


def generation_decoding(parts: PPOParts, sharded: bool) -> Decoding:
    """How ``generation_model``'s model decodes: as ``rollout.hf_decoding`` says, resolved for the device,
    into the run's kept caches where the model is kept (``keeps_generation_model``); the sharded actor
    with the dynamic cache, eagerly (FSDP2's hooks cannot be compiled)."""
    if sharded:
        return DYNAMIC
    decoding = parts.settings.hf_decoding.on(parts.env.device)
    return replace(decoding, caches=parts.kv_caches) if keeps_generation_model(parts) else decoding


def keeps_generation_model(parts: PPOParts) -> bool:
    """Whether generation decodes into a static cache with a model kept between generations (the actor
    itself, or its copy, refreshed in place), so that both keep their addresses: not for the dynamic
    cache, which gains nothing from it, nor for an actor offloaded between phases (``param_offload``,
    ``offload_policy``), whose memory on the device the copy would hold."""
    s = parts.settings  # klppo.plan.inputs.kept_generation says the same for the plan
    return s.hf_decoding.on(parts.env.device).mode != "dynamic" and not s.actor_offloaded


@contextmanager
def generation_model(parts: PPOParts) -> Iterator[tuple[torch.nn.Module, bool]]:
    """(the model to generate with, whether it is the sharded actor): the actor, or a plain copy of its
    weights, kept for the next generation (``keeps_generation_model``: the actor's current weights are
    written into it each time) or else freed afterwards.

    Freed to PyTorch's caching allocator, not to the driver: the next phases' tensors take its
    blocks. ``torch.cuda.empty_cache`` here waited for the device and returned them, to be
    allocated again by the next phase and the next step's copy; only memory outside PyTorch's
    allocator would gain, and the one such user, a vLLM engine, empties the cache itself before
    it wakes (``klppo.rollout.vllm``)."""
    if not uses_gathered_copy(parts):
        yield parts.actor, is_sharded(parts.actor)
        return
    dtype, device = parts.settings.actor.compute_dtype, parts.env.device
    if parts.kept_generation_model is not None:
        refresh_generation_copy(parts.kept_generation_model, parts.actor, dtype, device)
        yield parts.kept_generation_model, False
        return
    copy = generation_copy(parts.actor, dtype, device)
    if keeps_generation_model(parts):
        parts.kept_generation_model = copy
    try:
        yield copy, False
    finally:
        del copy


def generation_copy(actor: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A plain, whole model of the (sharded or LoRA) actor's weights on every rank, in ``dtype``
    (``inference_copy``: it shares the parameters a rank holds whole in ``dtype``); collective. A
    LoRA actor's adapters are merged into the copy's weights in fp32, or kept under a
    half-precision ``dtype`` (see the module's docstring)."""
    if merges_adapters(actor, dtype):
        return plain_copy(actor, dict(merged_weights(actor, dtype, device)))
    if not has_adapters(actor):
        return inference_copy(actor, dtype, device)
    return inference_copy(actor, dtype, device, prepare=lambda copy: add_adapters_like(copy, actor))


def merges_adapters(actor: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the generation copy of ``actor`` has its LoRA adapters merged into its weights (in fp32),
    rather than kept (under a half-precision ``dtype``) or absent."""
    return has_adapters(actor) and dtype == torch.float32


def refresh_generation_copy(copy: torch.nn.Module, actor: torch.nn.Module, dtype: torch.dtype,
                            device: torch.device) -> None:
    """Write the (sharded or LoRA) actor's current weights into ``generation_copy``'s copy, in place; as
    ``generation_copy`` makes them (merged, or with the adapters kept); collective."""
    if merges_adapters(actor, dtype):
        weights = merged_weights(actor, dtype, device, copies=False)
    else:
        weights = ((name, tensor) for name, tensor, _ in whole_parameters(actor, dtype, device))
    load_in_place(copy, weights)
