"""What the memory and time estimates read of a PPO config, compiled once into frozen settings.

``klppo.plan`` sits below ``klppo.trainer`` (the run-start check calls it from there), so it
cannot use ``trainer.settings.compile_ppo``; it compiles the config's memory-relevant keys
itself, here, once: per model its parameters (from ``model_shape``), what trains (LoRA), the
ranks that shard it, its compute dtype, offload and checkpointing; and per phase the tokens a
rank handles at a time. Which models a run loads comes from ``klppo.config.batch_sizes``,
the rules' one home.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from klppo.config import PPOConfig
from klppo.config.batch_sizes import (
    fsdp_sections, picks_cov_tokens, update_forwards_first, update_gives_old_log_prob, uses_critic, uses_reference,
)
from klppo.config.kl_probe import probe_prompts
from klppo.config.lora import lora_enabled
from klppo.config.rollout_checks import engine_dtype
from klppo.config.optimizers import optimizer_state_floats
from klppo.config.schema import FSDPConfig, LoraKeys, OptimConfig
from klppo.plan.model_shape import GOLD_ROLE, ModelShape, read_model_shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelPlan:
    """One model of the run, as its memory sees it."""

    role: str  # actor | ref | critic | reward_model | gold_reward_model
    shape: ModelShape
    parameters: int  # of the model this role loads (a critic's value head instead of the LM head)
    trainable: int  # parameters with gradients and optimiser state (all, the adapters, or none)
    shards: int  # ranks its parameters are split over (FSDP2; 1 = whole)
    compute_bytes: int  # bytes per element of forward/backward (fsdp_config.dtype; masters stay fp32)
    param_offload: bool  # parameters on the host between this model's phases (CUDA only)
    optimizer_offload: bool
    offload_policy: bool  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimiser state on the host
    checkpointing: bool  # enable_gradient_checkpointing
    lora_rank: int = 0
    optimizer_state_floats: float = 2.0  # fp32 floats of optimiser state per trainable parameter (AdamW: 2)


@dataclass(frozen=True)
class Passes:
    """Rows and tokens one rank handles at a time in each kind of pass (per micro-batch)."""

    update_tokens: int  # tokens of the actor's largest micro-batch (padding included when not packed)
    update_response_tokens: int  # of them, response tokens: where the LM head runs
    critic_tokens: int
    forward_tokens: int  # no-grad scoring micro-batch (old_log_prob, ref, values)
    forward_response_tokens: int
    gen_rows: int  # sequences this rank decodes at once
    gen_tokens: int  # prompt + response tokens each generated row's KV cache holds
    gen_response_tokens: int  # of them, response tokens (rollout.response_length)
    probe_rows: int  # offline: the KL probe's sampled sequences (0 online)


@dataclass(frozen=True)
class PlanSettings:
    world_size: int
    device: str  # cpu | cuda
    rollout: str  # offline | hf | vllm
    models: tuple[ModelPlan, ...]
    passes: Passes
    fused_head: bool  # use_fused_kernels (None: klppo's default, on)
    generation_copy: bool  # generation holds a copy of the actor's weights (gathered, cast, merged or on the device)
    engine_share: float  # vLLM: rollout.gpu_memory_utilization
    engine_kv_bytes: Optional[int]  # vLLM: rollout.kv_cache_memory_bytes, or a CPU engine's default (None: the share)
    engine_tp: int
    engine_bytes: int  # vLLM: bytes per element of the engine's weights (rollout.dtype; auto: the actor's compute)
    engine_sleeps: bool  # vLLM on a GPU with free_cache_engine: weights and KV cache released outside generation
    whole_loads: bool  # one process without a process group: every model loads with from_pretrained
    uses_reference: bool  # a KL term needs the reference (a LoRA actor is its own, with adapters off)
    device_bytes: int  # the device's memory (what vLLM's share is of)
    old_log_prob_forward: bool = True  # False where the actor's update gives pi_old (``update_gives_old_log_prob``)
    # The updates' forwards run first (``update_forwards_first``): no values forward, and the actor's
    # saved activations wait through the critic's update.
    update_forwards_first: bool = False
    # HF generation keeps its model (the copy, where there is one) and static KV caches between
    # generations (``kept_generation``): held through every phase after the first generation.
    generation_kept: bool = False
    # The actor's entropy bonus is in its loss (actor.entropy_coeff != 0): backward then runs
    # through the entropy too, which the unfused head pays in whole logits.
    entropy_in_loss: bool = False
    # Clip-Cov / KL-Cov: a no-grad forward of the actor over each mini-batch before it trains (``picks_cov_tokens``).
    cov_forwards: bool = False

    def model(self, role: str) -> Optional[ModelPlan]:
        return next((m for m in self.models if m.role == role), None)


def shard_count(fsdp: FSDPConfig, world_size: int) -> int:
    """Ranks a model's parameters are split over: fsdp_size (HSDP) where it divides the world, else all
    (-1, or a size at least the world: ``distributed.fsdp.build_mesh``)."""
    if 0 < fsdp.fsdp_size < world_size and world_size % fsdp.fsdp_size == 0:
        return fsdp.fsdp_size
    return world_size


def _module_matches(name: str, targets) -> bool:
    """Whether LoRA keys' target/exclude ``targets`` pick linear ``name`` (peft: a list of names, a
    regex over the full module name, or "all-linear")."""
    if targets is None:
        return False
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, f"model.layers.0.mlp.{name}") is not None or \
            re.fullmatch(targets, f"model.layers.0.self_attn.{name}") is not None
    return name in targets


def lora_parameters(shape: ModelShape, keys: LoraKeys, rank: int) -> int:
    """Adapter parameters: r x (in + out) per adapted linear layer of every decoder block."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    chosen = [n for n in LINEARS if _module_matches(n, keys.target_modules)
              and not _module_matches(n, keys.exclude_modules)]
    return shape.num_hidden_layers * sum(rank * sum(dims[n]) for n in chosen)


