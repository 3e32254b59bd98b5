"""Every rank takes the same decision when the numbers a rank measures for itself differ.

A 2-rank PPO run (``torchrun``, CPU) where rank 1 alone sees a higher KL estimate, a NaN score,
a NaN loss, a collapsed entropy or a higher reward KL (guard_agreement_worker.py): the guard's
rollbacks, skips and warnings and the adaptive KL coefficient must be the same on both ranks,
and the run must end. A rank that rolled back or skipped alone would wait in another collective
than the others (a hang until the timeout), and a coefficient of its own would give it other
rewards.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT, _env

WORKER = Path(__file__).parent / "guard_agreement_worker.py"

# rank 1's changes per step (see the worker), the overrides of the run, and what both ranks must decide.
CASES = {
    "offline": (
        {"1": ["kl+0.05"], "2": ["nan_scores"], "3": ["nan_loss", "entropy=-100"], "4": ["kl+1.0"]},
        {"trainer.total_training_steps": 4},
        [("check_finite", 2, "skip"), ("check_finite", 3, "skip"), ("check_kl", 4, "rollback")],
    ),
    "online": (
        {"1": ["reward_kl+0.5"], "2": ["reward_kl+0.5"]},
        {"trainer.total_training_steps": 2, "actor_rollout_ref.rollout.name": "hf",
         "data.train_files": "train.parquet"},
        [],
    ),
}


def _overrides(model: Path, task: Path, run_dir: Path, changes: dict) -> list[str]:
    settings = {
        "data.train_files": task / "offline.parquet", "data.max_prompt_length": 64, "data.max_response_length": 8,
        "data.train_batch_size": 4, "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.rollout.name": "offline", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.nccl_timeout": 60, "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.probe_prompts": 2, "trainer.save_freq": -1, "trainer.logger": "[]",
        "trainer.device": "cpu", "trainer.n_gpus_per_node": 2, "trainer.default_local_dir": run_dir,
    }
    settings.update(changes)
    if settings["data.train_files"] == "train.parquet":
        settings["data.train_files"] = task / "train.parquet"
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_measure_different_numbers_take_the_same_decisions(case, tiny_model_dir, task_dir, tmp_path):
    schedule, changes, expected = CASES[case]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(tmp_path), json.dumps(schedule), *_overrides(tiny_model_dir, task_dir, tmp_path / "run", changes)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rank0, rank1 = (json.loads((tmp_path / f"decisions_rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert [d[0] for d in rank0 if d[0] == "kl_coef"] == ["kl_coef"] * changes["trainer.total_training_steps"]
    taken = {(name, step, verdict) for name, step, verdict, *_ in rank0 if name != "kl_coef"}
    assert set(expected) <= taken, rank0
    if case == "offline":  # rank 1's collapsed entropy warned both ranks
        assert any(d[0] == "check_health" and d[1] == 3 and "warn_entropy" in d[4] for d in rank0), rank0
