"""Checkpoints are written atomically: a crash mid-save leaves the previous one loadable."""

import pytest
import torch

from klppo.checkpoint import state as ckpt


def test_a_crash_while_saving_leaves_the_previous_checkpoint_and_pointer(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.ones(3)})

    def dies_mid_write(obj, path, *args, **kwargs):
        open(path, "wb").write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", dies_mid_write)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 4, {"step": 4, "w": torch.zeros(3)})
    monkeypatch.undo()

    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest == tmp_path / "global_step_2"
    assert ckpt.load_checkpoint(latest)["step"] == 2
    assert not (tmp_path / "global_step_4").exists()


def test_only_the_newest_checkpoints_are_kept_when_asked(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_4"


def test_a_run_without_checkpoints_has_no_latest(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_rng_state_round_trips(tmp_path):
    state = ckpt.rng_state()
    expected = torch.rand(4)
    ckpt.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4), expected)
