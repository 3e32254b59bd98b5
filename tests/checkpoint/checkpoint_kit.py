"""What the checkpoint tests share: tiny checkpoint contents, and a pickle payload that leaves a mark.

(A module of its own: ``conftest`` names several modules in one pytest run, so tests import this.)
"""

from pathlib import Path

import torch

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
