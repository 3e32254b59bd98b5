"""Runs whose updates are one micro-batch a rank run their forwards first (``update_forwards_first``).

Their detached outputs are pi_old's log-probs and the critic's values, so the step has no
old_log_prob and no values phase, and the update takes the graphs instead of a second forward.
The same run with both scoring forwards (as every other run) must log the same metrics, roll
back at the same step when the KL passes rollback_kl (the KL in the reward, measured before any
weight moves), and end with the same weights; offline, with the KL probe sampling between the
scoring and the update; resumed, it repeats the uninterrupted run exactly.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.commands.main_ppo import run_ppo
from klppo.monitoring.jsonl import EVENTS_FILE, read_jsonl
from klppo.run import settings

quiet = lambda *a, **k: None  # noqa: E731
SCORING = ("timing_s/old_log_prob", "timing_s/values")


@pytest.fixture
def gae_overrides(ppo_overrides, task_dir):
    """PPO with a critic and the KL in the reward, sampled by the actor (hf), one mini-batch and one
    micro-batch per step; KL guards that roll back at the first step whose KL passes 1e-9."""
    changes = {
        "data.train_files": task_dir / "train.parquet", "data.max_response_length": 8, "data.train_batch_size": 4,
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "algorithm.adv_estimator": "gae",
        "algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive", "trainer.total_training_steps": 4,
        "actor_rollout_ref.model.use_remove_padding": "true", "critic.model.use_remove_padding": "true",
        "actor_rollout_ref.actor.use_dynamic_bsz": "true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 1024,
        # step 1 samples with the reference's weights (KL 0); the first k1 estimate above 1e-9 rolls back
        "trainer.guard.rollback_kl": 1e-9, "trainer.guard.early_stop_kl": 10.0, "trainer.guard.max_rollbacks": 1,
    }
    return lambda run_dir, **more: ppo_overrides(run_dir, **{**changes, **more})


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def _without_forwards_first(monkeypatch) -> None:
    monkeypatch.setattr(settings, "update_forwards_first", lambda cfg, world: False)


def _assert_same_runs(first: list[dict], scored: list[dict]) -> None:
    assert not any(k in r for r in first for k in SCORING)
    assert all("timing_s/old_log_prob" in r for r in scored)
    for mine, theirs in zip(first, scored, strict=True):
        mine, theirs = _comparable(mine), _comparable(theirs)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert math.isclose(mine[key], theirs[key], rel_tol=1e-4, abs_tol=1e-5), (mine["step"], key)


def _assert_same_actors(*runs) -> None:
    weights = [AutoModelForCausalLM.from_pretrained(run / "actor_hf").state_dict() for run in runs]
    for key, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_ppo_run_with_its_forwards_first_trains_as_one_with_the_scoring_forwards(gae_overrides, tmp_path,
                                                                                   monkeypatch):
    first = run_ppo(None, gae_overrides(tmp_path / "first"), print_fn=quiet)
    _without_forwards_first(monkeypatch)
    scored = run_ppo(None, gae_overrides(tmp_path / "scored"), print_fn=quiet)

    assert all("timing_s/values" in r for r in scored)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    _assert_same_runs(first, scored)
    events = [read_jsonl(tmp_path / run / EVENTS_FILE) for run in ("first", "scored")]
    rolled_back = next(r["step"] for r in first if r["actor/kl_to_ref"] > 1e-9)  # the first KL over the limit
    assert [(e["step"], e["kind"]) for e in events[0]] == [(e["step"], e["kind"]) for e in events[1]] == [
        (rolled_back, "rollback")]
    assert events[0][0]["kl"] == pytest.approx(events[1][0]["kl"], rel=1e-4)
    assert "actor/pg_loss" not in first[rolled_back - 1]  # rolled back before any weight moved
    assert first[0]["actor/kl_to_ref"] == 0 and "actor/pg_loss" in first[0]  # step 1: both updates, on the graphs
    assert first[0]["critic/vf_loss"] > 0
    _assert_same_actors(tmp_path / "first", tmp_path / "scored")


def test_an_offline_run_probes_its_kl_before_the_forwards_it_keeps(ppo_overrides, tmp_path, monkeypatch):
    changes = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8, "algorithm.kl_ctrl.probe_every": 2,
               "algorithm.kl_ctrl.probe_prompts": 2, "trainer.total_training_steps": 3}
    first = run_ppo(None, ppo_overrides(tmp_path / "first", **changes), print_fn=quiet)
    _without_forwards_first(monkeypatch)
    scored = run_ppo(None, ppo_overrides(tmp_path / "scored", **changes), print_fn=quiet)

    assert [("actor/kl_to_ref_sampled" in r) for r in first] == [True, False, True]  # steps 1 and 3 probe
    _assert_same_runs(first, scored)
    _assert_same_actors(tmp_path / "first", tmp_path / "scored")


def test_a_resumed_run_with_its_forwards_first_repeats_the_uninterrupted_run_exactly(gae_overrides, tmp_path,
                                                                                    crash_after_logging):
    changes = {"trainer.save_freq": 1, "trainer.guard.rollback_kl": "null", "trainer.guard.early_stop_kl": "null"}
    full = run_ppo(None, gae_overrides(tmp_path / "full", **changes), print_fn=quiet)
    with crash_after_logging(3):  # its newest checkpoint is step 2's
        run_ppo(None, gae_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    resumed = run_ppo(None, gae_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in full[2:]]
