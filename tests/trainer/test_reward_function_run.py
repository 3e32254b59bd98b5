"""verl's reward function forms in a run: an async def function (a judge it waits on), awaited
for a step's responses together, and custom_reward_function.reward_kwargs passed on every call."""

import pytest

from klppo.commands.main_ppo import run_ppo

REWARDS = '''
import asyncio


async def judge(data_source, solution_str, ground_truth, extra_info=None, base=0.0, per_char=0.0):
    await asyncio.sleep(0)  # waits on something, as a call to a judge model would
    return {"score": base + per_char * len(solution_str), "judged": 1.0}


def gold(data_source, solution_str, ground_truth, extra_info=None, value=0.0):
    return value
'''


def test_an_async_reward_function_with_reward_kwargs_scores_every_step_and_validation(ppo_overrides, task_dir,
                                                                                      tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    records = run_ppo(None, ppo_overrides(**{
        "data.val_files": task_dir / "val.parquet", "trainer.test_freq": 1,
        "custom_reward_function.path": rewards, "custom_reward_function.name": "judge",
        "+custom_reward_function.reward_kwargs.base": 0.25,
        "trainer.gold_reward.path": rewards, "trainer.gold_reward.name": "gold",
        "+trainer.gold_reward.reward_kwargs.value": 0.75}), print_fn=lambda *a, **k: None)
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert record["val-core/openai/gsm8k/reward/mean@1"] == pytest.approx(0.25)  # base, per_char left at 0
        assert record["val-gold/reward/mean"] == pytest.approx(0.75)
    for record in records[1:]:
        assert record["critic/score/mean"] == pytest.approx(0.25) and record["reward/judged/mean"] == 1.0


def test_verl_0_9_1_s_spelling_of_reward_kwargs_and_a_per_character_reward(ppo_overrides, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    (last,) = run_ppo(None, ppo_overrides(**{
        "reward.custom_reward_function.path": rewards, "reward.custom_reward_function.name": "judge",
        "+reward.custom_reward_function.reward_kwargs.per_char": 1.0, "trainer.total_training_steps": 1}),
        print_fn=lambda *a, **k: None)[-1:]
    # the score is the response's length in characters: at least one per response (the recorded answers)
    assert last["critic/score/mean"] >= 1.0 and last["critic/score/max"] > last["critic/score/min"]
