"""The optimal token baseline on two ranks: pi_old's sums of squared probabilities, measured on each
rank's rows, are gathered as its log-probs are, so the baselines and the training are one process's."""

from launch import assert_same_metrics, assert_same_weights, exact_ppo_overrides, run_ok

from klppo.monitoring.logger import read_metrics


def test_two_ranks_take_the_optimal_token_baseline_one_process_takes(tiny_model_dir, task_dir, tmp_path):
    otb = {"algorithm.adv_estimator": "optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared": "true"}
    run_ok(exact_ppo_overrides(tiny_model_dir, task_dir, tmp_path / "one", 1, 2, **otb), None)
    run_ok(exact_ppo_overrides(tiny_model_dir, task_dir, tmp_path / "two", 2, 2, **otb), 2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert all(r["variance_proxy/expected_w"] > 0 for r in one)
    assert_same_metrics(one, two)
    assert_same_weights(tmp_path / "one" / "actor_hf", tmp_path / "two" / "actor_hf")
