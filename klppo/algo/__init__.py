"""Pure tensor math for KL-regularised PPO: masked stats, KL, advantages, losses, rankings,
rollout correction, groups without spread.

Imports only torch and the standard library; takes tensors and plain numbers, returns
tensors (stats as 0-dim tensors). Names follow verl's `trainer/ppo/core_algos.py`.
"""

from klppo.algo.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from klppo.algo.groups import (
    dynamic_sampling_keep,
    group_has_spread,
    zero_advantage_fraction,
    zero_std_group_fraction,
)
from klppo.algo.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    importance_weighted_kl,
    kl_penalty,
)
from klppo.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
    compute_policy_loss_of_mode,
    compute_policy_loss_reinforce,
    compute_value_loss,
    entropy_from_logits,
    explained_variance,
    kl_loss,
    logprobs_from_logits,
)
from klppo.algo.ranking import (
    bradley_terry_loss,
    bradley_terry_strengths,
    comparisons_from_annotators,
    plackett_luce_loss,
    plackett_luce_strengths,
    rankings_to_comparisons,
    scalar_rewards_from_strengths,
)
from klppo.algo.rollout_correction import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    rollout_probs_diff_metrics,
    compute_rollout_rejection_mask,
)
from klppo.algo.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantage",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "bradley_terry_loss",
    "bradley_terry_strengths",
    "comparisons_from_annotators",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_offpolicy_metrics",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gspo",
    "compute_policy_loss_of_mode",
    "compute_policy_loss_reinforce",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "rollout_probs_diff_metrics",
    "compute_rollout_rejection_mask",
    "compute_value_loss",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "explained_variance",
    "group_has_spread",
    "importance_weighted_kl",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "plackett_luce_loss",
    "plackett_luce_strengths",
    "rankings_to_comparisons",
    "scalar_rewards_from_strengths",
    "zero_advantage_fraction",
    "zero_std_group_fraction",
]
