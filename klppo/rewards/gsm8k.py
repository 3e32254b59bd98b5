"""GSM8K rule reward, with verl's semantics (verl/utils/reward_score/gsm8k.py).

"strict" reads the answer after the last "#### " (the format GSM8K solutions use);
"flexible" takes the last number in the text. The reward is ``score`` for the right
answer, ``format_score`` for a found but wrong one, and 0 when no answer is found.
"""

from __future__ import annotations

import re
from typing import Any

# verl clips to the last 300 characters: regexes on long texts are slow, and the answer is last.
_SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_ANSWER = re.compile(r"-?[0-9.]+")  # what either method can return, commas removed (strict)


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in ``solution_str`` as a string, or None when there is none.

    strict: the last "#### <number>", with "," and "$" removed. flexible: the last number
    (verl leaves its commas in).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method is {method!r}; use 'strict' or 'flexible'")
    text = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def is_answer(ground_truth: Any) -> bool:
    """Whether an extracted answer can equal ``ground_truth``: a number, as ``extract_solution`` gives them."""
    return _ANSWER.fullmatch(normalize_ground_truth(ground_truth)) is not None


def normalize_ground_truth(ground_truth: Any) -> str:
    """Ground truth as the string an answer is compared to: 72, 72.0 and "72" all give "72"."""
    if isinstance(ground_truth, float) and ground_truth.is_integer():
        return str(int(ground_truth))
    return str(ground_truth).strip().replace(",", "").replace("$", "")


def compute_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the extracted answer equals ``ground_truth`` (as strings), else ``format_score``
    when an answer was found, else 0.0."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == normalize_ground_truth(ground_truth) else float(format_score)
