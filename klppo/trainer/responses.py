"""Step 2 of a PPO iteration: the step's responses, the whole batch on every rank.

Offline runs read the recorded responses. Online runs (``rollout.name: hf``) sample: each rank
for its share of the prompts, then the responses are gathered. On sharded ranks the actor is
either all-gathered once into a whole inference copy that decodes without any collective
(``rollout.generation_weights: gathered``), or used sharded, which all-gathers every layer for
every generated token but needs no second copy (``sharded``); ``auto`` picks the copy where it
fits in half the memory free on this rank.

A LoRA actor's copy is made also in one process. In fp32 it has its adapters merged into the
weights (once per step): decoding through peft's adapter layers ran 1.15x (a 512-wide, 8-layer
model) to 1.9x (the tiny model) slower on CPU than a merged copy, merging included
(``benchmarks/README.md``, "LoRA"). Under a half-precision ``fsdp_config.dtype`` the copy keeps
its adapters and computes exactly as the actor does (its log-probs are the actor's, bit for
bit): the merged weight W + dW, rounded to bf16, loses most of an early update (after 3 steps at
lr 1e-5 the tiny model's merged copy was as far from the actor, 1e-3 in log-prob, as the base
model was), so the sampler would not be the pi_old whose log-probs PPO uses. With ``sharded``
the adapters decode in place.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from klppo.data.rl_dataset import PromptRecord
from klppo.distributed import all_gather_padded, inference_copy, max_over_ranks, plain_copy, shard_range
from klppo.models.lora import add_adapters_like, has_adapters
from klppo.monitoring.memory import available_bytes
from klppo.rollout.batch import RolloutBatch, assemble_batch
from klppo.rollout.hf import hf_rollout
from klppo.rollout.offline import offline_rollout
from klppo.trainer.adapters import merged_weights

if TYPE_CHECKING:
    from klppo.trainer.build import PPOParts


def step_responses(parts: PPOParts, records: list[PromptRecord]) -> RolloutBatch:
    """The step's whole batch on every rank: recorded responses, or sampled by the ranks and gathered."""
    s, tokenizer, env = parts.settings, parts.tokenizer, parts.env
    if s.rollout == "offline":
        return offline_rollout(records, n=s.n, tokenizer=tokenizer, max_response_length=s.response_length)
    mine = records[shard_range(len(records), env)]
    with parts.offloader.resident("actor"), generation_model(parts) as (model, sharded):
        local = hf_rollout(model, mine, tokenizer, s.sampling, synced_gpus=sharded, device=env.device)
    if not env.is_distributed:
        return local
    return assemble_batch(records, s.n, tokenizer.pad_token_id,
                          all_gather_padded(local.response_ids, tokenizer.pad_token_id),
                          all_gather_padded(local.response_mask, 0))


def uses_gathered_copy(parts: PPOParts) -> bool:
    """Whether this step generates with a whole copy of the sharded (or LoRA) actor (``generation_weights``)."""
    s, env = parts.settings, parts.env
    if s.generation_weights == "sharded":
        return False
    if (env.world_size == 1 or not env.is_distributed) and not s.actor_lora:
        return False  # one process: the actor itself is whole (a group of one shards nothing)
    if s.generation_weights == "gathered":
        return True
    element = torch.finfo(s.actor.compute_dtype).bits // 8
    needed = sum(p.numel() for p in parts.actor.parameters()) * element  # global numel of sharded params
    too_big = float(needed > available_bytes(env.device) // 2)
    return max_over_ranks({"too_big": too_big})["too_big"] == 0.0  # every rank decides the same


@contextmanager
def generation_model(parts: PPOParts) -> Iterator[tuple[torch.nn.Module, bool]]:
    """(the model to generate with, whether it is sharded); a gathered copy is freed afterwards."""
    if not uses_gathered_copy(parts):
        yield parts.actor, parts.env.is_distributed
        return
    copy = generation_copy(parts.actor, parts.settings.actor.compute_dtype, parts.env.device)
    try:
        yield copy, False
    finally:
        del copy
        if parts.env.device.type == "cuda":
            torch.cuda.empty_cache()


def generation_copy(actor: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A whole copy of the (sharded or LoRA) actor on every rank, in ``dtype``; collective. A LoRA
    actor's adapters are merged into the copy's weights in fp32, or kept under a half-precision
    ``dtype`` (see the module's docstring)."""
    if not has_adapters(actor):
        return inference_copy(actor, dtype, device)
    if dtype == torch.float32:
        return plain_copy(actor, dict(merged_weights(actor, dtype, device)))
    return inference_copy(actor, dtype, device, prepare=lambda copy: add_adapters_like(copy, actor))
