"""Rollout correction: importance weights and rejection for responses from another policy.

The responses of a batch were sampled by a behaviour policy mu (offline data: whatever wrote
them; verl: the inference engine), while PPO's ratio is taken against pi_old. With
log_ratio = log pi_old - log mu per token, this module computes (verl's
``trainer/ppo/rollout_corr_helper.py``, same formulas and metric names):

- truncated importance weights (TIS): w = min(exp(log_ratio), upper) per token, or one
  weight exp(sum_t log_ratio) per sequence; with a lower bound too (IcePop) a weight outside
  [lower, upper] is zeroed instead. They multiply the per-token policy loss, detached (they
  change the measure the loss is averaged under, not the objective; verl's rollout_corr_math
  section 3.2.2). Optionally normalised to mean 1 over the batch;
- rejection sampling (RS): tokens or whole sequences whose divergence statistic (k1, k2, k3
  of the log-ratio; per token, or its sum, mean or max over a sequence) leaves its bound are
  dropped from the loss mask;
- off-policy diagnostics: KL(mu || pi_old), perplexities, chi-square divergences.

Shapes:
    B  batch size (sequences)
    T  response length (padded)

Masks are bool, True = real token. Every statistic is taken over the rows with at least one
real token (verl takes the sequence ones over all rows; the two agree when no row is all
padding). Metrics are 0-dim tensors, keyed ``rollout_corr/<verl's name>``; no host syncs.
"""

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from klppo.algo.stats import masked_mean, masked_sum, masked_var

# exp(+-20) bounds every exponentiated log-ratio (verl's SAFETY_BOUND).
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
TOKEN_RS_OPTIONS = ("token_k1", "token_k2", "token_k3")
RS_OPTIONS = TOKEN_RS_OPTIONS + tuple(f"seq_{agg}_k{k}" for agg in ("sum", "mean") for k in (1, 2, 3)) + (
    "seq_max_k2", "seq_max_k3")

Metrics = Dict[str, torch.Tensor]
# A parsed rejection criterion: (option, lower, upper). For the k1 options lower and upper bound
# the ratio mu / pi_old (both > 0); for k2 and k3 lower is None and upper bounds the divergence.
RSOption = Tuple[str, Optional[float], float]


# ---- masked reductions over rows and tokens (no host syncs) ----


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest value where ``mask``; 0 when nothing is masked in."""
    mask = mask.bool()
    top = values.masked_fill(~mask, float("-inf")).max()
    return torch.where(mask.any(), top, torch.zeros_like(top))


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smallest value where ``mask``; 0 when nothing is masked in."""
    return -_masked_max(-values, mask)


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """sqrt(E[x^2] - E[x]^2) of ``values`` clamped to [low, high], over ``mask`` (verl's std of
    weights and rejection statistics); 0 with one real token or none."""
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - mean.square()
    std = torch.sqrt(var.clamp(min=0.0))
    return torch.where(mask.bool().sum() > 1, std, torch.zeros_like(std))


def _row_summary(prefix: str, row_values: torch.Tensor, rows: torch.Tensor, ideal: float) -> Metrics:
    """mean, std (unbiased), max, min and largest |x - ideal| of one value per row, over ``rows``."""
    return {
        f"{prefix}_seq_mean": masked_mean(row_values, rows),
        f"{prefix}_seq_std": masked_var(row_values, rows).sqrt(),
        f"{prefix}_seq_max": _masked_max(row_values, rows),
        f"{prefix}_seq_min": _masked_min(row_values, rows),
        f"{prefix}_seq_max_deviation": _masked_max((row_values - ideal).abs(), rows),
    }


