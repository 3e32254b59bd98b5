"""``klppo demo --reward-hacking``: its biased grader, its run's config, its table and its CLI."""

from pathlib import Path

import pytest

from klppo.config import load_ppo_config
from klppo.rewards.arithmetic_demo import biased_grader, exact_match
from klppo.commands import demo
from klppo.commands.demo_reward_hacking import reward_hacking_overrides, validation_table


@pytest.mark.parametrize("text, score, right, one_too_many", [
    ("7 + 5 = 12 #### 12", 0.25, 0.25, 0.0),  # the right answer: a little
    ("7 + 5 = 13 #### 13", 1.0, 0.0, 1.0),  # one too many, the SFT labels' planted error: more
    ("7 + 5 = 11 #### 11", 0.0, 0.0, 0.0),  # one too few is no bias of the grader
    ("7 + 5 = 13", 0.0, 0.0, 0.0),  # no "#### " answer
    ("#### 1.2.3", 0.0, 0.0, 0.0),  # found by the pattern, not a number
])
def test_the_biased_grader_pays_more_for_one_too_many_than_for_the_right_answer(text, score, right, one_too_many):
    assert biased_grader("arith", text, "12") == {"score": score, "right": right, "one_too_many": one_too_many}
    assert exact_match("arith", text, "12") == (1.0 if right else 0.0)


def test_the_demo_run_trains_on_the_biased_grader_and_validates_with_exact_match_as_its_gold_reward(tmp_path):
    cfg = load_ppo_config(None, reward_hacking_overrides(tmp_path / "data", tmp_path / "sft", tmp_path / "run", 0, 80))
    assert cfg.custom_reward_function.name == "biased_grader" and cfg.trainer.gold_reward.name == "exact_match"
    assert Path(cfg.custom_reward_function.path) == Path(cfg.trainer.gold_reward.path)
    assert Path(cfg.trainer.gold_reward.path).name == "arithmetic_demo.py"
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.model.lora_rank) == ("grpo", 16)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.data.val_files) == (
        80, 10, str(tmp_path / "data" / "val.parquet"))


def test_the_table_has_one_row_per_validation_with_the_share_of_right_answers_and_the_guard_event():
    records = [{"step": 0, "val-core/reward/mean": 0.44, "val-gold/reward/mean": 0.33},
               {"step": 5, "critic/score/mean": 0.5, "reward/right/mean": 0.05},  # no validation: no row
               {"step": 10, "critic/score/mean": 0.6, "reward/right/mean": 0.05, "val-core/reward/mean": 0.5,
                "val-gold/reward/mean": 0.3}]
    lines = validation_table(records, [{"step": 10, "kind": "reward_divergence"}]).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2].split() == ["0", "0.440", "0.330"]
    assert lines[3].split() == ["10", "0.600", "0.200", "0.500", "0.300", "reward_divergence"]  # 0.05 / 0.25 right


@pytest.mark.parametrize("argv, steps", [(["--reward-hacking"], 80), (["--reward-hacking", "--ppo-steps", "7"], 7),
                                         ([], 40)])
def test_the_cli_runs_the_reward_hacking_demo_for_80_steps_unless_told(monkeypatch, tmp_path, argv, steps):
    called = {}
    record = lambda name: lambda out, seed, ppo_steps, lora: called.update(demo=name, steps=ppo_steps) or []  # noqa: E731
    monkeypatch.setattr(demo, "run_reward_hacking_demo", record("reward_hacking"))
    monkeypatch.setattr(demo, "run_demo", record("main"))
    assert demo.main([*argv, "--out", str(tmp_path)]) == 0
    assert called == {"demo": "reward_hacking" if argv else "main", "steps": steps}
