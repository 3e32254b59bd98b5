"""Rollout correction in the actor update: where verl applies ``algorithm.rollout_correction``.

Decoupled mode (``bypass_mode`` false; three policies mu, pi_old, pi): once per step, before
the mini-batches, the weights pi_old / mu and the rejection mask are computed from the
batch's old log-probs and its recorded behaviour log-probs over the whole global batch (so
batch normalisation and the ``rollout_corr/`` metrics are those of one process on the whole
batch), then every micro-batch's policy loss is multiplied by its detached weights, and the
rejected tokens leave the actor's losses and the token counts that normalise them (verl
overwrites ``response_mask`` with the same effect on the actor). Unlike verl, rejected tokens
still count in the advantages and the critic's update, which this phase comes after.

Bypass mode (pi_old = mu: the scoring phase took the recorded log-probs as old log-probs): the
weights and rejection are computed in each micro-batch from the current policy's log-probs
against mu (no gradient through them); ``ppo_clip`` clips the ratio pi / mu and applies no
weights (the ratio is the correction), ``reinforce`` uses -A log pi times the weights. The
rejection mask restricts the policy loss only; the counts stay those of every token, as in
verl's bypass loss. The metrics are then micro-batch token means, like the actor's others.
"""

from __future__ import annotations

import dataclasses

import torch

from klppo.algo import (
    compute_policy_loss,
    compute_policy_loss_of_mode,
    compute_policy_loss_reinforce,
    compute_rollout_correction_and_rejection_mask,
)
from klppo.distributed import all_gather_rows, my_rows
from klppo.trainer.cov_selection import cov_policy_loss
from klppo.rollout.batch import RolloutBatch
from klppo.run.settings import ActorUpdateSettings, RolloutCorrectionSettings


def _correct(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
             s: RolloutCorrectionSettings):
    """(weights or None, kept-token mask, metrics) of (b, T) inputs under the settings ``s``."""
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, mask, rollout_is=s.rollout_is, rollout_is_threshold=s.is_threshold,
        rollout_is_threshold_lower=s.is_threshold_lower, rollout_is_batch_normalize=s.batch_normalize,
        rollout_rs=s.rs)


def with_rollout_correction(batch: RolloutBatch, s: RolloutCorrectionSettings
                            ) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """Decoupled mode: ``batch`` (this rank's rows) with its weights and loss mask, and the metrics.

    Only rows that carry behaviour log-probs enter the metrics; the weights and rejection need
    every row to (the data reader requires it when the correction is on). Without behaviour
    log-probs, or in bypass mode, ``batch`` comes back as it was, with no metrics.
    """
    if batch.rollout_log_probs is None or s.bypass_mode:
        return batch, {}
    mask = batch.response_mask & batch.has_rollout_log_probs[:, None]  # (b, T)
    # The whole global batch, on every rank: batch normalisation and the metrics span it.
    gathered = [all_gather_rows(t) for t in (batch.old_log_prob, batch.rollout_log_probs, mask)]
    weights, keep, metrics = _correct(*gathered, s)
    if s.rollout_is is None and not s.rs:  # diagnostics only
        return batch, metrics
    assert bool(batch.has_rollout_log_probs.all()), "the reader requires rollout_log_probs when correcting"
    return dataclasses.replace(batch, rollout_is_weights=None if weights is None else my_rows(weights),
                               loss_mask=my_rows(keep)), metrics


def step_is_weights(batch: RolloutBatch, s: RolloutCorrectionSettings) -> torch.Tensor | None:
    """Decoupled mode's importance weights (B, T) over a batch every rank holds whole, as the
    update applies them (``with_rollout_correction``), for what reads them before it (the optimal
    token baseline, verl's ``rollout_is_weights`` there); None where no weights apply."""
    if batch.rollout_log_probs is None or s.bypass_mode or s.rollout_is is None:
        return None
    mask = batch.response_mask & batch.has_rollout_log_probs[:, None]
    return _correct(batch.old_log_prob, batch.rollout_log_probs, mask, s)[0]


def policy_loss(micro: RolloutBatch, log_prob: torch.Tensor, s: ActorUpdateSettings, counts: dict
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch: the one ``policy_loss.loss_mode`` names (with the weights
    the decoupled correction set; Clip-Cov's and KL-Cov's on the tokens picked for the mini-batch),
    or in bypass mode the loss ``loss_type`` names, corrected against mu (``config.checks`` refuses
    bypass mode with another loss mode than vanilla)."""
    rc = s.rollout_correction
    clip = dict(clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c)
    if s.cov is not None:  # Clip-Cov / KL-Cov (``config.checks`` refuses them in bypass mode)
        return cov_policy_loss(micro, log_prob, s, counts)
    if not rc.bypass_mode:
        return compute_policy_loss_of_mode(s.policy_loss_mode, micro.old_log_prob, log_prob, micro.advantages,
                                           micro.update_mask, **clip, loss_agg_mode=s.loss_agg_mode,
                                           tau_pos=s.tau_pos, tau_neg=s.tau_neg,
                                           rollout_is_weights=micro.rollout_is_weights, **counts)
    rollout_log_prob = micro.old_log_prob  # pi_old = mu in bypass mode
    with torch.no_grad():
        weights, keep, metrics = _correct(log_prob.detach(), rollout_log_prob, micro.response_mask, rc)
    if rc.loss_type == "reinforce":
        loss, stats = compute_policy_loss_reinforce(rollout_log_prob, log_prob, micro.advantages, keep,
                                                    loss_agg_mode=s.loss_agg_mode, rollout_is_weights=weights,
                                                    **counts)
    else:  # the ratio pi / mu is the correction: weights on top would count it twice (verl)
        loss, stats = compute_policy_loss(rollout_log_prob, log_prob, micro.advantages, keep, **clip,
                                          loss_agg_mode=s.loss_agg_mode, **counts)
    return loss, {**stats, **metrics}
