"""The scoring phase of a PPO step: old and reference log-probs, values, and rewards.

Every rank holds the step's whole batch and runs the no-grad forwards for its own rows
(``StepShards``); the per-row results are gathered back into the whole batch, so everything
after scoring (KL control, advantages, guards, metrics) is computed on the same numbers on
every rank. Rewards come from recorded offline scores, a rule function, or reward models
(their scores averaged, or their rankings of each prompt's responses distilled into rewards).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from klppo.data.batching import (
    MicroBatching, RowSpans, micro_batch_plan, rank_shards, restore_order, row_chunks, row_spans,
)
from klppo.distributed import all_gather_objects, all_gather_rows, all_reduce_max_int
from klppo.models.forward import HeadSettings, response_token_scores, response_values, sequence_scores
from klppo.monitoring.timer import PhaseTimer
from klppo.rewards.distill import group_ranking_rewards
from klppo.rewards.overlong import OverlongPenalty, overlong_components, overlong_rewards
from klppo.rewards.score import score_responses_with_components
from klppo.rewards.token_scores import scores_at_last_token
from klppo.rollout.batch import RolloutBatch
from klppo.run.adapters import adapters_at
from klppo.run.settings import RewardModelForward, RewardSettings
from klppo.distributed import same_on_every_rank
from klppo.trainer.update import Forwarded, forward_first

if TYPE_CHECKING:
    from klppo.run.build import PPOParts


@dataclasses.dataclass(frozen=True)
class StepShards:
    """Which rows of the step's global batch each rank scores and trains on (``rank_shards``)."""

    rows: list[list[int]]  # global row indices, per rank
    rank: int

    @property
    def mine(self) -> list[int]:
        return self.rows[self.rank]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's per-row ``local`` results (for its ``mine`` rows) in the global batch's order."""
        return restore_order(all_gather_rows(local), [i for rows in self.rows for i in rows])

    def gather_objects(self, local: list) -> list:
        """``gather`` for a list of picklable per-row values."""
        placed: list = [None] * sum(len(rows) for rows in self.rows)
        for rows, values in zip(self.rows, all_gather_objects(local)):
            for i, value in zip(rows, values, strict=True):
                placed[i] = value
        return placed


def step_shards(parts: PPOParts, batch: RolloutBatch) -> StepShards:
    """Each rank's rows of the step's batch: whole mini-batches dealt out (balanced with ``balance_batch``)."""
    s, env = parts.settings, parts.env
    lengths = batch.attention_mask.sum(-1).tolist()  # host sync
    return StepShards(rank_shards(lengths, env.world_size, s.shard_chunk_rows, s.balance_batch), env.rank)


# ---- the no-grad forwards ----


def _forward_in_parts(batch: RolloutBatch, forward: Callable[[RolloutBatch, RowSpans], torch.Tensor],
                      split: MicroBatching) -> torch.Tensor:
    """``forward(micro, spans) -> (b, T)`` over the batch's micro-batches, rows back in the batch's order.

    The rows' spans are read on the host once here (``RowSpans``), so the micro-batches' forwards
    do not wait for the device. Every rank runs as many forwards as the rank that needs the
    most, which FSDP2's collectives need.
    """
    spans = row_spans(batch.attention_mask)  # host sync: once per pass
    plan = micro_batch_plan(spans.lengths, split, all_reduce_max_int)
    parts = [forward(batch.select(idx), spans.select(idx)) for idx in plan]
    return restore_order(torch.cat(parts), [i for idx in plan for i in idx])


@torch.no_grad()
def compute_log_prob(model, batch: RolloutBatch, split: MicroBatching, *, temperature: float,
                     head: HeadSettings = HeadSettings()) -> torch.Tensor:
    """(B, T) response log-probs under ``model``, a micro-batch (rows or token budget) at a time."""
    return _log_prob_in_parts(model, batch, split, temperature, head, with_sum_pi_squared=False)


@torch.no_grad()
def compute_log_prob_and_sum_pi_squared(model, batch: RolloutBatch, split: MicroBatching, *, temperature: float,
                                        head: HeadSettings = HeadSettings()) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_log_prob``, and each response token's sum of squared probabilities (B, T) from the same forwards."""
    scores = _log_prob_in_parts(model, batch, split, temperature, head, with_sum_pi_squared=True)
    return scores[..., 0].contiguous(), scores[..., 1].contiguous()


def _log_prob_in_parts(model, batch: RolloutBatch, split: MicroBatching, temperature: float, head: HeadSettings,
                       with_sum_pi_squared: bool) -> torch.Tensor:
    """(B, T) log-probs, or with the sums of squared probabilities (B, T, 2) stacked after them."""
    model.eval()

    def forward(micro: RolloutBatch, spans: RowSpans) -> torch.Tensor:
        scores = response_token_scores(model, micro.input_ids, micro.attention_mask, micro.response_length,
                                       temperature=temperature, with_sum_pi_squared=with_sum_pi_squared,
                                       packed=split.packed, max_tokens=split.max_tokens, head=head, spans=spans)
        if not with_sum_pi_squared:
            return scores.log_probs
        return torch.stack([scores.log_probs, scores.sum_pi_squared], -1)

    return _forward_in_parts(batch, forward, split)


