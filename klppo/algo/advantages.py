"""Advantage estimators: GAE (with a critic) and group / outcome estimators (without one).

Shapes:
    B  batch size (sequences)
    T  response length (padded)
    G  number of distinct groups (prompts) in `index`

Masks are bool, True = real token. `index` gives each sequence's group id (the prompt it
answers): a length-B sequence of hashable ids (str, int, ...) or a 1-D integer tensor.
Every estimator returns (advantages, returns), both (B, T) and zero at padded tokens, and
runs under torch.no_grad. Names and conventions follow verl's
`verl/trainer/ppo/core_algos.py`; group statistics are vectorised with index_add
instead of verl's per-sequence Python loop (tests check both give the same numbers).
"""

from typing import Hashable, Optional, Sequence, Tuple, Union

import torch

from klppo.algo.stats import masked_whiten

GroupIndex = Union[Sequence[Hashable], torch.Tensor]


def _zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _gae_raw(
    token_level_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Unwhitened GAE advantages (B, T), not yet zeroed at padding.

    Schulman et al. 2016 (arXiv:1506.02438) eq. 16: A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t, computed backwards. A padded position is skipped:
    it neither updates V_{t+1} nor the running A, so padding (or observation tokens) in the
    middle of a row does not leak into earlier tokens (verl's nextvalues/lastgaelam carry).
    """
    next_values = torch.zeros_like(values[:, 0])  # (B,) V_{t+1} of the next real token
    last_gae = torch.zeros_like(values[:, 0])  # (B,) A_{t+1} of the next real token
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_values = torch.where(mask[:, t], values[:, t], next_values)
        last_gae = torch.where(mask[:, t], gae_t, last_gae)
        reversed_adv.append(last_gae)
    return torch.stack(reversed_adv[::-1], dim=1)


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets (verl's compute_gae_advantage_return).

    token_level_rewards, values, response_mask: (B, T). Returns (advantages, returns),
    both (B, T): returns = raw GAE + values (the critic's target, not whitened);
    advantages = raw GAE whitened over the real tokens of the batch. Both are 0 at padding.
    """
    mask = response_mask.bool()
    advantages = _gae_raw(token_level_rewards, values, mask, gamma, lam)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    return _zero_padding(advantages, mask), _zero_padding(returns, mask)


def _group_ids(index: GroupIndex, batch_size: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    """Dense group ids (B,) in [0, G) and G, from hashable ids or an integer tensor."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} group ids but the batch has {batch_size} sequences")
    if isinstance(index, torch.Tensor):
        uniques, ids = torch.unique(index.reshape(-1), return_inverse=True)
        return ids.to(device), uniques.numel()
    dense = {}
    ids = [dense.setdefault(g, len(dense)) for g in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_stats(
    scores: torch.Tensor, ids: torch.Tensor, num_groups: int, var_floor: float = 0.0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (mean, std, size) of its group's scores, each (B,).

    scores: (B,), ids: (B,) in [0, G). std is unbiased (as torch.std), from a variance of at
    least ``var_floor``. Groups of one sequence get mean 0 and std 1, as verl, so a lone
    answer keeps its raw score.
    """
    zeros = scores.new_zeros(num_groups)  # (G,)
    size = zeros.index_add(0, ids, torch.ones_like(scores))  # (G,)
    mean = zeros.index_add(0, ids, scores) / size
    sq_dev = zeros.index_add(0, ids, (scores - mean[ids]) ** 2)
    std = torch.sqrt((sq_dev / (size - 1).clamp(min=1)).clamp(min=var_floor))
    single = size < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[ids], std[ids], size[ids]


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each answer's score relative to its group (Shao et al. 2024, arXiv:2402.03300).

    token_level_rewards, response_mask: (B, T); index: B group ids. score = sum over T;
    adv = (score - group mean) / (group std + epsilon), or score - group mean when
    `norm_adv_by_std_in_grpo` is False (Dr. GRPO, arXiv:2503.20783). Broadcast over real
    tokens. Returns (advantages, returns), identical, (B, T).
    """
    return _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, var_floor=0.0)


@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's grpo_vectorized: GRPO with the group variance floored at ``epsilon`` (so a group
    whose scores nearly agree is divided by at least sqrt(epsilon), not by almost 0)."""
    return _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, var_floor=epsilon)


def _grpo(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, var_floor):
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    mean, std, _ = _group_stats(scores, ids, num_groups, var_floor)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    return _outcome(adv, mask)


def _outcome(adv: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sequence's advantage (B,) on each of its real tokens: (advantages, returns), identical, (B, T)."""
    advantages = _zero_padding(adv.unsqueeze(-1).expand(mask.shape).to(adv.dtype), mask)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the other answers to the same prompt (arXiv:2402.14740).

    token_level_rewards, response_mask: (B, T); index: B group ids. For a group of n > 1,
    score - mean(others) = (score - mean) * n / (n - 1); a group of one keeps its score
    (verl). `epsilon` is unused, kept for verl's signature. Returns (advantages, returns).
    """
    return _rloo(token_level_rewards, response_mask, index, lone=None)


@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's rloo_vectorized: RLOO, except that a group of one gets advantage 0 (no other
    answer to compare with), where ``compute_rloo_outcome_advantage`` keeps its score."""
    return _rloo(token_level_rewards, response_mask, index, lone=0.0)


def _rloo(token_level_rewards, response_mask, index, lone: Optional[float]):
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    mean, _, size = _group_stats(scores, ids, num_groups)
    loo = (scores - mean) * size / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, loo, scores if lone is None else torch.full_like(scores, lone))
    return _outcome(adv, mask)


@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """OPO: score minus the group's length-weighted mean score (Hao et al. 2025,
    arXiv:2505.23585; verl's opo), the baseline that minimises the gradient's variance when
    a response's gradient grows with its length.

    token_level_rewards, response_mask: (B, T); index: B group ids. baseline = sum_j L_j s_j /
    sum_j L_j over the group (itself included; L = response tokens), 0 for a group of one.
    ``epsilon`` is unused, kept for verl's signature. Returns (advantages, returns), identical.
    """
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    lengths = mask.sum(dim=-1).to(scores.dtype)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    _, _, size = _group_stats(scores, ids, num_groups)
    zeros = scores.new_zeros(num_groups)
    weighted = zeros.index_add(0, ids, lengths * scores)[ids] / zeros.index_add(0, ids, lengths)[ids].clamp(min=1)
    return _outcome(scores - torch.where(size > 1, weighted, torch.zeros_like(scores)), mask)


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, arXiv:2503.19595; verl's grpo_passk): only each
    group's best answer gets an advantage, its margin over the second best, divided by the
    group's std (+ epsilon) when ``norm_adv_by_std_in_grpo``; every other answer gets 0.

    token_level_rewards, response_mask: (B, T); index: B group ids, every group of at least
    two (a ValueError otherwise, as verl). Of tied best answers the first in the batch is the
    best (its margin is then 0). Returns (advantages, returns), identical, (B, T).
    """
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    _, std, size = _group_stats(scores, ids, num_groups)
    if bool((size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 answers to each prompt: it compares each group's best two")
    best = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, ids, scores, reduce="amax")
    order = torch.arange(scores.shape[0], device=scores.device)
    is_best = scores == best[ids]
    first = torch.full((num_groups,), scores.shape[0], device=scores.device).scatter_reduce(
        0, ids, torch.where(is_best, order, scores.shape[0]), reduce="amin")
    winner = order == first[ids]  # (B,) one per group
    others = torch.where(winner, -torch.inf, scores)
    second = torch.full_like(best, -torch.inf).scatter_reduce(0, ids, others, reduce="amax")
    margin = best[ids] - second[ids]
    if norm_adv_by_std_in_grpo:
        margin = margin / (std + epsilon)
    return _outcome(torch.where(winner, margin, torch.zeros_like(margin)), mask)


@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPG's advantage (Chu et al. 2025, arXiv:2504.02546; verl's gpg): the score minus its
    group's mean, scaled by alpha = B / (answers with a non-zero score), which undoes the
    dilution of the gradient by groups that all scored 0, and divided by ``f_norm``.

    token_level_rewards, response_mask: (B, T); index: B group ids; a group of one has mean 0.
    The batch is the whole step's (alpha counts over it). ``epsilon`` is unused, kept for
    verl's signature. Returns (advantages, returns), identical, (B, T).
    """
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    mean, _, _ = _group_stats(scores, ids, num_groups)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    return _outcome(alpha * (scores - mean) / f_norm, mask)


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    token_level_rewards, response_mask: (B, T). returns_t = r_t + gamma * returns_{t'}, t' the
    next real token: a masked position inside a response (a tool's reply in a multi-turn
    rollout) is skipped, neither discounting nor resetting the return, as GAE skips it. verl
    restarts the return there instead, which would cut every turn but the last from the score;
    on single-turn batches (padding only after the response) the two agree. Returns
    (advantages, returns), (B, T); both 0 at padding.
    """
    mask = response_mask.bool()
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])  # (B,)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    advantages = _zero_padding(masked_whiten(returns, mask), mask)
    return advantages, _zero_padding(returns, mask)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (arXiv:2501.03262, verl's rf++ baseline).

    token_level_rewards, response_mask: (B, T); index: B group ids. adv = score - group
    mean (0 for a group of one), broadcast over real tokens, then whitened over all real
    tokens of the batch. `epsilon` is unused, kept for verl's signature.
    Returns (advantages, returns), identical, (B, T).
    """
    mask = response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = _group_ids(index, scores.shape[0], scores.device)
    mean, _, _ = _group_stats(scores, ids, num_groups)
    adv = _zero_padding((scores - mean).unsqueeze(-1).expand_as(token_level_rewards), mask)
    advantages = _zero_padding(masked_whiten(adv, mask), mask)
    return advantages, advantages


@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505; verl's remax): the return-to-go minus the score of
    the greedy response to the same prompt, a baseline that costs one greedy generation per prompt.

    token_level_rewards, response_mask: (B, T); reward_baselines: (B,), each sample's prompt's
    greedy score. returns_t = sum_{t' >= t} r_t' over real tokens (no discount, as verl);
    advantages = returns - baseline at real tokens, not whitened. Returns (advantages, returns).
    """
    mask = response_mask.bool()
    rewards = _zero_padding(token_level_rewards, mask)
    returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return _zero_padding(returns - reward_baselines.unsqueeze(-1), mask), _zero_padding(returns, mask)


# ---- the optimal token baseline (OTB, verl's optimal_token_baseline) ----
#
# A group baseline (GRPO, RLOO) gives every token of a response one number. OTB gives each
# position t its own, the baseline that minimises the variance of the policy gradient there:
#     B*_t = sum_i G_{i,t} W_{i,t} / sum_i W_{i,t}      over the group's responses i,
# with G_{i,t} the return from t on and W_{i,t} = sum_{j <= t} w_{i,j}, where
# w = ||e_a - pi||^2 = 1 - 2 pi(a) + sum_v pi(v)^2 is the squared norm of the log-prob's gradient
# with respect to the logits at the sampled token a: the "energy" a path has taken on by t. It
# needs each token's sum of squared probabilities (``sum_pi_squared``, from the pi_old forward) and
# pi_old(a); with rollout correction's importance weights rho, w becomes rho^2 w. The group sums
# are vectorised with index_add (verl loops over groups in Python).

OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


def score_norms(old_log_prob: torch.Tensor, sum_pi_squared: torch.Tensor,
                rollout_is_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, T) w = 1 - 2 pi(a) + sum pi^2 per token, times rho^2 where importance weights are given."""
    w = 1.0 - 2.0 * old_log_prob.exp() + sum_pi_squared
    return w if rollout_is_weights is None else w * rollout_is_weights.square()


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    handle_zero_tail: bool = False,
    skip_empty: bool = False,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T): returns G_t (reward-to-go, undiscounted), advantages
    G_t - B*_t at real tokens. Not whitened.

    A response alone in its group gets no baseline (advantage = return). ``handle_zero_tail``:
    where a group's longest response is the only one that long, its baseline past the
    second-longest response's end is 0 (there, B*_t would be its own return, its advantage 0).
    ``skip_empty``: responses with no token do not count as group members (verl's
    ``tir_optimal_token_baseline``, which also sets ``handle_zero_tail``).
    """
    mask = response_mask.bool()
    rewards = _zero_padding(token_level_rewards, mask)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    energy = torch.where(mask, score_norms(old_log_prob, sum_pi_squared, rollout_is_weights), 0.0).cumsum(-1)
    ids, groups = _group_ids(index, len(mask), mask.device)
    lengths = mask.sum(-1)  # (B,)
    member = (lengths > 0) if skip_empty else torch.ones_like(lengths, dtype=torch.bool)
    size = torch.zeros(groups, device=mask.device, dtype=torch.long).index_add(0, ids, member.long())  # (G,)
    weighted = torch.where(mask, energy, 0.0)  # (B, T): W where the token is real
    numerator = returns.new_zeros(groups, mask.shape[1]).index_add(0, ids, returns * weighted)
    denominator = returns.new_zeros(groups, mask.shape[1]).index_add(0, ids, weighted) + epsilon
    baseline = (numerator / denominator)[ids]  # (B, T)
    baseline = torch.where((size[ids] > 1)[:, None] & member[:, None], baseline, 0.0)
    if handle_zero_tail:
        baseline = torch.where(_lone_tail(lengths, ids, groups, size, mask.shape[1]), 0.0, baseline)
    return _zero_padding(returns - baseline, mask), _zero_padding(returns, mask)


def _lone_tail(lengths: torch.Tensor, ids: torch.Tensor, groups: int, size: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: the positions of a group's longest response past the group's second-longest
    response, where that response is the only one of its length (False elsewhere)."""
    longest = lengths.new_zeros(groups).scatter_reduce(0, ids, lengths, "amax", include_self=False)
    at_longest = lengths == longest[ids]
    count = lengths.new_zeros(groups).index_add(0, ids, at_longest.long())
    others = torch.where(at_longest, torch.zeros_like(lengths), lengths)
    second = lengths.new_zeros(groups).scatter_reduce(0, ids, others, "amax", include_self=True)
    lone = at_longest & (count[ids] == 1) & (size[ids] > 1)
    positions = torch.arange(width, device=lengths.device)
    return lone[:, None] & (positions[None, :] >= second[ids][:, None])


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_vectorized",
                  "rloo_vectorized", "opo", "grpo_passk", "gpg", "remax", *OTB_ESTIMATORS)
_GROUP_OUTCOME = {  # estimators of (token_level_rewards, response_mask, index)
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}
_GROUP_OUTCOME_NORMED = {  # ... and norm_adv_by_std_in_grpo
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
}


def compute_advantage(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    *,
    values: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: Optional[torch.Tensor] = None,
    old_log_prob: Optional[torch.Tensor] = None,
    sum_pi_squared: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T), by the named estimator; ``values`` only for "gae",
    ``reward_baselines`` (B,) only for "remax", ``old_log_prob``, ``sum_pi_squared`` and
    ``rollout_is_weights`` (B, T) (None: no importance weights) only for the OTB estimators."""
    if adv_estimator == "gae":
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    if adv_estimator in _GROUP_OUTCOME_NORMED:
        return _GROUP_OUTCOME_NORMED[adv_estimator](token_level_rewards, response_mask, index,
                                                    norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    if adv_estimator in _GROUP_OUTCOME:
        return _GROUP_OUTCOME[adv_estimator](token_level_rewards, response_mask, index)
    if adv_estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)
    if adv_estimator == "remax":
        return compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)
    if adv_estimator in OTB_ESTIMATORS:
        multi_turn = adv_estimator == "tir_optimal_token_baseline"
        return compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_prob,
                                                        sum_pi_squared, rollout_is_weights,
                                                        handle_zero_tail=multi_turn, skip_empty=multi_turn)
    raise ValueError(f"unknown adv_estimator {adv_estimator!r}; use one of {', '.join(ADV_ESTIMATORS)}")


# ---- PF-PPO: resampling a batch towards its reliable rewards ----

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float = 2.0) -> torch.Tensor:
    """(B,) the sampling weight of each response by its score (verl's compute_pf_ppo_reweight_data,
    Policy Filtration for PPO): ``pow`` |score|^weight_pow; ``max_min`` 1 for the batch's best and
    worst scores, 0 otherwise; ``max_random`` 0.4 for the best score, 0.1 otherwise; then + 1e-8,
    so that no weight is 0."""
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"PF-PPO reweight method must be one of {PF_PPO_METHODS}, not {method!r}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_sample(scores: torch.Tensor, method: str, weight_pow: float, generator: torch.Generator) -> torch.Tensor:
    """(B,) row indices drawn with replacement by ``pf_ppo_weights``: the batch PF-PPO trains on
    (same size; rows may repeat). ``generator`` (on the CPU) makes the draw repeatable."""
    weights = pf_ppo_weights(scores.detach().float().cpu(), method, weight_pow)
    return torch.multinomial(weights, len(weights), replacement=True, generator=generator)
