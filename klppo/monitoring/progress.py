"""A progress bar over a run's steps (with ETA), and over the long phases inside a step.

Quiet (prints nothing at all) under CI, when ``KLPPO_QUIET=1``, or when stderr is not a
terminal, so logs and captured output hold only the per-step metrics.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import IO, Iterator, Mapping

from tqdm import tqdm

_TRUE = ("1", "true", "yes", "on")


def is_quiet(environ: Mapping[str, str] | None = None, stream: IO | None = None) -> bool:
    """True when the bar should stay silent: ``KLPPO_QUIET=1``, ``CI=true`` or a non-terminal stderr."""
    environ = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    if environ.get("KLPPO_QUIET", "").lower() in _TRUE or environ.get("CI", "").lower() in _TRUE:
        return True
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


class PhaseBar:
    """What ``Progress.phase`` yields: ``update(n)`` advances the phase's own bar, if it has one."""

    def __init__(self, bar: tqdm | None) -> None:
        self.bar = bar

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)


class Progress:
    """``total`` steps, starting after ``initial`` (a resumed run); shows rate and ETA.

    ``with progress.phase("gen"):`` names the phase in the bar's postfix while it runs; with
    ``total=`` it also shows a second bar for that phase (e.g. micro-batches of generation)
    that the yielded ``PhaseBar`` advances. ``advance(postfix={...})`` ends a step. ``write``
    prints a line above the bar without breaking it (use it as the console's print function).
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "steps", quiet: bool | None = None,
                 file: IO | None = None) -> None:
        self.file = sys.stderr if file is None else file
        self.quiet = is_quiet(stream=self.file) if quiet is None else quiet
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.file,
                        disable=self.quiet, dynamic_ncols=True)
        self.last: dict[str, str] = {}

    @contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[PhaseBar]:
        self._postfix(phase=name)
        inner = None
        if total is not None and not self.quiet:
            inner = tqdm(total=total, desc=name, unit="it", file=self.file, leave=False, position=1, dynamic_ncols=True)
        try:
            yield PhaseBar(inner)
        finally:
            if inner is not None:
                inner.close()
            self._postfix(phase=None)

    def advance(self, n: int = 1, postfix: Mapping[str, float] | None = None) -> None:
        """One step done; ``postfix`` (e.g. score and KL) stays on the bar until the next step."""
        if postfix is not None:
            self.last = {k: f"{v:.4g}" for k, v in postfix.items()}
        self._postfix()
        self.bar.update(n)

    def write(self, text: str) -> None:
        """Print ``text`` (to stdout) above the bar; a plain print when the bar is quiet."""
        if self.quiet:
            print(text)
        else:
            tqdm.write(text, file=sys.stdout)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _postfix(self, phase: str | None = None) -> None:
        if self.quiet:
            return
        shown = dict(self.last)
        if phase is not None:
            shown["phase"] = phase
        self.bar.set_postfix(shown, refresh=True)
