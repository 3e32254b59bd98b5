"""End-to-end PPO runs of the tiny model, as users meet them: config in, metrics and checkpoints out."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.checkpoint.state import LATEST_FILE
from klppo.errors import UserError
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""

VERL_METRICS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff", "critic/vf_loss", "critic/vf_explained_var", "critic/score/mean",
    "critic/rewards/mean", "critic/advantages/mean", "response_length/mean", "timing_s/gen",
    "timing_s/update_actor", "perf/throughput",
]


def _weights(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_offline_run_changes_the_actor_and_logs_verl_metrics(ppo_overrides, tiny_model_dir, tmp_path):
    records = run_ppo(None, ppo_overrides(), print_fn=quiet)
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    for name in VERL_METRICS:
        assert name in records[-1], name
    assert _changed(_weights(tiny_model_dir), _weights(run / "actor_hf"))
    assert (run / LATEST_FILE).read_text() == "2"
    first, second = records
    assert first["perf/peak_memory_gb/setup"] > 0 and "perf/peak_memory_gb/setup" not in second
    for phase in ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step"):
        assert 0 < second[f"perf/peak_memory_gb/{phase}"] <= second["perf/peak_memory_gb/step"], phase
    assert second["perf/max_memory_allocated_gb"] == second["perf/peak_memory_gb/step"]


def test_online_hf_run_generates_and_changes_the_actor(ppo_overrides, task_dir, tiny_model_dir, tmp_path):
    overrides = ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet",
        "data.val_files": task_dir / "val.parquet",
        "actor_rollout_ref.rollout.name": "hf",
        "trainer.test_freq": 1,
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    assert records[0]["step"] == 0 and "val-core/openai/gsm8k/reward/mean@1" in records[0]
    assert records[-1]["response_length/mean"] > 0
    assert "val-core/openai/gsm8k/reward/mean@1" in records[-1]
    assert 0.0 <= records[-1]["val-aux/bleu"] <= 1.0 and 0.0 <= records[-1]["val-aux/rougeL"] <= 1.0
    assert _changed(_weights(tiny_model_dir), _weights(tmp_path / "run" / "actor_hf"))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                       "grpo_vectorized", "rloo_vectorized", "opo", "grpo_passk", "gpg"])
def test_critic_free_estimators_train_without_a_critic(ppo_overrides, estimator):
    overrides = ppo_overrides(**{
        "algorithm.adv_estimator": estimator,
        "algorithm.use_kl_in_reward": "false",
        "actor_rollout_ref.actor.use_kl_loss": "true",
        "trainer.total_training_steps": 1,
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    assert "actor/kl_loss" in records[-1]
    assert not any(k.startswith("critic/vf_") for k in records[-1])


def test_grpo_on_one_response_per_prompt_trains_on_the_raw_scores_as_verl(ppo_overrides):
    # verl's rollout-correction and LoRA examples: each response its own group, baseline 0, advantage = score
    records = run_ppo(None, ppo_overrides(**{"algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 1,
                                             "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                                             "trainer.total_training_steps": 1}), print_fn=quiet)
    first = records[-1]
    assert first["critic/advantages/mean"] == pytest.approx(first["critic/score/mean"] / (1 + 1e-6), abs=1e-5)
    assert first["critic/score/mean"] != 0


def test_adaptive_kl_controller_moves_the_coefficient(ppo_overrides, task_dir):
    """Online, as verl: the controller reads the batch's KL penalty (the responses are the policy's)."""
    overrides = ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
        "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.1,
        "algorithm.kl_ctrl.target_kl": 1e-6, "algorithm.kl_ctrl.horizon": 10,
        "trainer.total_training_steps": 3,
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in records]
    # Each step logs the beta it used, then updates it with n_steps = 16 responses, horizon 10:
    # step 1: KL = 0 (actor == reference), error clipped to -0.2 -> beta = 0.1 * (1 - 0.2 * 1.6) = 0.068;
    # step 2: KL > 0 far above 1e-6, error clipped to +0.2 -> beta = 0.068 * (1 + 0.2 * 1.6) = 0.08976.
    assert records[0]["actor/reward_kl_penalty"] == 0.0 and records[1]["actor/reward_kl_penalty"] > 1e-5
    assert coefs == pytest.approx([0.1, 0.068, 0.08976])


def test_offline_the_adaptive_controller_reads_the_sampled_kl(ppo_overrides):
    overrides = ppo_overrides(**{
        "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.1, "algorithm.kl_ctrl.target_kl": 0.5,
        "algorithm.kl_ctrl.horizon": 10, "trainer.total_training_steps": 3,
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in records]
    for before, after, record in zip(coefs, coefs[1:], records):
        error = min(max(record["actor/kl_to_ref_sampled"] / 0.5 - 1, -0.2), 0.2)
        assert after == pytest.approx(before * (1 + error * 16 / 10))


def _comparable(record: dict) -> dict:
    """Metrics that must repeat exactly: everything but wall-clock timings and throughput."""
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


@pytest.mark.parametrize("rollout", ["offline", "hf"])
def test_resumed_run_repeats_the_uninterrupted_run_exactly(ppo_overrides, task_dir, tmp_path, crash_after_logging,
                                                          rollout):
    changes = {"trainer.total_training_steps": 4, "trainer.save_freq": 2, "actor_rollout_ref.rollout.name": rollout,
               "algorithm.kl_ctrl.type": "adaptive"}
    if rollout == "hf":
        changes["data.train_files"] = task_dir / "train.parquet"
    full = run_ppo(None, ppo_overrides(tmp_path / "full", **changes), print_fn=quiet)

    # Crash right after step 3 is logged (its checkpoint is step 2), as a killed process would.
    with crash_after_logging(3):
        run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    resumed = run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)

    assert [r["step"] for r in resumed] == [3, 4]
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in full[2:]]
    on_disk = read_metrics(tmp_path / "crashed")
    assert [r["step"] for r in on_disk] == [1, 2, 3, 4]  # step 3 of the crashed run is not duplicated


def test_exported_actor_loads_in_transformers_with_the_trained_logits(ppo_overrides, tmp_path):
    from klppo.run.build import build_ppo
    from klppo.config import load_ppo_config
    from klppo.trainer.ppo_trainer import PPOTrainer

    parts = build_ppo(load_ppo_config(None, ppo_overrides(**{"trainer.total_training_steps": 1})), log=quiet)
    PPOTrainer(parts, print_fn=quiet).fit()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, parts.actor(ids).logits, atol=1e-6)


def test_cli_runs_a_yaml_config_on_a_parquet_file(ppo_overrides, tmp_path):
    overrides = ppo_overrides(**{"trainer.total_training_steps": 1, "trainer.logger": "[console]"})
    config = tmp_path / "x.yaml"
    config.write_text("algorithm:\n  adv_estimator: gae\n  kl_ctrl:\n    kl_coef: 0.01\n")
    result = subprocess.run(
        [sys.executable, "-m", "klppo.commands.main_ppo", "--config", str(config), *overrides],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "step 1/1" in result.stdout
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and record["actor/reward_kl_penalty_coeff"] == pytest.approx(0.01)


@pytest.mark.parametrize("mode", ["auto", "disable"])
def test_looking_for_a_checkpoint_to_resume_leaves_a_fresh_runs_optimiser_untouched(ppo_overrides, mode):
    """Materialising the optimiser's state for the checkpoint check would make AdamW count a step."""
    from klppo.config import load_ppo_config
    from klppo.run.build import build_ppo
    from klppo.run.state import resume_target

    parts = build_ppo(load_ppo_config(None, ppo_overrides(**{"trainer.resume_mode": mode})), log=quiet)
    assert resume_target(parts) is None
    assert not parts.actor_optimizer.state and not parts.critic_optimizer.state


