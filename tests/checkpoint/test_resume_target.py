"""A resume target is checked whole before a run loads or writes anything; auto-resume refuses a
damaged newest checkpoint and names the newest complete one."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from klppo.checkpoint import state as ckpt
from klppo.checkpoint.verify import check_resume_target, find_resume_folder
from klppo.errors import UserError

from checkpoint_kit import sharded_state


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_genuine_checkpoint_passes_and_gives_its_step(save, tmp_path):
    folder = save(tmp_path, 7)
    assert check_resume_target(folder, kind="ppo", world_size=1, sharded=sharded_state("ppo")) == 7


def test_a_folder_of_junk_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)))
    with pytest.raises(UserError, match="holds no trainer_state.pt, so it is not a complete klppo checkpoint"):
        check_resume_target(tmp_path, kind="ppo", world_size=1)


def test_junk_named_like_checkpoint_files_is_refused_as_not_a_checkpoint(tmp_path):
    (tmp_path / ckpt.STATE_FILE).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UserError, match="trainer_state.pt' cannot be read .*not a klppo checkpoint or was modified"):
        check_resume_target(tmp_path, kind="ppo", world_size=1)


def test_a_path_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(UserError, match="is not a folder; point it at a global_step_N folder"):
        check_resume_target(tmp_path / "global_step_9", kind="ppo", world_size=1)


def test_a_truncated_trainer_state_is_refused(save, tmp_path):
    folder = save(tmp_path, 1)
    truncate(folder / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="trainer_state.pt' cannot be read"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_a_truncated_rank_file_is_refused(save, tmp_path):
    folder = save(tmp_path, 1)
    truncate(ckpt.rank_file(folder, 0))
    with pytest.raises(UserError, match="rank_0.pt' cannot be read"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_a_truncated_shard_is_refused_with_its_length(save, tmp_path):
    folder = save(tmp_path, 1)
    shard = next((folder / "weights").glob("*.distcp"))
    truncate(shard, 0.9)
    with pytest.raises(UserError, match=r"__0_0.distcp' is truncated \(\d+ of \d+ bytes\)"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_a_missing_shard_or_metadata_is_refused(save, tmp_path):
    folder = save(tmp_path, 1)
    next((folder / "weights").glob("*.distcp")).unlink()
    with pytest.raises(UserError, match="__0_0.distcp' is missing"):
        check_resume_target(folder, kind="ppo", world_size=1)
    (folder / "weights" / ".metadata").unlink()
    with pytest.raises(UserError, match="has no weights/.metadata"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_an_sft_checkpoint_given_to_ppo_is_refused_by_name(save, tmp_path):
    folder = save(tmp_path, 1, kind="sft")
    with pytest.raises(UserError, match="is a checkpoint of an SFT or reward-model run, not of a PPO run"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_a_ppo_checkpoint_given_to_sft_is_refused_by_name(save, tmp_path):
    folder = save(tmp_path, 1)
    with pytest.raises(UserError, match="is a checkpoint of a PPO run, not of an SFT run"):
        check_resume_target(folder, kind="sft", world_size=1)


def test_a_recorded_kind_tells_sft_from_reward_model_checkpoints(save, tmp_path):
    folder = save(tmp_path, 1, kind="sft", recorded="sft")
    assert check_resume_target(folder, kind="sft", world_size=1) == 1
    with pytest.raises(UserError, match="is a checkpoint of an SFT run, not of a reward-model run"):
        check_resume_target(folder, kind="rm", world_size=1)


def test_another_number_of_rank_files_is_refused(save, tmp_path):
    folder = save(tmp_path, 1, world=2)
    assert check_resume_target(folder, kind="ppo", world_size=2) == 1
    with pytest.raises(UserError, match="was not saved by 1 rank"):
        check_resume_target(folder, kind="ppo", world_size=1)
    ckpt.rank_file(folder, 1).rename(folder / "rank_5.pt")
    with pytest.raises(UserError, match="rank_5.pt' does not belong to a checkpoint of 2 rank"):
        check_resume_target(folder, kind="ppo", world_size=2)


def test_plain_data_of_the_wrong_shape_is_refused(save, tmp_path):
    folder = save(tmp_path, 1)
    torch.save({"rng": {"torch": torch.zeros(3)}}, ckpt.rank_file(folder, 0))
    with pytest.raises(UserError, match="rank_0.pt' holds no RNG states; this file is not a klppo checkpoint"):
        check_resume_target(folder, kind="ppo", world_size=1)
    save(tmp_path, 2)
    state = torch.load(ckpt.step_dir(tmp_path, 2) / ckpt.STATE_FILE, weights_only=True)
    torch.save({**state, "data": {"epoch": "zero"}}, ckpt.step_dir(tmp_path, 2) / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="'data' is not a data position"):
        check_resume_target(ckpt.step_dir(tmp_path, 2), kind="ppo", world_size=1)


@pytest.mark.parametrize("events", [[{"step": 1, "what": "x"}], [{"step": "1", "kind": "rollback", "message": "m"}],
                                    {"step": 1}])
def test_guard_events_that_are_not_guard_events_are_refused_before_anything_is_restored(save, tmp_path, events):
    """The guard's record is rebuilt from its events at restore, after the run has loaded everything."""
    folder = save(tmp_path, 2)
    state = torch.load(folder / ckpt.STATE_FILE, weights_only=True)
    torch.save({**state, "guard": {**state["guard"], "events": events}}, folder / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="trainer_state.pt' 'guard' holds events that are not guard events"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_the_guard_events_a_run_saves_pass(save, tmp_path):
    folder = save(tmp_path, 2)
    state = torch.load(folder / ckpt.STATE_FILE, weights_only=True)
    event = {"step": 2, "kind": "rollback", "message": "KL 0.3 above 0.15", "values": {"kl": 0.3}}
    torch.save({**state, "guard": {**state["guard"], "events": [event]}}, folder / ckpt.STATE_FILE)
    assert check_resume_target(folder, kind="ppo", world_size=1) == 2


def test_a_state_of_another_step_than_its_folder_is_refused(save, tmp_path):
    save(tmp_path, 1), save(tmp_path, 2)
    shutil.copy(ckpt.step_dir(tmp_path, 1) / ckpt.STATE_FILE, ckpt.step_dir(tmp_path, 2) / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="is the state of step 1, not of global_step_2"):
        check_resume_target(ckpt.step_dir(tmp_path, 2), kind="ppo", world_size=1)


def test_weights_of_another_model_are_refused_by_key_and_shape(save, tmp_path):
    folder = save(tmp_path, 1)
    with pytest.raises(UserError, match=r"'actor.layer.weight' .* has shape \[4, 3\], this run's has \[5, 3\]"):
        check_resume_target(folder, kind="ppo", world_size=1, sharded=sharded_state("ppo", rows=5))
    with_critic = {**sharded_state("ppo"), "critic": {"head.weight": torch.zeros(1)}}
    with pytest.raises(UserError, match="saved by a PPO run without a critic"):
        check_resume_target(folder, kind="ppo", world_size=1, sharded=with_critic)
    renamed = {"actor": {"other.weight": torch.zeros(4, 3)}}
    with pytest.raises(UserError, match="have no 'actor.other.weight'"):
        check_resume_target(folder, kind="ppo", world_size=1, sharded=renamed)


# ---- find_resume_folder: which checkpoint a run continues from ----

def _find(run_dir, mode="auto", path=None):
    return find_resume_folder(run_dir, mode, path, kind="ppo", world_size=1, sharded=sharded_state("ppo"))


def test_auto_resumes_from_the_newest_checkpoint_and_starts_fresh_without_one(save, tmp_path):
    assert _find(tmp_path) is None
    save(tmp_path, 1), save(tmp_path, 2)
    assert _find(tmp_path) == ckpt.step_dir(tmp_path, 2)
    assert _find(tmp_path, "disable") is None
    assert _find(tmp_path, "resume_path", str(ckpt.step_dir(tmp_path, 1))) == ckpt.step_dir(tmp_path, 1)


def test_auto_refuses_a_damaged_newest_checkpoint_and_names_the_newest_complete_one(save, tmp_path):
    save(tmp_path, 1), save(tmp_path, 2), save(tmp_path, 3)
    truncate(ckpt.step_dir(tmp_path, 3) / ckpt.STATE_FILE)
    truncate(next((ckpt.step_dir(tmp_path, 2) / "weights").glob("*.distcp")))
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as refused:
        _find(tmp_path)
    message = str(refused.value)
    assert "the newest checkpoint is damaged" in message and "global_step_3/trainer_state.pt" in message
    assert f"trainer.resume_mode=resume_path trainer.resume_from_path={ckpt.step_dir(tmp_path, 1)}" in message
    assert len(message.splitlines()) <= 3
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("pointer", ["twenty", "", "3.0", "-1", "99"])
def test_a_bad_or_dangling_pointer_is_damage_of_the_same_kind(save, tmp_path, pointer):
    save(tmp_path, 1), save(tmp_path, 2)
    (tmp_path / ckpt.LATEST_FILE).write_text(pointer)
    with pytest.raises(UserError, match=r"(not a step number|does not exist)(.|\n)*resume_from_path=.*global_step_2"):
        _find(tmp_path)


def test_when_no_complete_checkpoint_is_left_auto_says_to_start_fresh(save, tmp_path):
    save(tmp_path, 1)
    truncate(ckpt.step_dir(tmp_path, 1) / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="no complete checkpoint is left: start fresh with trainer.resume_mode=disable"):
        _find(tmp_path)


def test_auto_does_not_fall_back_past_a_checkpoint_of_another_kind_or_world(save, tmp_path):
    save(tmp_path, 1), save(tmp_path, 2, world=2)
    with pytest.raises(UserError, match="was not saved by 1 rank") as refused:
        _find(tmp_path)
    assert "newest complete" not in str(refused.value)


def test_an_explicit_resume_path_is_checked_and_never_replaced(save, tmp_path):
    save(tmp_path, 1), save(tmp_path, 2)
    truncate(ckpt.step_dir(tmp_path, 2) / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="global_step_2/trainer_state.pt' cannot be read"):
        _find(tmp_path, "resume_path", str(ckpt.step_dir(tmp_path, 2)))


@pytest.mark.parametrize("health", [
    {"grads": {"actor": {"norms": ["1.0"], "skipped_at": []}}, "entropy": {"values": [], "active": None}},
    {"grads": {"actor": {"norms": [1.0], "skipped_at": [2.5]}}, "entropy": {"values": [], "active": None}},
    {"grads": {}, "entropy": {"values": [1.0], "active": "run"}},
    {"grads": {}},
    {"grads": {"actor": {"norms": [1.0], "early": [None], "skipped_at": []}}, "entropy": {"values": [], "active": None}},
    {"grads": {}, "entropy": {"values": [1.0], "early": [1.0], "seen": "1", "active": None}},
    {"grads": {}, "entropy": {"values": [], "active": None}, "divergence": {"history": [[0.1, "0.2", 1.0, 1.0]]}},
])
def test_a_guard_health_record_that_is_not_one_is_refused_before_anything_is_restored(save, tmp_path, health):
    folder = save(tmp_path, 2)
    state = torch.load(folder / ckpt.STATE_FILE, weights_only=True)
    torch.save({**state, "guard": {**state["guard"], "health": health}}, folder / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="'guard' holds a health record that is not one"):
        check_resume_target(folder, kind="ppo", world_size=1)


def test_the_health_record_a_guard_saves_passes(save, tmp_path):
    from klppo.safety.guards import GuardSettings, RunGuard

    guard = RunGuard(GuardSettings(early_stop_kl=None, rollback_kl=None, rollback_lr=1e-6, max_rollbacks=1,
                                   max_nonfinite_steps=2, entropy_floor=None, clipfrac_max=None, grad_spike=10.0,
                                   entropy_collapse=0.5))
    guard.check_update(1, {"actor": ([1.0, 2.0], [True, True]), "critic": ([3.0], [True])}, 2.5)
    guard.check_validation(0, (0.5, 0.1), (0.4, 0.2))
    folder = save(tmp_path, 2)
    state = torch.load(folder / ckpt.STATE_FILE, weights_only=True)
    torch.save({**state, "guard": guard.state_dict()}, folder / ckpt.STATE_FILE)
    assert check_resume_target(folder, kind="ppo", world_size=1) == 2
