"""PF-PPO's weights and draw (verl's compute_pf_ppo_reweight_data), worked by hand."""

import pytest
import torch

from klppo.algo import pf_ppo_sample, pf_ppo_weights

SCORES = torch.tensor([1.0, -2.0, 0.0, 3.0, 3.0, 0.5])


def test_pow_weighs_each_response_by_its_absolute_score_to_the_power():
    expected = torch.tensor([1.0, 4.0, 0.0, 9.0, 9.0, 0.25]) + 1e-8
    torch.testing.assert_close(pf_ppo_weights(SCORES, "pow", 2.0), expected)
    torch.testing.assert_close(pf_ppo_weights(SCORES, "pow", 1.0), SCORES.abs() + 1e-8)


def test_max_min_keeps_the_best_and_the_worst_and_max_random_favours_the_best():
    torch.testing.assert_close(pf_ppo_weights(SCORES, "max_min"), torch.tensor([0, 1, 0, 1, 1, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(SCORES, "max_random"),
                               torch.tensor([0.1, 0.1, 0.1, 0.4, 0.4, 0.1]) + 1e-8)
    with pytest.raises(ValueError, match="one of"):
        pf_ppo_weights(SCORES, "softmax")


def test_the_draw_keeps_the_batch_size_repeats_by_weight_and_is_repeatable():
    draw = lambda seed: pf_ppo_sample(SCORES, "max_min", 2.0, torch.Generator().manual_seed(seed))  # noqa: E731
    rows = draw(0)
    assert rows.shape == (6,) and set(rows.tolist()) <= {1, 3, 4}  # a weight of 1e-8 is never drawn here
    assert torch.equal(draw(0), rows) and any(not torch.equal(draw(s), rows) for s in range(1, 5))
    many = pf_ppo_sample(torch.tensor([1.0, 2.0]), "pow", 2.0, torch.Generator().manual_seed(1))
    counts = torch.bincount(pf_ppo_sample(torch.tensor([1.0, 2.0]).repeat(5000), "pow", 2.0,
                                          torch.Generator().manual_seed(2)) % 2, minlength=2)
    assert many.shape == (2,) and abs(counts[1].item() / counts.sum().item() - 0.8) < 0.02  # 4 / (1 + 4)
