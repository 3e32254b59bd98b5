"""The memory plan of a config: every phase's estimate, the peak, whether it fits, and the knobs
that would make it fit. Shared by ``klppo plan`` and the check at the start of every run.

Knobs are tried on a copy of the config, one key at a time on top of the ones before that
lowered the peak, and estimated again, so each comes with the peak it gives; cheapest first: what costs no accuracy and little
time (checkpointing, the fused head, offloading optimiser state) before what costs time (a
smaller token budget, sharded generation, parameter offload) and what changes the run
(bf16 compute, LoRA, more ranks).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable, Optional

from klppo.config import PPOConfig
from klppo.errors import UserError
from klppo.plan.inputs import Lengths, PlanSettings, plan_settings
from klppo.plan.memory import PhaseMemory, peak_phase, phase_estimates
from klppo.plan.model_shape import ModelShape

GiB = 2**30
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value, key: str) -> int:
    """Bytes of a size such as ``80GiB``, ``24GB``, ``1.5TiB`` or a plain number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise UserError(f"{key} = '{value}' is not a size; write it as bytes or with a unit, e.g. 80GiB, 24GB, 1TiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Estimate:
    settings: PlanSettings
    phases: list[PhaseMemory]

    @property
    def peak(self) -> PhaseMemory:
        return peak_phase(self.phases)


@dataclass(frozen=True)
class Knob:
    override: str  # key=value, as a command line takes it
    peak_bytes: int  # the estimated peak with it
    fits: bool


def estimate(cfg: PPOConfig, shapes: dict[str, ModelShape], lengths: Lengths, *, world_size: int, device: str,
             device_bytes: int, first_step: bool = False) -> Estimate:
    s = plan_settings(cfg, shapes, world_size, device, device_bytes, lengths)
    return Estimate(s, phase_estimates(s, first_step))


def with_key(cfg: PPOConfig, key: str, value) -> PPOConfig:
    """A copy of ``cfg`` with the dotted ``key`` set to ``value``."""
    out = copy.deepcopy(cfg)
    *path, last = key.split(".")
    node = out
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)
    return out


def _candidates(cfg: PPOConfig, s: PlanSettings) -> list[tuple[str, object]]:
    """(key, value) of every knob that could lower this run's peak, cheapest first."""
    arf, out = cfg.actor_rollout_ref, []
    if not arf.model.enable_gradient_checkpointing:
        out.append(("actor_rollout_ref.model.enable_gradient_checkpointing", True))
    if s.model("critic") and not cfg.critic.model.enable_gradient_checkpointing:
        out.append(("critic.model.enable_gradient_checkpointing", True))
    if not s.fused_head:
        out.append(("actor_rollout_ref.model.use_fused_kernels", True))
    cuda = s.device == "cuda"
    if cuda and not arf.actor.fsdp_config.optimizer_offload:
        out.append(("actor_rollout_ref.actor.fsdp_config.optimizer_offload", True))
    actor_budget = arf.actor.ppo_max_token_len_per_gpu
    if arf.actor.use_dynamic_bsz and actor_budget // 2 >= s.passes.gen_tokens:
        out.append(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor_budget // 2))
    elif not arf.actor.use_dynamic_bsz:
        rows = arf.actor.ppo_micro_batch_size_per_gpu or arf.actor.ppo_mini_batch_size * arf.rollout.n // s.world_size
        if rows > 1:
            out.append(("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", rows // 2))
    if s.rollout != "vllm":  # a static KV cache holds data.max_prompt_length per row, not the longest prompt
        out.append(("actor_rollout_ref.rollout.hf_decoding", "dynamic"))
    if s.generation_copy:
        out.append(("actor_rollout_ref.rollout.generation_weights", "sharded"))
    if cuda:
        out += [("actor_rollout_ref.actor.fsdp_config.param_offload", True),
                ("actor_rollout_ref.ref.fsdp_config.param_offload", True),
                ("actor_rollout_ref.actor.fsdp_config.offload_policy", True)]
    if cuda and arf.actor.fsdp_config.dtype == "float32":
        out.append(("actor_rollout_ref.actor.fsdp_config.dtype", "bfloat16"))
    if not s.model("actor").lora_rank:
        out.append(("actor_rollout_ref.model.lora_rank", 16))
    return [(k, v) for k, v in out if _current(cfg, k) != v]


def _current(cfg: PPOConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def knobs(cfg: PPOConfig, shapes: dict[str, ModelShape], lengths: Lengths, base: Estimate) -> list[Knob]:
    """The knobs, cheapest first, each added to the ones above it that lowered the peak, with the
    peak that gives, until the run fits; then more ranks (the nodes doubled, up to 8 times)."""
    s, limit = base.settings, base.settings.device_bytes
    again: Callable[..., Estimate] = lambda c, world=s.world_size: estimate(
        c, shapes, lengths, world_size=world, device=s.device, device_bytes=limit)
    out, current, peak = [], cfg, base.peak.total
    for key, value in _candidates(cfg, s):
        trial = again(with_key(current, key, value)).peak.total
        if trial < peak:
            current, peak = with_key(current, key, value), trial
            out.append(Knob(f"{key}={_yaml(value)}", peak, peak <= limit))
        if peak <= limit:
            return out
    for factor in (2, 4, 8):
        trial = again(cfg, world=s.world_size * factor).peak.total
        out.append(Knob(f"trainer.nnodes={cfg.trainer.nnodes * factor} (alone)", trial, trial <= limit))
        if trial <= limit:
            break
    return out


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def fits(e: Estimate) -> bool:
    return e.peak.total <= e.settings.device_bytes


def device_bytes_from(cfg: PPOConfig, override: Optional[str], free: Callable[[], int]) -> int:
    """The memory per device to plan against: the command's option, else trainer.plan_device_memory,
    else what ``free()`` says this machine has."""
    if override is not None:
        return parse_size(override, "--device-memory")
    if cfg.trainer.plan_device_memory is not None:
        return parse_size(cfg.trainer.plan_device_memory, "trainer.plan_device_memory")
    return free()
