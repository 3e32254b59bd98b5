"""A module that records where it is moved: offload tests run where no accelerator exists."""

import torch


class RecordingLinear(torch.nn.Linear):
    """Records where ``.to()`` sends it (this CPU-only machine cannot really move to an accelerator)."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves = []

    def to(self, device, *args, **kwargs):
        self.moves.append(torch.device(device).type)
        return self
