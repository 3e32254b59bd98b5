"""Training runs learn: a tiny run's reward (or validation preference agreement) at its end is far
above its start, by a margin many times the seed-to-seed noise.

The online task is a bandit a random-initialised model can climb in seconds: the reward is the
share of digits in an 8-token response (a random policy writes about 2% digits). Measured on
this project's 2-core machine with data.seed 0-3 (2026-12-01): the mean score of the last 3 of
10 steps exceeds that of the first 3 by 0.52-0.74 (PPO with a critic) and 0.47-0.64 (GRPO), while
the first 3 steps' mean varies by under 0.01 between seeds and the last 3 steps' by about 0.1;
the tests ask for 0.3. Offline, from rankings of four responses that differ in one word (great >
good > fine > bad), held-out preference agreement goes from 0.33 to 0.83 in 8 steps for every
seed tried; the test asks for a rise of 0.3.
"""

from statistics import mean

import pytest

from klppo.commands.main_ppo import run_ppo

DIGITS = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture
def digit_reward(tmp_path):
    path = tmp_path / "digits.py"
    path.write_text(DIGITS)
    return path


def _online(ppo_overrides, task_dir, digit_reward, **changes) -> list[dict]:
    settings = {
        "data.train_files": task_dir / "train.parquet", "data.max_response_length": 8, "data.train_batch_size": 16,
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.optim.lr": 2e-2, "critic.optim.lr": 1e-3, "algorithm.use_kl_in_reward": "false",
        "custom_reward_function.path": digit_reward, "trainer.total_training_steps": 10, "data.seed": 0,
    }
    settings.update(changes)
    return run_ppo(None, ppo_overrides(**settings), print_fn=quiet)


def _rise(records: list[dict], key: str = "critic/score/mean") -> float:
    scores = [r[key] for r in records if key in r]
    return mean(scores[-3:]) - mean(scores[:3])


def test_ppo_with_a_critic_raises_its_reward(ppo_overrides, task_dir, digit_reward):
    records = _online(ppo_overrides, task_dir, digit_reward, **{"algorithm.adv_estimator": "gae"})
    assert _rise(records) > 0.3, [round(r["critic/score/mean"], 3) for r in records]


def test_grpo_raises_its_reward(ppo_overrides, task_dir, digit_reward):
    records = _online(ppo_overrides, task_dir, digit_reward, **{"algorithm.adv_estimator": "grpo",
                                                                "actor_rollout_ref.rollout.n": 4})
    assert _rise(records) > 0.3, [round(r["critic/score/mean"], 3) for r in records]


def test_offline_ppo_from_rankings_raises_held_out_preference_agreement(ppo_overrides, word_ranking_file, tmp_path):
    records = run_ppo(None, ppo_overrides(**{
        "data.train_files": word_ranking_file(tmp_path / "train.parquet", 64, 0),
        "data.val_files": word_ranking_file(tmp_path / "val.parquet", 32, 100),
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.optim.lr": 1e-2,
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "false",
        "trainer.total_training_steps": 8, "trainer.test_freq": 8,
    }), print_fn=quiet)
    agreement = [r["val-core/preference_agreement"] for r in records if "val-core/preference_agreement" in r]
    assert len(agreement) == 2 and agreement[1] - agreement[0] > 0.3, agreement
