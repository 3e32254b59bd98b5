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


def _ranking_by_score(values: list[float]) -> list:
    """Indices best first; equal scores form a tie (a list of indices)."""
    tiers = [[i for i, v in enumerate(values) if v == level] for level in sorted(set(values), reverse=True)]
    return [tier if len(tier) > 1 else tier[0] for tier in tiers]


def group_ranking_rewards(
    scores: torch.Tensor, group_index: torch.Tensor, method: Literal["bradley_terry", "plackett_luce"],
    *, scale: float = 1.0, center: bool = True,
) -> torch.Tensor:
    """(B,) or (B, K) scores of K reward models -> (B,) rewards distilled from each group's rankings.

    Within a group (one prompt's responses) each reward model ranks the responses by
    descending score, equal scores tied; the K rankings are several annotators' rankings of
    the group, distilled together as recorded rankings are.
    """
    by_model = scores.reshape(len(scores), -1)  # (B, K)
    rewards = torch.zeros(len(scores), dtype=torch.float32, device=scores.device)
    for group in group_index.unique().tolist():
        rows = (group_index == group).nonzero().squeeze(-1)
        rankings = [_ranking_by_score(column) for column in by_model[rows].T.tolist()]
        rewards[rows] = torch.tensor(ranking_rewards(rankings, len(rows), method, scale=scale, center=center),
                                     device=scores.device)
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
            where=r.where,
            rollout_log_probs=r.rollout_log_probs,
        )
        for r in records
    ]
