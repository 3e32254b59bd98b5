"""Clip-Cov and KL-Cov (verl's policy_loss.loss_mode clip_cov / kl_cov) against the formulas worked by hand."""

import math

import pytest
import torch

from klppo.algo.cov_losses import (
    clip_cov_cut, compute_policy_loss_clip_cov, compute_policy_loss_kl_cov, kl_cov_penalised, token_covariance,
)

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([[2.0, 0.0, 1.0], [-1.0, -2.0, 9.0]])  # mean over real tokens: 0
LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -2.0, 7.0]])  # mean over real tokens: -2


def test_the_covariance_is_the_product_of_deviations_from_the_real_tokens_means():
    cov = token_covariance(ADV, LOGP, MASK)
    expected = torch.tensor([[2.0 * 1.0, 0.0, 1.0 * -1.0], [-1.0 * 0.0, -2.0 * 0.0, -math.inf]])
    assert torch.equal(cov, expected)


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    picked = kl_cov_penalised(LOGP, ADV, MASK, kl_cov_ratio=0.4)  # int(0.4 x 5) = 2 tokens
    zeros = torch.tensor([[False, True, False], [True, True, False]])  # three covariances of 0 tie for second
    assert picked[0, 0] and picked.sum() == 2 and (picked & zeros).sum() == 1
    assert kl_cov_penalised(LOGP, ADV, MASK, kl_cov_ratio=1e-9).tolist() == [[True, False, False], [False] * 3]


def test_clip_cov_cuts_the_candidates_with_the_smallest_keys_among_unclipped_tokens_in_the_window():
    old = LOGP.clone()
    old[0, 0] = -1.5  # ratio e^0.5 > 1.2 with A = 2 > 0: the clip already holds this token back
    keys = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.4, 0.0]])
    window = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.4)
    # the window (-0.5, 0.5) holds the covariances of 0: (0, 1), (1, 0), (1, 1); the two smallest keys win
    cut = clip_cov_cut(old, LOGP, ADV, MASK, keys, clip_cov_lb=-0.5, clip_cov_ub=0.5, **window)
    assert cut.tolist() == [[False, True, False], [False, True, False]]
    # token (0, 0) has the largest covariance but is clipped: never a candidate, so nothing is cut
    assert not clip_cov_cut(old, LOGP, ADV, MASK, keys, clip_cov_lb=1.5, clip_cov_ub=5.0, **window).any()


def test_clip_cov_loss_is_the_clipped_surrogate_with_the_cut_tokens_left_out():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.5, 0.0], [0.3, 0.0, 0.0]], requires_grad=True)
    cut = torch.tensor([[False, True, False], [False, False, False]])
    loss, stats = compute_policy_loss_clip_cov(old, logp, ADV, MASK, cut, 0.2, 0.2)
    ratio = logp.detach().exp()
    per_token = torch.maximum(-ADV * ratio, -ADV * ratio.clamp(0.8, 1.2))
    expected = (per_token[0, 0] + per_token[0, 2] + per_token[1, 0] + per_token[1, 1]) / 5  # token-mean over 5
    assert loss.item() == pytest.approx(expected.item())
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0
    assert stats["actor/pg_clipfrac"].item() == pytest.approx(1 / 5)  # the share cut, as verl reports it


def test_kl_cov_loss_adds_the_absolute_log_ratio_on_the_penalised_tokens_only():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.5, 0.0], [0.3, 0.0, 0.0]])
    penalised = torch.tensor([[False, True, False], [True, False, False]])
    loss, stats = compute_policy_loss_kl_cov(old, logp, ADV, MASK, penalised, ppo_kl_coef=0.5)
    surrogate = -ADV * logp.exp()  # no clip
    expected = (surrogate[MASK].sum() + 0.5 * (0.5 + 0.3)) / 5
    assert loss.item() == pytest.approx(expected.item())
    assert stats["actor/ppo_kl"].item() == pytest.approx((0.1 + 0.5 + 0.0 + 0.3 + 0.0) / 5)
    assert stats["actor/pg_clipfrac"].item() == 0.0


def test_on_one_micro_batch_kl_cov_is_verls_loss():
    """verl's kl_cov, restated: cov over the real tokens, top max(1, int(n x ratio)), unclipped -A r
    plus coef |log r| on them, token-mean."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, logp, old = (torch.randn(4, 6, generator=g) for _ in range(3))
    adv_v, logp_v = adv[mask], logp[mask]
    cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
    top = torch.topk(cov, max(1, int(len(cov) * 0.3))).indices
    losses = -adv_v * (logp_v - old[mask]).exp()
    losses[top] += 2.0 * (logp_v - old[mask]).abs()[top]
    loss, _ = compute_policy_loss_kl_cov(old, logp, adv, mask, kl_cov_penalised(logp, adv, mask, kl_cov_ratio=0.3), 2.0)
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-6)
