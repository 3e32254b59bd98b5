"""Rewards distilled from rankings: each prompt's ranking(s) -> one scalar reward per response.

A prompt whose responses were ranked by people or models (A > B > C, several annotators, ties)
gets Bradley-Terry or Plackett-Luce strengths (``klppo.algo.ranking``), and those, scaled and
centred within the prompt, are the rewards PPO's advantages are computed from: offline RLHF
with no scalar label and no generation.
"""

from __future__ import annotations

from typing import Literal

import torch

from klppo.algo.ranking import (
    bradley_terry_strengths,
    comparisons_from_annotators,
    plackett_luce_strengths,
    scalar_rewards_from_strengths,
)
from klppo.data.ranked import RankedRecord
from klppo.data.rl_dataset import PromptRecord

RANKED_DATA_SOURCE = "ranked"  # data_source of ranked rows that name none


def ranking_rewards(
    rankings: list[list], n_responses: int, method: Literal["bradley_terry", "plackett_luce"],
    *, scale: float = 1.0, center: bool = True,
) -> list[float]:
    """One reward per response from one or several annotators' rankings (best first)."""
    if method == "bradley_terry":
        strengths = bradley_terry_strengths(comparisons_from_annotators(rankings, n_responses))
    else:
        strengths = plackett_luce_strengths(rankings, n_responses)
    return scalar_rewards_from_strengths(strengths, scale=scale, center=center).tolist()


def group_ranking_rewards(
    scores: torch.Tensor, group_index: torch.Tensor, method: Literal["bradley_terry", "plackett_luce"],
    *, scale: float = 1.0, center: bool = True,
) -> torch.Tensor:
    """(B,) reward-model scores -> (B,) rewards distilled from each group's ranking by score.

    Within a group (one prompt's responses) the responses are ranked by descending score,
    equal scores tied, and the ranking is distilled as recorded rankings are.
    """
    rewards = torch.zeros_like(scores, dtype=torch.float32)
    for group in group_index.unique().tolist():
        rows = (group_index == group).nonzero().squeeze(-1)
        values = scores[rows].tolist()
        tiers = [[i for i, v in enumerate(values) if v == level] for level in sorted(set(values), reverse=True)]
        ranking = [tier if len(tier) > 1 else tier[0] for tier in tiers]
        rewards[rows] = torch.tensor(ranking_rewards([ranking], len(values), method, scale=scale, center=center))
    return rewards


def with_ranking_rewards(
    records: list[RankedRecord], method: Literal["bradley_terry", "plackett_luce"], *, scale: float, center: bool
) -> list[PromptRecord]:
    """Ranked records as RL prompt records whose recorded ``scores`` are the distilled rewards."""
    return [
        PromptRecord(
            index=r.index,
            data_source=r.data_source or RANKED_DATA_SOURCE,
            raw_prompt=r.raw_prompt,
            prompt_ids=r.prompt_ids,
            ground_truth=r.ground_truth,
            extra_info=r.extra_info,
            responses=r.responses,
            scores=ranking_rewards(r.rankings, len(r.responses), method, scale=scale, center=center),
        )
        for r in records
    ]