# ---- importance weights ----


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, log_for_metrics: torch.Tensor, mask: torch.Tensor,
                level: str, upper: float, lower: Optional[float]) -> Metrics:
    """verl's compute_is_metrics: weights (applied), raw (before truncation), mask (B, T);
    log_for_metrics (B, T) per token or (B, 1) per sequence."""
    rows = mask.any(dim=-1)  # (B,)
    low = 1.0 / upper if lower is None else lower
    m: Metrics = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        seq_log = log_for_metrics.squeeze(-1)  # (B,)
        m["rollout_is_max"] = torch.exp(_masked_max(seq_log, rows).clamp(max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(_masked_min(seq_log, rows))
        m["rollout_is_ratio_fraction_high"] = masked_mean((seq_log > math.log(upper)).float(), rows)
        m["rollout_is_ratio_fraction_low"] = masked_mean((seq_log < math.log(low)).float(), rows)
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).float(), mask)
        m["rollout_is_max"] = _masked_max(weights, mask)
        m["rollout_is_min"] = _masked_min(weights, mask)
    m["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    # Effective sample size of the (clamped) weights, as a fraction: 1 / E[(w / E[w])^2].
    clamped = weights.clamp(min=0.0, max=upper)
    normalised = clamped / (masked_mean(clamped, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), mask)
    m.update(_row_summary("rollout_is", masked_mean(weights, mask, dim=-1), rows, ideal=1.0))
    # The raw per-sequence mean: a mean of clamped weights can never pass the bound.
    raw_rows = masked_mean(raw, mask, dim=-1)
    m["rollout_is_seq_fraction_high"] = masked_mean((raw_rows > upper).float(), rows)
    m["rollout_is_seq_fraction_low"] = masked_mean((raw_rows < low).float(), rows)
    return m


def _batch_mean_weight(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Mean weight over the batch's tokens ("token") or its sequences ("sequence")."""
    if level == "token":
        return masked_mean(weights, mask)
    rows = mask.any(dim=-1)
    return masked_sum(masked_mean(weights, mask, dim=-1), rows) / rows.sum().to(weights.dtype).clamp(min=1e-8)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: Optional[float] = None,
    rollout_is_batch_normalize: bool = False,
) -> Tuple[torch.Tensor, Metrics]:
    """Truncated importance weights pi_old / mu (verl's compute_rollout_correction_weights).

    log_ratio = log pi_old - log mu, response_mask: (B, T). ``rollout_is`` "token": one weight
    exp(log_ratio_t) per token; "sequence": exp(sum_t log_ratio_t) on every token of the row
    (exponents clamped to +-20). Without a lower bound the weights are clamped at
    ``rollout_is_threshold`` (TIS); with one, weights outside [lower, upper] become 0 (IcePop).
    With batch normalisation they are divided by their mean over the batch's tokens (token) or
    sequences (sequence). Returns the detached (B, T) weights, 0 on padding, and the metrics
    (measured before normalisation; "rollout_is_batch_norm_factor" is the divisor).
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS}, got {rollout_is!r}")
    mask = response_mask.bool()
    if rollout_is == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_for_metrics = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(log_for_metrics.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    upper, lower = rollout_is_threshold, rollout_is_threshold_lower
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, log_for_metrics, mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    weights = weights.detach()
    if rollout_is_batch_normalize:
        mean = _batch_mean_weight(weights, mask, rollout_is)
        usable = mean > 1e-8  # an all-zero batch keeps its weights
        factor = torch.where(usable, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


# ---- rejection sampling ----


def _token_divergences(log_ratio: torch.Tensor) -> Dict[str, torch.Tensor]:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r per token, log r clamped to +-20."""
    safe = log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def _rs_statistic(option: str, divergences: Dict[str, torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """(B,) the per-sequence statistic of a seq_* option; None for a token_* option."""
    if option in TOKEN_RS_OPTIONS:
        return None
    _, agg, k = option.split("_")
    per_token = divergences[k]
    if agg == "sum":
        return masked_sum(per_token, mask, dim=-1)
    if agg == "mean":
        return masked_mean(per_token, mask, dim=-1)
    top = per_token.masked_fill(~mask, float("-inf")).max(dim=-1).values
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)  # a row of padding only


def _rs_metrics(prefix: str, stat: torch.Tensor, row_stat: torch.Tensor, mask: torch.Tensor, sequence_level: bool,
                high: float, low: Optional[float]) -> Metrics:
    """verl's compute_rs_metrics for one option: stat (B, T) per token (a sequence option's row
    statistic repeated on its tokens), row_stat (B,), bounds ``low`` (k1 only) and ``high``."""
    rows = mask.any(dim=-1)
    values, where = (row_stat, rows) if sequence_level else (stat, mask)
    m: Metrics = {f"{prefix}_mean": masked_mean(stat, mask)}
    m[f"{prefix}_max"], m[f"{prefix}_min"] = _masked_max(values, where), _masked_min(values, where)
    m[f"{prefix}_fraction_high"] = masked_mean((values > high).float(), where)
    zero = torch.zeros_like(m[f"{prefix}_mean"])
    m[f"{prefix}_fraction_low"] = zero if low is None else masked_mean((values < low).float(), where)
    m[f"{prefix}_std"] = _clamped_std(stat, mask, 0.0 if low is None else low, high)
    m.update(_row_summary(prefix, row_stat, rows, ideal=0.0))
    m[f"{prefix}_seq_fraction_high"] = masked_mean((row_stat > high).float(), rows)
    if low is not None:
        m[f"{prefix}_seq_fraction_low"] = masked_mean((row_stat < low).float(), rows)
    return m


def _rs_option(option: RSOption, divergences: Dict[str, torch.Tensor], mask: torch.Tensor
               ) -> Tuple[torch.Tensor, Metrics]:
    """(B, T) bool: tokens one criterion keeps (True also on padding), and its metrics."""
    name, lower, upper = option
    k1 = name.endswith("k1")
    # k1 bounds the ratio mu / pi_old: compare -log r with log(lower), log(upper).
    high = math.log(upper) if k1 else upper
    low = (math.log(lower) if lower is not None else -high) if k1 else None
    row_stat = _rs_statistic(name, divergences, mask)
    per_token = divergences[name[-2:]] if row_stat is None else row_stat.unsqueeze(-1).expand_as(mask)
    keep = per_token <= high if low is None else (per_token >= low) & (per_token <= high)
    if row_stat is None:
        row_stat = masked_mean(per_token, mask, dim=-1)
    prefix = f"rollout_rs_{name}"
    metrics = _rs_metrics(prefix, per_token, row_stat, mask, name not in TOKEN_RS_OPTIONS, high, low)
    rows = mask.any(dim=-1)
    metrics[f"{prefix}_masked_fraction"] = masked_mean((~keep).float(), mask)
    metrics[f"{prefix}_seq_masked_fraction"] = masked_mean((~keep & mask).any(dim=-1).float(), rows)
    return keep, metrics


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: Sequence[RSOption]
) -> Tuple[torch.Tensor, Metrics]:
    """Drop the tokens or sequences whose divergence leaves its bounds (verl's compute_rollout_rejection_mask).

    log_ratio = log pi_old - log mu, response_mask: (B, T). ``rollout_rs``: the criteria
    ``(option, lower, upper)``, every one of which a token must pass: "token_k1..3" judge each
    token, "seq_sum_k1..3" / "seq_mean_k1..3" / "seq_max_k2..3" the sum, mean or max over its
    sequence (then the whole sequence goes). Returns the (B, T) bool mask of kept real tokens
    and the metrics.
    """
    mask = response_mask.bool()
    divergences = _token_divergences(log_ratio)
    keep_all = torch.ones_like(mask)
    metrics: Metrics = {}
    for option in dict.fromkeys(rollout_rs):  # a repeated criterion counts once
        keep, option_metrics = _rs_option(option, divergences, mask)
        keep_all = keep_all & keep
        metrics.update(option_metrics)
    rows = mask.any(dim=-1)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep_all).float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = masked_mean((~keep_all & mask).any(dim=-1).float(), rows)
    return keep_all & mask, metrics


