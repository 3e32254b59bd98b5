"""Clip-Cov's and KL-Cov's tokens, picked over a whole mini-batch before its micro-batches train.

The covariance of a token's log-probability and advantage is measured against the means of
the mini-batch, under the weights its micro-batches train (``klppo.algo.cov_losses``). So before
them, one no-grad forward over this rank's rows of the mini-batch gives their log-probs; every
rank gathers the mini-batch's log-probs, advantages, pi_old's log-probs and masks, puts the rows
in the step's order (``RolloutBatch.row_id``), picks the same tokens, and keeps its own rows'.
Clip-Cov's random pick ranks the candidates by a uniform number per token, drawn for the
mini-batch's rows in the step's order from a generator seeded by ``data.seed``, the step, the epoch
and the mini-batch: the same on every rank, for any micro-batch split, and after a resume. verl picks within each
micro-batch instead; the two agree where a mini-batch is one micro-batch on one rank.
"""

from __future__ import annotations

import dataclasses

import torch

from klppo.algo.cov_losses import (
    clip_cov_cut, compute_policy_loss_clip_cov, compute_policy_loss_kl_cov, kl_cov_penalised,
)
from klppo.data.batching import RowSpans, restore_order
from klppo.distributed import all_gather_rows, my_rows
from klppo.models.forward import response_logprobs
from klppo.rollout.batch import RolloutBatch
from klppo.run.settings import ActorUpdateSettings


def draw_seed(seed: int, step: int, epoch: int, mini_batch: int) -> int:
    """The seed of Clip-Cov's draw for one mini-batch of one epoch of one step."""
    return ((seed * 1_000_003 + step) * 1_009 + epoch) * 10_007 + mini_batch


@torch.no_grad()
def with_cov_tokens(actor, mini: RolloutBatch, spans: RowSpans, plan: list[list[int]], s: ActorUpdateSettings,
                    seed: int) -> RolloutBatch:
    """``mini`` (this rank's rows of a mini-batch) with ``cov_tokens`` set; ``plan`` its micro-batches' rows,
    ``seed`` the draw's (``draw_seed``)."""
    assert s.cov is not None and mini.row_id is not None, "the advantages number the rows (row_id)"
    parts = [response_logprobs(actor, part.input_ids, part.attention_mask, part.response_length,
                               temperature=s.temperature, packed=s.micro.packed, max_tokens=s.micro.max_tokens,
                               head=s.head, spans=spans.select(rows))[0]
             for rows in plan for part in (mini.select(rows),)]
    log_prob = restore_order(torch.cat(parts), [i for rows in plan for i in rows])
    mask = mini.update_mask
    gathered = [all_gather_rows(t) for t in (mini.row_id, log_prob, mini.old_log_prob, mini.advantages, mask)]
    order = torch.argsort(gathered[0])  # the step's order, whichever rank holds which rows
    row_id, log_prob_all, old_all, adv_all, mask_all = (t[order] for t in gathered)
    if s.cov.mode == "kl_cov":
        picked = kl_cov_penalised(log_prob_all, adv_all, mask_all, kl_cov_ratio=s.cov.ratio)
    else:
        generator = torch.Generator().manual_seed(seed)
        first = row_id.min()
        keys = torch.rand(int(row_id.max() - first) + 1, mask.shape[1], generator=generator)[(row_id - first).cpu()]
        picked = clip_cov_cut(old_all, log_prob_all, adv_all, mask_all, keys.to(mask.device),
                              clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
                              clip_cov_ratio=s.cov.ratio, clip_cov_lb=s.cov.clip_cov_lb, clip_cov_ub=s.cov.clip_cov_ub)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return dataclasses.replace(mini, cov_tokens=my_rows(picked[back]))


def cov_policy_loss(micro: RolloutBatch, log_prob: torch.Tensor, s: ActorUpdateSettings, counts: dict
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov's or KL-Cov's loss of one micro-batch, on the tokens ``with_cov_tokens`` picked."""
    assert s.cov is not None and micro.cov_tokens is not None, "with_cov_tokens picks the mini-batch's tokens first"
    inputs = (micro.old_log_prob, log_prob, micro.advantages, micro.update_mask, micro.cov_tokens)
    if s.cov.mode == "kl_cov":
        return compute_policy_loss_kl_cov(*inputs, s.cov.ppo_kl_coef, s.loss_agg_mode,
                                          rollout_is_weights=micro.rollout_is_weights, **counts)
    return compute_policy_loss_clip_cov(*inputs, s.clip_ratio_low, s.clip_ratio_high, s.loss_agg_mode,
                                        rollout_is_weights=micro.rollout_is_weights, **counts)
