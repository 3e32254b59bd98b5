"""Step 5 of a PPO iteration: advantages and returns, and PF-PPO's redrawn batch.

The optimal token baseline reads pi_old's log-probs and sums of squared probabilities, and with
rollout correction's importance weights (decoupled mode) scales each token's weight by their square.

PF-PPO (``algorithm.use_pf_ppo``, with GAE as in verl) trains each step on a batch of the same
size drawn with replacement from the step's responses, each weighted by its score
(``algo.pf_ppo_weights``): a response whose reward is more reliable is trained on more often.
The draw is seeded by ``data.seed`` and the step, so every rank (each holding the whole batch)
draws the same rows, and a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from klppo.algo import OTB_ESTIMATORS, compute_advantage, pf_ppo_sample
from klppo.rollout.batch import RolloutBatch
from klppo.trainer.rollout_correction import step_is_weights

if TYPE_CHECKING:
    from klppo.run.build import PPOParts


def estimate_advantages(parts: PPOParts, batch: RolloutBatch, reward_baselines: Optional[torch.Tensor], step: int
                        ) -> tuple[RolloutBatch, dict[str, float]]:
    """(the batch with its advantages and returns, or PF-PPO's draw of it, its rows numbered (``row_id``);
    PF-PPO's metrics)."""
    adv = parts.settings.advantage
    otb = adv.estimator in OTB_ESTIMATORS
    batch.advantages, batch.returns = compute_advantage(
        adv.estimator, batch.token_level_rewards, batch.response_mask, batch.group_index, values=batch.values,
        gamma=adv.gamma, lam=adv.lam, norm_adv_by_std_in_grpo=adv.norm_adv_by_std_in_grpo,
        reward_baselines=reward_baselines, old_log_prob=batch.old_log_prob, sum_pi_squared=batch.sum_pi_squared,
        rollout_is_weights=step_is_weights(batch, parts.settings.actor.rollout_correction) if otb else None)
    metrics = {}
    if adv.pf_ppo is not None:
        pf = adv.pf_ppo
        generator = torch.Generator().manual_seed(pf.seed * 1_000_003 + step)
        rows = pf_ppo_sample(batch.token_level_scores.sum(-1), pf.method, pf.weight_pow, generator)  # host sync
        # training/pf_ppo/unique_frac: the share of the step's responses the draw kept at least once
        batch, metrics = batch.select(rows), {"training/pf_ppo/unique_frac": len(set(rows.tolist())) / len(rows)}
    batch.row_id = torch.arange(len(batch), device=batch.response_mask.device)
    return batch, metrics
