"""On two ranks, a run whose actor update gives pi_old (no old_log_prob forward) trains as the same
run with pi_old recomputed: each rank's share of the KL and of the log-probs is gathered as the
scoring forward's would be, and the guard decides alike on both ranks, before the optimiser step."""

import subprocess
import sys
from pathlib import Path

from launch import ROOT, _env, assert_same_metrics, assert_same_weights, run_ok

from klppo.monitoring.jsonl import EVENTS_FILE, read_jsonl
from klppo.monitoring.logger import read_metrics

WORKER = Path(__file__).parent / "on_policy_worker.py"


def _overrides(model: Path, task: Path, run_dir: Path) -> list[str]:
    settings = {
        "data.train_files": task / "train.parquet", "data.max_prompt_length": 64, "data.max_response_length": 8,
        "data.train_batch_size": 4, "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.actor.use_dynamic_bsz": "true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 128,
        "actor_rollout_ref.model.use_remove_padding": "true",
        "actor_rollout_ref.actor.use_kl_loss": "true", "algorithm.use_kl_in_reward": "false",
        "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 3, "trainer.save_freq": -1,
        "trainer.guard.rollback_kl": 1e-9, "trainer.guard.early_stop_kl": 10.0, "trainer.guard.max_rollbacks": 1,
        "trainer.logger": "[]", "trainer.device": "cpu", "trainer.n_gpus_per_node": 2,
        "trainer.default_local_dir": run_dir,
    }
    return [f"{k}={v}" for k, v in settings.items()]


def test_two_ranks_without_the_old_log_prob_forward_train_as_with_it(tiny_model_dir, task_dir, tmp_path):
    run_ok(_overrides(tiny_model_dir, task_dir, tmp_path / "measured"), 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           *_overrides(tiny_model_dir, task_dir, tmp_path / "recomputed")]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    measured, recomputed = read_metrics(tmp_path / "measured"), read_metrics(tmp_path / "recomputed")
    assert not any("timing_s/old_log_prob" in r for r in measured) and all("timing_s/old_log_prob" in r for r in recomputed)
    assert_same_metrics(measured, recomputed)
    events = [[(e["step"], e["kind"]) for e in read_jsonl(tmp_path / run / EVENTS_FILE)] for run in ("measured", "recomputed")]
    assert events[0] == events[1] == [(2, "rollback")]
    assert_same_weights(tmp_path / "measured" / "actor_hf", tmp_path / "recomputed" / "actor_hf")