# ---- diagnostics and the whole correction ----


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                              response_mask: torch.Tensor) -> Metrics:
    """How far mu is from pi_old (verl's compute_offpolicy_metrics); inputs (B, T).

    kl = E[log mu - log pi_old] (KL(mu || pi_old) on mu's tokens), k3_kl = E[r - log r - 1],
    perplexities per sequence averaged over rows, chi2_token = E[r^2] - 1 and chi2_seq =
    E_seq[(prod_t r_t)^2] - 1, with r = pi_old / mu.
    """
    mask = response_mask.bool()
    rows = mask.any(dim=-1)
    train_row = masked_mean(old_log_prob, mask, dim=-1)  # (B,) mean log-prob per sequence
    rollout_row = masked_mean(rollout_log_prob, mask, dim=-1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = rollout_row - train_row
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {
        "training_ppl": masked_mean(torch.exp(-train_row), rows),
        "training_log_ppl": masked_mean(-train_row, rows),
        "kl": masked_mean(rollout_log_prob - old_log_prob, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": masked_mean(torch.exp(-rollout_row), rows),
        "rollout_log_ppl": masked_mean(-rollout_row, rows),
        "log_ppl_diff": masked_mean(log_ppl_diff, rows),
        "log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), rows),
        "log_ppl_diff_max": _masked_max(log_ppl_diff, rows),
        "log_ppl_diff_min": _masked_min(log_ppl_diff, rows),
        "ppl_ratio": masked_mean(torch.exp(log_ppl_diff), rows),
        "chi2_token": masked_mean(torch.exp(log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * seq_log_ratio), rows) - 1.0,
    }


def rollout_probs_diff_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor, low: float = 0.8, high: float = 1.25) -> Metrics:
    """How far the sampler's token probabilities are from the trainer's; inputs (B, T).

    verl's ``training/rollout_probs_diff_{mean,max,std}``: |pi_old(y_t) - mu(y_t)| over the
    response tokens; and ``training/rollout_probs_ratio_outside``: the share of tokens whose
    ratio pi_old / mu lies outside [``low``, ``high``] (the inference engine and the trainer
    disagree there by more than a PPO clip range would forgive).
    """
    mask = response_mask.bool()
    diff = (torch.exp(old_log_prob) - torch.exp(rollout_log_prob)).abs()
    ratio = torch.exp((old_log_prob - rollout_log_prob).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    outside = ((ratio < low) | (ratio > high)).float()
    return {
        "training/rollout_probs_diff_mean": masked_mean(diff, mask),
        "training/rollout_probs_diff_max": _masked_max(diff, mask),
        "training/rollout_probs_diff_std": masked_var(diff, mask).clamp(min=0).sqrt(),
        "training/rollout_probs_ratio_outside": masked_mean(outside, mask),
    }


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: Optional[float] = None,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Sequence[RSOption] = (),
) -> Tuple[Optional[torch.Tensor], torch.Tensor, Metrics]:
    """Importance weights, rejection mask and diagnostics of one batch (verl's function of this name).

    old_log_prob (pi_old; in bypass mode the current policy), rollout_log_prob (mu),
    response_mask: (B, T). Returns (weights (B, T) or None when ``rollout_is`` is None, the
    (B, T) bool mask of real tokens rejection keeps, metrics keyed "rollout_corr/...").
    """
    mask = response_mask.bool()
    log_ratio = old_log_prob - rollout_log_prob
    metrics: Metrics = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_threshold_lower, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    keep = mask
    if rollout_rs:
        keep, rs_metrics = compute_rollout_rejection_mask(log_ratio, mask, rollout_rs)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, mask))
    return weights, keep, {f"rollout_corr/{k}": v.detach() for k, v in metrics.items()}
