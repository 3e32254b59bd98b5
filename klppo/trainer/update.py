"""The PPO updates: critic and actor, as ppo_epochs x mini-batches x micro-batches.

Each micro-batch's loss is normalised by the token (or sequence) count of its whole
mini-batch, so the gradients accumulated over micro-batches equal those of the mini-batch in
one piece, whatever the micro-batch size. Ratio statistics (clip fractions, KL) are weighted
the same way, so they too do not depend on how the mini-batch was split.

Micro-batches are either a fixed number of rows (``MicroBatching.max_tokens`` None) or as few as fit a
token budget (``use_dynamic_bsz``: ``klppo.data.batching.micro_batch_plan``, balanced by
Karmarkar-Karp, so the rows of a micro-batch are not consecutive). Either way the forwards
return (b, T) tensors at the mini-batch's full response width, so the losses, including
seq-mean-token-sum-norm's constant T, are those of the full mini-batch.

On several ranks each rank updates on its share of every mini-batch: the token and sequence
counts that normalise the loss are summed over ranks (``klppo.distributed.reduce_counts``), so
each rank's loss is its share of the global mini-batch's loss and FSDP2's summed gradients are
the global gradient (torchtitan's global token normalisation); metric shares are summed the
same way, and every rank runs the largest micro-batch count any rank needs. In one process
these collectives are the identity.

Each optimiser step applies only a finite gradient norm within the spike guard's limit
(``OptimizerSteps.limit``, from ``RunGuard.grad_limit``): the limit is fixed for the whole update,
so every step decides on the device, and the host reads the steps' norms once, after the update.
FSDP2's norm is the full norm, the same on every rank, so every rank skips the same steps.

An on-policy actor update (one epoch over one mini-batch of the whole step: ``OnPolicy``) is its
own pi_old: it gives the step the old log-probs and their KL to the reference, and asks the
guard before its one optimiser step. Where each model's update is one micro-batch per rank
(``update_forwards_first``), its forward runs before the step is scored (``forward_first``): its
detached outputs are pi_old's log-probs and the values, and the update takes the outputs with
their graphs (``Forwarded``) instead of running the forward again.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from klppo.algo import agg_loss, compute_value_loss, kl_loss, masked_mean
from klppo.data.batching import MicroBatching, RowSpans, micro_batch_plan, restore_order, row_chunks, row_spans
from klppo.distributed import all_reduce_max_int, reduce_counts, reduce_stats
from klppo.models.forward import response_logprobs, response_values
from klppo.rollout.batch import RolloutBatch
from klppo.safety.guards import Action
from klppo.trainer.cov_selection import draw_seed, with_cov_tokens
from klppo.trainer.rollout_correction import policy_loss, with_rollout_correction
from klppo.run.settings import ActorUpdateSettings, CriticUpdateSettings

# (micro-batch, its rows' spans, global token count, global sequence count) -> (loss, summed stats, token-mean stats)
MicroLoss = Callable[[RolloutBatch, RowSpans, torch.Tensor, torch.Tensor], tuple]
# (mini-batch, its rows' spans, its micro-batches' rows, epoch, its index) -> the mini-batch the micro-batches take
PrepareMiniBatch = Callable[[RolloutBatch, RowSpans, list[list[int]], int, int], RolloutBatch]


def _counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and sequence counts that normalise a mini-batch's loss."""
    return mask.sum(), (mask.sum(-1) > 0).sum()


@dataclass
class OptimizerSteps:
    """One update's optimiser steps: the largest norm they may apply, and what each measured."""

    limit: float = math.inf  # the gradient-spike guard's limit (inf: only non-finite norms are skipped)
    norms: list[torch.Tensor] = field(default_factory=list)  # each step's pre-clip norm, () on the device
    applied: list[torch.Tensor] = field(default_factory=list)  # each step's verdict, () bool

    def on_host(self) -> tuple[list[float], list[bool]]:
        """The norms and verdicts as Python values (one host sync for the whole update)."""
        if not self.norms:
            return [], []
        norms, applied = torch.stack([torch.stack(self.norms).float(), torch.stack(self.applied).float()]).tolist()  # host sync
        return norms, [a > 0 for a in applied]


