"""Groups that teach nothing: a prompt whose responses all got the same reward.

Shapes (the legend of klppo.algo): B sequences, T response length; G groups (the distinct
ids of ``index``, the prompt each response answers).

A group estimator (GRPO, RLOO, REINFORCE++ with a baseline) scores each response against the
other responses to its prompt, so a group whose rewards all tie gives every one of its tokens
an advantage of 0: it costs a forward and a backward and moves nothing (DAPO, Yu et al. 2025,
arXiv:2503.14476, section 3.2, "dynamic sampling"). "No spread" is exact here: every value
of the group equal to every other (max == min). verl's DAPO recipe tests ``np.std(values) > 0``,
which agrees on any values that tie exactly, except where rounding in the mean makes the std
of equal float64 values a few 1e-17 (np.std([0.1] * 3) > 0): verl keeps such a group, klppo
does not. A group holding a NaN has no defined spread; it counts as spread (kept), so the
run's finite-reward guard still sees the NaN instead of it vanishing with its group.
"""

from __future__ import annotations

import torch


def _dense_ids(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B,) dense group ids in [0, G) and G, from (B,) integer group ids."""
    uniques, ids = torch.unique(index.reshape(-1), return_inverse=True)
    return ids, uniques.numel()


def _group_extremes(values: torch.Tensor, ids: torch.Tensor, num_groups: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G,) max, min (NaN where the group holds a NaN) and size of each group's ``values`` (B,)."""
    empty = values.new_zeros(num_groups)
    high = empty.scatter_reduce(0, ids, values, "amax", include_self=False)
    low = empty.scatter_reduce(0, ids, values, "amin", include_self=False)
    size = torch.zeros(num_groups, dtype=torch.long, device=values.device).index_add(0, ids, torch.ones_like(ids))
    return high, low, size


def group_has_spread(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(G,) bool, groups in ascending id order: the group's values (B,) are not all equal.

    ``index``: (B,) integer group ids. A NaN makes its group count as spread (see the module's
    docstring); a group of one has no spread.
    """
    ids, num_groups = _dense_ids(index)
    high, low, _ = _group_extremes(values.float(), ids, num_groups)
    return ~(high == low)  # NaN == NaN is False: spread


def zero_std_group_fraction(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """0-dim: the fraction of groups whose ``values`` (B,) all tie (zero std), over the G groups of ``index`` (B,).

    E.g. values [1, 1, 0, 1, 2, 2], index [0, 0, 1, 1, 2, 2]: groups 0 and 2 tie, 1 does not -> 2/3.
    """
    return (~group_has_spread(values, index)).float().mean()


def dynamic_sampling_keep(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the rows DAPO's dynamic sampling keeps, those whose group has spread or has one
    member (verl's rule: a lone response is kept, its std is 0 only for want of company).

    values: (B,) the filter metric of each response; index: (B,) integer group ids.
    """
    ids, num_groups = _dense_ids(index)
    high, low, size = _group_extremes(values.float(), ids, num_groups)
    kept = ~(high == low) | (size == 1)  # (G,)
    return kept[ids]


def zero_advantage_fraction(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim: the fraction of real tokens (``mask`` (B, T), True = real) whose advantage (B, T) is exactly 0.

    Tokens of a tied group under a group estimator; under GAE a zero is a coincidence. A batch
    without real tokens gives 0.
    """
    real = mask.bool()
    zeros = ((advantages == 0) & real).sum()
    return zeros.float() / real.sum().clamp(min=1).float()
