"""Checkpoints hold plain data and load without running code from the files (issue: resuming
never runs code from a checkpoint): a crafted trainer state, rank file, DCP metadata or DCP
value is refused with a message naming the file, and its payload never runs."""

import pickle
import random

import numpy as np
import pytest
import torch

from klppo.checkpoint import state as ckpt
from klppo.distributed import load_sharded, save_sharded
from klppo.errors import UserError

from checkpoint_kit import SHARED, sharded_state


def test_rng_states_load_with_weights_only_and_restore_every_stream(tmp_path):
    torch.save({"rng": ckpt.rng_state()}, tmp_path / "rank_0.pt")
    expected = (torch.rand(3), random.random(), np.random.rand(), random.gauss(0, 1), np.random.randn())
    ckpt.set_rng_state(torch.load(tmp_path / "rank_0.pt", weights_only=True)["rng"])
    assert (torch.rand(3), random.random(), np.random.rand(), random.gauss(0, 1), np.random.randn())[1:] == expected[1:]
    ckpt.set_rng_state(torch.load(tmp_path / "rank_0.pt", weights_only=True)["rng"])
    torch.testing.assert_close(torch.rand(3), expected[0])


def test_a_pending_gaussian_survives_the_round_trip(tmp_path):
    random.gauss(0, 1)  # Python keeps the second of each pair of normals for the next call
    np.random.randn()  # NumPy too
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = (random.gauss(0, 1), np.random.randn())
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.gauss(0, 1), np.random.randn()) == expected


def test_a_genuine_checkpoint_loads_with_weights_only(save, tmp_path):
    folder = save(tmp_path, 3)
    assert torch.load(folder / ckpt.STATE_FILE, weights_only=True) == SHARED["ppo"](3)
    assert "rng" in torch.load(ckpt.rank_file(folder, 0), weights_only=True)


@pytest.mark.parametrize("value", [np.float64(1.0), np.arange(2), object(), {1.5: "x"}])
def test_saving_anything_but_plain_data_is_refused_before_writing(tmp_path, value):
    with pytest.raises(TypeError):
        ckpt.save_checkpoint(tmp_path, 1, {"step": 1, "x": value})
    assert not list(tmp_path.iterdir())


def test_a_crafted_trainer_state_is_refused_and_never_runs(save, payload, tmp_path):
    evil, marker = payload
    folder = save(tmp_path, 1)
    torch.save({**SHARED["ppo"](1), "kl_ctrl": evil}, folder / ckpt.STATE_FILE)
    with pytest.raises(UserError, match="trainer_state.pt.*not a klppo checkpoint or was modified"):
        ckpt.load_checkpoint(folder)
    assert not marker.exists()


def test_a_crafted_rank_file_is_refused_and_never_runs(save, payload, tmp_path):
    evil, marker = payload
    folder = save(tmp_path, 1)
    torch.save({"rng": evil}, ckpt.rank_file(folder, 0))
    with pytest.raises(UserError, match="rank_0.pt.*not a klppo checkpoint or was modified"):
        ckpt.load_rank_state(folder, ckpt.SINGLE_PROCESS)
    assert not marker.exists()


def test_crafted_dcp_metadata_is_refused_and_never_runs(save, payload, tmp_path):
    evil, marker = payload
    folder = save(tmp_path, 1)
    (folder / "weights" / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(UserError, match=r"weights.*not a klppo checkpoint or was modified"):
        ckpt.load_sharded_state(folder, sharded_state("ppo"))
    assert not marker.exists()


def test_metadata_that_wraps_a_payload_inside_dcp_classes_is_refused(save, payload, tmp_path):
    evil, marker = payload
    folder = save(tmp_path, 1)
    path = folder / "weights" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file, written a moment ago
    metadata.planner_data = {"x": evil}
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="weights.*not a klppo checkpoint or was modified"):
        ckpt.load_sharded_state(folder, sharded_state("ppo"))
    assert not marker.exists()


def test_a_crafted_non_tensor_value_in_a_shard_is_refused_and_never_runs(payload, tmp_path):
    # DCP's default planner reads non-tensor values (saved as bytes) with weights_only=False.
    evil, marker = payload
    save_sharded({"w": torch.ones(2), "lr": evil}, tmp_path / "weights")
    with pytest.raises(UserError, match="not a klppo checkpoint or was modified"):
        load_sharded({"w": torch.zeros(2), "lr": 0.0}, tmp_path / "weights")
    assert not marker.exists()


def test_sharded_state_round_trips_through_the_restricted_readers(tmp_path):
    saved = sharded_state("ppo")
    save_sharded(saved, tmp_path / "weights")
    loaded = sharded_state("ppo")
    loaded["actor"]["layer.weight"].zero_()
    loaded["actor_optimizer"]["param_groups"][0]["lr"] = 0.0
    load_sharded(loaded, tmp_path / "weights")
    torch.testing.assert_close(loaded["actor"]["layer.weight"], saved["actor"]["layer.weight"])
    assert loaded["actor_optimizer"]["param_groups"][0]["lr"] == 1e-3


def test_a_pointer_that_is_not_a_step_number_is_a_user_error(tmp_path):
    (tmp_path / ckpt.LATEST_FILE).write_text("twenty")
    with pytest.raises(UserError, match="latest_checkpointed_iteration.txt' holds 'twenty', not a step number"):
        ckpt.latest_checkpoint(tmp_path)


def test_the_payload_is_real_the_old_way_of_loading_runs_it(payload, tmp_path):
    evil, marker = payload
    torch.save({"rng": evil}, tmp_path / "rank_0.pt")
    torch.load(tmp_path / "rank_0.pt", weights_only=False)
    assert marker.exists()


def _point_shards_outside(folder, where) -> None:
    """Move the weights' shard files out of the checkpoint and rewrite its metadata to name them there."""
    weights = folder / "weights"
    metadata = pickle.loads((weights / ".metadata").read_bytes())  # our own file, written a moment ago
    outside = folder.parent / "elsewhere"
    outside.mkdir()
    for shard in weights.glob("*.distcp"):
        shard.rename(outside / shard.name)
    for info in metadata.storage_data.values():
        info.relative_path = where(outside, info.relative_path)
    (weights / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", [lambda outside, name: f"../elsewhere/{name}",
                                   lambda outside, name: str(outside / name)], ids=["dot_dot", "absolute"])
def test_metadata_naming_shards_outside_the_checkpoint_is_refused_where_rollback_reads_it(save, tmp_path, where):
    # The shards are genuine and readable where the metadata points: only the reader's own check can refuse them.
    folder = save(tmp_path / "run", 1)
    _point_shards_outside(folder, where)
    with pytest.raises(UserError, match=r"\.metadata' cannot be read \(it names the shard .*elsewhere.*which is "
                                        r"not a file in its folder\); .*not a klppo checkpoint or was modified"):
        ckpt.load_sharded_state(folder, sharded_state("ppo"))  # what run_state.restore (rollback, resume) reads
