"""Policy, value and KL losses, their aggregation, and per-token log-prob / entropy.

Shapes:
    B  batch size (sequences) of this micro-batch
    T  response length (padded)
    V  vocabulary size

Masks are bool, True = real token. Losses follow verl's `core_algos.py` (names, clamps,
metric keys). Aggregation is split-invariant: give `agg_loss` the token / sequence counts
of the whole (global) batch and the losses of its micro-batches, on every rank, add up to
the loss of the whole batch. The caller must therefore SUM gradients over micro-batches
and ranks (not average them), or scale by the number of parts it averages over.
"""

from typing import Dict, Optional, Tuple, Union

import torch

from klppo.algo.kl import kl_penalty
from klppo.algo.stats import masked_mean, masked_sum, masked_var

Count = Optional[Union[int, float, torch.Tensor]]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _denominator(count: Count, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`count` (or the local count) as a float tensor >= 1, on `like`'s device.

    Clamping at 1 makes an all-padding batch give a loss of 0 rather than NaN.
    """
    dtype = torch.promote_types(like.dtype, torch.float32)  # never count in bf16
    value = local if count is None else count
    return torch.as_tensor(value, device=like.device).to(dtype).clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a 0-dim loss (verl's agg_loss).

    loss_mat, loss_mask: (B, T). Modes (N_tok = real tokens, N_seq = sequences with at
    least one real token; both default to this call's counts, or pass the global batch's):
      "token-mean":              sum(loss * mask) / N_tok
      "seq-mean-token-sum":      sum_i (sum_t loss_it) / N_seq
      "seq-mean-token-mean":     sum_i (mean_t loss_it) / N_seq
      "seq-mean-token-sum-norm": sum_i (sum_t loss_it) / loss_scale_factor (default T), as
          verl now defines it (Dr. GRPO's constant normaliser); it does not divide by N_seq
          and ignores the global counts. Pass a fixed loss_scale_factor when micro-batches
          are padded to different T.
    """
    mask = loss_mask.bool()
    if loss_agg_mode == "token-mean":
        n_tok = _denominator(global_token_count, mask.sum(), loss_mat)
        return masked_sum(loss_mat, mask) / n_tok
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return seq_sums.sum() / scale
    seq_real = mask.any(dim=-1)  # (B,) rows with no real token do not count
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / mask.sum(dim=-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}")
    n_seq = _denominator(global_seq_count, seq_real.sum(), loss_mat)
    return masked_sum(seq_losses, seq_real) / n_seq


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip (verl's compute_policy_loss_vanilla).

    old_log_prob, log_prob, advantages, response_mask: (B, T). Per token, with
    ratio = exp(log_prob - old_log_prob): loss = max(-A ratio, -A clip(ratio, 1 - low,
    1 + high)) (Schulman et al. 2017, arXiv:1707.06347, eq. 7); for A < 0 it is further
    capped at -A * clip_ratio_c (dual clip, Ye et al. 2020, arXiv:1912.09729, eq. 5).
    ``rollout_is_weights`` (B, T), detached rollout-correction weights, multiply the per-token
    losses before aggregation (verl's place for them); the clip statistics ignore them.
    Returns the aggregated loss (0-dim) and detached stats "actor/pg_loss",
    "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower".
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    mask = response_mask.bool()
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # verl
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor)
    with torch.no_grad():
        lower = (clip_pg_losses1 > pg_losses3) & (advantages < 0)
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), mask),
            "actor/ppo_kl": masked_mean(-negative_approx_kl, mask),
            "actor/pg_clipfrac_lower": masked_mean(lower.float(), mask),
        }
    return loss, stats


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped surrogate (Zheng et al. 2025, arXiv:2507.18071; verl's gspo).

    All inputs (B, T). Each sequence's ratio is the geometric mean of its tokens' ratios,
    s_i = exp(mean_t (log_prob - old_log_prob)), clipped as a whole; every token carries it as
    s_i,t = sg[s_i] pi / sg[pi] (GSPO-token: the value of s_i, the gradient of its own log-prob).
    Loss per token max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)), times the rollout-correction
    weights, reduced seq-mean-token-mean whatever the run's loss_agg_mode (as verl: the paper
    averages each sequence's tokens first); no dual clip. The paper's ranges are 3e-4 and 4e-4:
    a sequence's ratio moves far less than a token's. Stats as ``compute_policy_loss``; the lower
    clip fraction is 0.
    """
    mask = response_mask.bool()
    negative_approx_kl = log_prob - old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1)
    sequence_log_ratio = masked_sum(negative_approx_kl, mask, dim=-1) / lengths  # (B,)
    log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))  # verl's bound, for numerical safety
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, "seq-mean-token-mean", global_seq_count=global_seq_count)
    with torch.no_grad():
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), mask),
            "actor/ppo_kl": masked_mean(-negative_approx_kl, mask),
            "actor/pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        }
    return loss, stats


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio (MiniMax 2025,
    arXiv:2506.13585; verl's cispo).

    All inputs (B, T). Loss per token -sg[clip(ratio, 1 - low, 1 + high)] A log_prob, ratio =
    exp(log_prob - old_log_prob) (clamped to +-20 in log space, as verl): every token keeps its
    gradient, clipping bounds only its weight (PPO's clip drops the gradient of a clipped
    token). Times the rollout-correction weights, reduced by ``loss_agg_mode``. "actor/pg_clipfrac"
    is the fraction of tokens whose ratio was clipped on either side; the lower one is 0.
    """
    mask = response_mask.bool()
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    pg_losses = -clipped * advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor)
    with torch.no_grad():
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean((ratio != clipped).float(), mask),
            "actor/ppo_kl": masked_mean(-negative_approx_kl, mask),
            "actor/pg_clipfrac_lower": torch.zeros((), dtype=loss.dtype, device=loss.device),
        }
    return loss, stats


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """SAPO: a smooth gate on the ratio in place of PPO's hard clip (Qwen 2025, arXiv:2511.20347;
    verl's sapo).

    All inputs (B, T). Per token, with ratio r = exp(clamp(log_prob - old_log_prob, +-20)) and
    tau = tau_pos where A > 0, else tau_neg: loss = -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau,
    whose gradient in r is 1 at r = 1 (PPO's) and fades smoothly as r leaves 1, faster with a
    larger tau; nothing is cut off, so the clip fractions are 0. Times the rollout-correction
    weights, reduced seq-mean-token-mean whatever the run's loss_agg_mode (as verl).
    """
    mask = response_mask.bool()
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                       torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, "seq-mean-token-mean", global_seq_count=global_seq_count)
    return loss, _unclipped_stats(loss, negative_approx_kl, mask)


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GPG: the plain policy gradient, no ratio and no clip (Chu et al. 2025, arXiv:2504.02546;
    verl's gpg, which pairs it with ``algorithm.adv_estimator=gpg``).

    All inputs (B, T). Loss per token -A log_prob, times the rollout-correction weights, reduced
    by ``loss_agg_mode``; ``old_log_prob`` enters only the logged "actor/ppo_kl". The clip
    fractions are 0.
    """
    mask = response_mask.bool()
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor)
    return loss, _unclipped_stats(loss, log_prob.detach() - old_log_prob, mask)


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GMPO: the geometric mean of a sequence's token ratios in place of their arithmetic mean
    (Zhao et al. 2025, arXiv:2507.20673; verl's geo_mean).

    All inputs (B, T). Each token's log-ratio d = log_prob - old_log_prob is clipped in log space
    to [-low, high] on the side its advantage's sign makes pessimistic (d itself where that is
    smaller in sign(A) d); a sequence's ratio is exp(mean_t clipped d), its advantage mean_t A, its
    loss -A_seq ratio_seq, times the geometric mean of its tokens' rollout-correction weights.
    The sequences' losses are averaged: over ``global_seq_count`` sequences when given (this
    micro-batch's otherwise, verl's torch.mean, which a micro-batch of the whole batch equals).
    "actor/pg_clipfrac" / "_lower": the fractions of tokens clipped with A > 0 / A < 0.
    """
    mask = response_mask.bool()
    negative_approx_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * negative_approx_kl, sign * clamped)
    lengths = mask.sum(dim=-1)  # (B,)
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / (lengths + 1e-8))  # (B,), verl's epsilon
    advantage = masked_sum(advantages, mask, dim=-1) / (lengths + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        log_weights = masked_sum(torch.log(rollout_is_weights + 1e-10), mask, dim=-1)
        pg_losses = pg_losses * torch.exp(log_weights / (lengths + 1e-8))
    n_seq = _denominator(global_seq_count, torch.tensor(pg_losses.shape[0]), pg_losses)
    loss = pg_losses.sum() / n_seq
    with torch.no_grad():
        clipped = negative_approx_kl != clamped
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean((clipped & (advantages > 0)).float(), mask),
            "actor/ppo_kl": masked_mean(-negative_approx_kl, mask),
            "actor/pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).float(), mask),
        }
    return loss, stats


