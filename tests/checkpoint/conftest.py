"""Small checkpoints written by klppo's own save path, and files whose unpickling would leave a mark."""

from pathlib import Path

import pytest
import torch
from checkpoint_kit import SHARED, Payload, sharded_state

from klppo.checkpoint import state as ckpt


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
