"""The reward functions of ``klppo demo --reward-hacking``, in verl's signature.

``exact_match`` is the task's honest rule (GSM8K's strict "#### <answer>" match). ``paid_for_length``
is the gameable training reward: the same match plus a bonus per character of the response, a
stand-in for a learned reward model that has picked up a taste for long answers (the length bias
Singhal et al. 2023, "A Long Way to Go", measure in RLHF reward models). A policy can raise it
without answering better, by writing more, which is what the demo shows.
"""

from __future__ import annotations

from typing import Any

from klppo.rewards import gsm8k

LENGTH_BONUS_PER_CHAR = 0.02  # a 20-character answer earns 0.4 for its length, a right answer 1.0


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 for the right final answer after "#### ", else 0.0: the demo's gold reward."""
    return gsm8k.compute_score(solution_str, ground_truth)


def paid_for_length(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """The exact match plus ``LENGTH_BONUS_PER_CHAR`` per character, as verl's reward_extra_info
    dict: ``score`` (what PPO trains on) and its two components."""
    correct = gsm8k.compute_score(solution_str, ground_truth)
    bonus = LENGTH_BONUS_PER_CHAR * len(solution_str)
    return {"score": correct + bonus, "exact_match": correct, "length_bonus": bonus}
