"""Bradley-Terry and Plackett-Luce fits, ranking -> comparisons, and the ranking losses."""

import math

import pytest
import torch

from klppo.algo.ranking import (
    bradley_terry_loss,
    bradley_terry_strengths,
    comparisons_from_annotators,
    plackett_luce_loss,
    plackett_luce_strengths,
    rankings_to_comparisons,
    scalar_rewards_from_strengths,
)


def sample_pairwise_wins(true_strengths, n_per_pair, seed):
    """Win counts (n, n) from n_per_pair BT comparisons of every pair, P(i > j) = sigmoid(s_i - s_j)."""
    g = torch.Generator().manual_seed(seed)
    n = true_strengths.shape[0]
    p_win = torch.sigmoid(true_strengths[:, None] - true_strengths[None, :])  # (n, n)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    wins_upper = (torch.rand(n, n, n_per_pair, generator=g) < p_win[..., None]).sum(-1).float()
    wins_upper = torch.where(upper, wins_upper, torch.zeros(()))
    return wins_upper + (n_per_pair - wins_upper.T) * upper.T  # j beat i whenever i did not beat j


def sample_gumbel_rankings(true_strengths, n_rankings, seed):
    """Full PL rankings by the Gumbel trick: sort theta + Gumbel noise, best first (Yellott 1977)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n_rankings, true_strengths.shape[0], generator=g).clamp(1e-12, 1 - 1e-12)
    noisy = true_strengths + (-torch.log(-torch.log(u)))
    return [[int(i) for i in row] for row in torch.argsort(noisy, dim=-1, descending=True)]


# ---- rankings -> comparisons ---------------------------------------------------------------


def test_one_ranking_gives_one_win_per_ordered_pair_and_none_for_unlisted_items():
    # 2 > 0 > 1, item 3 unlisted: wins 2>0, 2>1, 0>1 and nothing involving 3
    wins = rankings_to_comparisons([2, 0, 1], 4)
    expected = torch.zeros(4, 4)
    expected[2, 0] = expected[2, 1] = expected[0, 1] = 1.0
    assert torch.equal(wins, expected)


def test_a_tier_of_tied_items_counts_half_a_win_each_way():
    # 2 > {0 = 3} > 1: 2 beats 0, 3, 1; 0 and 3 beat 1; 0 vs 3 is half a win each
    wins = rankings_to_comparisons([2, [0, 3], 1], 4)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.5],
                             [0.0, 0.0, 0.0, 0.0],
                             [1.0, 1.0, 0.0, 1.0],
                             [0.5, 1.0, 0.0, 0.0]])
    assert torch.equal(wins, expected)


def test_a_ranking_tensor_gives_the_same_comparisons_as_a_list():
    assert torch.equal(rankings_to_comparisons(torch.tensor([3, 1, 0]), 5), rankings_to_comparisons([3, 1, 0], 5))


def test_annotators_comparisons_are_summed():
    wins = comparisons_from_annotators([[0, 1, 2], [1, 0], [[0, 2]]], 3)
    # 0>1 once, 1>0 once, 0>2 once + 0.5, 2>0 0.5, 1>2 once
    expected = torch.tensor([[0.0, 1.0, 1.5], [1.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    assert torch.equal(wins, expected)
    assert torch.equal(comparisons_from_annotators([], 3), torch.zeros(3, 3))


@pytest.mark.parametrize("ranking, message", [
    ([0, 3], "out of range for 3 items"),
    ([0, 1, 0], "item 0 appears twice"),
    ([0, [1, 0]], "item 0 appears twice"),
    ([0, [1.0]], "item 1.0 is not a Python int"),
    ([0, True], "item True is not a Python int"),
    ([0, 1.0], "neither an int item index nor a non-empty list"),
    ([0, []], "neither an int item index nor a non-empty list"),
    ("012", "must be a list of item indices"),
])
def test_bad_rankings_are_value_errors_that_say_why(ranking, message):
    with pytest.raises(ValueError, match=message):
        rankings_to_comparisons(ranking, 3)


# ---- Bradley-Terry fit ---------------------------------------------------------------------


def test_bradley_terry_two_items_hand_worked():
    # 0 beat 1 three times, 1 beat 0 once; prior 0.1 pseudo-wins each way:
    # MAP odds = 3.1 / 1.1, so theta_0 - theta_1 = log(3.1 / 1.1) = 1.0361, centred +-0.5181
    wins = torch.tensor([[0.0, 3.0], [1.0, 0.0]])
    half = 0.5 * math.log(3.1 / 1.1)
    assert torch.allclose(bradley_terry_strengths(wins), torch.tensor([half, -half]), atol=1e-5)


def test_bradley_terry_recovers_known_strengths_from_sampled_comparisons():
    true = torch.tensor([1.0, 0.0, -1.0])
    wins = sample_pairwise_wins(true, n_per_pair=2000, seed=0)
    estimate = bradley_terry_strengths(wins)
    assert torch.allclose(estimate, true, atol=0.15), estimate
    assert abs(float(estimate.sum())) < 1e-5  # centred


def test_bradley_terry_fit_satisfies_the_likelihood_equations():
    # at the MAP, each item's (pseudo-)wins equal its expected wins: sum_j W'_ij = sum_j N'_ij p_ij
    wins = sample_pairwise_wins(torch.tensor([0.5, -0.2, 0.0, 1.3]), n_per_pair=7, seed=1).double()
    theta = bradley_terry_strengths(wins, prior=0.1)
    w = (wins + 0.1) * (1 - torch.eye(4, dtype=torch.float64))
    p = torch.sigmoid(theta[:, None] - theta[None, :])
    assert torch.allclose(w.sum(-1), ((w + w.T) * p).sum(-1), atol=1e-8)


def test_bradley_terry_batch_equals_separate_fits():
    a = rankings_to_comparisons([0, 1, 2], 3)
    b = comparisons_from_annotators([[2, 0], [1, 2, 0]], 3)
    batched = bradley_terry_strengths(torch.stack([a, b]))
    assert torch.allclose(batched, torch.stack([bradley_terry_strengths(a), bradley_terry_strengths(b)]))


def test_bradley_terry_stops_within_tol_of_the_fixed_point():
    wins = rankings_to_comparisons([0, 1, 2, 3, 4], 5).double()
    frozen = bradley_terry_strengths(wins, tol=1e-6)
    assert torch.allclose(frozen, bradley_terry_strengths(wins, tol=0.0), atol=1e-5)


# ---- Plackett-Luce fit ---------------------------------------------------------------------


def test_plackett_luce_recovers_known_strengths_from_gumbel_rankings():
    true = torch.tensor([1.0, 0.0, -1.0, 0.5])
    true = true - true.mean()
    estimate = plackett_luce_strengths(sample_gumbel_rankings(true, 2000, seed=0), 4)
    assert torch.allclose(estimate, true, atol=0.15), estimate


def test_plackett_luce_on_two_item_rankings_equals_bradley_terry():
    # a 2-item PL ranking is one BT comparison, and both fits use the same prior
    rankings = [[0, 1], [0, 1], [1, 0], [2, 0], [1, 2]]
    pl = plackett_luce_strengths(rankings, 3, dtype=torch.float64)
    bt = bradley_terry_strengths(comparisons_from_annotators(rankings, 3, dtype=torch.float64))
    assert torch.allclose(pl, bt, atol=1e-7)


def test_plackett_luce_fit_satisfies_the_likelihood_equations_with_partial_rankings():
    # stationarity (Hunter 2004 sec. 5): w_t / gamma_t = sum over stages with t left of 1 / sum_left gamma
    rankings = [[0, 1, 2, 3], [3, 1], [2, 0, 3], [1, 2]]
    theta = plackett_luce_strengths(rankings, 4, dtype=torch.float64, prior=0.05)
    gamma = theta.exp()
    chosen, denom = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for ranking in rankings:
        for k in range(len(ranking) - 1):
            left = ranking[k:]
            chosen[ranking[k]] += 1
            for t in left:
                denom[t] += 1 / gamma[left].sum()
    for i in range(4):
        for j in range(4):
            if i != j:  # the prior's pseudo-comparisons: 0.05 wins each way
                chosen[i] += 0.05
                denom[i] += 0.1 / (gamma[i] + gamma[j])
    assert torch.allclose(chosen / gamma, denom, atol=1e-8)


def test_a_single_ranking_order_is_preserved_by_both_fits():
    ranking = [3, 0, 4, 1, 2]
    bt = bradley_terry_strengths(rankings_to_comparisons(ranking, 5))
    pl = plackett_luce_strengths([ranking], 5)
    for strengths in (bt, pl):
        assert torch.argsort(strengths, descending=True).tolist() == ranking
        assert torch.isfinite(strengths).all()


def test_tied_items_get_equal_strengths_in_both_fits():
    ranking = [1, [0, 2], 3]
    bt = bradley_terry_strengths(rankings_to_comparisons(ranking, 4))
    pl = plackett_luce_strengths([ranking], 4)
    for s in (bt, pl):
        assert torch.isclose(s[0], s[2], atol=1e-5) and s[1] > s[0] > s[3]


def test_degenerate_inputs_give_defined_finite_strengths():
    zeros3 = torch.zeros(3)
    # one item
    assert torch.equal(bradley_terry_strengths(torch.zeros(1, 1)), torch.zeros(1))
    assert torch.equal(plackett_luce_strengths([[0]], 1), torch.zeros(1))
    # no comparisons at all
    assert torch.allclose(bradley_terry_strengths(torch.zeros(3, 3)), zeros3)
    assert torch.allclose(plackett_luce_strengths([], 3), zeros3)
    # all tied
    assert torch.allclose(bradley_terry_strengths(rankings_to_comparisons([[0, 1, 2]], 3)), zeros3, atol=1e-6)
    assert torch.allclose(plackett_luce_strengths([[[0, 1, 2]]], 3), zeros3, atol=1e-6)
    # contradictory annotators: A > B and B > A equally often; for 3 items every rotation once
    for contradicting in ([[0, 1], [1, 0]], [[0, 1, 2], [1, 2, 0], [2, 0, 1]]):
        bt = bradley_terry_strengths(comparisons_from_annotators(contradicting, 3))
        assert torch.allclose(bt, zeros3, atol=1e-6)
        assert torch.allclose(plackett_luce_strengths(contradicting, 3), zeros3, atol=1e-6)
    # an undefeated item: the MLE is at infinity, the prior keeps it finite and on top
    undefeated = [[0, 1, 2], [0, 2, 1], [0, 1], [0, 2]]
    bt = bradley_terry_strengths(comparisons_from_annotators(undefeated, 3))
    pl = plackett_luce_strengths(undefeated, 3)
    for s in (bt, pl):
        assert torch.isfinite(s).all() and s[0] > s[1] and s[0] > s[2] and s[0] < 10


def test_fits_converge_within_the_default_iterations_when_annotators_agree_strongly():
    # 100 annotators agree on 0 > 1 > ... > 5: the MAP strengths are far apart (MM would need
    # thousands of steps); at the default n_iter both fits sit at their fixed point
    rankings = [list(range(6))] * 100
    wins = comparisons_from_annotators(rankings, 6, dtype=torch.float64)
    bt = bradley_terry_strengths(wins)
    assert torch.allclose(bt, bradley_terry_strengths(wins, n_iter=300, tol=0.0), atol=1e-9)
    pl = plackett_luce_strengths(rankings, 6, dtype=torch.float64)
    assert torch.allclose(pl, plackett_luce_strengths(rankings, 6, dtype=torch.float64, n_iter=300, tol=0.0),
                          atol=1e-9)
    assert (bt[:-1] - bt[1:] > 3).all() and (pl[:-1] - pl[1:] > 3).all()


def test_fits_return_the_requested_dtype():
    assert bradley_terry_strengths(torch.zeros(3, 3, dtype=torch.float16)).dtype == torch.float32
    assert bradley_terry_strengths(torch.zeros(3, 3, dtype=torch.float64)).dtype == torch.float64
    assert plackett_luce_strengths([[0, 1]], 2).dtype == torch.float32


def test_zero_items_give_an_empty_result():
    assert bradley_terry_strengths(torch.zeros(0, 0)).shape == (0,)
    assert plackett_luce_strengths([], 0).shape == (0,)


@pytest.mark.parametrize("kwargs, message", [
    ({"prior": 0.0}, "prior must be > 0"),
    ({"n_iter": 0}, "n_iter must be a positive int"),
    ({"tol": -1.0}, "tol must be >= 0"),
])
def test_bad_fit_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bradley_terry_strengths(torch.zeros(2, 2), **kwargs)
    with pytest.raises(ValueError, match=message):
        plackett_luce_strengths([[0, 1]], 2, **kwargs)


def test_non_square_wins_is_a_value_error():
    with pytest.raises(ValueError, match=r"square \(\.\.\., n, n\)"):
        bradley_terry_strengths(torch.zeros(2, 3))


# ---- losses --------------------------------------------------------------------------------


def test_bradley_terry_loss_hand_worked():
    # -log sigmoid(2 - 0) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147
    loss = bradley_terry_loss(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert torch.isclose(loss, torch.tensor((0.126928 + 0.693147) / 2), atol=1e-6)
    # margin 1: -log sigmoid(2 - 0 - 1) = log(1 + e^-1) = 0.313262
    with_margin = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0]), margin=torch.tensor([1.0]))
    assert torch.isclose(with_margin, torch.tensor(0.313262), atol=1e-6)
    assert bradley_terry_loss(torch.zeros(0), torch.zeros(0)) == 0.0


def test_plackett_luce_loss_three_items_hand_worked():
    # scores 2, 1, 0 in rank order:
    # stage 1: 2 - log(e^2 + e^1 + e^0) = 2 - log(11.1073) = -0.407606
    # stage 2: 1 - log(e^1 + e^0)       = 1 - log(3.71828) = -0.313262
    # stage 3: 0 - log(e^0)             = 0
    # nll = 0.407606 + 0.313262 = 0.720868
    loss = plackett_luce_loss(torch.tensor([[2.0, 1.0, 0.0]]))
    assert torch.isclose(loss, torch.tensor(0.720868), atol=1e-6)


def test_plackett_luce_loss_with_two_responses_equals_bradley_terry_loss():
    scores = torch.tensor([[0.3, -1.2], [2.0, 2.5], [0.0, 0.0]])
    expected = bradley_terry_loss(scores[:, 0], scores[:, 1])
    assert torch.allclose(plackett_luce_loss(scores), expected)


def plackett_luce_loss_loop(scores, valid):
    """Reference: the PL nll of each prompt's valid scores, stage by stage, in Python."""
    nlls = []
    for row, keep in zip(scores, valid):
        s = row[keep]
        if len(s) < 2:
            continue
        nlls.append(-sum(s[k] - torch.logsumexp(s[k:], dim=0) for k in range(len(s))))
    return torch.stack(nlls).mean() if nlls else torch.zeros(())