def lora_rank_of(keys: LoraKeys) -> int:
    """The adapters' rank: lora_rank, or a saved adapter's ``r``."""
    if not lora_enabled(keys):
        return 0
    if keys.lora_rank > 0:
        return keys.lora_rank
    import json
    from pathlib import Path

    return int(json.loads((Path(keys.lora_adapter_path) / "adapter_config.json").read_text())["r"])


def model_plan(role: str, shape: ModelShape, fsdp: FSDPConfig, world_size: int, *, lora: Optional[LoraKeys] = None,
               trains: bool = True, checkpointing: bool = False, optim: Optional[OptimConfig] = None) -> ModelPlan:
    loaded_as = {"actor": "causal_lm", "ref": "causal_lm"}.get(role, role)
    parameters = shape.role_parameters(loaded_as)
    rank = lora_rank_of(lora) if lora is not None else 0
    head = parameters - shape.role_parameters("causal_lm") + shape.lm_head_parameters if role == "critic" else 0
    trainable = 0 if not trains else (lora_parameters(shape, lora, rank) + head if rank else parameters)
    return ModelPlan(role=role, shape=shape, parameters=parameters, trainable=trainable,
                     shards=shard_count(fsdp, world_size), compute_bytes=DTYPE_BYTES[fsdp.dtype],
                     param_offload=fsdp.param_offload, optimizer_offload=fsdp.optimizer_offload,
                     offload_policy=fsdp.offload_policy, checkpointing=checkpointing, lora_rank=rank,
                     optimizer_state_floats=2.0 if optim is None else optimizer_state_floats(
                         optim.optimizer_impl, optim.optimizer, optim.override_optimizer_config))


@dataclass(frozen=True)
class Lengths:
    """Token lengths of a sample of the run's rows: (prompt, response) means and maxima."""

    mean_prompt: float
    mean_response: float
    max_prompt: int
    max_response: int

    @classmethod
    def of(cls, prompts: Sequence[int], responses: Sequence[int]) -> "Lengths":
        """From each sample's prompt and response tokens (``batches.LengthSample``'s two columns)."""
        return cls(sum(prompts) / len(prompts), sum(responses) / len(responses), max(prompts), max(responses))


def _micro_tokens(rows: int, micro_rows: Optional[int], budget: Optional[int], packed: bool,
                  lengths: Lengths) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch of ``rows`` rows: a token budget packs
    up to it; fixed rows are padded to the longest prompt and response unless packed."""
    mean = lengths.mean_prompt + lengths.mean_response
    if budget is not None:
        tokens = max(min(budget, round(rows * mean)), lengths.max_prompt + lengths.max_response)
        return tokens, round(tokens * lengths.mean_response / mean)
    take = min(rows, micro_rows or rows)
    if packed:
        return round(take * mean), round(take * lengths.mean_response)
    return take * (lengths.max_prompt + lengths.max_response), take * lengths.max_response


def static_kv_cache(cfg: PPOConfig, device: str) -> bool:
    """Whether HF generation's KV cache is static (``rollout.hf_decoding``, ``rollout.hf.Decoding.on``):
    allocated for ``data.max_prompt_length`` + response tokens per row, whatever the prompts' lengths."""
    decoding = cfg.actor_rollout_ref.rollout.hf_decoding
    return decoding in ("static", "compiled") or (decoding == "auto" and device == "cuda")


