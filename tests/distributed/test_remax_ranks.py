"""ReMax on two ranks: each rank decodes the greedy baseline of its share of the prompts, and the
scores are gathered, so the baseline is the one a single process computes (the sampled responses
differ, one random stream per rank; the greedy ones cannot)."""

import math

from launch import run_ok

from klppo.monitoring.logger import read_metrics


LENGTH = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return len(solution_str) / 100\n"  # a score every greedy response has: its length


def test_two_ranks_take_the_greedy_baseline_one_process_takes(ppo_overrides, task_dir, tmp_path):
    (tmp_path / "length.py").write_text(LENGTH)

    def overrides(name: str, world: int) -> list[str]:
        return ppo_overrides(tmp_path / name, **{
            "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
            "algorithm.adv_estimator": "remax", "custom_reward_function.path": tmp_path / "length.py",
            "trainer.total_training_steps": 1, "trainer.n_gpus_per_node": world})

    run_ok(overrides("one", 1), None)
    run_ok(overrides("two", 2), 2)
    (one,), (two,) = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert math.isclose(one["critic/reward_baseline/mean"], two["critic/reward_baseline/mean"], abs_tol=1e-6)
    assert two["timing_s/gen_max"] > 0
    assert one["critic/reward_baseline/mean"] > 0
