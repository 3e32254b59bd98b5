"""Reliability: a killed run resumes exactly, a crash mid-save loses nothing, the guards act."""

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.checkpoint.state import LATEST_FILE
from klppo.monitoring.jsonl import EVENTS_FILE, read_jsonl
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def _train_cli(overrides, stdout=subprocess.DEVNULL):
    # One thread per process: multi-threaded CPU kernels may sum in a different order when the
    # cores are contended, and this test compares two processes' numbers exactly.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "klppo.commands.main_ppo", *overrides],
                            stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(run_dir: Path, step: int, proc, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in read_metrics(run_dir)):
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


# Run-health detectors at thresholds this run crosses (the tiny run's entropy moves by ~1e-6 of itself a step,
# its gradient norms by ~10%): their windows, skip counts, entropy episodes and certified checkpoints
# must come back from the checkpoint exactly for the resumed run to repeat the uninterrupted one.
FIRING_DETECTORS = {"actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.guard.window": 6,
                    "trainer.guard.grad_spike": 1.05, "trainer.guard.max_grad_skips": 4,
                    "trainer.guard.entropy_collapse": 1e-7, "trainer.guard.entropy_surge": 1e-7}


# A gold reward that never moves beside a training reward that pays for length: the divergence
# detector fires whenever the sampled held-out responses grow over 3 validations (by any amount).
GOLD_REWARDS = """
def longer_is_better(data_source, solution_str, ground_truth, extra_info=None):
    return 0.01 * len(solution_str)


def constant(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""


def test_kill_9_at_a_random_step_then_resume_repeats_the_uninterrupted_run(ppo_overrides, task_dir, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(GOLD_REWARDS)
    gold = {"data.val_files": task_dir / "val.parquet", "trainer.test_freq": 1,
            "custom_reward_function.path": rewards, "custom_reward_function.name": "longer_is_better",
            "trainer.gold_reward.path": rewards, "trainer.gold_reward.name": "constant",
            "trainer.guard.divergence_margin": 1e-9,  # sampled held-out responses: their lengths move
            "actor_rollout_ref.rollout.val_kwargs.do_sample": "true", "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0}
    changes = {"trainer.total_training_steps": 7, "trainer.save_freq": 1, "actor_rollout_ref.rollout.name": "offline",
               **FIRING_DETECTORS, **gold}
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    full = _train_cli(ppo_overrides(full_dir, **changes))
    assert full.wait(timeout=300) == 0, full.stderr.read()
    kill_at = random.Random(os.getpid()).randint(2, 4)
    victim = _train_cli(ppo_overrides(killed_dir, **changes))
    _wait_for_step(killed_dir, kill_at, victim)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL  # it died by the signal, not by finishing first
    checkpoint = int((killed_dir / LATEST_FILE).read_text())
    assert 1 <= checkpoint < 7
    resumed = _train_cli(ppo_overrides(killed_dir, **changes), stdout=subprocess.PIPE)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    # It resumed (a fresh start would reproduce the same numbers, runs being deterministic), and
    # from the step of the checkpoint the kill left.
    assert f"resumed from {killed_dir / f'global_step_{checkpoint}'} at step {checkpoint}" in out, out
    expected = [_comparable(r) for r in read_metrics(full_dir)]
    assert [_comparable(r) for r in read_metrics(killed_dir)] == expected, f"killed at step {kill_at}"
    events = read_jsonl(full_dir / EVENTS_FILE)
    fired = {e["kind"] for e in events}
    assert {"skip_grad_spike", "rollback_grad_spike"} <= fired and fired & {"entropy_collapse", "entropy_surge"}, fired
    assert "reward_divergence" in fired, fired
    assert read_jsonl(killed_dir / EVENTS_FILE) == events, f"killed at step {kill_at}"


def test_a_crash_while_saving_leaves_the_previous_checkpoint_for_resume(ppo_overrides, tmp_path, monkeypatch):
    from klppo.checkpoint import state as ckpt

    changes = {"trainer.total_training_steps": 4, "trainer.save_freq": 2}
    real_save = torch.save

    def dies_on_step_4(obj, path, *args, **kwargs):
        if "global_step_4" in str(path):
            Path(path).write_bytes(b"torn")
            raise OSError("power cut")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", dies_on_step_4)
    with pytest.raises(OSError):
        run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "global_step_2"
    printed = []
    resumed = run_ppo(None, ppo_overrides(**changes), print_fn=printed.append)
    assert any("resumed from" in line and "global_step_2" in line for line in printed)
    assert [r["step"] for r in resumed] == [3, 4]


def test_a_kl_blow_up_is_rolled_back_and_the_run_ends_under_target(ppo_overrides, task_dir, tmp_path):
    changes = {
        "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
        "actor_rollout_ref.actor.optim.lr": 0.05,  # a learning-rate spike: KL explodes within a step
        "trainer.total_training_steps": 6, "trainer.save_freq": 1,
        "trainer.guard.rollback_kl": 0.05, "trainer.guard.early_stop_kl": 5.0,
        "trainer.guard.rollback_lr": 1e-7, "trainer.guard.max_rollbacks": 3,
    }
    records = run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    events = read_jsonl(tmp_path / "run" / EVENTS_FILE)
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert rollbacks and rollbacks[0]["kl"] > 0.05
    assert records[-1]["step"] == 6 and records[-1]["actor/kl_to_ref"] < 0.05
    assert records[-1]["actor/lr"] == pytest.approx(1e-7)

    # The run report shows the rollback on the curves, in the events table and in the diagnosis.
    from klppo.monitoring.report import write_report

    report = write_report(tmp_path / "run")
    text = report.read_text()
    assert "rollback" in text and f"rolled back at {rollbacks[0]['step']}" in text
    pngs = sorted(p.name for p in report.parent.glob("*.png"))
    assert any("kl" in name for name in pngs) and any("reward" in name for name in pngs)


def test_a_gradient_blow_up_skips_its_optimiser_steps_then_rolls_back(ppo_overrides, tmp_path):
    """A learning-rate warm-up to a rate far too large: within a few steps the actor's gradient
    norm blows up (17x its median at step 3, after it had collapsed at step 2). The KL guards are
    off, so the gradient guard alone acts: it skips the spikes (four optimiser steps a PPO step),
    then rolls back to a checkpoint it certified."""
    changes = {
        "actor_rollout_ref.actor.optim.lr": 3.0, "actor_rollout_ref.actor.optim.lr_warmup_steps": 6,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.total_training_steps": 7, "trainer.save_freq": 1,
        "trainer.guard.rollback_kl": "null", "trainer.guard.early_stop_kl": "null",
        "trainer.guard.max_grad_skips": 1, "trainer.guard.grad_spike": 10.0, "trainer.guard.rollback_lr": 1e-7,
    }
    records = run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    events = read_jsonl(tmp_path / "run" / EVENTS_FILE)
    rollback = next((e for e in events if e["kind"] == "rollback_grad_spike"), None)
    assert rollback is not None, [(r["step"], r.get("actor/grad_norm"), r.get("critic/grad_norm")) for r in records]
    model, at = rollback["model"], rollback["step"]
    skips = [e for e in events if e["kind"] == "skip_grad_spike" and e["model"] == model and e["step"] <= at]
    # skips in two steps (two optimiser steps at step 3, one at 5): a step with skips alone first, within
    # max_grad_skips = 1; the second step with skips rolls back
    assert len({e["step"] for e in skips}) == rollback["skips"] == 2 and skips[0]["step"] < at
    for e in skips:  # each more than grad_spike = 10 times its reference level
        assert e["ratio"] > 10.0 and e["grad_norm"] == pytest.approx(e["median"] * e["ratio"])
        assert e["log_ratio"] == pytest.approx(math.log(e["ratio"]))
    counted = sum(r.get(f"{model}/grad_norm_skipped", 0) for r in records if r["step"] <= at)
    assert counted == len(skips)
    # The target is a checkpoint saved before the first skip; the run goes on at the rollback rate.
    assert 1 <= rollback["to_step"] < skips[0]["step"]
    after = [r for r in records if r["step"] > at]
    assert after and all(r["actor/lr"] == pytest.approx(1e-7) and r["guard/rollbacks"] == 1 for r in after)


def test_a_batch_with_a_huge_advantage_is_skipped_by_the_default_guard(ppo_overrides, tmp_path, monkeypatch):
    """With every trainer.guard default, one step whose advantages are 1000x too large (a reward bug,
    a mis-scaled batch) has its actor optimiser steps skipped; no other step is touched."""
    from klppo.trainer import advantages

    real, calls = advantages.compute_advantage, []

    def one_huge_batch(*args, **kwargs):
        advantages, returns = real(*args, **kwargs)
        calls.append(1)
        return (advantages * 1000.0 if len(calls) == 5 else advantages), returns

    monkeypatch.setattr(advantages, "compute_advantage", one_huge_batch)
    records = run_ppo(None, ppo_overrides(**{"trainer.total_training_steps": 6}), print_fn=quiet)
    events = read_jsonl(tmp_path / "run" / EVENTS_FILE) if (tmp_path / "run" / EVENTS_FILE).exists() else []
    skips = [e for e in events if e["kind"] == "skip_grad_spike"]
    assert skips and {(e["step"], e["model"]) for e in skips} == {(5, "actor")}, events
    assert all(e["ratio"] > 30.0 for e in skips)  # trainer.guard.grad_spike's default
    assert [r["actor/grad_norm_skipped"] for r in records] == [0, 0, 0, 0, len(skips), 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and "actor/grad_norm_median" in records[4]


def _nan_reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "nan_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float('nan')\n")
    return path


def test_a_nan_reward_skips_the_update_without_touching_the_weights(ppo_overrides, tiny_model_dir, tmp_path):
    changes = {"custom_reward_function.path": _nan_reward_file(tmp_path), "trainer.total_training_steps": 1,
               "trainer.guard.max_nonfinite_steps": 2}
    records = run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    assert [e["kind"] for e in read_jsonl(tmp_path / "run" / EVENTS_FILE)] == ["skip_nonfinite"]
    assert "actor/pg_loss" not in records[-1]
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nan_rewards_step_after_step_stop_the_run(ppo_overrides, tmp_path):
    changes = {"custom_reward_function.path": _nan_reward_file(tmp_path), "trainer.total_training_steps": 5,
               "trainer.guard.max_nonfinite_steps": 2}
    records = run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    assert [r["step"] for r in records] == [1, 2]
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "run" / EVENTS_FILE)]
    assert kinds == ["skip_nonfinite", "stop_nonfinite"]
    assert not (tmp_path / "run" / "actor_hf").exists()


def test_an_offline_policy_that_runs_away_is_rolled_back_though_its_recorded_kl_stays_negative(
        tiny_model_dir, task_dir, ppo_overrides, tmp_path):
    """An SFT model, and recorded responses that all score 0 with a strong entropy bonus: the policy
    flattens away from what the reference likes. On the recorded responses the log-ratio to the
    reference (the recorded k1) is negative; on what the policy now samples the KL is large. The
    guard reads the sampled KL and rolls back."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from klppo.config import load_sft_config
    from klppo.commands.main_sft import run_sft

    sft = run_sft(load_sft_config(None, [
        f"data.train_files={task_dir / 'sft.parquet'}", "data.max_length=96", "data.train_batch_size=16",
        f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3", "trainer.total_epochs=4",
        f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]", "trainer.device=cpu"]), print_fn=quiet)
    rows = pq.read_table(task_dir / "offline.parquet").to_pylist()
    for row in rows:
        row["scores"] = [0.0] * len(row["responses"])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "flat.parquet")
    changes = {
        "data.train_files": tmp_path / "flat.parquet", "actor_rollout_ref.model.path": sft,
        "actor_rollout_ref.actor.optim.lr": 0.01, "actor_rollout_ref.actor.entropy_coeff": 1.0,
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "false",
        "actor_rollout_ref.actor.use_kl_loss": "true", "actor_rollout_ref.actor.kl_loss_coef": 0.0,
        "trainer.total_training_steps": 3, "trainer.save_freq": 1,
        "trainer.guard.rollback_kl": 0.3, "trainer.guard.early_stop_kl": 50.0, "trainer.guard.max_rollbacks": 1,
        "trainer.guard.rollback_lr": 1e-9,
    }
    records = run_ppo(None, ppo_overrides(**changes), print_fn=quiet)
    events = [e for e in read_jsonl(tmp_path / "run" / EVENTS_FILE) if e["kind"] == "rollback"]
    assert events, [(r["step"], r.get("actor/kl_to_ref_sampled"), r.get("actor/kl_to_ref_recorded")) for r in records]
    at = next(r for r in records if r["step"] == events[0]["step"])
    assert at["actor/kl_to_ref_recorded"] < 0 < 0.3 < at["actor/kl_to_ref_sampled"] == at["actor/kl_to_ref"]
    assert events[0]["kl"] == pytest.approx(at["actor/kl_to_ref_sampled"])
