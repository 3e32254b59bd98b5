"""KL estimators, KL coefficient controllers and KL-shaped token rewards.

Shapes:
    B  batch size (sequences)
    T  response length (padded)

Masks are bool, True = real token. Log-probs are the per-token log pi(y_t | x, y_<t) of
the sampled tokens, shape (B, T). Estimators follow J. Schulman, "Approximating KL
divergence" (2020, http://joschu.net/blog/kl-approx.html) with verl's names and clamps
(`verl/trainer/ppo/core_algos.py: kl_penalty`).
"""

from typing import Dict, Tuple

import torch

from klppo.algo.stats import masked_mean

# Base estimators and their straight-through "+" variants (value of the base, gradient of k2).
KL_PENALTY_NAMES: Tuple[str, ...] = (
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "k1+", "k2+", "k3+", "low_var_kl+",
)


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """The base estimator `name` (no "+"), elementwise; shapes as `logprob`."""
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    # name in ("low_var_kl", "k3"): k3 = r - log r - 1 with r = p_ref / p, always >= 0.
    kl = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)  # verl: keep exp finite
    kld = torch.exp(kl) - kl - 1.0
    return torch.clamp(kld, min=-10.0, max=10.0)  # verl's clamp


def _kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """`kl_penalty` under a name that does not clash with verl's argument name."""
    if name not in KL_PENALTY_NAMES:
        raise ValueError(f"unknown kl_penalty {name!r}; valid names are {', '.join(KL_PENALTY_NAMES)}")
    if not name.endswith("+"):
        return _kl_value(logprob, ref_logprob, name)
    value = _kl_value(logprob, ref_logprob, name[:-1])
    k2 = _kl_value(logprob, ref_logprob, "k2")
    return k2 + (value - k2).detach()  # forward: value; backward: d k2 = (logprob - ref)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs.

    logprob, ref_logprob: (B, T). Returns (B, T), unmasked.
    Names: "kl"/"k1" log-ratio; "abs" its absolute value; "mse"/"k2" half squared
    log-ratio; "low_var_kl"/"k3" the non-negative low-variance estimator. A trailing "+"
    ("k1+", "k2+", "k3+", "low_var_kl+") keeps the base estimator's value but takes k2's
    gradient, which is the unbiased gradient of KL (straight-through, as verl).
    Raises ValueError for any other name.
    """
    return _kl_penalty(logprob, ref_logprob, kl_penalty)


class FixedKLController:
    """Constant KL coefficient; `update` is a no-op (verl's FixedKLController)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient; the arguments exist so both controllers are called alike."""

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, d: Dict[str, float]) -> None:
        self.value = float(d["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards `target_kl`.

    Ziegler et al. 2019 (arXiv:1909.08593, sec. 2.2): e = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta * (1 + e * n_steps / horizon). Takes Python floats: the caller reads the
    batch KL off the device once per step.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply the coefficient by 1 + clip(current_kl / target - 1, +-0.2) * n_steps / horizon."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: Dict[str, float]) -> None:
        """Restore the coefficient; target_kl and horizon stay as configured for this run."""
        self.value = float(d["value"])


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """KL-shaped rewards r_t = score_t - beta * KL_t on real tokens (verl's apply_kl_penalty).

    token_level_scores, old_log_prob, ref_log_prob, response_mask: (B, T).
    Returns token_level_rewards (B, T) and stats (0-dim tensors):
    "actor/reward_kl_penalty": mean over sequences of each sequence's token-mean KL (the
    number to feed to AdaptiveKLController.update) and "actor/reward_kl_penalty_coeff".
    """
    with torch.no_grad():
        mask = response_mask.bool()
        kld = _kl_penalty(old_log_prob, ref_log_prob, kl_penalty)
        kld = torch.where(mask, kld, torch.zeros_like(kld))
        token_level_rewards = token_level_scores - kl_coef * kld
        current_kl = masked_mean(kld, mask, dim=-1).mean()  # (B,) -> ()
    stats = {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef), device=kld.device),
    }
    return token_level_rewards, stats



def importance_weighted_kl(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    response_mask: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """KL(pi || pi_ref) per token, from responses sampled by another policy mu (offline data).

    KL = E_pi[sum_t log pi/pi_ref] / E_pi[|y|], and E_pi[f(y)] = E_mu[w(y) f(y)] with the
    sequence weight w(y) = prod_t pi(y_t) / mu(y_t). The weights are self-normalised over the
    batch (softmax of the summed log-ratios: finite for any ratio, biased towards mu for small
    batches, as every self-normalised estimator), so
    KL = sum_i w_i sum_t (log pi - log pi_ref)_it / sum_i w_i |y_i|.

    logprob, ref_logprob, behaviour_logprob, response_mask: (B, T). Returns the estimate and
    the weights' effective sample size 1 / sum_i w_i^2 (in [1, B]; a small one says the
    recorded responses are far from what pi would sample and the estimate is noisy).
    """
    mask = response_mask.bool()
    zero = torch.zeros_like(logprob)
    log_w = torch.where(mask, logprob - behaviour_logprob, zero).sum(-1)  # (B,)
    w = torch.softmax(log_w.float(), dim=0)  # (B,), sums to 1
    per_sequence = torch.where(mask, logprob - ref_logprob, zero).sum(-1).float()  # (B,)
    kl = (w * per_sequence).sum() / (w * mask.sum(-1).float()).sum().clamp(min=1e-8)
    return kl, 1.0 / w.square().sum()