def kept_generation(cfg: PPOConfig, device: str) -> bool:
    """Whether HF generation keeps its model and static KV caches from one generation to the next
    (``trainer.responses.keeps_generation_model``): with a static cache, unless the actor is
    offloaded between its phases."""
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    return (cfg.actor_rollout_ref.rollout.name != "vllm" and static_kv_cache(cfg, device)
            and not (fsdp.param_offload or fsdp.offload_policy))


def passes(cfg: PPOConfig, world_size: int, lengths: Lengths, device: str = "cpu") -> Passes:
    """Tokens per micro-batch of each pass on one rank, for a run on ``world_size`` ranks of ``device``."""
    arf, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    actor, rollout, critic = arf.actor, arf.rollout, cfg.critic
    packed = arf.model.use_remove_padding
    step_rows = max(1, cfg.data.train_batch_size * n // world_size)
    budget = actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None
    update = _micro_tokens(max(1, actor.ppo_mini_batch_size * n // world_size), actor.ppo_micro_batch_size_per_gpu,
                           budget, packed, lengths)
    critic_dynamic = actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
    critic_update = _micro_tokens(max(1, critic.ppo_mini_batch_size * n // world_size),
                                  critic.ppo_micro_batch_size_per_gpu,
                                  critic.ppo_max_token_len_per_gpu if critic_dynamic else None,
                                  critic.model.use_remove_padding, lengths)
    dynamic = actor.use_dynamic_bsz if rollout.log_prob_use_dynamic_bsz is None else rollout.log_prob_use_dynamic_bsz
    forward_budget = (rollout.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu) if dynamic else None
    forward = _micro_tokens(step_rows, rollout.log_prob_micro_batch_size_per_gpu, forward_budget, packed, lengths)
    response = rollout.response_length or cfg.data.max_response_length
    probe = probe_prompts(cfg) * n if rollout.name == "offline" and uses_reference(cfg) else 0
    return Passes(update_tokens=update[0], update_response_tokens=update[1], critic_tokens=critic_update[0],
                  forward_tokens=forward[0], forward_response_tokens=forward[1],
                  gen_rows=step_rows if rollout.name != "offline" else 0,
                  gen_tokens=response + (cfg.data.max_prompt_length if static_kv_cache(cfg, device)
                                         else lengths.max_prompt),
                  gen_response_tokens=response, probe_rows=min(probe, cfg.data.train_batch_size * n))


def read_shapes(cfg: PPOConfig) -> dict[str, ModelShape]:
    """The shape of every model the run loads, from the folders' config.json and weight headers."""
    arf = cfg.actor_rollout_ref
    shapes = {"actor": read_model_shape(arf.model.path)}
    if uses_reference(cfg) and not lora_enabled(arf.model):
        shapes["ref"] = shapes["actor"]
    if uses_critic(cfg):
        path = cfg.critic.model.path or arf.model.path
        shapes["critic"] = shapes["actor"] if path == arf.model.path else read_model_shape(path, "critic.model.path")
    if cfg.reward_model.enable:
        shapes["reward_model"] = read_model_shape(cfg.reward_model.model.path, "reward_model.model.path")
    if cfg.trainer.gold_reward.model_path:  # loaded with the others, used at validation only
        shapes[GOLD_ROLE] = read_model_shape(cfg.trainer.gold_reward.model_path, "trainer.gold_reward.model_path")
    return shapes


def _models(cfg: PPOConfig, shapes: dict[str, ModelShape], world_size: int) -> tuple[ModelPlan, ...]:
    arf, critic = cfg.actor_rollout_ref, cfg.critic
    models = [model_plan("actor", shapes["actor"], arf.actor.fsdp_config, world_size, lora=arf.model,
                         checkpointing=arf.model.enable_gradient_checkpointing, optim=arf.actor.optim)]
    if "ref" in shapes:
        models.append(model_plan("ref", shapes["ref"], arf.ref.fsdp_config, world_size, trains=False))
    if "critic" in shapes:
        models.append(model_plan("critic", shapes["critic"], critic.model.fsdp_config, world_size, lora=critic.model,
                                 checkpointing=critic.model.enable_gradient_checkpointing, optim=critic.optim))
    for role in ("reward_model", GOLD_ROLE):  # a gold reward model is sharded as the reward model is
        if role in shapes:
            models.append(model_plan(role, shapes[role], cfg.reward_model.model.fsdp_config, world_size, trains=False))
    return tuple(models)


def generation_copy(cfg: PPOConfig, actor: ModelPlan, device: str, device_bytes: int) -> bool:
    """Whether HF generation holds a copy of the actor's weights (``trainer.responses.uses_gathered_copy``,
    ``distributed.inference_copy_bytes``): never with ``sharded``, nor where the plain model it
    decodes with shares the actor's parameters (a rank holding them whole, in fp32, on the device:
    one process, or ``fsdp_size: 1``); else the gathered, cast (bf16) or merged (LoRA) copy, or the
    copy on the device of parameters ``offload_policy`` keeps on the host; ``auto`` when it takes at
    most half the device."""
    weights = cfg.actor_rollout_ref.rollout.generation_weights
    on_host = actor.offload_policy and device == "cuda"
    shares = actor.shards == 1 and actor.compute_bytes == DTYPE_BYTES["float32"] and not on_host
    if weights == "sharded" or (shares and not actor.lora_rank):
        return False
    return weights == "gathered" or actor.parameters * actor.compute_bytes <= device_bytes // 2


# A CPU engine's KV cache default (klppo.rollout.vllm, which the plan cannot import; a test checks
# that they agree): at least MIN_CPU_KV_BYTES, every row at max_model_len plus a block of slack.
MIN_CPU_KV_BYTES, CPU_BLOCK_TOKENS = 64 << 20, 128


def engine_kv_bytes(cfg: PPOConfig, shape: ModelShape, world_size: int, device: str, device_bytes: int,
                    dtype_bytes: int) -> Optional[int]:
    """The vLLM engine's KV cache: rollout.kv_cache_memory_bytes, else on CPU the engine's default
    (``rollout.vllm.cpu_kv_cache_bytes``: every sequence one generation call decodes at
    max_model_len, within a quarter of the memory, at least 64 MiB); None on a GPU, where the
    engine takes gpu_memory_utilization of the device."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm" or rollout.kv_cache_memory_bytes is not None or device == "cuda":
        return rollout.kv_cache_memory_bytes
    tp = rollout.tensor_model_parallel_size
    rows = cfg.data.gen_batch_size * rollout.n * tp // world_size
    per_token = 2 * shape.num_hidden_layers * max(1, shape.num_key_value_heads // tp) * shape.head_dim * dtype_bytes
    wanted = min(rows, rollout.max_num_seqs) * (rollout.max_model_len + CPU_BLOCK_TOKENS) * per_token
    return max(MIN_CPU_KV_BYTES, min(wanted, device_bytes // 4))


def plan_settings(cfg: PPOConfig, shapes: dict[str, ModelShape], world_size: int, device: str, device_bytes: int,
                  lengths: Lengths) -> PlanSettings:
    """The memory-relevant settings of a validated PPO config on ``world_size`` ranks of ``device``."""
    arf = cfg.actor_rollout_ref
    models = _models(cfg, shapes, world_size)
    engine_bytes = DTYPE_BYTES[engine_dtype(cfg)]  # auto: the actor's compute dtype, fp32 for a bf16 LoRA actor
    return PlanSettings(
        world_size=world_size, device=device, rollout=arf.rollout.name, models=models,
        passes=passes(cfg, world_size, lengths, device), fused_head=arf.model.use_fused_kernels is not False,
        generation_copy=generation_copy(cfg, models[0], device, device_bytes),
        engine_share=arf.rollout.gpu_memory_utilization, engine_tp=arf.rollout.tensor_model_parallel_size,
        engine_kv_bytes=engine_kv_bytes(cfg, shapes["actor"], world_size, device, device_bytes, engine_bytes),
        engine_bytes=engine_bytes, engine_sleeps=device == "cuda" and arf.rollout.free_cache_engine,
        whole_loads=world_size == 1 and all(f == FSDPConfig() for f in fsdp_sections(cfg).values()),
        uses_reference=uses_reference(cfg),
        device_bytes=device_bytes, old_log_prob_forward=not update_gives_old_log_prob(cfg, world_size),
        entropy_in_loss=arf.actor.entropy_coeff != 0, cov_forwards=picks_cov_tokens(cfg),
        update_forwards_first=update_forwards_first(cfg, world_size), generation_kept=kept_generation(cfg, device))
