"""Reward functions: built-in rules chosen by data_source (GSM8K) and user functions."""

from klppo.rewards.gsm8k import compute_score as gsm8k_compute_score
from klppo.rewards.gsm8k import extract_solution
from klppo.rewards.score import (
    RewardFunction,
    default_compute_score,
    load_custom_reward_function,
    make_reward_fn,
    score_responses,
)

__all__ = [
    "RewardFunction",
    "default_compute_score",
    "extract_solution",
    "gsm8k_compute_score",
    "load_custom_reward_function",
    "make_reward_fn",
    "score_responses",
]
