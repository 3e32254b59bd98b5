"""``Problem``: one thing wrong with a config, as every check reports it (collected, never raised, so a
user sees all of a config's problems at once)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the dotted keys it concerns and a message naming the fix."""

    keys: tuple[str, ...]
    message: str
