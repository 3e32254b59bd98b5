"""Small checkpoints written by klppo's own save path, and files whose unpickling would leave a mark."""

from pathlib import Path

import pytest
import torch

from klppo.checkpoint import state as ckpt


class Payload:
    """Unpickling this creates ``marker``: the proof that loading ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


SHARED = {
    "ppo": lambda step: {"step": step, "actor_scheduler": {"last_epoch": step, "base_lrs": [1e-3]},
                         "kl_ctrl": {"value": 0.1}, "data": {"epoch": 0, "position": step},
                         "guard": {"rollbacks": 0, "nonfinite_in_a_row": 0, "good_checkpoints": [],
                                   "pending_checkpoint": None, "lr_override": None, "events": []}},
    "sft": lambda step: {"step": step, "scheduler": {"last_epoch": step, "base_lrs": [1e-3]},
                         "data": {"epoch": 0, "position": step}},
}
SHARDED_NAMES = {"ppo": ("actor", "actor_optimizer"), "sft": ("model", "optimizer")}


def sharded_state(kind: str, rows: int = 4) -> dict:
    """Models and optimisers as the trainer hands them to DCP: tensors, plus one non-tensor value."""
    model, optimizer = SHARDED_NAMES[kind]
    return {model: {"layer.weight": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)},
            optimizer: {"state": {"layer.weight": {"exp_avg": torch.ones(rows, 3)}}, "param_groups": [{"lr": 1e-3}]}}


@pytest.fixture
def save():
    """save(run_dir, step, kind="ppo", world=1, recorded=None) -> the checkpoint folder, written by
    ``save_checkpoint`` (``recorded``: the kind it records; "sft" and "rm" save the same state)."""

    def write(run_dir: Path, step: int, kind: str = "ppo", world: int = 1, recorded: str | None = None) -> Path:
        shape = "sft" if kind == "rm" else kind
        folder = ckpt.save_checkpoint(run_dir, step, SHARED[shape](step), sharded=sharded_state(shape),
                                      rank_state={"rng": ckpt.rng_state()}, kind=recorded)
        for rank in range(1, world):  # the other ranks' files, as a run of `world` ranks leaves them
            torch.save({"rng": ckpt.rng_state()}, ckpt.rank_file(folder, rank))
        return folder

    return write


@pytest.fixture
def payload(tmp_path):
    """(Payload, marker path): write the payload anywhere a checkpoint file goes, then check the marker."""
    marker = tmp_path / "payload_ran"
    return Payload(marker), marker