# An on-policy micro-batch's share of the step's KL(pi_old || ref) per token (summed like the losses).
KL_SHARE = "actor/kl_to_ref_share"


def _go_on(kl: Optional[float]) -> Action:
    return Action.CONTINUE


@dataclass
class OnPolicy:
    """What an on-policy actor update (``ActorUpdateSettings.on_policy``) gives and asks.

    Its forward is pi_old's (one epoch, one optimiser step, nothing moved the weights since they
    sampled), so each micro-batch takes old = log_prob.detach() (ratio 1, as verl's dp_actor and
    TRL's GRPOTrainer with one iteration) and keeps it with its rows, and its share of the step's
    KL(pi_old || ref) per token is summed over micro-batches and ranks as the losses are. Before
    the optimiser step ``decide`` gets that KL (None without a reference) and returns the step's
    action, the guard's check before an update; the step applies only on CONTINUE.
    """

    decide: Callable[[Optional[float]], Action] = _go_on
    action: Action = Action.CONTINUE  # what ``decide`` returned
    rows: list[list[int]] = field(default_factory=list)  # each micro-batch's rows of the update's batch
    log_probs: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's (b, T) pi_old log-probs

    def approve(self, stats: dict[str, torch.Tensor]) -> bool:
        """Take the KL out of the step's summed ``stats`` and ask ``decide`` whether the step applies."""
        share = stats.pop(KL_SHARE, None)
        self.action = self.decide(None if share is None else float(share))  # host sync: the guard decides
        return self.action is Action.CONTINUE

    @property
    def log_prob(self) -> torch.Tensor:
        """(b, T) pi_old's log-probs of the update's rows, in the batch's order."""
        return restore_order(torch.cat(self.log_probs), [i for rows in self.rows for i in rows])


@dataclass
class Forwarded:
    """A model's update forward, run before the step was scored (``forward_first``): one micro-batch
    of all the update's rows, in the order its plan gave them, and its outputs with their graphs."""

    rows: list[int]  # the micro-batch's rows of the update's batch
    outputs: tuple[torch.Tensor, ...]  # (log_prob, entropy) of the actor, (values,) of the critic; (b, T) each

    def detached(self) -> torch.Tensor:
        """(b, T) the first output without its graph (pi_old's log-probs, or the values), in the batch's order."""
        return restore_order(self.outputs[0].detach(), self.rows)


