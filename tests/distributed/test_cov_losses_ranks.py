"""Clip-Cov on two ranks: the ranks gather each mini-batch, pick its tokens as one process picks
them (the covariance's means, the candidates and the seeded random pick span the mini-batch), and
train exactly as one process does, with token-budget micro-batches and balanced ranks."""

from launch import assert_same_metrics, assert_same_weights, exact_ppo_overrides, run_ok

from klppo.monitoring.logger import read_metrics

CLIP_COV = {"actor_rollout_ref.actor.policy_loss.loss_mode": "clip_cov",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": 0.2,
            "actor_rollout_ref.actor.policy_loss.clip_cov_lb": 0.0,
            "actor_rollout_ref.actor.policy_loss.clip_cov_ub": 100.0}


def test_two_ranks_cut_the_tokens_one_process_cuts_and_train_the_same(tiny_model_dir, task_dir, tmp_path):
    run_ok(exact_ppo_overrides(tiny_model_dir, task_dir, tmp_path / "one", 1, 2, **CLIP_COV), None)
    run_ok(exact_ppo_overrides(tiny_model_dir, task_dir, tmp_path / "two", 2, 2, **CLIP_COV), 2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert all(r["actor/pg_clipfrac"] > 0.1 for r in one)  # tokens were cut
    assert_same_metrics(one, two)
    assert_same_weights(tmp_path / "one" / "actor_hf", tmp_path / "two" / "actor_hf")

