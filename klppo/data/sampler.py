"""Deterministic epoch-wise batching of dataset indices, with exact resume.

The order of epoch ``e`` is a permutation drawn from a ``torch.Generator`` seeded with
``seed + e`` (or ``0..n-1`` without shuffling), so it depends on nothing but the seed and
the epoch: a run resumed from ``state_dict()`` yields exactly the batches the uninterrupted
run would have.
"""

from __future__ import annotations

import torch

from klppo.errors import UserError


def steps_per_epoch(num_items: int, batch_size: int, *, drop_last: bool = True) -> int:
    """Batches per epoch: a last partial batch counts only when ``drop_last`` is False."""
    full, rest = divmod(num_items, batch_size)
    return full + (1 if rest and not drop_last else 0)


def run_length(total_training_steps: int | None, total_epochs: int, steps_per_epoch: int) -> int:
    """A run's steps: ``trainer.total_training_steps``, else ``total_epochs`` passes over the data (as verl)."""
    return total_training_steps or total_epochs * steps_per_epoch


class PromptBatches:
    """Hands out the dataset indices of successive batches, epoch after epoch."""

    def __init__(self, num_items: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True,
                 key: str = "data.train_batch_size"):
        # key: the config key of batch_size (dynamic sampling draws batches of data.gen_batch_size)
        if batch_size <= 0:
            raise UserError(f"{key} is {batch_size}; set it to a positive number of prompts")
        if batch_size > num_items:
            raise UserError(
                f"{key}={batch_size} is larger than the dataset ({num_items} prompts after "
                f"filtering); lower {key} to at most {num_items} or add data"
            )
        self.num_items, self.batch_size, self.key = num_items, batch_size, key
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self._epoch = 0
        self._position = 0  # batches already handed out in the current epoch
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.num_items, self.batch_size, drop_last=self.drop_last)

    @property
    def epoch(self) -> int:
        """The epoch the most recent batch came from (0 before the first batch)."""
        return self._epoch

    def _order_of(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.num_items, generator=generator).tolist()
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[int]:
        """Indices of the next batch; starts the next epoch when this one is exhausted."""
        if self._position >= self.steps_per_epoch:
            self._epoch += 1
            self._position = 0
        start = self._position * self.batch_size
        self._position += 1
        return self._order_of(self._epoch)[start : start + self.batch_size]

    def state_dict(self) -> dict:
        """``{"epoch", "position"}``: enough, with the constructor arguments, to resume exactly."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``; the next batch is the one that would have followed."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise UserError(
                f"data position {state} does not fit {self.steps_per_epoch} batches per epoch; "
                f"resume with the {self.key} and data files the checkpoint was made with"
            )
        self._epoch, self._position = epoch, position
