"""Rollout correction: hand-worked weights and rejection, and verl 0.9.1's figures on random tensors.

verl cannot be imported here; ``data/verl_rollout_corr_0.9.1.json`` holds the inputs and the
outputs of verl's ``compute_rollout_correction_and_rejection_mask`` run once on seeded tensors
(``data/make_verl_rollout_corr.py`` wrote it), and klppo's functions must give the same
weights, masks and metrics to 1e-6.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from klppo.algo.rollout_correction import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from klppo.config.rollout_correction import parse_is_threshold, parse_rs

VERL = json.loads((Path(__file__).parent / "data" / "verl_rollout_corr_0.9.1.json").read_text())


def _klppo_case(kwargs: dict):
    old = torch.tensor(VERL["old_log_prob"])
    rollout = torch.tensor(VERL["rollout_log_prob"])
    mask = torch.arange(old.shape[1])[None, :] < torch.tensor(VERL["lengths"])[:, None]
    upper, lower = parse_is_threshold(kwargs.get("rollout_is_threshold", 2.0))
    rs = parse_rs(kwargs["rollout_rs"], kwargs["rollout_rs_threshold"]) if kwargs.get("rollout_rs") else ()
    return mask, compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=kwargs.get("rollout_is"), rollout_is_threshold=upper,
        rollout_is_threshold_lower=lower, rollout_is_batch_normalize=kwargs.get("rollout_is_batch_normalize", False),
        rollout_rs=rs)


@pytest.mark.parametrize("name", sorted(VERL["cases"]))
def test_weights_masks_and_metrics_match_verl_on_random_tensors(name):
    case = VERL["cases"][name]
    mask, (weights, keep, metrics) = _klppo_case(case["kwargs"])
    assert keep.tolist() == case["keep"]
    if "weights" in case:
        assert torch.allclose(weights, torch.tensor(case["weights"]), atol=1e-6, rtol=1e-6)
    else:
        assert weights is None
    assert sorted(metrics) == sorted(case["metrics"])
    for key, expected in case["metrics"].items():
        assert float(metrics[key]) == pytest.approx(expected, rel=1e-6, abs=1e-6), key


def test_the_verl_cases_exercise_both_bounds_and_rejection():
    cases = VERL["cases"]
    assert cases["token_tis"]["metrics"]["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    assert cases["token_tis"]["metrics"]["rollout_corr/rollout_is_ratio_fraction_low"] > 0
    assert 0 < cases["rs_mixed_with_token_is"]["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_token_weights_are_truncated_ratios_zero_on_padding():
    # log r = [ln 0.5, ln 3, 0 (padding)]: weights 0.5, min(3, 2) = 2, and 0 on padding
    log_ratio = torch.tensor([[math.log(0.5), math.log(3.0), 5.0]])
    mask = torch.tensor([[True, True, False]])
    weights, metrics = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 2.0, 0.0]]))
    assert float(metrics["rollout_is_ratio_fraction_high"]) == pytest.approx(0.5)  # 3 > 2
    assert float(metrics["rollout_is_mean"]) == pytest.approx(1.25)


def test_sequence_weight_is_the_product_of_token_ratios_on_every_token():
    # row 0: 0.5 * 3 = 1.5 on both tokens; row 1: 2 * 4 = 8, truncated at 5
    log_ratio = torch.log(torch.tensor([[0.5, 3.0], [2.0, 4.0]]))
    weights, _ = compute_rollout_correction_weights(log_ratio, torch.ones(2, 2, dtype=torch.bool), "sequence", 5.0)
    assert torch.allclose(weights, torch.tensor([[1.5, 1.5], [5.0, 5.0]]))


def test_icepop_zeroes_weights_outside_the_bounds_and_batch_normalisation_makes_the_mean_one():
    log_ratio = torch.log(torch.tensor([[0.25, 1.0, 1.5, 4.0]]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    weights, metrics = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0, 0.5)
    assert torch.allclose(weights, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    assert float(metrics["rollout_is_oob_ratio"]) == pytest.approx(0.5)
    normalised, metrics = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0, 0.5, True)
    # mean of [0, 1, 1.5, 0] = 0.625
    assert float(metrics["rollout_is_batch_norm_factor"]) == pytest.approx(0.625)
    assert float(normalised.mean()) == pytest.approx(1.0)


def test_weights_carry_no_gradient():
    log_ratio = torch.zeros(1, 3, requires_grad=True)
    weights, _ = compute_rollout_correction_weights(log_ratio, torch.ones(1, 3, dtype=torch.bool), "token", 2.0)
    assert not weights.requires_grad


def test_token_k1_rejects_tokens_whose_ratio_leaves_its_bounds():
    # k1 = -log r = log(mu / pi_old); bounds [0.5, 2] on mu / pi_old: r = 3 (mu/pi = 1/3) and
    # r = 0.25 (mu/pi = 4) are rejected, r = 1.5 is kept; padding stays out
    log_ratio = torch.log(torch.tensor([[3.0, 1.5, 0.25, 1.0]]))
    mask = torch.tensor([[True, True, True, False]])
    keep, metrics = compute_rollout_rejection_mask(log_ratio, mask, [("token_k1", 0.5, 2.0)])
    assert keep.tolist() == [[False, True, False, False]]
    assert float(metrics["rollout_rs_masked_fraction"]) == pytest.approx(2 / 3)
    assert float(metrics["rollout_rs_seq_masked_fraction"]) == pytest.approx(1.0)


def test_sequence_criteria_reject_whole_rows():
    # seq_max_k2: max_t (log r)^2 / 2; row 0 has log r = 1 (k2 = 0.5 > 0.3), row 1 stays under
    log_ratio = torch.tensor([[0.0, 1.0], [0.5, -0.5]])
    keep, metrics = compute_rollout_rejection_mask(log_ratio, torch.ones(2, 2, dtype=torch.bool),
                                                   [("seq_max_k2", None, 0.3)])
    assert keep.tolist() == [[False, False], [True, True]]
    assert float(metrics["rollout_rs_seq_max_k2_max"]) == pytest.approx(0.5)


def test_offpolicy_kl_is_the_mean_log_ratio_of_mu_to_pi_old():
    old = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-0.5, -2.5]])
    metrics = compute_offpolicy_metrics(old, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert float(metrics["kl"]) == pytest.approx(0.0)  # (0.5 - 0.5) / 2
    assert float(metrics["training_ppl"]) == pytest.approx(math.exp(1.5))
    assert float(metrics["chi2_token"]) == pytest.approx((math.exp(-1) + math.exp(1)) / 2 - 1, rel=1e-5)
