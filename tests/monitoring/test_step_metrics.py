"""Per-step metrics of a batch: the response lengths and a reward function's components."""

import pytest
import torch

from klppo.monitoring.metrics import compute_data_metrics, reward_component_metrics
from klppo.rollout.batch import RolloutBatch


def _batch(lengths: list[int], width: int) -> RolloutBatch:
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rows = len(lengths)
    batch = RolloutBatch(prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2, dtype=torch.bool),
                         response_ids=torch.ones(rows, width, dtype=torch.long), response_mask=mask,
                         group_index=torch.arange(rows), data_sources=["x"] * rows, ground_truths=[None] * rows,
                         extra_infos=[{}] * rows)
    batch.token_level_scores = batch.token_level_rewards = torch.zeros(rows, width)
    batch.advantages = batch.returns = torch.zeros(rows, width)
    return batch


def test_length_mean_and_the_share_of_responses_cut_at_the_limit():
    metrics = compute_data_metrics(_batch([4, 2, 4, 1], width=4), max_response_length=4)
    assert metrics["response_length/mean"] == 11 / 4
    assert metrics["response_length/clip_ratio"] == 0.5  # two of four responses reached the 4-token limit


def test_reward_components_means_and_shares_of_their_absolute_sizes():
    components = [{"exact_match": 1.0, "length_bonus": 0.4}, {"exact_match": 0.0, "length_bonus": 0.6},
                  {"length_bonus": -1.0}]  # a response without exact_match counts 0 for it
    metrics = reward_component_metrics(components)
    assert metrics["reward/exact_match/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/length_bonus/mean"] == pytest.approx(0.0)  # (0.4 + 0.6 - 1.0) / 3
    # mean |c|: exact_match 1/3, length_bonus 2/3; shares 1/3 and 2/3
    assert metrics["reward/exact_match/share"] == pytest.approx(1 / 3)
    assert metrics["reward/length_bonus/share"] == pytest.approx(2 / 3)


def test_one_component_has_a_mean_and_no_share_and_plain_scores_have_none():
    assert reward_component_metrics([{"acc": 1.0}, {"acc": 0.0}]) == {"reward/acc/mean": 0.5}
    assert reward_component_metrics([{}, {}]) == {}
