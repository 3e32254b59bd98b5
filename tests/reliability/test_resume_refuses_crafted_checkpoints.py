"""Resuming through the real CLI never runs code from a checkpoint, and refuses one it cannot use.

A real 1-step run's checkpoint gets one file replaced by a crafted pickle whose unpickling would
create a marker file (trainer state, rank file, DCP metadata); ``python -m klppo.commands.main_ppo``
resuming from it exits 2 with one message naming the file, prints no traceback, and the marker
never appears. The damaged and foreign targets below are refused the same way, and a refused
resume leaves the run folder byte-identical.
"""

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
STEP_1 = "global_step_1"


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _cli(module: str, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, *overrides], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def _ppo_overrides(run_dir: Path, tiny_model_dir: Path, task_dir: Path, steps: int, *extra: str) -> list[str]:
    return [f"data.train_files={task_dir / 'offline.parquet'}", "data.max_prompt_length=64",
            "data.max_response_length=16", "data.train_batch_size=8", f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.rollout.name=offline", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1", "trainer.logger=[]", "trainer.device=cpu", f"trainer.default_local_dir={run_dir}",
            *extra]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, task_dir, tmp_path_factory):
    """A finished 1-step PPO run and a 1-step SFT run, both with a checkpoint at step 1."""
    out = tmp_path_factory.mktemp("runs")
    done = _cli("klppo.commands.main_ppo", _ppo_overrides(out / "ppo", tiny_model_dir, task_dir, 1))
    assert done.returncode == 0, done.stderr[-3000:]
    done = _cli("klppo.commands.main_sft", [
        f"data.train_files={task_dir / 'sft.parquet'}", "data.max_length=96", "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8", f"model.partial_pretrain={tiny_model_dir}", "trainer.total_training_steps=1",
        "trainer.save_freq=1", "trainer.logger=[]", "trainer.device=cpu", f"trainer.default_local_dir={out / 'sft'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture
def resume(runs, tiny_model_dir, task_dir, tmp_path):
    """resume(*overrides) -> the CLI's result for a 2-step run continuing a copy of the 1-step PPO run
    (tmp_path/ppo); the longer run means a config.yaml written before the resume check would differ."""
    shutil.copytree(runs / "ppo", tmp_path / "ppo")

    def run(*extra: str) -> subprocess.CompletedProcess:
        return _cli("klppo.commands.main_ppo", _ppo_overrides(tmp_path / "ppo", tiny_model_dir, task_dir, 2, *extra))

    return run


def snapshot(folder: Path) -> dict:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def craft(run_dir: Path, target: str, marker: Path) -> Path:
    """Replace one file of the step-1 checkpoint with a payload; returns the file."""
    folder = run_dir / STEP_1
    if target == "trainer_state":
        path = folder / "trainer_state.pt"
        state = torch.load(path, weights_only=True)
        torch.save({**state, "kl_ctrl": Payload(marker)}, path)
    elif target == "rank_file":
        path = folder / "rank_0.pt"
        torch.save({"rng": Payload(marker)}, path)
    else:
        path = folder / "weights" / ".metadata"
        path.write_bytes(pickle.dumps(Payload(marker)))
    return path


def assert_refused(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.strip()]
    assert error and error[0].startswith("error: ") and len(error) <= 3, done.stderr[-3000:]
    for text in expected:
        assert text in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("target", ["trainer_state", "rank_file", "dcp_metadata"])
def test_resuming_from_a_crafted_checkpoint_file_refuses_it_runs_no_payload_and_changes_nothing(resume, tmp_path,
                                                                                                  target):
    marker = tmp_path / "payload_ran"
    crafted = craft(tmp_path / "ppo", target, marker)
    before = snapshot(tmp_path / "ppo")
    assert_refused(resume(), "not a klppo checkpoint or was modified", crafted.name)
    assert not marker.exists()
    assert snapshot(tmp_path / "ppo") == before  # the run folder byte-identical


def _junk_folder(run_dir: Path) -> list[str]:
    junk = run_dir.parent / "junk"
    junk.mkdir()
    (junk / "trainer_state.pt").write_bytes(os.urandom(500))
    (junk / "notes.txt").write_text("not a checkpoint")
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={junk}"]


def _truncated_state(run_dir: Path) -> list[str]:
    path = run_dir / STEP_1 / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:200])
    return []


def _truncated_shard(run_dir: Path) -> list[str]:
    shard = next((run_dir / STEP_1 / "weights").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return []


def _sft_checkpoint(run_dir: Path) -> list[str]:
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={run_dir.parent / 'sft' / STEP_1}"]


def _bad_pointer(run_dir: Path) -> list[str]:
    (run_dir / "latest_checkpointed_iteration.txt").write_text("one")
    return []


DAMAGED = {  # name -> (break the copied run, returning extra overrides; text the message must hold)
    "junk_folder": (_junk_folder, "trainer_state.pt"),
    "truncated_trainer_state": (_truncated_state, "trainer_state.pt"),
    "truncated_shard": (_truncated_shard, "is truncated"),
    "sft_checkpoint_given_to_ppo": (_sft_checkpoint, "not of a PPO run"),
    "non_numeric_pointer": (_bad_pointer, "not a step number"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_resuming_from_a_damaged_or_foreign_checkpoint_is_refused_before_anything_is_written(
        resume, runs, tmp_path, case):
    shutil.copytree(runs / "sft", tmp_path / "sft")
    damage, expected = DAMAGED[case]
    extra = damage(tmp_path / "ppo")
    before = snapshot(tmp_path)
    assert_refused(resume(*extra), expected)
    assert snapshot(tmp_path) == before
