"""``Problem``: one thing wrong with a config, as every check reports it (collected, never raised, so a
user sees all of a config's problems at once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the dotted keys it concerns and a message naming the fix."""

    keys: tuple[str, ...]
    message: str


def check_positive(out: list[Problem], key: str, value: Optional[float], what: str = "value") -> None:
    """``value`` must be > 0 (``None`` means unset and passes)."""
    if value is not None and value <= 0:
        out.append(Problem((key,), f"{key} = {value!r} must be > 0; set it to a positive {what}"))


def check_at_least(out: list[Problem], key: str, value: Optional[int], low: int) -> None:
    """``value`` must be >= ``low`` (``None`` means unset and passes)."""
    if value is not None and value < low:
        out.append(Problem((key,), f"{key} = {value!r} must be >= {low}; set it to {low} or more"))
