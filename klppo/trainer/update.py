"""The PPO updates: critic and actor, as ppo_epochs x mini-batches x micro-batches.

Each micro-batch's loss is normalised by the token (or sequence) count of its whole
mini-batch, so the gradients accumulated over micro-batches equal those of the mini-batch in
one piece, whatever the micro-batch size. Ratio statistics (clip fractions, KL) are weighted
the same way, so they too do not depend on how the mini-batch was split.

Micro-batches are either a fixed number of rows (``max_token_len`` None) or as few as fit a
token budget (``use_dynamic_bsz``: ``klppo.data.batching.token_budget_micro_batches``, balanced
by Karmarkar-Karp, so the rows of a micro-batch are not consecutive). Either way the forwards
return (b, T) tensors at the mini-batch's full response width, so the losses, including
seq-mean-token-sum-norm's constant T, are those of the full mini-batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from klppo.algo import agg_loss, compute_policy_loss, compute_value_loss, kl_loss, masked_mean
from klppo.data.batching import token_budget_micro_batches
from klppo.models.forward import response_logprobs, response_values
from klppo.rollout.batch import RolloutBatch

ReduceCounts = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ReduceStats = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
MaxOverRanks = Callable[[int], int]

ACTOR_BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
CRITIC_BUDGET_KEY = "critic.ppo_max_token_len_per_gpu"


@dataclass(frozen=True)
class ActorUpdateSettings:
    mini_batch_rows: int  # ppo_mini_batch_size * rollout.n
    micro_batch_rows: int  # ppo_micro_batch_size_per_gpu, or mini_batch_rows
    ppo_epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    temperature: float
    max_token_len: int | None = None  # token budget per micro-batch (use_dynamic_bsz); None = micro_batch_rows
    use_remove_padding: bool = False  # run each micro-batch as one packed row


@dataclass(frozen=True)
class CriticUpdateSettings:
    mini_batch_rows: int
    micro_batch_rows: int
    ppo_epochs: int
    cliprange_value: float
    loss_agg_mode: str
    grad_clip: float
    max_token_len: int | None = None  # token budget per micro-batch (use_dynamic_bsz); None = micro_batch_rows
    use_remove_padding: bool = False  # run each micro-batch as one packed row


def chunks(n_rows: int, size: int) -> list[torch.Tensor]:
    """Consecutive row-index chunks of at most ``size`` rows covering ``range(n_rows)``."""
    return list(torch.arange(n_rows).split(size))


def micro_batches(
    batch: RolloutBatch, micro_rows: int | None, max_token_len: int | None, budget_key: str,
    max_over_ranks: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """Row indices of each micro-batch: ``micro_rows`` consecutive rows, or a token budget's partition.

    The budget counts real tokens (prompt + response), as verl's ``rearrange_micro_batches``.
    ``max_over_ranks`` (``klppo.distributed.all_reduce_max_int``) makes every rank split its shard into
    the largest count any rank needs, so FSDP's per-forward collectives line up.
    """
    if max_token_len is None:
        return [c.tolist() for c in chunks(len(batch), micro_rows or len(batch))]
    seq_lens = batch.attention_mask.sum(-1).tolist()  # host-device sync
    plan = token_budget_micro_batches(seq_lens, max_token_len, budget_key=budget_key)
    if max_over_ranks is not None and (n := max_over_ranks(len(plan))) > len(plan):
        plan = token_budget_micro_batches(seq_lens, max_token_len, min_num_micro_batches=n, budget_key=budget_key)
    return plan


def _counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and sequence counts that normalise a mini-batch's loss."""
    return mask.sum(), (mask.sum(-1) > 0).sum()