def test_plackett_luce_loss_vectorised_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 5, generator=g, dtype=torch.float64)
    valid = torch.rand(6, 5, generator=g) < 0.7
    valid[0] = True  # a full row
    valid[1] = torch.tensor([True, False, False, False, False])  # one response: not counted
    valid[2] = torch.tensor([True, True, False, False, False])  # padding at the end
    valid[3] = torch.tensor([False, True, False, True, True])  # gaps anywhere
    assert torch.allclose(plackett_luce_loss(scores, valid), plackett_luce_loss_loop(scores, valid))
    assert torch.allclose(plackett_luce_loss(scores), plackett_luce_loss_loop(scores, torch.ones_like(valid)))


def test_plackett_luce_loss_gradient_raises_better_and_lowers_worse_responses():
    scores = torch.tensor([[0.5, 0.5, 0.5, 9.0]], requires_grad=True)
    valid = torch.tensor([[True, True, True, False]])
    plackett_luce_loss(scores, valid).backward()
    grad = scores.grad[0]
    # descending the loss pushes the best score up and the worst down; padding gets no gradient
    assert grad[0] < 0 and grad[2] > 0 and grad[3] == 0
    assert torch.isfinite(grad).all()


def test_plackett_luce_loss_without_rankable_prompts_is_zero_with_finite_gradient():
    scores = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss = plackett_luce_loss(scores, torch.tensor([[True, False]]))
    loss.backward()
    assert loss == 0.0 and torch.equal(scores.grad, torch.zeros(1, 2))


def test_plackett_luce_loss_accepts_bfloat16_scores():
    loss = plackett_luce_loss(torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.bfloat16))
    assert loss.dtype == torch.float32 and torch.isclose(loss, torch.tensor(0.720868), atol=1e-3)


# ---- rewards -------------------------------------------------------------------------------


def test_scalar_rewards_are_scaled_centred_strengths():
    strengths = torch.tensor([[3.0, 1.0, 2.0]])
    # mean 2 -> centred [1, -1, 0], times 0.5
    assert torch.equal(scalar_rewards_from_strengths(strengths, scale=0.5), torch.tensor([[0.5, -0.5, 0.0]]))
    assert torch.equal(scalar_rewards_from_strengths(strengths, scale=2.0, center=False), 2.0 * strengths)
