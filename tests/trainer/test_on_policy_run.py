"""Runs whose actor update gives pi_old (``on_policy_update``) skip the old_log_prob forward.

A GRPO run sampled with HF generate, one epoch over one mini-batch: the same run with pi_old
recomputed by the scoring forward (as every other run) must log the same metrics, roll back at
the same step when the KL passes rollback_kl (the guard acts before the on-policy update's
optimiser step), and end with the same weights; resumed, it repeats the uninterrupted run exactly.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.commands.main_ppo import run_ppo
from klppo.monitoring.jsonl import EVENTS_FILE, read_jsonl
from klppo.run import settings

quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def grpo_overrides(ppo_overrides, task_dir):
    """GRPO sampled by the actor (hf), a KL loss, one mini-batch per step; KL guards that roll back at step 2."""
    changes = {
        "data.train_files": task_dir / "train.parquet", "data.train_batch_size": 4,
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.actor.kl_loss_coef": 0.1, "algorithm.use_kl_in_reward": "false",
        "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 4,
        # step 1 samples with the reference's weights (KL 0); step 2's KL passes 1e-9: a rollback
        "trainer.guard.rollback_kl": 1e-9, "trainer.guard.early_stop_kl": 10.0, "trainer.guard.max_rollbacks": 1,
    }
    return lambda run_dir, **more: ppo_overrides(run_dir, **{**changes, **more})


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def test_a_grpo_run_without_the_old_log_prob_forward_trains_as_one_with_it(grpo_overrides, tmp_path, monkeypatch):
    measured = run_ppo(None, grpo_overrides(tmp_path / "measured"), print_fn=quiet)
    monkeypatch.setattr(settings, "on_policy_update", lambda cfg: False)
    recomputed = run_ppo(None, grpo_overrides(tmp_path / "recomputed"), print_fn=quiet)

    assert all("timing_s/old_log_prob" in r for r in recomputed) and not any("timing_s/old_log_prob" in r for r in measured)
    assert [r["step"] for r in measured] == [1, 2, 3, 4]
    for mine, theirs in zip(measured, recomputed):
        mine, theirs = _comparable(mine), _comparable(theirs)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-4, abs_tol=1e-5), (mine["step"], key)
    events = [read_jsonl(tmp_path / run / EVENTS_FILE) for run in ("measured", "recomputed")]
    assert [(e["step"], e["kind"]) for e in events[0]] == [(e["step"], e["kind"]) for e in events[1]] == [(2, "rollback")]
    assert events[0][0]["kl"] == pytest.approx(events[1][0]["kl"], rel=1e-4)
    assert "actor/pg_loss" not in measured[1] and measured[1]["actor/kl_to_ref"] > 1e-9  # rolled back before stepping
    weights = [AutoModelForCausalLM.from_pretrained(tmp_path / run / "actor_hf").state_dict()
               for run in ("measured", "recomputed")]
    for key, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_resumed_on_policy_run_repeats_the_uninterrupted_run_exactly(grpo_overrides, tmp_path, crash_after_logging):
    changes = {"trainer.save_freq": 1, "trainer.guard.rollback_kl": "null", "trainer.guard.early_stop_kl": "null"}
    full = run_ppo(None, grpo_overrides(tmp_path / "full", **changes), print_fn=quiet)
    with crash_after_logging(3):  # its newest checkpoint is step 2's
        run_ppo(None, grpo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    resumed = run_ppo(None, grpo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in full[2:]]
