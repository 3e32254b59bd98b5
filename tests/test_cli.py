"""The ``klppo`` command as users meet it: one-line errors, exit status, nothing overwritten."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def klppo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "klppo.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_validate_config_prints_the_resolved_config(tmp_path):
    config = tmp_path / "x.yaml"
    config.write_text("data:\n  train_files: t.parquet\nactor_rollout_ref:\n  model:\n    path: m\n")
    result = klppo("validate-config", config, "actor_rollout_ref.actor.clip_ratio=0.3")
    assert result.returncode == 0, result.stderr
    assert "clip_ratio_low: 0.3" in result.stdout and "train_files: t.parquet" in result.stdout


def test_validate_config_names_a_misspelled_key_and_its_fix(tmp_path):
    config = tmp_path / "x.yaml"
    config.write_text("actor_rollout_ref:\n  actor:\n    clip_ration: 0.2\n")
    result = klppo("validate-config", config)
    assert result.returncode == 2
    assert "actor_rollout_ref.actor.clip_ration" in result.stderr
    assert "actor_rollout_ref.actor.clip_ratio" in result.stderr
    assert "Traceback" not in result.stderr


def _bad_parquet_cases(tmp_path):
    missing = tmp_path / "nope.parquet"
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    plain_prompt = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "openai/gsm8k", "prompt": "",
                                          "reward_model": {"style": "rule", "ground_truth": "1"}}]), plain_prompt)
    no_prompt = tmp_path / "noprompt.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "openai/gsm8k", "question": "hi"}]), no_prompt)
    return [(missing, "nope.parquet"), (garbage, "garbage.parquet"), (plain_prompt, "row 0"),
            (no_prompt, "'prompt'")]


def test_bad_parquet_files_give_one_line_errors_naming_the_place(tmp_path, tiny_model_dir):
    for path, place in _bad_parquet_cases(tmp_path):
        result = klppo("ppo", f"data.train_files={path}", f"actor_rollout_ref.model.path={tiny_model_dir}",
                       "actor_rollout_ref.rollout.name=hf", f"trainer.default_local_dir={tmp_path / 'run'}",
                       "trainer.device=cpu")
        assert result.returncode == 2, (path, result.stderr)
        assert "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and place in lines[0], lines


def test_missing_model_folder_is_named_with_its_config_key(tmp_path, task_dir):
    result = klppo("ppo", f"data.train_files={task_dir / 'train.parquet'}",
                   f"actor_rollout_ref.model.path={tmp_path / 'no_model'}", "actor_rollout_ref.rollout.name=hf",
                   f"trainer.default_local_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "actor_rollout_ref.model.path" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["ppo", "sft", "demo"])
def test_every_sub_command_has_help(command):
    result = klppo(command, "--help")
    assert result.returncode == 0 and "usage" in result.stdout


def test_unknown_command_exits_non_zero():
    result = klppo("train")
    assert result.returncode == 2 and "unknown command" in result.stderr
