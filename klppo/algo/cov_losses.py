"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv:2505.22617; verl's policy_loss.loss_mode clip_cov / kl_cov).

Shapes: B sequences, T response length (padded). Masks are bool, True = real token.

The policy's entropy falls fastest through tokens whose log-probability and advantage covary
most: cov_t = (A_t - mean A) (log pi_t - mean log pi), the means over the real tokens. Clip-Cov
cuts the gradient of a random few of the tokens whose covariance lies in (lb, ub) (and that the
ordinary clip left alone); KL-Cov adds ppo_kl_coef |log pi - log pi_old| to the loss of the
top ``kl_cov_ratio`` of tokens by covariance.

Which tokens: verl picks them within each micro-batch, so what trains depends on how a batch is
split over micro-batches and ranks. klppo picks them over the whole mini-batch, which is the same
on any split (``klppo.trainer.cov_selection`` gathers it); within one micro-batch on one rank the
two agree. Clip-Cov's random pick takes the candidates with the smallest ``keys``: a seeded
uniform number per token, so a resumed run and any number of ranks pick alike.

KL-Cov's penalty |log pi - log pi_old| has no slope where the policy has not moved (the first
mini-batch of a step, pi = pi_old): there its gradient on the picked tokens is +-ppo_kl_coef times
the log-prob's, the sign that of the rounding between the two forwards, as in verl. The picks are
the same on any split; that gradient is not.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from klppo.algo.losses import Count, agg_loss
from klppo.algo.stats import masked_mean

COV_LOSS_MODES = ("clip_cov", "kl_cov")


def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) cov_t = (A_t - mean A)(log pi_t - mean log pi) over the real tokens; -inf elsewhere."""
    mask = mask.bool()
    cov = (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))
    return torch.where(mask, cov, float("-inf"))


def _count(ratio: float, mask: torch.Tensor) -> int:
    """max(1, int(ratio x real tokens)), verl's number of tokens to pick."""
    return max(int(ratio * int(mask.sum())), 1)  # host sync, once per mini-batch


def clip_cov_cut(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 keys: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float, clip_cov_ratio: float,
                 clip_cov_lb: float, clip_cov_ub: float) -> torch.Tensor:
    """(B, T) bool: the tokens whose gradient Clip-Cov cuts. Candidates are real tokens the ratio
    clip leaves alone with lb < cov < ub; of them, the max(1, int(ratio x real tokens)) with the
    smallest ``keys`` (B, T) (uniform numbers: a random pick)."""
    mask = mask.bool()
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    cov = token_covariance(advantages, log_prob, mask)
    candidates = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    return _smallest(keys, candidates, _count(clip_cov_ratio, mask))


def kl_cov_penalised(log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                     kl_cov_ratio: float) -> torch.Tensor:
    """(B, T) bool: the max(1, int(ratio x real tokens)) real tokens of largest covariance."""
    cov = token_covariance(advantages, log_prob, mask)
    k = min(_count(kl_cov_ratio, mask), cov.numel())
    picked = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    picked[torch.topk(cov.flatten(), k).indices] = True
    return picked.view_as(cov) & mask.bool()


def _smallest(keys: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) bool: the (at most) k ``candidates`` with the smallest ``keys``."""
    flat = torch.where(candidates, keys, float("inf")).flatten()
    k = min(k, int(candidates.sum()))  # host sync
    picked = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k:
        picked[torch.topk(flat, k, largest=False).indices] = True
    return picked.view_as(candidates)


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cut: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO's clipped surrogate max(-A r, -A clip(r)) (no dual clip, as verl's clip_cov) on every token
    but the ``cut`` ones (``clip_cov_cut``), whose loss and gradient are 0. "actor/pg_clipfrac" is
    the share of real tokens cut, as verl reports it."""
    mask = response_mask.bool()
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_ratio_low,
                                                                             1 + clip_ratio_high))
    pg_losses = torch.where(cut, 0.0, pg_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_token_count, global_seq_count)
    with torch.no_grad():
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        stats = {"actor/pg_loss": loss.detach(), "actor/pg_clipfrac": masked_mean((cut & mask).float(), mask),
                 "actor/ppo_kl": masked_mean(-negative_approx_kl, mask), "actor/pg_clipfrac_lower": zero}
    return loss, stats


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    penalised: torch.Tensor,
    ppo_kl_coef: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count = None,
    global_seq_count: Count = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The unclipped surrogate -A r on every token, plus ppo_kl_coef |log pi - log pi_old| on the
    ``penalised`` ones (``kl_cov_penalised``), as verl's kl_cov. It clips nothing, so both clip
    fractions are 0; "actor/ppo_kl" is the mean |log pi - log pi_old|, as verl reports it."""
    mask = response_mask.bool()
    negative_approx_kl = log_prob - old_log_prob
    pg_losses = -advantages * torch.exp(negative_approx_kl)
    pg_losses = pg_losses + torch.where(penalised, ppo_kl_coef * negative_approx_kl.abs(), 0.0)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, mask, loss_agg_mode, global_token_count, global_seq_count)
    with torch.no_grad():
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        stats = {"actor/pg_loss": loss.detach(), "actor/pg_clipfrac": zero,
                 "actor/ppo_kl": masked_mean(negative_approx_kl.abs(), mask), "actor/pg_clipfrac_lower": zero}
    return loss, stats
