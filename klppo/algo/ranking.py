"""Learning from rankings: Bradley-Terry and Plackett-Luce fits and reward-model losses.

Shapes:
    n  items being ranked (e.g. the responses to one prompt)
    P  preference pairs in a batch
    B  prompts in a batch
    K  responses per prompt (padded)

A *ranking* lists item indices best first. An entry may also be a list of indices: a tier of
tied items, e.g. [2, [0, 3], 1] says 2 > {0 = 3} > 1. Rankings may be partial: a ranking
ranks only the items it lists among themselves, and says nothing about the others (no
comparison is made with an unlisted item). Under Plackett-Luce this is exact, not an
approximation: the order a PL model induces on any subset of items is PL with the same
strengths (Luce's choice axiom, Luce 1959), so a partial ranking is the marginal of a full one.

Ties. Pairwise (Bradley-Terry): a tie counts as half a win each way (as in chess scoring and
Elo ratings); no separate tie parameter is fitted (Davidson 1970 and Rao-Kupper 1967 do that).
Listwise (Plackett-Luce): Breslow's (1974) approximation from Cox regression, whose partial
likelihood is the PL likelihood: each member of a tier is "chosen" from the set of items
still unranked, tier included. For strict rankings both reduce to the plain models.

Prior. Both fits add `prior` pseudo-wins to each ordered pair (i, j), i != j, i.e. every pair
is also observed tied with weight 2 * prior. It is a weak symmetric prior that shrinks
strengths toward equality (as in Bayesian BT); it is what keeps the estimate finite when an
item won every comparison (the MLE is then at infinity) and what gives an item with no
comparisons a defined strength (near the middle of the others). With 0.1 it weighs a tenth of one real
comparison per pair, so it barely moves an estimate backed by real data.

Strengths are log-strengths theta (gamma = exp(theta)), centred to mean zero over the items:
P(i beats j) = sigmoid(theta_i - theta_j). Both fits maximise a concave log-posterior by
Newton's method with a line search, in float64, under torch.no_grad. The stopping test runs on
the device (no host sync): once the largest change falls below `tol` the estimate is frozen,
so all `n_iter` iterations run but the result is the one at convergence (about 10 are needed).
"""

from collections.abc import Sequence
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

RankingEntry = Union[int, Sequence[int]]
Ranking = Union[Sequence[RankingEntry], torch.Tensor]


def _as_tiers(ranking: Sequence[RankingEntry], n_items: int) -> List[List[int]]:
    """A list-form ranking as validated tiers [[best...], [next...], ...] of Python ints."""
    if isinstance(ranking, (str, bytes)) or not isinstance(ranking, Sequence):
        raise ValueError(f"a ranking must be a list of item indices (best first), got {ranking!r}")
    tiers, seen = [], set()
    for entry in ranking:
        tier = [entry] if isinstance(entry, int) else entry
        if isinstance(tier, (str, bytes)) or not isinstance(tier, Sequence) or not tier:
            raise ValueError(f"ranking {list(ranking)!r}: entry {entry!r} is neither an int item index "
                             "nor a non-empty list of tied int item indices")
        for i in tier:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"ranking {list(ranking)!r}: item {i!r} is not a Python int index")
            if not 0 <= i < n_items:
                raise ValueError(f"ranking {list(ranking)!r}: item {i} is out of range for {n_items} items "
                                 f"(valid indices 0..{n_items - 1})")
            if i in seen:
                raise ValueError(f"ranking {list(ranking)!r}: item {i} appears twice; list each item once")
            seen.add(i)
        tiers.append(list(tier))
    return tiers


def _check_n_items(n_items: int) -> None:
    if isinstance(n_items, bool) or not isinstance(n_items, int) or n_items < 0:
        raise ValueError(f"n_items must be a non-negative int, got {n_items!r}")


