"""The optimal token baseline in a run (verl's algorithm.adv_estimator=optimal_token_baseline):
pi_old's forward measures each token's sum of squared probabilities, the advantages are the
returns less the per-position baseline of those numbers, and the variance proxies are logged."""

import pytest

from klppo.algo import compute_optimal_token_baseline_advantage
from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.config.batch_sizes import on_policy_update, update_gives_old_log_prob
from klppo.errors import UserError

PROXIES = ("variance_proxy/proxy1_signal_strength", "variance_proxy/proxy2_total_power",
           "variance_proxy/proxy3_pure_noise", "variance_proxy/expected_a_squared", "variance_proxy/expected_w")


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_a_run_trains_on_the_optimal_token_baseline_of_pi_olds_measured_distributions(ppo_overrides, tmp_path,
                                                                                        monkeypatch):
    seen = []
    import klppo.algo.advantages as advantages

    def spy(rewards, mask, index, old_log_prob, sum_pi_squared, weights, **kwargs):
        result = compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_prob, sum_pi_squared,
                                                          weights, **kwargs)
        seen.append((mask, old_log_prob, sum_pi_squared, weights, kwargs, result))
        return result

    monkeypatch.setattr(advantages, "compute_optimal_token_baseline_advantage", spy)
    records = run_ppo(None, ppo_overrides(tmp_path / "otb", **{
        "algorithm.adv_estimator": "optimal_token_baseline", "algorithm.use_kl_in_reward": "false",
        }), print_fn=quiet)
    assert len(seen) == 2
    for mask, old_log_prob, squares, weights, kwargs, (adv, _) in seen:
        real = mask.bool()
        # a distribution's sum of squared probabilities lies in [1/V, 1], and is at least pi(a)^2
        assert squares[real].min() > 0 and squares[real].max() <= 1.0 + 1e-6
        assert (squares[real] >= old_log_prob[real].exp() ** 2 - 1e-6).all()
        assert (squares[~real] == 0).all() and weights is None and kwargs["handle_zero_tail"] is False
        assert adv.abs().sum() > 0
    for record in records:
        assert all(k in record for k in PROXIES) and record["variance_proxy/expected_w"] > 0
        # proxy 1 is the actor's squared gradient norm
        assert record["variance_proxy/proxy1_signal_strength"] == pytest.approx(record["actor/grad_norm"] ** 2)
        assert "timing_s/old_log_prob" in record  # pi_old has its own forward


def test_the_sum_of_squared_probabilities_keeps_pi_olds_forward_and_bypass_mode_is_refused():
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.name=hf"]
    assert on_policy_update(load_ppo_config(None, base))  # one step, HF generate: the update gives pi_old
    for extra in ("algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"):
        cfg = load_ppo_config(None, [*base, extra])
        assert not on_policy_update(cfg) and not update_gives_old_log_prob(cfg, 1)
    with pytest.raises(UserError, match="bypass_mode = true skips"):
        load_ppo_config(None, [*base, "algorithm.adv_estimator=optimal_token_baseline",
                               "actor_rollout_ref.rollout.name=offline", "algorithm.rollout_correction.bypass_mode=true"])
