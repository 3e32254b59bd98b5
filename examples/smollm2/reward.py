"""Reward of the SmolLM2 online example: 1 when the response's last number is the answer.

verl's GSM8K rule reads the answer after "####", a format SmolLM2-135M-Instruct almost never
writes unprompted: under it every response of the untrained model scores 0 and GRPO has nothing
to learn from. Read as its last number, a response like "Ben has 6 pens and gets 10 more, so
Ben has 6 + 10 = 16 pens." is right, and the untrained model is right about one time in four,
so from the first step most groups of samples hold both right and wrong answers.

Used through verl's ``custom_reward_function.path`` / ``custom_reward_function.name`` keys
(``ppo_online.yaml`` sets them); the signature is verl's ``compute_score``.
"""

from __future__ import annotations

import re
from typing import Any

# An integer, with optional thousands separators ("1,200"); a trailing "." is a full stop.
_INTEGER = re.compile(r"-?\d[\d,]*")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text``, or None when it has none."""
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the last integer of ``solution_str`` equals ``ground_truth``, else 0.0."""
    answer = last_integer(solution_str)
    return 1.0 if answer is not None and answer == int(str(ground_truth).replace(",", "")) else 0.0
