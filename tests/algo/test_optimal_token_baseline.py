"""The optimal token baseline (verl's optimal_token_baseline / tir_optimal_token_baseline) against
the formula worked by hand, and against a plain loop over groups and positions on random batches."""

import math

import pytest
import torch

from klppo.algo import compute_advantage, compute_optimal_token_baseline_advantage, score_norms
from klppo.monitoring.metrics import variance_proxy_metrics


def _hand_batch():
    """Group 0: row 0 (2 tokens, pi(a) = 0.5, sum pi^2 = 0.5: w = 0.5, reward 1 at its end) and row 1
    (3 tokens, pi(a) = 0.25, sum pi^2 = 0.5: w = 1, reward 0.5); group 1: row 2 alone (reward 2)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [2.0, 0.0, 0.0]])
    pi = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.25], [0.5, 0.0, 0.0]])
    squares = torch.where(mask, 0.5, 0.0)
    return rewards, mask, torch.tensor([0, 0, 1]), torch.where(mask, pi.log(), 0.0), squares


def test_each_position_gets_the_energy_weighted_mean_return_of_its_group_worked_by_hand():
    rewards, mask, index, old, squares = _hand_batch()
    # W: row 0 [0.5, 1.0], row 1 [1, 2, 3]; G: row 0 [1, 1], row 1 [0.5, 0.5, 0.5]
    # B*_0 = (1 * 0.5 + 0.5 * 1) / 1.5 = 2/3, B*_1 = (1 * 1 + 0.5 * 2) / 3 = 2/3, B*_2 = 0.5 * 3 / 3 = 1/2
    adv, returns = compute_advantage("optimal_token_baseline", rewards, mask, index, old_log_prob=old,
                                     sum_pi_squared=squares)
    expected = torch.tensor([[1 / 3, 1 / 3, 0.0], [-1 / 6, -1 / 6, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.5, 0.5], [2.0, 0.0, 0.0]]))
    # tir: row 1 is its group's only response that long: past row 0's end its baseline is 0
    tir, _ = compute_advantage("tir_optimal_token_baseline", rewards, mask, index, old_log_prob=old,
                               sum_pi_squared=squares)
    torch.testing.assert_close(tir, expected + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)


def test_importance_weights_scale_each_tokens_energy_by_their_square():
    rewards, mask, index, old, squares = _hand_batch()
    rho = torch.where(mask, 1.0, 0.0)
    rho[1] = 2.0  # row 1's W becomes [4, 8, 12]: B*_0 = (0.5 + 0.5 * 4) / 4.5 = 5/9
    adv, _ = compute_advantage("optimal_token_baseline", rewards, mask, index, old_log_prob=old,
                               sum_pi_squared=squares, rollout_is_weights=rho)
    assert adv[0, 0].item() == pytest.approx(1 - 5 / 9)
    assert adv[0, 1].item() == pytest.approx(1 - (1 + 0.5 * 8) / 9)


def test_tir_does_not_count_an_empty_response_as_a_member_of_its_group():
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old, squares = torch.where(mask, math.log(0.5), 0.0), torch.where(mask, 0.5, 0.0)
    otb, _ = compute_advantage("optimal_token_baseline", rewards, mask, torch.tensor([0, 0]),
                               old_log_prob=old, sum_pi_squared=squares)
    tir, _ = compute_advantage("tir_optimal_token_baseline", rewards, mask, torch.tensor([0, 0]),
                               old_log_prob=old, sum_pi_squared=squares)
    assert otb.abs().max() < 1e-6  # two members: the baseline is the one response's own return
    torch.testing.assert_close(tir, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # alone: no baseline


def _by_loop(rewards, mask, index, old, squares, weights, handle_zero_tail, skip_empty, eps=1e-8):
    """The definition, one group and one position at a time, in float64."""
    rewards, old, squares = rewards.double(), old.double(), squares.double()
    b, t = mask.shape
    w = 1 - 2 * old.exp() + squares
    if weights is not None:
        w = w * weights.double() ** 2
    energy = (w * mask).cumsum(-1)
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    baseline = torch.zeros(b, t, dtype=torch.float64)
    lengths = mask.sum(-1).tolist()
    for group in set(index.tolist()):
        rows = [i for i in range(b) if index[i] == group and (lengths[i] > 0 or not skip_empty)]
        if len(rows) < 2:
            continue
        for pos in range(t):
            num = sum(returns[i, pos] * energy[i, pos] * mask[i, pos] for i in rows)
            den = sum(energy[i, pos] * mask[i, pos] for i in rows) + eps
            for i in rows:
                baseline[i, pos] = num / den
        ordered = sorted(lengths[i] for i in rows)
        longest = [i for i in rows if lengths[i] == ordered[-1]]
        if handle_zero_tail and len(longest) == 1:
            baseline[longest[0], ordered[-2]:] = 0.0
    return (returns - baseline) * mask, returns * mask


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("flags", [(False, False), (True, False), (True, True)])
def test_the_vectorised_baseline_equals_the_loop_over_groups_and_positions(seed, flags):
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 9
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[seed % b] = t  # a longest response, sometimes alone
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = torch.randn(b, t, generator=g) * mask
    index = torch.randint(0, 4, (b,), generator=g)
    logits = torch.randn(b, t, 11, generator=g)
    probs = torch.softmax(logits, -1)
    picked = probs.gather(-1, torch.randint(0, 11, (b, t, 1), generator=g)).squeeze(-1)
    old, squares = torch.where(mask, picked.log(), 0.0), torch.where(mask, probs.square().sum(-1), 0.0)
    weights = torch.rand(b, t, generator=g) * 2 if seed % 2 else None
    got = compute_optimal_token_baseline_advantage(rewards, mask, index, old, squares, weights,
                                                   handle_zero_tail=flags[0], skip_empty=flags[1])
    expected = _by_loop(rewards, mask, index, old, squares, weights, *flags)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a.double(), e, atol=1e-5, rtol=1e-5)


def test_the_score_norm_is_the_squared_distance_from_the_sampled_tokens_one_hot():
    probs = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(3)), -1)
    labels = torch.tensor([0, 3, 6, 2, 2])
    w = score_norms(probs.gather(-1, labels[:, None]).squeeze(-1).log(), probs.square().sum(-1))
    torch.testing.assert_close(w, (torch.nn.functional.one_hot(labels, 7) - probs).square().sum(-1))


def test_variance_proxies_worked_by_hand():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 3.0], [-2.0, 0.0]])  # mean advantages 2 and -2
    old = torch.where(mask, math.log(0.5), 0.0)
    squares = torch.where(mask, 0.5, 0.0)  # w = 0.5 per token: W = 1 and 0.5
    metrics = variance_proxy_metrics(adv, mask, old, squares, grad_norm=1.0)
    assert metrics["variance_proxy/proxy2_total_power"] == pytest.approx((4 * 1 + 4 * 0.5) / 2)
    assert metrics["variance_proxy/proxy1_signal_strength"] == 1.0
    assert metrics["variance_proxy/proxy3_pure_noise"] == pytest.approx(3.0 - 1.0)
    assert metrics["variance_proxy/expected_a_squared"] == pytest.approx(4.0)
    assert metrics["variance_proxy/expected_w"] == pytest.approx(0.75)
    assert variance_proxy_metrics(adv, mask, old, squares)["variance_proxy/proxy3_pure_noise"] == 0.0
