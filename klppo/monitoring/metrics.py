"""Per-step metrics of a PPO batch, under verl's names."""

from __future__ import annotations

import torch

from klppo.algo import explained_variance, masked_mean, rollout_probs_diff_metrics
from klppo.rollout.batch import RolloutBatch


def _summary(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    values = values.float()
    return {f"{prefix}/mean": values.mean(), f"{prefix}/max": values.max(), f"{prefix}/min": values.min()}


def compute_data_metrics(batch: RolloutBatch, max_response_length: int) -> dict[str, torch.Tensor]:
    """Scores, rewards, advantages, returns, values and lengths of a scored batch."""
    mask = batch.response_mask
    response_length = mask.sum(-1).float()  # (B,)
    metrics = {
        **_summary("critic/score", batch.token_level_scores.sum(-1)),
        **_summary("critic/rewards", batch.token_level_rewards.sum(-1)),
        **_summary("critic/advantages", batch.advantages[mask]),
        **_summary("critic/returns", batch.returns[mask]),
        **_summary("response_length", response_length),
        **_summary("prompt_length", batch.prompt_mask.sum(-1)),
        # Fraction of responses cut at the length limit (verl: response_length/clip_ratio).
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean(),
    }
    if batch.values is not None:
        metrics.update(_summary("critic/values", batch.values[mask]))
        metrics["critic/vf_explained_var"] = explained_variance(batch.values, batch.returns, mask)
    if batch.ref_log_prob is not None:
        # Mean per-token log-ratio of the sampling policy to the reference (k1 estimate of KL).
        metrics["actor/kl_to_ref"] = masked_mean(batch.old_log_prob - batch.ref_log_prob, mask)
    if batch.rollout_log_probs is not None:  # the sampler's (vLLM's, or the offline data's) log-probs vs pi_old's
        metrics.update(rollout_probs_diff_metrics(batch.old_log_prob, batch.rollout_log_probs,
                                                  mask & batch.has_rollout_log_probs[:, None]))
    return metrics


def compute_throughput_metrics(batch: RolloutBatch, step_seconds: float, n_devices: int = 1) -> dict[str, float]:
    """Tokens processed (prompt + response, real tokens only) per second per device."""
    total_tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())  # host-device sync
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / n_devices,
    }
