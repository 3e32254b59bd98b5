"""Per-step metrics of a PPO batch, under verl's names."""

from __future__ import annotations

import torch

from klppo.algo import (
    explained_variance, masked_mean, rollout_probs_diff_metrics, score_norms, zero_advantage_fraction,
    zero_std_group_fraction,
)
from klppo.rollout.batch import RolloutBatch


def _summary(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    values = values.float()
    return {f"{prefix}/mean": values.mean(), f"{prefix}/max": values.max(), f"{prefix}/min": values.min()}


def compute_data_metrics(batch: RolloutBatch, max_response_length: int, grouped: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Scores, rewards, advantages, returns, values and lengths of a scored batch.

    ``grouped`` (a group estimator: GRPO, RLOO, REINFORCE++ with a baseline): also the fraction of
    prompts whose responses' scores all tie (``critic/score/zero_std_frac``), which teach nothing
    there; 0 by construction when ``algorithm.filter_groups`` filters by the score (its
    ``training/filter_groups/*`` say what was dropped). The fraction of response tokens whose advantage is exactly 0 (``critic/advantages/zero_frac``)
    is logged for every estimator.
    """
    mask = batch.response_mask  # the policy's tokens
    response_length = batch.response_attention.sum(-1).float()  # (B,) every token, tools' replies too (verl's)
    scores = batch.token_level_scores.sum(-1)  # (B,)
    metrics = {
        **_summary("critic/score", scores),
        **_summary("critic/rewards", batch.token_level_rewards.sum(-1)),
        **_summary("critic/advantages", batch.advantages[mask]),
        "critic/advantages/zero_frac": zero_advantage_fraction(batch.advantages, mask),
        **_summary("critic/returns", batch.returns[mask]),
        **_summary("response_length", response_length),
        **_summary("prompt_length", batch.prompt_mask.sum(-1)),
        # Fraction of responses cut at the length limit (verl: response_length/clip_ratio).
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean(),
    }
    if grouped:
        metrics["critic/score/zero_std_frac"] = zero_std_group_fraction(scores, batch.group_index)
    if batch.num_turns is not None:
        metrics.update(_summary("num_turns", batch.num_turns))
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


def reward_component_metrics(components: list[dict[str, float]]) -> dict[str, float]:
    """``reward/<name>/mean`` of each component a reward function returns beside its score (verl's
    reward_extra_info), over the responses (a response without it counts 0); with two or more,
    ``reward/<name>/share``: its mean absolute value over the sum of every component's, so the
    shares add up to 1 and say which component the rewards come from (whatever the signs).

    E.g. [{"a": 1, "b": -1}, {"a": 0, "b": -1}]: means a 0.5, b -1.0; shares 0.5 / 1.5, 1.0 / 1.5.
    """
    names = sorted({name for response in components for name in response})
    if not components or not names:
        return {}
    n = len(components)
    means = {name: sum(c.get(name, 0.0) for c in components) / n for name in names}
    metrics = {f"reward/{name}/mean": mean for name, mean in means.items()}
    sizes = {name: sum(abs(c.get(name, 0.0)) for c in components) / n for name in names}
    total = sum(sizes.values())
    if len(names) >= 2 and total > 0:
        metrics.update({f"reward/{name}/share": size / total for name, size in sizes.items()})
    return metrics


def compute_throughput_metrics(batch: RolloutBatch, step_seconds: float, n_devices: int = 1) -> dict[str, float]:
    """Tokens processed (prompt + response, real tokens only) per second per device."""
    total_tokens = int(batch.attention_mask.sum())  # host-device sync
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / n_devices,
    }


def variance_proxy_metrics(advantages: torch.Tensor, response_mask: torch.Tensor, old_log_prob: torch.Tensor,
                           sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
                           grad_norm: float | None = None) -> dict[str, float]:
    """verl's ``variance_proxy/`` metrics of a step: how much of the policy gradient is noise.

    Per response, A its mean advantage over real tokens and W = sum_t w_t its score-norm proxy;
    ``proxy2_total_power`` E[A^2 W] approximates E[||g_i||^2] (with rollout correction, the
    mean weight squared times the unweighted W); ``proxy1_signal_strength`` is ||g||^2, the
    actor's gradient norm squared (0 without one); ``proxy3_pure_noise`` (proxy2 - proxy1) /
    (B - 1), at least 0, the variance of the batch's mean gradient.
    """
    mask = response_mask.bool()
    real = mask.sum(-1).clamp(min=1)
    adv = torch.where(mask, advantages, 0.0).sum(-1) / real  # (B,)
    w = torch.where(mask, score_norms(old_log_prob, sum_pi_squared), 0.0).sum(-1)  # (B,), unweighted
    if rollout_is_weights is None:
        power = (adv.square() * w.clamp(min=0.0)).mean()
        w_logged = w
    else:  # verl divides the weighted w by rho^2 (at least 1e-10) again: tokens with rho = 0 drop out
        rho = torch.where(mask, rollout_is_weights, 0.0).sum(-1) / real
        weighted = torch.where(mask, score_norms(old_log_prob, sum_pi_squared, rollout_is_weights), 0.0)
        unweighted = (weighted / rollout_is_weights.square().clamp(min=1e-10)).sum(-1)
        power = (rho.square() * adv.square() * unweighted.clamp(min=0.0)).mean()
        w_logged = weighted.sum(-1)
    signal = 0.0 if grad_norm is None else float(grad_norm) ** 2
    power = float(power)  # host sync
    noise = max(0.0, (power - signal) / (len(adv) - 1)) if grad_norm is not None and len(adv) > 1 else 0.0
    return {
        "variance_proxy/proxy1_signal_strength": signal,
        "variance_proxy/proxy2_total_power": power,
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": float(adv.square().mean()),
        "variance_proxy/expected_w": float(w_logged.mean()),
    }