def _unclipped_stats(loss: torch.Tensor, negative_approx_kl: torch.Tensor, mask: torch.Tensor
                     ) -> Dict[str, torch.Tensor]:
    """The policy loss's stats for a loss that clips nothing: both clip fractions 0."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        return {"actor/pg_loss": loss.detach(), "actor/pg_clipfrac": zero,
                "actor/ppo_kl": masked_mean(-negative_approx_kl.detach(), mask), "actor/pg_clipfrac_lower": zero}


POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean")


def compute_policy_loss_of_mode(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    global_token_count: Count = None,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The policy loss verl's ``actor.policy_loss.loss_mode`` names: vanilla (dual-clip PPO,
    ``compute_policy_loss``), gspo, cispo, sapo (``tau_pos``/``tau_neg``), gpg or geo_mean, with
    the arguments each takes. gspo, sapo and geo_mean reduce over sequences whatever
    ``loss_agg_mode`` says, as verl's do."""
    inputs = (old_log_prob, log_prob, advantages, response_mask)
    weights = dict(global_seq_count=global_seq_count, rollout_is_weights=rollout_is_weights)
    if loss_mode == "gspo":
        return compute_policy_loss_gspo(*inputs, clip_ratio_low, clip_ratio_high, **weights)
    if loss_mode == "sapo":
        return compute_policy_loss_sapo(*inputs, tau_pos, tau_neg, **weights)
    if loss_mode == "geo_mean":
        return compute_policy_loss_geo_mean(*inputs, clip_ratio_low, clip_ratio_high, **weights)
    counts = dict(loss_agg_mode=loss_agg_mode, global_token_count=global_token_count, **weights)
    if loss_mode == "cispo":
        return compute_policy_loss_cispo(*inputs, clip_ratio_low, clip_ratio_high, **counts)
    if loss_mode == "gpg":
        return compute_policy_loss_gpg(*inputs, **counts)
    if loss_mode == "vanilla":
        return compute_policy_loss(*inputs, clip_ratio_low, clip_ratio_high, clip_ratio_c, **counts)
    raise ValueError(f"unknown policy loss mode {loss_mode!r}; valid modes are {', '.join(POLICY_LOSS_MODES)}")


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """REINFORCE with optional importance weights (verl's compute_policy_loss_reinforce).

    All inputs (B, T). Per token loss = -A * log pi(a|s) * w, w the detached rollout-correction
    weight pi / mu (1 without weights); no ratio and no clipping, so "actor/pg_clipfrac" and
    "actor/pg_clipfrac_lower" are 0. "actor/ppo_kl" is the mean of log mu - log pi.
    """
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_token_count, global_seq_count)
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    with torch.no_grad():
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": zero,
            "actor/ppo_kl": masked_mean(rollout_log_prob - log_prob.detach(), response_mask),
            "actor/pg_clipfrac_lower": zero,
        }
    return loss, stats


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2) (verl's compute_value_loss).

    vpreds (new values), returns (targets), values (values at rollout), response_mask:
    (B, T). V_clip = clip(vpreds, values - c, values + c). Returns the aggregated loss
    (0-dim) and detached stats "critic/vf_loss", "critic/vf_clipfrac" (share of tokens
    where the clipped loss is the larger), "critic/vpred_mean".
    """
    mask = response_mask.bool()
    # Clamp vpreds itself (verl's form): values + clamp(vpreds - values) rounds differently with the
    # batch split, so a prediction equal to its old value could count as clipped by chance.
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_losses = torch.maximum(vf_losses1, vf_losses2)
    agg = agg_loss(vf_losses, mask, loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor)
    loss = 0.5 * agg
    with torch.no_grad():
        stats = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), mask),
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask),
        }
    return loss, stats


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) as an actor loss term (verl's actor.use_kl_loss); 0-dim.

    log_prob, ref_log_prob, response_mask: (B, T). The per-token estimator is
    kl_penalty(log_prob, ref_log_prob, kl_loss_type) (e.g. "low_var_kl", "k3+"),
    aggregated with agg_loss. The caller multiplies by kl_loss_coef.
    """
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kld, response_mask, loss_agg_mode, global_token_count, global_seq_count, loss_scale_factor)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...), float32 or wider.

    H = logsumexp(z) - sum softmax(z) * z (verl), computed in at least float32 because
    bf16 loses the small differences that make up the entropy.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_j softmax(logits)_j^2 over the last dim: (..., V) -> (...), float32 or wider.

    exp(logsumexp(2 z) - 2 logsumexp(z)) (verl's calculate_sum_pi_squared_from_logits): 1 for a
    one-hot distribution, 1 / V for a uniform one.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for each position: logits (..., V), labels (...) -> (...).

    Computed as z_label - logsumexp(z) in at least float32, which never materialises the
    full (..., V) log-softmax (verl's logprobs_from_logits_v2 identity).
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over real tokens; 0-dim (critic/vf_explained_var).

    values, returns, mask: (B, T). 1 is a perfect critic, 0 no better than a constant,
    negative worse. When Var(returns) is 0 the ratio is undefined and this returns 0.0 (a
    NaN would poison averaged logs); verl instead adds 1e-5 to the denominator.
    """
    with torch.no_grad():
        mask = mask.bool()
        var_returns = masked_var(returns, mask)
        var_diff = masked_var(returns - values, mask)
        safe = torch.where(var_returns > 0, var_returns, torch.ones_like(var_returns))
        return torch.where(var_returns > 0, 1.0 - var_diff / safe, torch.zeros_like(var_returns))