def rankings_to_comparisons(
    ranking: Ranking, n_items: int, *, dtype: torch.dtype = torch.float32, device=None
) -> torch.Tensor:
    """Pairwise win counts (n, n) of one ranking: W[i, j] = times i beat j.

    `ranking`: list of indices best first, optionally with tiers of tied items (see the module
    docstring), or a 1-D integer tensor (a strict ranking; trusted: indices must be distinct
    and in range, as checking them would need a host sync). Each listed pair gets 1 win for
    the better item, or 0.5 each way when tied; unlisted items get no comparisons.
    """
    _check_n_items(n_items)
    if isinstance(ranking, torch.Tensor):
        if ranking.dim() != 1:
            raise ValueError(f"a ranking tensor must be 1-D (item indices best first), "
                             f"got shape {tuple(ranking.shape)}")
        device = ranking.device if device is None else device
        pos = torch.full((n_items,), -1, dtype=torch.long, device=device)  # (n,) tier number, -1 unlisted
        pos[ranking.to(device=device, dtype=torch.long)] = torch.arange(ranking.shape[0], device=device)
    else:
        pos_list = [-1] * n_items
        for t, tier in enumerate(_as_tiers(ranking, n_items)):
            for i in tier:
                pos_list[i] = t
        pos = torch.tensor(pos_list, dtype=torch.long, device=device)
    listed = pos >= 0
    both = listed[:, None] & listed[None, :]  # (n, n)
    not_self = ~torch.eye(n_items, dtype=torch.bool, device=pos.device)
    beats = both & (pos[:, None] < pos[None, :])
    tied = both & (pos[:, None] == pos[None, :]) & not_self
    return beats.to(dtype) + 0.5 * tied.to(dtype)


def comparisons_from_annotators(
    rankings: Sequence[Ranking], n_items: int, *, dtype: torch.dtype = torch.float32, device=None
) -> torch.Tensor:
    """Sum of `rankings_to_comparisons` over several annotators' rankings of the same items: (n, n).

    No rankings give an all-zero matrix (whose BT fit is all zeros).
    """
    _check_n_items(n_items)
    wins = torch.zeros((n_items, n_items), dtype=dtype, device=device)
    for ranking in rankings:
        wins = wins + rankings_to_comparisons(ranking, n_items, dtype=dtype, device=device)
    return wins


def _check_fit_args(n_iter: int, tol: float, prior: float) -> None:
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol!r}")
    if not prior > 0:
        raise ValueError(f"prior must be > 0 (it keeps strengths finite when an item wins every comparison), "
                         f"got {prior!r}; use a small value such as 1e-3 for an almost-pure MLE")


# Line-search step sizes, largest first; 0 keeps the current point, so a step never lowers the objective.
_STEP_SIZES = [2.0 ** -k for k in range(12)] + [0.0]

Objective = Callable[[torch.Tensor], torch.Tensor]
GradHess = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def _maximise(objective: Objective, grad_hess: GradHess, theta: torch.Tensor, n_iter: int,
              tol: float) -> torch.Tensor:
    """Newton ascent with a line search on a concave objective invariant to shifting theta.

    theta: (..., n), leading dims are independent problems. objective maps (A, ..., n) to
    (A, ...); grad_hess maps (..., n) to the gradient (..., n) and Hessian (..., n, n). The
    Hessian is singular along the all-ones vector (the shift), so the step solves
    (-H + 11^T / n) d = g, whose solution is the Newton step within the mean-zero subspace.
    The line search tries all step sizes at once and keeps the best (the largest on ties),
    and a row is frozen once it moves less than `tol`: no Python branch on a tensor, no sync.
    """
    n = theta.shape[-1]
    shift = torch.full((n, n), 1.0 / n, dtype=theta.dtype, device=theta.device)
    sizes = torch.tensor(_STEP_SIZES, dtype=theta.dtype, device=theta.device)
    sizes = sizes.reshape(-1, *([1] * theta.dim()))  # (A, 1.., 1)
    done = torch.zeros(theta.shape[:-1], dtype=torch.bool, device=theta.device)  # (...,)
    for _ in range(n_iter):
        grad, hess = grad_hess(theta)
        # solve_ex: linalg.solve's singularity check would sync with the host on CUDA
        step = torch.linalg.solve_ex(shift - hess, grad.unsqueeze(-1)).result.squeeze(-1)  # (..., n)
        candidates = theta + sizes * step  # (A, ..., n)
        best = objective(candidates).argmax(dim=0)  # (...,) first maximum = largest step
        index = best.unsqueeze(0).unsqueeze(-1).expand(1, *theta.shape)
        new = candidates.gather(0, index).squeeze(0)
        new = new - new.mean(dim=-1, keepdim=True)  # strengths are defined up to a shift
        new = torch.where(done[..., None], theta, new)
        done = done | ((new - theta).abs().amax(dim=-1) < tol)
        theta = new
    return theta