@torch.no_grad()
def compute_values(critic, batch: RolloutBatch, split: MicroBatching) -> torch.Tensor:
    """(B, T) critic values, a micro-batch (rows or token budget) at a time."""
    critic.eval()

    def forward(micro: RolloutBatch, spans: RowSpans) -> torch.Tensor:
        return response_values(critic, micro.input_ids, micro.attention_mask, micro.response_length,
                               packed=split.packed, max_tokens=split.max_tokens, spans=spans)

    return _forward_in_parts(batch, forward, split)


@torch.no_grad()
def compute_rm_scores(reward_model, batch: RolloutBatch, rm: RewardModelForward) -> torch.Tensor:
    """(B,) reward-model scores of prompt + response, read at each response's last token.

    The reward model reads at most the prompt's last ``rm.prompt_length`` and the response's first
    ``rm.response_length`` tokens (verl's reward_model.rollout lengths).
    """
    reward_model.eval()
    prompt_ids, prompt_mask = batch.prompt_ids[:, -rm.prompt_length:], batch.prompt_mask[:, -rm.prompt_length:]
    response_ids = batch.response_ids[:, : rm.response_length]
    response_mask = batch.response_attention[:, : rm.response_length]  # the whole conversation
    input_ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    parts = [sequence_scores(reward_model, input_ids[idx], mask[idx], packed=rm.micro.packed)
             for idx in row_chunks(len(batch), rm.micro.rows or len(batch))]
    return torch.cat(parts)


def decode_responses(batch: RolloutBatch, tokenizer) -> list[str]:
    """The text of each response (its real tokens, special tokens dropped; a multi-turn response's
    with the tools' replies between its turns, as verl's reward managers decode it)."""
    return [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids.cpu(), batch.response_attention.cpu())
    ]


def compute_scores(batch: RolloutBatch, tokenizer, reward_fn: Callable, prompt_places: Sequence[str] | None = None
                   ) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """(B,) each response's rule reward, and each response's reward components (``reward_components``).

    ``prompt_places``: where each prompt of the step came from ("x.parquet row 5"), indexed by
    ``batch.group_index``; an error of the reward function names its response's.
    """
    texts = decode_responses(batch, tokenizer)
    places = None if prompt_places is None else [prompt_places[g] for g in batch.group_index.tolist()]
    scores, components = score_responses_with_components(reward_fn, batch.scored_as, texts, batch.ground_truths,
                                                         batch.reward_extra_infos, places)
    return torch.tensor(scores, dtype=torch.float32, device=batch.response_mask.device), components


# ---- the scoring phase of a step ----


@contextmanager
def reference_model(parts: PPOParts) -> Iterator[torch.nn.Module]:
    """The reference policy for the ``with`` block: the frozen reference model, or for a LoRA actor
    (``ref_in_actor``) the actor itself with its adapters at their reference values (their
    starting values, or the base model's: ``actor_rollout_ref.ref.lora_reference``): the
    reference costs no second model."""
    if parts.settings.ref_in_actor:
        with adapters_at(parts.actor, parts.reference_adapters):
            yield parts.actor
    else:
        yield parts.ref


def reference_role(parts: PPOParts) -> str:
    """The offloader's name of the model the reference runs on."""
    return "actor" if parts.settings.ref_in_actor else "ref"


def reward_model_roles(parts: PPOParts) -> list[str]:
    """The offloader's names of the run's reward models."""
    return [f"reward_model_{i}" for i in range(len(parts.reward_models))]


def score_batch(parts: PPOParts, batch: RolloutBatch, shards: StepShards, timer: PhaseTimer,
                prompt_places: Sequence[str] | None = None) -> None:
    """Fill ``batch``'s old and reference log-probs, values and token-level scores (step 3).

    Each rank runs the forwards for its rows; the results are gathered into ``batch``. In
    rollout correction's bypass mode the old log-probs are the recorded behaviour log-probs.
    ``prompt_places``: the file and row of each prompt (``compute_scores``).
    """
    score_log_probs(parts, batch, shards, timer)
    score_rewards(parts, batch, shards, timer, prompt_places)


