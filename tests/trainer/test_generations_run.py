"""A PPO run writes its responses as text where verl's trainer.rollout_data_dir and
trainer.validation_data_dir say, and shows trainer.log_val_generations of validation's on the console."""

import json

import pytest
from klppo.commands.main_ppo import run_ppo
from klppo.monitoring.generations import GENERATIONS_KEY
from klppo.monitoring.logger import read_metrics


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_online_ppo_writes_each_steps_and_each_validations_responses(ppo_overrides, task_dir, tmp_path):
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    printed = []
    records = run_ppo(None, ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
        "actor_rollout_ref.rollout.name": "hf", "trainer.test_freq": 1, "trainer.logger": "[console]",
        "trainer.rollout_data_dir": rollouts, "trainer.validation_data_dir": validations,
        "trainer.log_val_generations": 3}), print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
    by_step = {r["step"]: r for r in records}
    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in validations.iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    for step in (1, 2):
        lines = _lines(rollouts / f"{step}.jsonl")
        assert len(lines) == 8 * 2  # train_batch_size prompts x rollout.n
        assert {tuple(line)[:5] for line in lines} == {("input", "output", "gts", "score", "step")}
        assert {line["step"] for line in lines} == {step}
        assert sum(line["score"] for line in lines) / len(lines) == pytest.approx(by_step[step]["critic/score/mean"])
        assert all(line["input"].startswith("user\n") and line["input"].endswith("assistant\n") for line in lines)
    for step in (0, 1, 2):
        lines = _lines(validations / f"{step}.jsonl")
        assert len(lines) == 8  # the validation prompts, val_kwargs.n = 1 each
        key = "val-core/openai/gsm8k/reward/mean@1"
        assert sum(line["score"] for line in lines) / len(lines) == pytest.approx(by_step[step][key])
        assert [line["gts"] for line in lines] == [line["gts"] for line in _lines(validations / "0.jsonl")]
    shown = [text for text in printed if text.startswith("validation samples at step ")]
    assert [text.splitlines()[0] for text in shown] == [f"validation samples at step {s}:" for s in (0, 1, 2)]
    assert all(sum(line.startswith("[") for line in text.splitlines()) == 3 for text in shown)
    assert all(GENERATIONS_KEY not in r for r in records + read_metrics(tmp_path / "run"))


def test_offline_ppo_writes_the_recorded_responses_it_trains_on(ppo_overrides, task_dir, tmp_path):
    import pyarrow.parquet as pq

    rollouts = tmp_path / "rollouts"
    run_ppo(None, ppo_overrides(**{"trainer.rollout_data_dir": rollouts, "trainer.total_training_steps": 1}),
            print_fn=lambda *a, **k: None)
    recorded = {r for row in pq.read_table(task_dir / "offline.parquet").to_pylist() for r in row["responses"]}
    lines = _lines(rollouts / "1.jsonl")
    assert len(lines) == 8 * 2 and all(line["output"] in recorded for line in lines)
