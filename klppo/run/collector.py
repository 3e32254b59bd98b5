"""Python's garbage collector during training: what was built before the first step is frozen.

A full collection walks every object the collector tracks. After torch, transformers and a run's
models are loaded that is several hundred thousand objects (366k after klppo's imports alone:
0.43 s a collection on a busy CPU), and a full collection comes whenever enough objects have
survived younger ones (the interpreter's own schedule) or a library asks for one; the first H200
run spent 0.5 s per step in gc.collect. ``gc.freeze`` moves everything alive at the start of
training into a generation no collection walks (what vLLM and torchtitan do after their set-up),
so a collection during the steps walks only what the steps made. Reference counting still frees
objects without cycles at once, frozen or not; a frozen object in a garbage cycle is freed only
once unfrozen, hence ``collect_everything`` before the export, and the thaw when training ends.
"""

from __future__ import annotations

import gc

# Objects frozen before klppo was imported: Python 3.12 starts with some (375 in 3.12.1, none in
# 3.11). Counting from 0 read them as another library's freeze, and 3.12 runs (the GPU image's
# Python) froze nothing.
FROZEN_AT_IMPORT = gc.get_freeze_count()


class FrozenSetup:
    """``with FrozenSetup():`` everything alive at its start (the run's models, data, libraries) is
    frozen, after one full collection, until the block ends or ``collect_everything``. Where
    something else froze objects since klppo was imported (vLLM, a caller) it freezes nothing and
    thaws nothing."""

    def __init__(self) -> None:
        self.frozen = False

    def __enter__(self) -> "FrozenSetup":
        if gc.get_freeze_count() <= FROZEN_AT_IMPORT:
            gc.collect()
            gc.freeze()
            self.frozen = True
        return self

    def __exit__(self, *exc) -> None:
        self.thaw()

    def thaw(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def collect_everything(self) -> None:
        """A full collection that also frees what the set-up made and training dropped since (the
        reference, critic and reward models before the export)."""
        self.thaw()
        gc.collect()
