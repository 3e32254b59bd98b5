"""KL estimators, controllers and KL-shaped rewards."""

import json
import math

import pytest
import torch

from klppo.algo import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)

LOGPROB = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-1.0, 0.0]])


def test_k1_is_the_log_ratio():
    # logprob - ref = [0 - (-1), -1 - 0] = [1, -1]
    for name in ("kl", "k1"):
        assert torch.allclose(kl_penalty(LOGPROB, REF, name), torch.tensor([[1.0, -1.0]]))


def test_abs_is_the_absolute_log_ratio():
    assert torch.allclose(kl_penalty(LOGPROB, REF, "abs"), torch.tensor([[1.0, 1.0]]))


def test_k2_is_half_the_squared_log_ratio():
    # 0.5 * [1^2, (-1)^2] = [0.5, 0.5]
    for name in ("mse", "k2"):
        assert torch.allclose(kl_penalty(LOGPROB, REF, name), torch.tensor([[0.5, 0.5]]))


def test_k3_is_ratio_minus_log_ratio_minus_one():
    # kl = ref - logprob = [-1, 1]; exp(kl) - kl - 1 = [e^-1 + 1 - 1, e - 1 - 1]
    expected = torch.tensor([[math.exp(-1.0), math.e - 2.0]])
    for name in ("low_var_kl", "k3"):
        assert torch.allclose(kl_penalty(LOGPROB, REF, name), expected)


def test_k3_is_clamped_for_huge_log_ratios():
    # kl = -50 -> clamp -20 -> exp(-20) + 20 - 1 = 19.000000002 -> clamp 10
    out = kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "k3")
    assert torch.allclose(out, torch.tensor([10.0]))


def test_straight_through_variants_keep_the_base_value():
    for name in ("k1+", "k3+", "low_var_kl+", "k2+"):
        base = name[:-1]
        assert torch.allclose(kl_penalty(LOGPROB, REF, name), kl_penalty(LOGPROB, REF, base))


def test_k3_plus_has_the_gradient_of_k2():
    # d k2 / d logprob = logprob - ref = [1, -1]
    for name in ("k3+", "k1+", "low_var_kl+"):
        logprob = LOGPROB.clone().requires_grad_(True)
        kl_penalty(logprob, REF, name).sum().backward()
        assert torch.allclose(logprob.grad, torch.tensor([[1.0, -1.0]]))
    k2_logprob = LOGPROB.clone().requires_grad_(True)
    kl_penalty(k2_logprob, REF, "k2").sum().backward()
    assert torch.allclose(k2_logprob.grad, torch.tensor([[1.0, -1.0]]))


def test_kl_penalty_with_an_unknown_name_raises_and_lists_valid_names():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGPROB, REF, "k4")
    assert "k3+" in KL_PENALTY_NAMES


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_raises_beta_when_kl_is_above_target():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    # error = clip(9 / 6 - 1 = 0.5, -0.2, 0.2) = 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    assert ctrl.value == pytest.approx(0.1 * 1.00512)


def test_adaptive_controller_lowers_beta_when_kl_is_below_target():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=5.4, n_steps=100)
    # error = 5.4 / 6 - 1 = -0.1 (inside the clip); mult = 1 - 0.1 * 100 / 10000 = 0.999
    assert ctrl.value == pytest.approx(0.1 * 0.999)


def test_adaptive_controller_rejects_a_non_positive_horizon():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)


def test_controller_state_round_trips_through_json():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    state = json.loads(json.dumps(ctrl.state_dict()))
    fresh = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value
    fixed = FixedKLController(0.2)
    fixed.load_state_dict(json.loads(json.dumps({"value": 0.3})))
    assert fixed.state_dict() == {"value": 0.3}


def test_apply_kl_penalty_subtracts_beta_kl_on_real_tokens_only():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 9.0]])  # k1 = old - ref; 9.0 is padding
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rewards, stats = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # row 0: [0 - 0.05, 0 - 0.05, 1 - 0.05]; row 1: [0 - 0.1, 2 - 0.1, 0 (padding untouched)]
    expected = torch.tensor([[-0.05, -0.05, 0.95], [-0.1, 1.9, 0.0]])
    assert torch.allclose(rewards, expected)
    # per-sequence mean KL [0.5, 1.0] -> batch mean 0.75
    assert torch.allclose(stats["actor/reward_kl_penalty"], torch.tensor(0.75))
    assert torch.allclose(stats["actor/reward_kl_penalty_coeff"], torch.tensor(0.1))
    assert all(v.dim() == 0 for v in stats.values())


def test_importance_weighted_kl_by_hand():
    """Two responses sampled by mu. Sequence 0: log pi/mu = 0.5 + 0.2 = 0.7, log pi/ref = 0.1 + 0.3;
    sequence 1 (one token): log pi/mu = -0.7, log pi/ref = -0.2. Weights softmax(0.7, -0.7):
    w0 = 1 / (1 + e^-1.4), w1 = 1 - w0. KL = (w0 * 0.4 + w1 * -0.2) / (2 w0 + 1 w1)."""
    import math

    from klppo.algo import importance_weighted_kl

    pi = torch.tensor([[-1.0, -2.0], [-1.5, 0.0]])
    mu = pi - torch.tensor([[0.5, 0.2], [-0.7, 9.0]])  # 9.0 sits on padding and must not count
    ref = pi - torch.tensor([[0.1, 0.3], [-0.2, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    kl, ess = importance_weighted_kl(pi, ref, mu, mask)
    w0 = 1 / (1 + math.exp(-1.4))
    w1 = 1 - w0
    assert kl.item() == pytest.approx((w0 * 0.4 + w1 * -0.2) / (2 * w0 + w1), rel=1e-6)
    assert ess.item() == pytest.approx(1 / (w0 ** 2 + w1 ** 2), rel=1e-6)


def test_importance_weighted_kl_equals_the_plain_mean_when_mu_is_pi():
    from klppo.algo import importance_weighted_kl

    g = torch.Generator().manual_seed(0)
    pi, ref = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    kl, ess = importance_weighted_kl(pi, ref, pi, mask)
    assert kl.item() == pytest.approx(((pi - ref) * mask).sum().item() / mask.sum().item(), rel=1e-6)
    assert ess.item() == pytest.approx(5.0)