def optimizer_step(model, optimizer, grad_clip: float) -> torch.Tensor:
    """Clip, then step unless the gradient norm is not finite (the step is skipped then)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of per-rank partial norms
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach()


def _run_updates(model, optimizer, batch, *, mini_rows, split, epochs, grad_clip, micro_loss, prefix,
                 reduce_counts: ReduceCounts | None = None, reduce_stats: ReduceStats | None = None):
    """ppo_epochs x mini-batches x micro-batches of ``micro_loss``, one optimiser step per mini-batch.

    ``split(mini) -> list[list[int]]`` gives the rows of each micro-batch of a mini-batch.

    Data parallel (``klppo.distributed``): ``reduce_counts`` sums the token and sequence counts over
    ranks, so each rank's loss is its share of the global mini-batch's loss and the summed
    gradients are the global gradient (torchtitan's global token normalisation);
    ``reduce_stats`` sums the per-rank metric shares, which are additive for the same reason.

    ``micro_loss(micro, tokens, seqs) -> (loss, sums, means)``: ``sums`` are the micro-batch's
    shares of mini-batch losses (they add up), ``means`` are its own token means (weighted here
    by its token share). Returns every metric averaged over the optimiser steps.
    """
    model.train()
    per_update: dict[str, list[torch.Tensor]] = defaultdict(list)
    for _ in range(epochs):
        for mini_idx in chunks(len(batch), mini_rows):
            mini = batch.select(mini_idx)
            tokens, seqs = _counts(mini.response_mask)
            if reduce_counts is not None:
                tokens, seqs = reduce_counts(tokens, seqs)
            stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
            for micro_idx in split(mini):
                micro = mini.select(micro_idx)
                loss, sums, means = micro_loss(micro, tokens, seqs)
                loss.backward()
                weight = micro.response_mask.sum() / tokens  # token share of this micro-batch
                for k, v in sums.items():
                    stats[k] = stats[k] + v
                for k, v in means.items():
                    stats[k] = stats[k] + v * weight
            if reduce_stats is not None:
                stats = reduce_stats(stats)
            stats[f"{prefix}/grad_norm"] = optimizer_step(model, optimizer, grad_clip)
            for k, v in stats.items():
                per_update[k].append(v)
    return {k: torch.stack(v).mean() for k, v in per_update.items()}


def update_actor(actor, optimizer, batch: RolloutBatch, s: ActorUpdateSettings, *,
                 reduce_counts: ReduceCounts | None = None,
                 reduce_stats: ReduceStats | None = None,
                 max_over_ranks: MaxOverRanks | None = None) -> dict[str, torch.Tensor]:
    """One PPO actor update over ``batch`` (this rank's shard); returns metrics averaged over optimiser steps."""
    return _run_updates(
        actor, optimizer, batch, mini_rows=s.mini_batch_rows, reduce_counts=reduce_counts, reduce_stats=reduce_stats,
        split=lambda mini: micro_batches(
            mini, s.micro_batch_rows, s.max_token_len, ACTOR_BUDGET_KEY, max_over_ranks,
        ),
        epochs=s.ppo_epochs, grad_clip=s.grad_clip, prefix="actor",
        micro_loss=lambda micro, tokens, seqs: _actor_micro_loss(actor, micro, s, tokens, seqs),
    )


def _actor_micro_loss(actor, micro: RolloutBatch, s: ActorUpdateSettings, tokens, seqs):
    """Clipped surrogate - entropy bonus (+ KL loss) of one micro-batch, mini-batch normalised."""
    mask = micro.response_mask
    log_prob, entropy = response_logprobs(
        actor, micro.input_ids, micro.attention_mask, micro.response_length,
        temperature=s.temperature, with_entropy=True, packed=s.use_remove_padding, max_tokens=s.max_token_len,
    )  # (b, T), (b, T)
    counts = {"global_token_count": tokens, "global_seq_count": seqs}
    pg_loss, pg_stats = compute_policy_loss(
        micro.old_log_prob, log_prob, micro.advantages, mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c,
        loss_agg_mode=s.loss_agg_mode, **counts,
    )
    entropy_loss = agg_loss(entropy, mask, s.loss_agg_mode, **counts)
    loss = pg_loss - s.entropy_coeff * entropy_loss
    sums = {"actor/pg_loss": pg_loss.detach()}
    means = {k: v for k, v in pg_stats.items() if k != "actor/pg_loss"}
    means["actor/entropy"] = masked_mean(entropy.detach(), mask)
    if s.use_kl_loss:
        kl = kl_loss(log_prob, micro.ref_log_prob, mask, s.kl_loss_type, s.loss_agg_mode, **counts)
        loss = loss + s.kl_loss_coef * kl
        sums["actor/kl_loss"] = kl.detach()
    return loss, sums, means


def update_critic(critic, optimizer, batch: RolloutBatch, s: CriticUpdateSettings, *,
                  reduce_counts: ReduceCounts | None = None,
                  reduce_stats: ReduceStats | None = None,
                  max_over_ranks: MaxOverRanks | None = None) -> dict[str, torch.Tensor]:
    """One clipped value-loss update of the critic over ``batch`` (this rank's shard)."""

    def micro_loss(micro: RolloutBatch, tokens, seqs):
        vpreds = response_values(critic, micro.input_ids, micro.attention_mask, micro.response_length,
                                 packed=s.use_remove_padding, max_tokens=s.max_token_len)  # (b, T)
        loss, stats = compute_value_loss(
            vpreds, micro.returns, micro.values, micro.response_mask,
            cliprange_value=s.cliprange_value, loss_agg_mode=s.loss_agg_mode,
            global_token_count=tokens, global_seq_count=seqs,
        )
        means = {k: v for k, v in stats.items() if k != "critic/vf_loss"}
        return loss, {"critic/vf_loss": loss.detach()}, means

    return _run_updates(
        critic, optimizer, batch, mini_rows=s.mini_batch_rows,
        split=lambda mini: micro_batches(
            mini, s.micro_batch_rows, s.max_token_len, CRITIC_BUDGET_KEY, max_over_ranks,
        ),
        epochs=s.ppo_epochs, grad_clip=s.grad_clip, micro_loss=micro_loss, prefix="critic",
        reduce_counts=reduce_counts, reduce_stats=reduce_stats,
    )