def _pair_log_likelihood(theta: torch.Tensor, wins: torch.Tensor) -> torch.Tensor:
    """BT log-likelihood sum_ij W_ij log sigmoid(theta_i - theta_j): theta (..., n) -> (...)."""
    diff = theta[..., :, None] - theta[..., None, :]  # (..., n, n)
    # log sigmoid(x) = -softplus(-x): F.logsigmoid measured ~100x slower on small CPU tensors
    return -(wins * F.softplus(-diff, threshold=50.0)).sum(dim=(-1, -2))


def _pair_grad_hess(theta: torch.Tensor, wins: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradient (..., n) and Hessian (..., n, n) of `_pair_log_likelihood`.

    g_i = sum_j W_ij - N_ij p_ij and H = -(graph Laplacian with edge weights N_ij p_ij (1 - p_ij)),
    where N = W + W^T and p_ij = sigmoid(theta_i - theta_j).
    """
    n_pair = wins + wins.transpose(-1, -2)  # (..., n, n)
    p = torch.sigmoid(theta[..., :, None] - theta[..., None, :])
    grad = wins.sum(dim=-1) - (n_pair * p).sum(dim=-1)
    edge = n_pair * p * (1 - p)
    hess = edge - torch.diag_embed(edge.sum(dim=-1))
    return grad, hess


def _prior_wins(n: int, prior: float, dtype: torch.dtype, device) -> torch.Tensor:
    """(n, n) `prior` pseudo-wins for every ordered pair i != j (the module's symmetric prior)."""
    return prior * (1 - torch.eye(n, dtype=dtype, device=device))


@torch.no_grad()
def bradley_terry_strengths(
    wins: torch.Tensor, *, n_iter: int = 50, tol: float = 1e-8, prior: float = 0.1
) -> torch.Tensor:
    """Centred Bradley-Terry log-strengths (..., n) from win counts wins (..., n, n).

    Bradley & Terry 1952: P(i beats j) = gamma_i / (gamma_i + gamma_j). Maximum a posteriori
    with `prior` pseudo-wins on each ordered pair (module docstring), by Newton's method on the
    log-likelihood, which is concave in theta = log gamma (Hunter 2004). Newton rather than the
    MM / Zermelo (1929) iteration of Hunter 2004 because MM needs thousands of steps when
    annotators agree strongly (strengths far apart); Newton needs about 10. Computed in float64, returned in
    the dtype of `wins` (at least float32). The diagonal of `wins` is ignored; counts must be
    >= 0 (not checked: that would sync). Leading dims are a batch of independent fits.
    Degenerate inputs are defined: one item -> [0.]; no comparisons, all tied, or
    contradictory annotators (a symmetric `wins`) -> all zeros; an undefeated item -> finite.
    """
    _check_fit_args(n_iter, tol, prior)
    if wins.dim() < 2 or wins.shape[-1] != wins.shape[-2]:
        raise ValueError(f"wins must be a square (..., n, n) matrix of win counts, got shape {tuple(wins.shape)}")
    n = wins.shape[-1]
    out_dtype = torch.promote_types(wins.dtype, torch.float32)
    theta = torch.zeros(wins.shape[:-1], dtype=torch.float64, device=wins.device)  # (..., n)
    if n < 2:
        return theta.to(out_dtype)
    off_diagonal = 1 - torch.eye(n, dtype=torch.float64, device=wins.device)
    w = wins.to(torch.float64) * off_diagonal + _prior_wins(n, prior, torch.float64, wins.device)
    theta = _maximise(lambda th: _pair_log_likelihood(th, w), lambda th: _pair_grad_hess(th, w),
                      theta, n_iter, tol)
    return theta.to(out_dtype)


def _plackett_luce_stages(rankings: Sequence[Sequence[RankingEntry]], n_items: int):
    """Choice stages of all rankings: (members, n_chosen, times_chosen) as Python lists.

    Stage s picks one tier out of the items not yet ranked; members[s] (n bools) marks those
    items (tier included) and n_chosen[s] is the tier size. Stages with the same members are
    merged (their n_chosen added: the log-likelihood depends only on the sum), which keeps S
    small when many annotators rank the same few responses. A stage with a single member has
    likelihood factor 1 and is dropped (Hunter 2004 sec. 5). times_chosen[t] counts the
    stages in which t was (one of the) chosen.
    """
    chosen_per_set, times_chosen = {}, [0] * n_items
    for ranking in rankings:
        tiers = _as_tiers(ranking, n_items)
        remaining = {i for tier in tiers for i in tier}
        for tier in tiers:
            if len(remaining) > 1:
                key = frozenset(remaining)
                chosen_per_set[key] = chosen_per_set.get(key, 0) + len(tier)
                for i in tier:
                    times_chosen[i] += 1
            remaining.difference_update(tier)
    members = [[i in key for i in range(n_items)] for key in chosen_per_set]
    return members, list(chosen_per_set.values()), times_chosen


def _on_stages(theta: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """theta (..., n) spread over the stages: (..., S, n), -inf where an item is not a member."""
    neg_inf = torch.tensor(float("-inf"), dtype=theta.dtype, device=theta.device)
    return torch.where(members, theta[..., None, :], neg_inf)


def _stage_log_likelihood(theta: torch.Tensor, members: torch.Tensor, n_chosen: torch.Tensor,
                          times_chosen: torch.Tensor) -> torch.Tensor:
    """PL log-likelihood with Breslow ties: sum_t w_t theta_t - sum_s c_s logsumexp_{members_s} theta.

    theta (..., n), members (S, n) bool, n_chosen (S,), times_chosen (n,) -> (...).
    """
    masked = _on_stages(theta, members)  # (..., S, n)
    return (theta * times_chosen).sum(dim=-1) - (torch.logsumexp(masked, dim=-1) * n_chosen).sum(dim=-1)


def _stage_grad_hess(theta: torch.Tensor, members: torch.Tensor, n_chosen: torch.Tensor,
                     times_chosen: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradient (n,) and Hessian (n, n) of `_stage_log_likelihood` at theta (n,).

    With p_s = softmax of theta over stage s's members (0 elsewhere): g = w - sum_s c_s p_s,
    H = -sum_s c_s (diag(p_s) - p_s p_s^T) (the multinomial-logit Hessian).
    """
    masked = _on_stages(theta, members)  # (S, n)
    # softmax as exp(x - logsumexp): torch.softmax measured ~100x slower on small CPU tensors
    p = torch.exp(masked - torch.logsumexp(masked, dim=-1, keepdim=True))  # (S, n), 0 off the stage
    grad = times_chosen - (n_chosen[:, None] * p).sum(dim=0)
    weighted = n_chosen[:, None] * p  # (S, n)
    hess = weighted.T @ p - torch.diag(weighted.sum(dim=0))
    return grad, hess


@torch.no_grad()
def plackett_luce_strengths(
    rankings: Sequence[Sequence[RankingEntry]],
    n_items: int,
    *,
    n_iter: int = 50,
    tol: float = 1e-8,
    prior: float = 0.1,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """Centred Plackett-Luce log-strengths (n,) from rankings (lists best first, full or partial).

    Plackett 1975 / Luce 1959: a ranking is built by repeatedly choosing the next item from
    those left with probability gamma_i / sum_{left} gamma; ties by Breslow's approximation
    (module docstring). Maximum a posteriori by Newton's method on the concave log-likelihood
    in theta = log gamma (Hunter 2004 sec. 5 gives an MM alternative, slow when annotators
    agree). The `prior` adds, for every pair, the BT pseudo-wins of `bradley_terry_strengths`
    (a 2-item PL ranking is a BT comparison), with the same degenerate guarantees. Computed in
    float64, returned as `dtype`.
    """
    _check_fit_args(n_iter, tol, prior)
    _check_n_items(n_items)
    if isinstance(rankings, torch.Tensor):
        raise ValueError("plackett_luce_strengths takes a list of rankings (lists of Python ints), not a tensor")
    members_list, n_chosen_list, times_chosen_list = _plackett_luce_stages(rankings, n_items)
    theta = torch.zeros(n_items, dtype=torch.float64, device=device)  # (n,)
    if n_items < 2:
        return theta.to(dtype)
    f64 = {"dtype": torch.float64, "device": device}
    members = torch.tensor(members_list, dtype=torch.bool, device=device).reshape(-1, n_items)  # (S, n)
    stages = (members, torch.tensor(n_chosen_list, **f64), torch.tensor(times_chosen_list, **f64))
    w = _prior_wins(n_items, prior, torch.float64, device)

    def objective(th: torch.Tensor) -> torch.Tensor:
        return _stage_log_likelihood(th, *stages) + _pair_log_likelihood(th, w)

    def grad_hess(th: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        (g1, h1), (g2, h2) = _stage_grad_hess(th, *stages), _pair_grad_hess(th, w)
        return g1 + g2, h1 + h2

    return _maximise(objective, grad_hess, theta, n_iter, tol).to(dtype)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Pairwise reward-model loss, 0-dim: mean over pairs of -log sigmoid(s_chosen - s_rejected - margin).

    chosen_scores, rejected_scores, margin (optional, a tensor or number): (P,). The negative
    BT log-likelihood (Bradley & Terry 1952) as used for InstructGPT's reward model (Ouyang et
    al. 2022, eq. 1); the margin is Llama 2's (Touvron et al. 2023, eq. 2). No pairs give 0.
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    return losses.sum() / max(losses.numel(), 1)


def plackett_luce_loss(scores_in_rank_order: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Listwise reward-model loss, 0-dim: the PL negative log-likelihood of the observed orders.

    scores_in_rank_order: (B, K) the model's scores of each prompt's responses, sorted so the
    best response comes first. valid: (B, K) bool, True = a real response (default all); the
    invalid entries (padding for prompts with fewer than K responses, anywhere in the row) are
    dropped and the others keep their order. Per prompt (Plackett 1975):
        nll = -sum_k [s_k - logsumexp(s_k, ..., s_K)]
    computed with a reversed logcumsumexp. The loss is the mean nll over prompts with at
    least 2 valid responses (a single response carries no ordering); 0 when there are none.
    With K = 2 this equals `bradley_terry_loss`.
    """
    scores = scores_in_rank_order
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # logsumexp differences are lost in half precision
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    # A finite stand-in for -inf: exp(lowest - s) = 0, and an all-padding suffix gives no NaN.
    lowest = torch.full_like(scores, torch.finfo(scores.dtype).min)
    masked = torch.where(valid, scores, lowest)
    suffix_lse = torch.logcumsumexp(masked.flip(-1), dim=-1).flip(-1)  # (B, K) logsumexp of s_k..s_K
    log_choice = torch.where(valid, masked - suffix_lse, torch.zeros_like(scores))  # (B, K)
    nll = -log_choice.sum(dim=-1)  # (B,)
    counted = valid.sum(dim=-1) >= 2  # (B,)
    nll = torch.where(counted, nll, torch.zeros_like(nll))
    return nll.sum() / counted.sum().clamp(min=1).to(nll.dtype)


def scalar_rewards_from_strengths(
    strengths: torch.Tensor, *, scale: float = 1.0, center: bool = True
) -> torch.Tensor:
    """Rewards (..., n) from log-strengths (..., n): scale * (strengths - mean over the items).

    The one place of this convention. Centring makes the rewards of one prompt's responses sum
    to zero (a ranking says nothing about the absolute level); with `scale` = 1 the difference
    of two rewards is the BT log-odds that one response beats the other.
    """
    if center:
        strengths = strengths - strengths.mean(dim=-1, keepdim=True)
    return scale * strengths
