"""Two ranks whose updates run their forwards first (``update_forwards_first``: one micro-batch a
rank) train as one process that scores pi_old and the values in forwards of their own: each
rank's forward outputs are gathered into the step's batch as the scoring forwards' are, the
KL-shaped rewards and advantages come from the same numbers on every rank, and each rank's
update takes its own graphs."""

from launch import assert_same_metrics, assert_same_weights, exact_ppo_overrides, run_ok

from klppo.monitoring.logger import read_metrics

# One mini-batch of 16 samples (8 per rank on 2 ranks) of at most 64 + 16 tokens: a budget of 640
# holds a rank's 8 in one micro-batch, but not one process's 16, which scores them first.
ONE_MICRO_BATCH_ON_TWO_RANKS = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 640,
    "critic.use_dynamic_bsz": "true", "critic.ppo_max_token_len_per_gpu": 640, "trainer.save_freq": -1,
}


def test_two_ranks_with_their_forwards_first_train_as_one_process_that_scores(tiny_model_dir, task_dir, tmp_path):
    for world, nproc in ((2, 2), (1, None)):
        run_ok(exact_ppo_overrides(tiny_model_dir, task_dir, tmp_path / f"world{world}", world, 3,
                                   **ONE_MICRO_BATCH_ON_TWO_RANKS), nproc)
    two, one = read_metrics(tmp_path / "world2"), read_metrics(tmp_path / "world1")
    scoring = ("timing_s/old_log_prob", "timing_s/values")
    assert not any(k in r for r in two for k in scoring) and all(k in r for r in one for k in scoring)
    assert_same_metrics(two, one)
    assert_same_weights(tmp_path / "world2" / "actor_hf", tmp_path / "world1" / "actor_hf")
