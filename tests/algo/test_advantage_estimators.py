"""Advantage estimators: hand-worked GAE and group estimators, loop vs vectorised, verl's own
functions on a seeded batch."""

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from klppo.algo import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    masked_mean,
    masked_var,
)


def test_gae_returns_match_a_hand_worked_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72, V_3 = 0
    # t=2: delta = 1 + 0.9 * 0 - 0.3 = 0.7;            A_2 = 0.7
    # t=1: delta = 0 + 0.9 * 0.3 - 0.4 = -0.13;         A_1 = -0.13 + 0.72 * 0.7 = 0.374
    # t=0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14;         A_0 = -0.14 + 0.72 * 0.374 = 0.12928
    # returns = A + V = [0.62928, 0.774, 1.0]
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(ret, torch.tensor([[0.62928, 0.774, 1.0]]), atol=1e-6)
    # advantages are the raw A whitened: A = [0.12928, 0.374, 0.7], mean 0.40109..., unbiased std
    raw = torch.tensor([0.12928, 0.374, 0.7])
    assert torch.allclose(adv[0], (raw - raw.mean()) / raw.std(), atol=1e-4)


def test_gae_padding_at_the_end_does_not_leak_and_is_zeroed():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])  # 7.0 and 9.0 sit on padding
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(ret, torch.tensor([[0.62928, 0.774, 1.0, 0.0]]), atol=1e-6)
    assert adv[0, 3] == 0.0


def test_gae_skips_padding_in_the_middle_of_a_row():
    # a masked token between real ones (e.g. a tool observation) is skipped: the row
    # [a, b, PAD, c] gets the same numbers at a, b, c as the compact row [a, b, c]
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    full = torch.ones(2, 3, dtype=torch.bool)
    adv_c, ret_c = compute_gae_advantage_return(rewards, values, full, gamma=0.95, lam=0.9)
    pad = torch.full((2, 1), 5.0)
    rewards_p = torch.cat([rewards[:, :2], pad, rewards[:, 2:]], dim=1)
    values_p = torch.cat([values[:, :2], pad, values[:, 2:]], dim=1)
    mask_p = torch.tensor([[True, True, False, True]] * 2)
    adv_p, ret_p = compute_gae_advantage_return(rewards_p, values_p, mask_p, gamma=0.95, lam=0.9)
    assert torch.allclose(ret_p[mask_p].view(2, 3), ret_c, atol=1e-6)
    assert torch.allclose(adv_p[mask_p].view(2, 3), adv_c, atol=1e-5)
    assert torch.all(adv_p[:, 2] == 0) and torch.all(ret_p[:, 2] == 0)


def test_gae_advantages_are_whitened_over_real_tokens():
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.arange(6).expand(4, 6) < torch.tensor([[6], [3], [1], [5]])
    adv, _ = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(masked_mean(adv, mask), torch.tensor(0.0), atol=1e-5)
    assert torch.allclose(masked_var(adv, mask), torch.tensor(1.0), atol=1e-4)


def _outcome_batch():
    """Five answers, score at the last real token; groups a: [1, 0], b: [2, 1, 0], c: [3]."""
    mask = torch.tensor(
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool
    )
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 3.0])
    last = mask.sum(dim=-1) - 1
    rewards = torch.zeros(6, 3)
    rewards[torch.arange(6), last] = scores
    index = ["a", "a", "b", "b", "b", "c"]
    return rewards, mask, index


def test_grpo_normalises_scores_within_each_group():
    rewards, mask, index = _outcome_batch()
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    # a: [1, 0], mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.70711 -> +-0.5 / 0.70711 = +-0.70711
    # b: [2, 1, 0], mean 1, std sqrt((1 + 0 + 1) / 2) = 1 -> [1, 0, -1]
    # c: a group of one: mean 0, std 1 -> 3
    per_seq = torch.tensor([0.70711, -0.70711, 1.0, 0.0, -1.0, 3.0])
    expected = per_seq.unsqueeze(-1) * mask
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation_only_centres():
    rewards, mask, index = _outcome_batch()
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # score - group mean: a [0.5, -0.5], b [1, 0, -1], c [3 - 0]
    per_seq = torch.tensor([0.5, -0.5, 1.0, 0.0, -1.0, 3.0])
    assert torch.allclose(adv, per_seq.unsqueeze(-1) * mask)