def score_log_probs(parts: PPOParts, batch: RolloutBatch, shards: StepShards, timer: PhaseTimer) -> None:
    """Fill ``batch``'s old and reference log-probs and values (``score_batch`` without the rewards).

    The old log-probs stay None where the actor's update gives them (``old_log_prob_from_update``),
    and the values where the updates' forwards run first (``update_forwards_first``): the trainer
    fills them in from the update's forwards."""
    f, mine, resident = parts.settings.forwards, batch.select(shards.mine), parts.offloader.resident
    if f.old_log_prob_from_rollout:  # rollout correction's bypass mode: pi_old is the recorded mu
        assert batch.rollout_log_probs is not None, "the reader requires rollout_log_probs in bypass mode"
        batch.old_log_prob = batch.rollout_log_probs.to(batch.response_mask.device)
    elif f.sum_pi_squared:
        with timer.phase("old_log_prob"), resident("actor"):
            measured = compute_log_prob_and_sum_pi_squared(parts.actor, mine, f.old_log_prob,
                                                           temperature=f.temperature, head=f.head)
            batch.old_log_prob, batch.sum_pi_squared = (shards.gather(x) for x in measured)
    elif not f.old_log_prob_from_update:
        with timer.phase("old_log_prob"), resident("actor"):
            batch.old_log_prob = shards.gather(compute_log_prob(parts.actor, mine, f.old_log_prob,
                                                                temperature=f.temperature, head=f.head))
    if parts.settings.uses_reference:
        with timer.phase("ref"), resident(reference_role(parts)), reference_model(parts) as ref:
            batch.ref_log_prob = shards.gather(compute_log_prob(ref, mine, f.ref, temperature=f.temperature,
                                                                head=f.head))
    if parts.critic is not None and not f.update_forwards_first:
        with timer.phase("values"), resident("critic"):
            batch.values = shards.gather(compute_values(parts.critic, mine, f.values))


def forwards_first(parts: PPOParts, batch: RolloutBatch, shards: StepShards, timer: PhaseTimer) -> dict[str, Forwarded]:
    """The updates' forwards over this rank's rows, run before the step is shaped (``update_forwards_first``):
    pi_old's log-probs and the values, gathered into ``batch`` as ``score_log_probs`` would; their
    graphs, by model, wait for the updates (timed as theirs)."""
    s, mine, done = parts.settings, batch.select(shards.mine), {}
    with timer.phase("update_actor"):
        done["actor"] = forward_first(parts.actor, mine, s.actor)
    batch.old_log_prob = shards.gather(done["actor"].detached())
    if parts.critic is not None:
        with timer.phase("update_critic"):
            done["critic"] = forward_first(parts.critic, mine, s.critic)
        batch.values = shards.gather(done["critic"].detached())
    return done


def score_rewards(parts: PPOParts, batch: RolloutBatch, shards: StepShards, timer: PhaseTimer,
                  prompt_places: Sequence[str] | None = None) -> None:
    """Fill ``batch``'s token-level scores, each rank scoring its rows (``score_batch``'s last part),
    and with a reward function its ``reward_components`` (each response's, in the batch's order)."""
    with timer.phase("reward"), parts.offloader.resident(*reward_model_roles(parts)):
        local, components = response_scores(parts, batch.select(shards.mine), prompt_places)
        batch.token_level_scores = token_scores(parts.settings.reward, batch, shards.gather(local))
    if components is not None:
        batch.reward_components = shards.gather_objects(components)


def response_scores(parts: PPOParts, batch: RolloutBatch, prompt_places: Sequence[str] | None = None
                    ) -> tuple[torch.Tensor, list[dict[str, float]] | None]:
    """(B,) one score per response: recorded offline scores, or the reward function's; or (B, K)
    the scores of K reward models. With a reward function, each response's components too (None
    otherwise). ``prompt_places``: as ``compute_scores``'."""
    if batch.recorded_scores is not None:
        return batch.recorded_scores.to(parts.env.device), None
    if not parts.reward_models:
        scores, components = same_on_every_rank(
            lambda: compute_scores(batch, parts.tokenizer, parts.reward_fn, prompt_places))
        return with_overlong_penalty(parts.settings.reward.overlong, batch, scores, components)
    rm = parts.settings.forwards.reward_model
    return torch.stack([compute_rm_scores(model, batch, rm) for model in parts.reward_models], dim=-1), None


def with_overlong_penalty(penalty: OverlongPenalty | None, batch: RolloutBatch, scores: torch.Tensor,
                          components: list[dict[str, float]]) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The reward function's scores with DAPO's overlong punishment added (``reward_kwargs``), as
    verl's dapo reward manager adds it (a reward model's scores keep none), and with its ``log``
    each response's penalty among the reward components."""
    if penalty is None:
        return scores, components
    rewards = overlong_rewards(batch.response_attention.sum(-1), penalty)
    if penalty.log:
        components = [{**mine, **punished} for mine, punished in zip(components, overlong_components(rewards))]
    return scores + rewards, components


def token_scores(reward: RewardSettings, batch: RolloutBatch, scores: torch.Tensor,
                 validation: bool = False) -> torch.Tensor:
    """(B, T) the scores at the last response tokens. Reward models' scores are averaged, or,
    for training batches with ``reward_model.rank_responses``, distilled from the rankings
    the models make of each prompt's responses."""
    if scores.dim() == 2 and reward.rank_responses and not validation:
        ranking = reward.ranking
        scores = group_ranking_rewards(scores, batch.group_index, ranking.method, scale=ranking.scale,
                                       center=ranking.center)
    elif scores.dim() == 2:
        scores = scores.mean(-1)
    return scores_at_last_token(scores, batch.response_mask)
