"""The memory plan's run-start verdict is one verdict over the ranks.

Two gloo ranks where rank 1 alone has too little free memory for the plan (plan_check_worker.py):
both must stop with the same refusal, rank 0 printing it, instead of rank 1 stopping alone and
rank 0 printing that the run fits and going on into a collective rank 1 never joins.
"""

import json
import subprocess
import sys
from pathlib import Path

from launch import ROOT, _env

WORKER = Path(__file__).parent / "plan_check_worker.py"


def test_ranks_with_different_free_memory_reach_the_same_plan_verdict(tiny_model_dir, task_dir, tmp_path):
    settings = {
        "data.train_files": task_dir / "offline.parquet", "data.max_prompt_length": 64,
        "data.max_response_length": 8, "data.train_batch_size": 4, "actor_rollout_ref.model.path": tiny_model_dir,
        "actor_rollout_ref.rollout.name": "offline", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.nccl_timeout": 30,
        "algorithm.adv_estimator": "grpo", "trainer.plan_check": "error", "trainer.logger": "[]",
        "trainer.device": "cpu", "trainer.n_gpus_per_node": 2, "trainer.default_local_dir": tmp_path / "run",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(tmp_path), *[f"{k}={v}" for k, v in settings.items()]]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    missing = [r for r in (0, 1) if not (tmp_path / f"rank{r}.json").is_file()]
    assert not missing, f"rank(s) {missing} did not stop on their own (killed by torchrun): {done.stderr[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert done.returncode != 0
    assert [r["code"] for r in ranks] == [2, 2], (ranks, done.stderr[-4000:])
    assert ranks[0]["err"] == ranks[1]["err"] and "the memory plan's peak exceeds" in ranks[0]["err"]
    assert ": fits" not in ranks[0]["out"], ranks[0]["out"]
    assert not (tmp_path / "run").exists()
