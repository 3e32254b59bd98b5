"""FLOPs of one PPO step by phase and the step time they take at a stated MFU.

The FLOPs are ``klppo.monitoring.flops.model_flops``' count (what MFU divides, the PaLM
convention: real tokens, causal attention, the LM head where log-probs are read, training = 3
passes, recomputation not counted), over the whole step (every rank's rows). A phase's time at
MFU u on W devices of peak F is FLOPs / (u x F x W). Generation with a KV cache runs about the
FLOPs of one forward over the prompt and response, but is bound by memory bandwidth, not
FLOPs, so its time at the same MFU is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from klppo.monitoring import flops
from klppo.plan.inputs import PlanSettings
from klppo.plan.model_shape import ModelShape


@dataclass(frozen=True)
class PhaseFlops:
    phase: str
    flops: float  # over the whole step, all ranks


def model_flops(shape: ModelShape, seqs: list[int], **kwargs) -> float:
    """``flops.model_flops`` of a planned model: its config's numbers and the weights a token runs through."""
    return flops.model_flops(shape, seqs, layer_weights=shape.layer_weights, **kwargs)


def _model(s: PlanSettings, role: str):
    m = s.model(role)
    return None if m is None else m.shape


def step_flops(s: PlanSettings, prompts: list[int], responses: list[int], *, epochs: dict[str, int],
               probe_rows: float = 0) -> list[PhaseFlops]:
    """FLOPs of one step whose rows have ``prompts`` / ``responses`` tokens (one entry per row of the
    whole step); ``epochs``: ppo_epochs of the actor and the critic; ``probe_rows``: the offline KL
    probe's rows per step (a probe's rows over its cadence, ``config.kl_probe.probe_every``)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    resp = sum(responses)
    actor = _model(s, "actor")
    out = []
    if s.rollout != "offline":
        out.append(PhaseFlops("gen", model_flops(actor, seqs, training=False, head_positions=resp)))
    if probe_rows:
        share = probe_rows / len(seqs)
        out.append(PhaseFlops("kl_probe", 3 * share * model_flops(actor, seqs, training=False, head_positions=resp)))
    if s.old_log_prob_forward:
        out.append(PhaseFlops("old_log_prob", model_flops(actor, seqs, training=False, head_positions=resp)))
    if s.uses_reference:
        out.append(PhaseFlops("ref", model_flops(_model(s, "ref") or actor, seqs, training=False, head_positions=resp)))
    critic, rm = _model(s, "critic"), _model(s, "reward_model")
    if critic is not None and not s.update_forwards_first:
        out.append(PhaseFlops("values", model_flops(critic, seqs, training=False, head_outputs=1)))
    if rm is not None:
        out.append(PhaseFlops("reward", model_flops(rm, seqs, training=False, head_positions=len(seqs), head_outputs=1)))
    if critic is not None:
        out.append(PhaseFlops("update_critic", epochs["critic"] * model_flops(critic, seqs, training=True, head_outputs=1)))
    update = model_flops(actor, seqs, training=True, head_positions=resp)
    if s.cov_forwards:  # Clip-Cov / KL-Cov's no-grad forward over each mini-batch, timed with the update
        update += model_flops(actor, seqs, training=False, head_positions=resp)
    out.append(PhaseFlops("update_actor", epochs["actor"] * update))
    return out


def phase_seconds(flops: float, mfu: float, peak_flops: float, devices: int) -> float:
    """Seconds of ``flops`` at utilisation ``mfu`` of ``devices`` devices of ``peak_flops`` each."""
    return flops / (mfu * peak_flops * devices)