def test_rloo_subtracts_the_mean_of_the_other_answers():
    rewards, mask, index = _outcome_batch()
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    # a: 1 - 0 = 1, 0 - 1 = -1; b: 2 - (1 + 0) / 2 = 1.5, 1 - 1 = 0, 0 - 1.5 = -1.5; c: 3
    per_seq = torch.tensor([1.0, -1.0, 1.5, 0.0, -1.5, 3.0])
    assert torch.allclose(adv, per_seq.unsqueeze(-1) * mask)


def test_reinforce_plus_plus_discounts_and_restarts_after_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])  # 5.0 sits on padding
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: [0.5^2 * 1, 0.5 * 1, 1] = [0.25, 0.5, 1]
    # row 1: padding's 5.0 does not flow back: [0.5 * 2, 2, 0] = [1, 2, 0]
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    real = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0])
    assert torch.allclose(adv[mask], (real - real.mean()) / real.std(), atol=1e-5)
    assert adv[1, 2] == 0.0


def test_group_index_may_be_a_long_tensor():
    rewards, mask, index = _outcome_batch()
    as_tensor = torch.tensor([7, 7, 3, 3, 3, 11])
    for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage):
        assert torch.allclose(fn(rewards, mask, index)[0], fn(rewards, mask, as_tensor)[0])


def test_group_index_of_the_wrong_length_raises():
    rewards, mask, index = _outcome_batch()
    with pytest.raises(ValueError, match="group ids"):
        compute_grpo_outcome_advantage(rewards, mask, index[:-1])


# Straightforward per-sequence loops, written the way verl's reference code reads.
def _loop_group_scores(rewards, index):
    scores = rewards.sum(dim=-1)
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(scores[i])
    return scores, groups


def _loop_grpo(rewards, mask, index, eps, norm):
    scores, groups = _loop_group_scores(rewards, index)
    out = scores.clone()
    for i, g in enumerate(index):
        s = torch.stack(groups[g])
        mean, std = (s.mean(), s.std()) if len(s) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out.unsqueeze(-1) * mask


def _loop_rloo(rewards, mask, index):
    scores, groups = _loop_group_scores(rewards, index)
    out = scores.clone()
    for i, g in enumerate(index):
        n = len(groups[g])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - torch.stack(groups[g]).mean() * n / (n - 1)
    return out.unsqueeze(-1) * mask


def _loop_rfpp_baseline(rewards, mask, index):
    scores, groups = _loop_group_scores(rewards, index)
    out = scores.clone()
    for i, g in enumerate(index):
        if len(groups[g]) > 1:
            out[i] = scores[i] - torch.stack(groups[g]).mean()
    tiled = out.unsqueeze(-1) * mask
    real = tiled[mask]
    return torch.where(mask, (tiled - real.mean()) / torch.sqrt(real.var() + 1e-8), 0.0)


def _random_group_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 1, 8]
    index = [f"p{g}" for g, n in enumerate(sizes) for _ in range(n)]
    order = torch.randperm(len(index), generator=gen).tolist()  # groups interleaved
    index = [index[i] for i in order]
    b, t = len(index), 6
    rewards = torch.randn(b, t, generator=gen)
    mask = torch.arange(t).expand(b, t) < torch.randint(1, t + 1, (b, 1), generator=gen)
    return rewards * mask, mask, index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_group_estimators_match_a_python_loop(seed):
    rewards, mask, index = _random_group_batch(seed)
    for norm in (True, False):
        got, _ = compute_grpo_outcome_advantage(rewards, mask, index, 1e-6, norm)
        assert torch.allclose(got, _loop_grpo(rewards, mask, index, 1e-6, norm), atol=1e-5)
    got, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    assert torch.allclose(got, _loop_rloo(rewards, mask, index), atol=1e-5)
    got, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    assert torch.allclose(got, _loop_rfpp_baseline(rewards, mask, index), atol=1e-5)


def test_estimators_do_not_track_gradients():
    rewards, mask, index = _outcome_batch()
    rewards = rewards.clone().requires_grad_(True)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    assert not adv.requires_grad


def test_compute_advantage_dispatches_by_name_and_refuses_unknown_names():
    from klppo.algo import compute_advantage, compute_grpo_outcome_advantage

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    mask = torch.ones_like(rewards, dtype=torch.bool)
    index = [0, 0, 1, 1]
    got = compute_advantage("grpo", rewards, mask, index)
    want = compute_grpo_outcome_advantage(rewards, mask, index)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="grpo"):
        compute_advantage("ppo", rewards, mask, index)


VERL = json.loads((Path(__file__).parent / "data" / "verl_advantages.json").read_text())