def step_allowed(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Whether an optimiser step applies: a finite norm no larger than ``max_norm`` (a bool tensor)."""
    return torch.isfinite(grad_norm) & (grad_norm <= max_norm)


def optimizer_step(model, optimizer, grad_clip: float, max_norm: float = math.inf,
                   steps: Optional[OptimizerSteps] = None) -> torch.Tensor:
    """Clip, then step unless the gradient norm is not finite or above ``max_norm`` (the step is
    skipped then); ``steps``, when given, records the norm and the verdict.

    A fused AdamW (``build_optimizer`` makes one for CUDA and for CPU parameters) gets the
    verdict as a device tensor, ``found_inf``, the way torch's GradScaler hands it over: the
    kernel skips the update and the step count stays, and the host never waits for the norm.
    Other optimisers are checked on the host (verl checks the same way).
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of per-rank partial norms
        grad_norm = grad_norm.full_tensor()
    allowed = step_allowed(grad_norm, max_norm)
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = (~allowed).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif allowed:  # host sync
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if steps is not None:
        steps.norms.append(grad_norm.detach())
        steps.applied.append(allowed)
    return grad_norm.detach()


def micro_plans(batch: RolloutBatch, spans: RowSpans, mini_rows: int, micro: MicroBatching
                ) -> list[tuple[list[int], list[list[int]]]]:
    """Each mini-batch's rows and its micro-batches' rows (within the mini-batch), planned once
    for all epochs from the rows' lengths (``spans``, read on the host once per update)."""
    return [(mini, micro_batch_plan([spans.lengths[i] for i in mini], micro, all_reduce_max_int))
            for mini in row_chunks(len(batch), mini_rows)]


def _nothing() -> None:
    pass


def _only_micro_batch(batch: RolloutBatch, spans: RowSpans, mini_rows: int, micro: MicroBatching) -> list[int]:
    """The rows of the update's one micro-batch, in its plan's order (``update_forwards_first`` made sure of one)."""
    plans = micro_plans(batch, spans, mini_rows, micro)
    assert len(plans) == 1 and len(plans[0][1]) == 1, "update_forwards_first: one mini-batch of one micro-batch"
    mini, [rows] = plans[0]
    return [mini[i] for i in rows]


def forward_first(model, batch: RolloutBatch, settings: ActorUpdateSettings | CriticUpdateSettings) -> Forwarded:
    """The forward of ``model``'s coming update over ``batch`` (this rank's rows, one micro-batch), in
    training mode and with its graph: the actor's log-probs and entropies, or the critic's values."""
    model.train()
    spans = row_spans(batch.attention_mask)  # host sync
    rows = _only_micro_batch(batch, spans, settings.mini_batch_rows, settings.micro)
    micro, micro_spans = batch.select(rows), spans.select(rows)
    if isinstance(settings, ActorUpdateSettings):
        return Forwarded(rows, _actor_forward(model, micro, micro_spans, settings))
    return Forwarded(rows, (_critic_forward(model, micro, micro_spans, settings),))


def _run_updates(model, optimizer, batch: RolloutBatch, *, mini_rows: int, micro: MicroBatching, epochs: int,
                 grad_clip: float, micro_loss: MicroLoss, prefix: str,
                 after_micro_batch: Callable[[], None] = _nothing,
                 steps: Optional[OptimizerSteps] = None,
                 on_policy: Optional[OnPolicy] = None,
                 forwarded: Optional[Forwarded] = None,
                 prepare: Optional[PrepareMiniBatch] = None) -> dict[str, torch.Tensor]:
    """ppo_epochs x mini-batches x micro-batches of ``micro_loss``, one optimiser step per mini-batch.

    ``micro_loss(micro, spans, tokens, seqs) -> (loss, sums, means)``: ``sums`` are the micro-batch's
    shares of mini-batch losses (they add up), ``means`` are its own token means (weighted here
    by its token share). Returns every metric averaged over the optimiser steps. The rows' spans
    (``RowSpans``) are read once for the whole update, the one host sync before the optimiser
    steps: each micro-batch's forward and backward then run without the host waiting on the device.
    ``after_micro_batch``: called after each micro-batch's backward (``monitoring.overlap.profiled``).
    ``steps``: the optimiser steps' limit, and where their norms and verdicts go. ``on_policy``: an
    on-policy update's record of rows, and its approval before the step (none: no metrics, no step).
    ``forwarded``: the one micro-batch's forward, already run (``micro_loss`` then runs none).
    ``prepare(mini, spans, plan, epoch, index)``: each mini-batch as its micro-batches take it
    (Clip-Cov's and KL-Cov's tokens, ``cov_selection``).
    """
    model.train()
    steps = steps if steps is not None else OptimizerSteps()
    per_update: dict[str, list[torch.Tensor]] = defaultdict(list)
    spans = row_spans(batch.attention_mask)  # host sync: once per update
    if forwarded is None:
        plans = micro_plans(batch, spans, mini_rows, micro)
    else:
        assert epochs == 1, "a forward run first serves one epoch"
        plans = [(list(range(len(batch))), [forwarded.rows])]
    for epoch in range(epochs):
        for index, (mini_idx, plan) in enumerate(plans):
            mini, mini_spans = batch.select(mini_idx), spans.select(mini_idx)
            if prepare is not None:
                mini = prepare(mini, mini_spans, plan, epoch, index)
            tokens, seqs = reduce_counts(*_counts(mini.update_mask))
            stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
            for micro_idx in plan:
                part = mini.select(micro_idx)
                if on_policy is not None:
                    on_policy.rows.append([mini_idx[i] for i in micro_idx])
                loss, sums, means = micro_loss(part, mini_spans.select(micro_idx), tokens, seqs)
                loss.backward()
                after_micro_batch()
                weight = part.update_mask.sum() / tokens  # token share of this micro-batch
                for k, v in sums.items():
                    stats[k] = stats[k] + v
                for k, v in means.items():
                    stats[k] = stats[k] + v * weight
            stats = reduce_stats(stats)
            if on_policy is not None and not on_policy.approve(stats):
                optimizer.zero_grad(set_to_none=True)
                return {}
            stats[f"{prefix}/grad_norm"] = optimizer_step(model, optimizer, grad_clip, steps.limit, steps)
            for k, v in stats.items():
                per_update[k].append(v)
    return {k: torch.stack(v).mean() for k, v in per_update.items()}


def update_actor(actor, optimizer, batch: RolloutBatch, s: ActorUpdateSettings,
                 after_micro_batch: Callable[[], None] = _nothing,
                 steps: Optional[OptimizerSteps] = None,
                 on_policy: Optional[OnPolicy] = None,
                 forwarded: Optional[Forwarded] = None,
                 step: int = 0) -> dict[str, torch.Tensor]:
    """One PPO actor update over ``batch`` (this rank's shard); returns metrics averaged over optimiser
    steps, and the step's ``rollout_corr/`` metrics when the batch carries behaviour log-probs.
    ``steps``: the optimiser steps' gradient limit and record (``OptimizerSteps``). ``on_policy``
    (with ``s.on_policy``; by default one that always steps): what the update gives, whom it asks.
    ``forwarded``: its forward over ``batch``, run first (``forward_first``). ``step``: the run's,
    which seeds Clip-Cov's pick (with the epoch and the mini-batch)."""
    assert on_policy is None or s.on_policy, "only a one-step, one-epoch update is its own pi_old"
    assert not s.on_policy or (s.ppo_epochs == 1 and len(batch) <= s.mini_batch_rows), "one optimiser step"
    on_policy = on_policy if on_policy is not None or not s.on_policy else OnPolicy()
    batch, correction = with_rollout_correction(batch, s.rollout_correction)
    metrics = _run_updates(
        actor, optimizer, batch, mini_rows=s.mini_batch_rows, micro=s.micro, epochs=s.ppo_epochs,
        grad_clip=s.grad_clip, prefix="actor", after_micro_batch=after_micro_batch, steps=steps, on_policy=on_policy,
        forwarded=forwarded, prepare=None if s.cov is None else (
            lambda mini, spans, plan, epoch, index: with_cov_tokens(
                actor, mini, spans, plan, s, draw_seed(s.cov.seed, step, epoch, index))),
        micro_loss=lambda micro, spans, tokens, seqs: _actor_micro_loss(
            actor, micro, spans, s, tokens, seqs, on_policy, None if forwarded is None else forwarded.outputs),
    )
    return {**metrics, **correction}


def _actor_forward(actor, micro: RolloutBatch, spans: RowSpans, s: ActorUpdateSettings
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T) log-probs and entropies of one micro-batch, with their graphs (the entropy's only with a bonus)."""
    return response_logprobs(
        actor, micro.input_ids, micro.attention_mask, micro.response_length,
        temperature=s.temperature, with_entropy=True, entropy_grad=bool(s.entropy_coeff), packed=s.micro.packed,
        max_tokens=s.micro.max_tokens, head=s.head, spans=spans,
    )


def _actor_micro_loss(actor, micro: RolloutBatch, spans: RowSpans, s: ActorUpdateSettings, tokens, seqs,
                      on_policy: Optional[OnPolicy] = None, forwarded: Optional[tuple[torch.Tensor, ...]] = None):
    """Clipped surrogate - entropy bonus (+ KL loss) of one micro-batch, mini-batch normalised.

    The losses count the tokens rollout rejection kept (``update_mask``; every response token
    without it), and the policy loss carries the rollout correction (``rollout_correction``).
    ``on_policy``: this forward is pi_old (``OnPolicy``). ``forwarded``: the micro-batch's
    log-probs and entropies, already computed (``Forwarded``).
    """
    mask = micro.update_mask
    log_prob, entropy = forwarded if forwarded is not None else _actor_forward(actor, micro, spans, s)  # (b, T) each
    if on_policy is not None:
        micro = dataclasses.replace(micro, old_log_prob=log_prob.detach())
        on_policy.log_probs.append(micro.old_log_prob)
    counts = {"global_token_count": tokens, "global_seq_count": seqs}
    pg_loss, pg_stats = policy_loss(micro, log_prob, s, counts)
    loss = pg_loss
    # The entropy is always measured (actor/entropy, the entropy guards); it joins the loss only with a
    # bonus: 0 x entropy adds nothing, yet its backward made a pass over the head's (N, V) logits.
    if s.entropy_coeff:
        loss = loss - s.entropy_coeff * agg_loss(entropy, mask, s.loss_agg_mode, **counts)
    sums = {"actor/pg_loss": pg_loss.detach()}
    if on_policy is not None and micro.ref_log_prob is not None:  # no rejection here: update_mask is response_mask
        sums[KL_SHARE] = ((micro.old_log_prob - micro.ref_log_prob) * micro.response_mask).sum() / tokens
    means = {k: v for k, v in pg_stats.items() if k != "actor/pg_loss"}
    means["actor/entropy"] = masked_mean(entropy.detach(), mask)
    if s.use_kl_loss:
        kl = kl_loss(log_prob, micro.ref_log_prob, mask, s.kl_loss_type, s.loss_agg_mode, **counts)
        loss = loss + s.kl_loss_coef * kl
        sums["actor/kl_loss"] = kl.detach()
    return loss, sums, means


def update_critic(critic, optimizer, batch: RolloutBatch, s: CriticUpdateSettings,
                  after_micro_batch: Callable[[], None] = _nothing,
                  steps: Optional[OptimizerSteps] = None,
                  forwarded: Optional[Forwarded] = None) -> dict[str, torch.Tensor]:
    """One clipped value-loss update of the critic over ``batch`` (this rank's shard); ``forwarded``:
    its forward over ``batch``, run first (``forward_first``)."""

    def micro_loss(micro: RolloutBatch, spans: RowSpans, tokens, seqs):
        vpreds = forwarded.outputs[0] if forwarded is not None else _critic_forward(critic, micro, spans, s)  # (b, T)
        loss, stats = compute_value_loss(
            vpreds, micro.returns, micro.values, micro.response_mask,
            cliprange_value=s.cliprange_value, loss_agg_mode=s.loss_agg_mode,
            global_token_count=tokens, global_seq_count=seqs,
        )
        means = {k: v for k, v in stats.items() if k != "critic/vf_loss"}
        return loss, {"critic/vf_loss": loss.detach()}, means

    return _run_updates(critic, optimizer, batch, mini_rows=s.mini_batch_rows, micro=s.micro, epochs=s.ppo_epochs,
                        grad_clip=s.grad_clip, micro_loss=micro_loss, prefix="critic",
                        after_micro_batch=after_micro_batch, steps=steps, forwarded=forwarded)


def _critic_forward(critic, micro: RolloutBatch, spans: RowSpans, s: CriticUpdateSettings) -> torch.Tensor:
    """(b, T) the critic's values of one micro-batch, with their graph."""
    return response_values(critic, micro.input_ids, micro.attention_mask, micro.response_length,
                           packed=s.micro.packed, max_tokens=s.micro.max_tokens, spans=spans)
