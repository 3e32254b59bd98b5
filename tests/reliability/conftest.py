"""Finished runs with a checkpoint, for the cases that resume from (damaged copies of) them."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, tiny_model_dir) -> Path:
    """<folder>/sft, <folder>/rm and <folder>/ppo: 1-step runs of the tiny model, each with global_step_1
    (in-process)."""
    from bad_input_kit import Workspace
    from klppo.cli import main

    out = tmp_path_factory.mktemp("trained")
    ws = Workspace(out / "inputs", tiny_model_dir)
    for kind in ("sft", "rm", "ppo"):
        argv = getattr(ws, kind)(None, {"trainer.default_local_dir": str(out / kind), "trainer.save_freq": 1})
        assert main(argv) == 0, kind
    return out