@pytest.mark.parametrize("name", sorted(VERL["cases"]))
def test_verls_other_group_estimators_give_verls_advantages(name):
    # verl's own functions on a seeded batch (data/make_verl_advantages.py): groups of 1 to 5, ties, zero scores
    from klppo.algo import compute_advantage

    case, x = VERL["cases"][name], VERL["inputs"]
    rewards, mask = torch.tensor(x["token_level_rewards"]), torch.tensor(x["response_mask"])
    index = x["paired_index"] if case["paired"] else x["index"]
    got, returns = compute_advantage(case["estimator"], rewards, mask, index,
                                     norm_adv_by_std_in_grpo=case["norm_adv_by_std_in_grpo"],
                                     reward_baselines=torch.tensor(x["reward_baselines"]))
    torch.testing.assert_close(got, torch.tensor(case["advantages"]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns, torch.tensor(case["returns"]), rtol=1e-6, atol=1e-6)


def _scores(*values):
    return torch.tensor(values).unsqueeze(-1), torch.ones(len(values), 1, dtype=torch.bool)


def test_opo_subtracts_the_groups_length_weighted_mean_worked_by_hand():
    from klppo.algo import compute_opo_outcome_advantage

    rewards = torch.tensor([[0.0, 0.0, 1.0], [3.0, 0.0, 0.0], [2.0, 0.0, 0.0]])  # lengths 3, 1; a group of one
    mask = torch.tensor([[True, True, True], [True, False, False], [True, False, False]])
    adv, _ = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "b"])
    baseline = (3 * 1.0 + 1 * 3.0) / 4  # the longer answer weighs 3 times as much
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0 - baseline, 3.0 - baseline, 2.0]))
    assert adv[1, 1:].abs().sum() == 0  # padding stays 0


def test_grpo_passk_gives_only_each_groups_best_answer_its_margin():
    from klppo.algo import compute_grpo_passk_outcome_advantage

    rewards, mask = _scores(1.0, 3.0, 2.0, 5.0, 5.0)
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "b"], norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # 3 - 2; a tie's best has no margin
    normed, _ = compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "b"])
    assert normed[1, 0].item() == pytest.approx(1.0 / (1.0 + 1e-6))  # std of 1, 3, 2 is 1
    with pytest.raises(ValueError, match="at least 2 answers"):
        compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "c"])


def test_gpg_scales_the_centred_score_by_the_share_of_non_zero_scores():
    from klppo.algo import compute_gpg_outcome_advantage

    rewards, mask = _scores(1.0, 0.0, 0.0, 0.0)  # one non-zero score of 4: alpha = 4
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, ["a", "a", "b", "b"])
    assert adv[:, 0].tolist() == [2.0, -2.0, 0.0, 0.0]  # 4 x (1 - 0.5), 4 x (0 - 0.5)


def test_the_vectorized_variants_differ_from_grpo_and_rloo_only_where_verls_do():
    from klppo.algo import (compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage,
                            compute_rloo_outcome_advantage, compute_rloo_vectorized_outcome_advantage)

    rewards, mask = _scores(1.0, 1.0002, 4.0)  # a group whose scores nearly agree, and a group of one
    index = ["a", "a", "b"]
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    floored, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    assert abs(grpo[0, 0].item()) == pytest.approx(0.70, rel=1e-2)  # about 1/sqrt(2), whatever the spread
    assert abs(floored[0, 0].item()) < 0.15  # the variance floored at 1e-6: std >= 1e-3, the spread 1e-4
    assert grpo[2, 0].item() == floored[2, 0].item() == pytest.approx(4.0)  # a lone answer keeps its score (/ 1 + eps)
    rloo, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    lone, _ = compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    assert rloo[2, 0] == 4.0 and lone[2, 0] == 0.0
    torch.testing.assert_close(rloo[:2], lone[:2])


def test_remax_subtracts_the_greedy_score_from_each_tokens_return_to_go_worked_by_hand():
    from klppo.algo import compute_remax_outcome_advantage

    rewards = torch.tensor([[-0.1, 0.0, 1.0], [0.0, 2.0, 9.0]])  # a KL penalty on the first token; 9 sits on padding
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, returns = compute_remax_outcome_advantage(rewards, torch.tensor([0.5, 3.0]), mask)
    torch.testing.assert_close(returns, torch.tensor([[0.9, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.5, 0.5], [-1.0, -1.0, 0.0]]))  # not whitened
