"""Groups without spread: hand-worked fractions, and dynamic sampling's kept rows against verl's rule."""

import random

import numpy as np
import torch

from klppo.algo import (
    compute_advantage,
    dynamic_sampling_keep,
    group_has_spread,
    zero_advantage_fraction,
    zero_std_group_fraction,
)

# 4 groups of 3: group 0 ties at 1, group 1 spreads (0, 1, 1), group 2 ties at 0, group 3 spreads (0.5, 0, 0)
SCORES = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
INDEX = torch.arange(4).repeat_interleave(3)


def test_zero_std_fraction_counts_the_groups_whose_rewards_all_tie():
    # groups 0 and 2 tie: 2 of 4
    assert torch.equal(group_has_spread(SCORES, INDEX), torch.tensor([False, True, False, True]))
    assert torch.equal(zero_std_group_fraction(SCORES, INDEX), torch.tensor(0.5))


def test_groups_are_found_by_id_wherever_their_rows_are():
    # the same groups, rows interleaved and ids not contiguous (7, 3): group 7 ties at 2, group 3 spreads (1, 4)
    values, index = torch.tensor([2.0, 1.0, 2.0, 4.0]), torch.tensor([7, 3, 7, 3])
    assert torch.equal(group_has_spread(values, index), torch.tensor([True, False]))  # ascending ids: 3, 7
    assert torch.equal(dynamic_sampling_keep(values, index), torch.tensor([False, True, False, True]))


def test_a_nan_counts_as_spread_so_the_guard_still_sees_it():
    values, index = torch.tensor([float("nan"), float("nan"), 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    assert torch.equal(group_has_spread(values, index), torch.tensor([True, False]))
    assert torch.equal(zero_std_group_fraction(values, index), torch.tensor(0.5))


def test_dynamic_sampling_keeps_spread_groups_and_lone_responses():
    # group 0: (1, 1) ties -> dropped; group 1: a lone response -> kept; group 2: (0, 1) -> kept
    values, index = torch.tensor([1.0, 1.0, 5.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 2, 2])
    assert torch.equal(dynamic_sampling_keep(values, index), torch.tensor([False, False, True, True, True]))


def test_zero_advantage_fraction_counts_real_tokens_only():
    advantages = torch.tensor([[0.0, 0.0, 9.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # real tokens: 0, 0 | 0.5, 0, 0 -> 4 zeros of 5 (the padded 9 is not counted)
    assert torch.equal(zero_advantage_fraction(advantages, mask), torch.tensor(0.8))
    assert torch.equal(zero_advantage_fraction(advantages, torch.zeros_like(mask)), torch.tensor(0.0))


def test_a_tied_group_has_exactly_zero_grpo_advantage_on_every_token():
    rewards = torch.zeros(12, 2)
    rewards[:, -1] = SCORES
    mask = torch.ones(12, 2, dtype=torch.bool)
    advantages, _ = compute_advantage("grpo", rewards, mask, INDEX)
    # groups 0 and 2 tie: their 6 rows x 2 tokens are 0; the spread groups' are not
    assert torch.equal(zero_advantage_fraction(advantages, mask), torch.tensor(0.5))


# ---- verl's rule, written out as the reference ----


def verl_kept_rows(uids: list[str], metric: list[float], prompts_wanted: int, n: int) -> list[int]:
    """recipe/dapo/dapo_ray_trainer.py's selection, on one generation batch after another: the std of
    the metric per uid (population std, as np.std), uids with std > 0 or a single trajectory kept, rows in
    their order, the kept rows of every batch concatenated and cut to train_batch_size * rollout.n rows."""
    values: dict[str, list[float]] = {}
    for uid, value in zip(uids, metric):
        values.setdefault(uid, []).append(value)
    kept_uids = [u for u, v in values.items() if np.std(v) > 0 or len(v) == 1]
    rows = [i for i, uid in enumerate(uids) if uid in kept_uids]
    return rows[: prompts_wanted * n]


def klppo_kept_rows(metric: torch.Tensor, index: torch.Tensor, prompts_wanted: int, n: int) -> list[int]:
    """What klppo's dynamic sampling trains on: the rows ``dynamic_sampling_keep`` keeps, cut to whole groups."""
    rows = dynamic_sampling_keep(metric, index).nonzero().squeeze(-1).tolist()
    return rows[: prompts_wanted * n]


def test_kept_rows_are_verls_for_the_same_rewards():
    rng = random.Random(0)
    for trial in range(200):
        n, prompts = rng.choice([2, 3, 4]), rng.randint(1, 12)
        # rewards from a small set, as a rule reward gives them: ties are common, exact in floats
        metric = [rng.choice([0.0, 1.0, 0.5, -1.0]) if rng.random() < 0.5 else 1.0 for _ in range(prompts * n)]
        uids = [f"uid-{p}" for p in range(prompts) for _ in range(n)]
        wanted = rng.randint(1, prompts)
        index = torch.arange(prompts).repeat_interleave(n)
        expected = verl_kept_rows(uids, metric, wanted, n)
        assert klppo_kept_rows(torch.tensor(metric), index, wanted, n) == expected, (trial, metric)


def test_verls_float64_std_of_equal_values_is_where_the_rules_part():
    # np.std of three float64 0.1s is about 1.4e-17 (rounding in the mean): verl would keep the group
    assert 0 < np.std([0.1] * 3) < 1e-16
    assert not bool(group_has_spread(torch.tensor([0.1] * 3), torch.zeros(3, dtype=torch.long)))