def test_critic_warmup_steps_train_the_critic_only(ppo_overrides, tmp_path, tiny_model_dir):
    records = run_ppo(None, ppo_overrides(**{"trainer.critic_warmup": 2, "trainer.total_training_steps": 2}),
                      print_fn=quiet)
    assert all("critic/vf_loss" in r and "actor/pg_loss" not in r for r in records)
    assert not _changed(_weights(tiny_model_dir), _weights(tmp_path / "run" / "actor_hf"))  # the actor never moved
    records = run_ppo(None, ppo_overrides(tmp_path / "run3", **{"trainer.critic_warmup": 2,
                                                                "trainer.total_training_steps": 3}), print_fn=quiet)
    assert ["actor/pg_loss" in r for r in records] == [False, False, True]


def test_val_only_validates_the_model_once_and_writes_no_checkpoint_or_export(ppo_overrides, task_dir, tmp_path):
    overrides = ppo_overrides(**{"data.val_files": task_dir / "val.parquet", "trainer.val_only": "true",
                                 "trainer.val_before_train": "false"})
    records = run_ppo(None, overrides, print_fn=quiet)
    assert [r["step"] for r in records] == [0] and "val-core/openai/gsm8k/reward/mean@1" in records[0]
    assert read_metrics(tmp_path / "run") == records
    assert not (tmp_path / "run" / "actor_hf").exists() and not list((tmp_path / "run").glob("global_step_*"))


def test_val_only_without_validation_files_is_refused(ppo_overrides):
    with pytest.raises(UserError, match="trainer.val_only.*data.val_files"):
        run_ppo(None, ppo_overrides(**{"trainer.val_only": "true"}), print_fn=quiet)
