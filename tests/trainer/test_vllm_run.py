"""PPO runs with vLLM rollouts through the real entry point, one process each (one engine per
process): a run killed with SIGKILL resumes to the uninterrupted run's numbers, a LoRA actor's
merged weights reach the engine (a bf16 one's small updates too), and rollout correction acts
online on the engine's log-probs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klppo.checkpoint.state import LATEST_FILE
from klppo.monitoring.logger import read_metrics

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[2]
LORA_WORKER = Path(__file__).with_name("vllm_lora_worker.py")
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return (len(solution_str) % 7) / 7\n"


@pytest.fixture
def overrides(vllm_model_dir, task_dir, tmp_path):
    """overrides(run_dir, **changes): a 4-step online GAE run with vLLM rollouts, saving every step."""
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)  # varies with the response: the random model never answers right

    def make(run_dir: Path, **changes) -> list[str]:
        settings = {
            "data.train_files": task_dir / "train.parquet", "data.max_prompt_length": 64,
            "data.max_response_length": 12, "data.train_batch_size": 8,
            "actor_rollout_ref.model.path": vllm_model_dir, "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.optim.lr": 1e-3, "critic.optim.lr": 1e-3, "algorithm.use_kl_in_reward": "true",
            "custom_reward_function.path": reward, "trainer.total_training_steps": 4, "trainer.save_freq": 1,
            "trainer.logger": "[]", "trainer.device": "cpu", "trainer.default_local_dir": run_dir,
        }
        settings.update(changes)
        return [f"{k}={v}" for k, v in settings.items()]

    return make


def _start(overrides: list[str], stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}  # one thread: exact comparisons
    return subprocess.Popen([sys.executable, "-m", "klppo.commands.main_ppo", *overrides], stdout=stdout,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _run(overrides: list[str]) -> None:
    proc = _start(overrides)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def test_a_run_killed_with_sigkill_resumes_to_the_uninterrupted_runs_numbers(overrides, tmp_path):
    _run(overrides(tmp_path / "full"))
    victim = _start(overrides(tmp_path / "killed"))
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 2 for r in read_metrics(tmp_path / "killed")):
        assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read()[-4000:]
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    checkpoint = int((tmp_path / "killed" / LATEST_FILE).read_text())
    assert 1 <= checkpoint < 4
    resumed = _start(overrides(tmp_path / "killed"), stdout=subprocess.PIPE)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-6000:]
    assert f"at step {checkpoint}" in out  # it resumed, and from the kill's checkpoint
    full, killed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "killed")
    assert [_comparable(r) for r in killed] == [_comparable(r) for r in full]


def test_a_lora_actors_merged_weights_reach_the_engine(overrides, tmp_path):
    _run(overrides(tmp_path / "lora", **{"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
                                         "trainer.total_training_steps": 3, "trainer.save_freq": -1}))
    metrics = read_metrics(tmp_path / "lora")
    assert abs(metrics[-1]["actor/kl_to_ref"]) > 0  # the adapters did move the policy
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in metrics)  # and the engine samples from it


def test_rollout_correction_acts_online_on_the_engines_log_probs(overrides, tmp_path):
    corrected = {"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_rs": "token_k1",
                 "algorithm.rollout_correction.rollout_rs_threshold": "0.99_1.01",
                 "trainer.total_training_steps": 2, "trainer.save_freq": -1}
    _run(overrides(tmp_path / "is", **corrected))
    metrics = read_metrics(tmp_path / "is")
    assert all(abs(r["rollout_corr/rollout_is_mean"] - 1) < 1e-3 for r in metrics)  # engine == trainer here
    assert all(r["rollout_corr/rollout_rs_masked_fraction"] < 0.01 for r in metrics)
    _run(overrides(tmp_path / "bypass", **{"algorithm.rollout_correction.bypass_mode": "true",
                                           "trainer.total_training_steps": 2, "trainer.save_freq": -1}))
    bypass = read_metrics(tmp_path / "bypass")
    assert "timing_s/old_log_prob" not in bypass[0]  # pi_old = the engine's log-probs: no forward for them


def test_a_bf16_actor_on_a_group_of_one_samples_with_a_bf16_engine_that_scores_as_the_trainer(overrides, tmp_path):
    _run(overrides(tmp_path / "bf16", **{"actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
                                         "critic.model.fsdp_config.dtype": "bfloat16",
                                         "trainer.total_training_steps": 2, "trainer.save_freq": -1}))
    metrics = read_metrics(tmp_path / "bf16")
    assert len(metrics) == 2 and all(r["training/rollout_probs_diff_mean"] < 1e-3 for r in metrics)


def test_a_bf16_lora_actors_engine_samples_from_the_policy_its_small_updates_made(overrides, tmp_path):
    # 4 steps at lr 1e-5: each adapted weight moves far below bf16's resolution of it. Merged into a bf16
    # engine the update was lost (gap 2.4e-3, 8x the update's mean change of 3e-4); rollout.dtype auto
    # gives the LoRA actor an fp32 engine.
    run = tmp_path / "bf16_lora"
    _run(overrides(run, **{"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
                           "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16", "algorithm.adv_estimator": "grpo",
                           "actor_rollout_ref.actor.optim.lr": 1e-5, "trainer.save_freq": -1}))
    done = subprocess.run([sys.executable, str(LORA_WORKER), str(run), str(tmp_path / "out.json")], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["dtype"] == "torch.float32"
    assert result["change"] > 1e-4  # training moved the actor's log-probs of the sampled tokens
    assert result["gap"] < 1e-5  # and the engine samples from that actor, the moves included


def test_a_model_type_vllm_runs_through_transformers_trains_with_a_critic_and_samples_as_the_trainer_scores(
        overrides, vllm_olmo2_model_dir, tmp_path):
    # OLMo 2: vLLM compiles transformers' own Olmo2Model (its Transformers backend), and transformers has no
    # critic class for it (klppo.models.heads.model_class)
    _run(overrides(tmp_path / "olmo2", **{"actor_rollout_ref.model.path": vllm_olmo2_model_dir,
                                          "actor_rollout_ref.model.use_remove_padding": "true",
                                          "trainer.total_training_steps": 2, "trainer.save_freq": -1}))
    metrics = read_metrics(tmp_path / "olmo2")
    assert len(metrics) == 2 and all(r["training/rollout_probs_diff_max"] < 1e-4 for r in metrics)
    assert metrics[-1]["critic/vf_loss"] > 0
