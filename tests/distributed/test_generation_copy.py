"""Sharded ranks generate with a whole copy of the actor gathered once: the same samples as the
sharded actor gives, and no collective while decoding; a kept copy takes the actor's new weights in
place, as a new copy would have them."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from launch import assert_same_metrics, run_ok
from klppo.monitoring.logger import read_metrics

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def test_the_gathered_copy_samples_what_the_sharded_actor_samples_without_collectives(tiny_model_dir, task_dir,
                                                                                      tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "generation_worker.py"), str(tiny_model_dir), str(task_dir), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in torch.load(tmp_path / "generation.pt", weights_only=False):
        (sharded_ids, sharded_comms), (gathered_ids, gathered_comms) = rank["sharded"], rank["gathered"]
        assert gathered_ids == sharded_ids
        assert sharded_comms > 0 and gathered_comms == 0
        assert rank["refreshed"] == {"same_addresses": True, "equal": True, "moved": True}


def test_two_rank_ppo_trains_the_same_with_either_generation_weights(ppo_overrides, task_dir, tmp_path):
    def overrides(name: str, weights: str) -> list[str]:
        return ppo_overrides(tmp_path / name, **{
            "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
            "actor_rollout_ref.rollout.generation_weights": weights, "trainer.total_training_steps": 2,
            "trainer.n_gpus_per_node": 2})

    run_ok(overrides("sharded", "sharded"), 2)
    run_ok(overrides("gathered", "gathered"), 2)
    assert_same_metrics(read_metrics(tmp_path / "sharded"), read_metrics(tmp_path / "gathered"))
