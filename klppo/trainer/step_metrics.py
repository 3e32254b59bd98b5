"""Step 8 of a PPO iteration: the numbers a step logs about itself, apart from the phases' own.

The batch's data metrics (scores, rewards, advantages, lengths and their trend), each phase's
peak memory, throughput, the updates' MFU and, with ``trainer.balance_batch``, how evenly the
ranks' shares were sized. Every value that differs between ranks is agreed (max or gathered)
before it is returned, so rank 0 logs the run's figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from klppo.data.batching import seqlen_balance_metrics
from klppo.distributed import max_over_ranks
from klppo.monitoring.flops import UpdateWork, decoder_weights_per_token, update_efficiency_metrics
from klppo.monitoring.metrics import (
    compute_data_metrics, compute_throughput_metrics, reward_component_metrics, variance_proxy_metrics,
)
from klppo.monitoring.timer import PEAK_MEMORY, PhaseTimer
from klppo.rollout.batch import RolloutBatch
from klppo.safety.guards import RunGuard
from klppo.trainer.rollout_correction import step_is_weights

if TYPE_CHECKING:
    from klppo.run.build import PPOParts
    from klppo.trainer.forwards import StepShards


def data_metrics(parts: PPOParts, batch: RolloutBatch, kl: float | None, guard: RunGuard,
                 grad_norm: float | None = None) -> dict:
    """The batch's metrics (verl's names), the response length's trend and the reward's components,
    and verl's ``variance_proxy/`` metrics where pi_old's sums of squared probabilities were measured
    (``grad_norm``: the actor's, where it stepped).

    Offline, the batch's own log-ratio is a KL of the recorded responses, not of the policy: it is
    logged as ``actor/kl_to_ref_recorded``, and ``actor/kl_to_ref`` is the step's measured ``kl``."""
    s = parts.settings
    metrics = compute_data_metrics(batch, s.response_length, grouped=s.advantage.grouped)
    if batch.sum_pi_squared is not None and batch.advantages is not None:
        weights = step_is_weights(batch, s.actor.rollout_correction)
        metrics.update(variance_proxy_metrics(batch.advantages, batch.response_mask, batch.old_log_prob,
                                              batch.sum_pi_squared, weights, grad_norm))
    metrics["response_length/mean_trend"] = guard.observe_response_length(
        float(metrics["response_length/mean"]))  # host sync
    if batch.reward_components is not None:
        metrics.update(reward_component_metrics(batch.reward_components))
    if s.rollout == "offline" and "actor/kl_to_ref" in metrics:
        metrics["actor/kl_to_ref_recorded"] = metrics.pop("actor/kl_to_ref")
        if kl is not None:
            metrics["actor/kl_to_ref"] = kl
    return metrics


def memory_metrics(timer: PhaseTimer, setup_peak_gb: float | None) -> dict[str, float]:
    """Each phase's peak memory, the largest over ranks (``setup``'s too, given once: the first
    step's); ``perf/max_memory_allocated_gb`` the step's."""
    peaks = timer.peak_metrics()
    if setup_peak_gb is not None:
        peaks[f"{PEAK_MEMORY}/setup"] = setup_peak_gb
    peaks = max_over_ranks(peaks)
    peaks["perf/max_memory_allocated_gb"] = max(v for k, v in peaks.items() if not k.endswith("/setup"))
    return peaks


def performance_metrics(parts: PPOParts, batch: RolloutBatch, shards: StepShards, seconds: dict[str, float]) -> dict:
    """Throughput over the whole batch, this rank's updates' MFU, and the ranks' balance."""
    metrics = compute_throughput_metrics(batch, seconds["step"], n_devices=parts.env.world_size)
    metrics.update(efficiency_metrics(parts, batch.select(shards.mine), seconds))
    if parts.settings.balance_batch:
        metrics.update(seqlen_balance_metrics(batch.attention_mask.sum(-1).tolist(), shards.rows))  # host sync
    return metrics


def efficiency_metrics(parts: PPOParts, batch: RolloutBatch, seconds: dict[str, float]) -> dict[str, float]:
    """perf/mfu/{actor,critic} where the device's peak is known (the actor's counts Clip-Cov's and
    KL-Cov's no-grad forward per mini-batch, which its phase times too)."""
    responses = batch.response_attention.sum(-1)
    lengths, responses = torch.stack([batch.prompt_mask.sum(-1) + responses, responses]).tolist()  # host sync
    s, tokens = parts.settings, sum(lengths)
    # The actor's LM head runs at the response positions only; the critic's value head everywhere.
    actor, critic = parts.actor, parts.critic
    updated = {"actor": UpdateWork(actor.config, s.actor.ppo_epochs, s.actor.compute_dtype, sum(responses),
                                   layer_weights=decoder_weights_per_token(actor, actor.config),
                                   no_grad_passes=s.actor.ppo_epochs if s.actor.cov is not None else 0)}
    if critic is not None:
        updated["critic"] = UpdateWork(critic.config, s.critic.ppo_epochs, s.critic.compute_dtype, tokens,
                                       head_outputs=1, layer_weights=decoder_weights_per_token(critic, critic.config))
    return update_efficiency_metrics(parts.device, seconds, lengths, updated)
