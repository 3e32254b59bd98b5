"""Steps 1-3 of a PPO iteration (prompts, responses, scores), with DAPO's dynamic sampling when asked.

Without ``algorithm.filter_groups`` a step draws ``data.train_batch_size`` prompts, gets their
responses and scores them: old and reference log-probs, values and rewards.

With it (Yu et al. 2025, arXiv:2503.14476, section 3.2; verl's ``recipe/dapo``) a step draws
generation batches of ``data.gen_batch_size`` prompts, one after another: each batch's responses
are sampled (or read, offline) and rewarded, the prompts whose responses' scores all tie are
dropped (``algo.dynamic_sampling_keep``), and the drawing stops once ``train_batch_size``
prompts with spread are kept; the first ``train_batch_size`` of them are trained on, the rest
are discarded, as verl does. What must differ is the response's score, or with
``algorithm.filter_groups.metric`` naming one, a component the reward function returns beside
it (verl's ``reward_extra_info``: its DAPO recipe filters by ``acc``). Only the kept responses
go through the log-prob and value forwards (verl computes them after filtering too). Every
draw advances the prompt sampler, whose position the checkpoint holds, so a resumed run
repeats the uninterrupted run's draws.

A step may draw several generation batches, and ``trainer.total_epochs`` counts generation
batches (``data.gen_batch_size`` prompts each) as steps: ``total_epochs`` x (prompts //
gen_batch_size) steps, which together draw more than ``total_epochs`` passes over the prompts
whenever groups are dropped (verl's DAPO recipe instead ends the run once its epochs of prompts
are drawn). ``training/filter_groups/*`` say what was drawn and kept; ``critic/score/zero_std_frac``
is 0 by construction when filtering by the score (the trained groups all have spread).

Offline runs filter the same way: recorded groups whose scores tie are dropped (counted) and
further prompts are drawn, so every step trains on ``train_batch_size`` prompts and the
mini-batch arithmetic stays as configured. Their responses do not change from epoch to
epoch, so more draws than an epoch holds would only repeat groups already seen: without
``max_num_gen_batches`` an offline step draws at most one epoch of generation batches.

Every rank holds each generation batch whole and the same scores (gathered), so every rank
keeps the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from klppo.algo import dynamic_sampling_keep
from klppo.data.rl_dataset import PromptRecord
from klppo.errors import UserError
from klppo.monitoring.generations import batch_generations, write_generations
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch, concat_batches
from klppo.trainer.forwards import StepShards, score_batch, score_log_probs, score_rewards, step_shards
from klppo.trainer.responses import greedy_responses, step_responses

if TYPE_CHECKING:
    from klppo.run.build import PPOParts

# training/filter_groups/gen_batches: generation batches the step drew; kept_groups: prompts with spread
# they held (the first train_batch_size of them are trained on); dropped_groups: prompts that tied.
METRICS = "training/filter_groups"


@dataclass
class StepBatch:
    """A step's scored batch and what it was made of."""

    records: list[PromptRecord]  # the prompts trained on, in the order of the batch's groups
    batch: RolloutBatch  # old and reference log-probs, values and token-level scores filled
    shards: StepShards  # the rows each rank scores and trains on
    metrics: dict[str, float] = field(default_factory=dict)  # training/filter_groups/* with dynamic sampling
    reward_baselines: Optional[torch.Tensor] = None  # (B,) ReMax's: the score of each row's prompt's greedy response


def scored_step_batch(parts: PPOParts, timer: PhaseTimer, step: int) -> StepBatch:
    """Steps 1-3: the step's prompts, responses and scores (the whole batch on every rank); with
    ``trainer.rollout_data_dir`` rank 0 writes them as text (``monitoring.generations``)."""
    drawn = _draw_and_score(parts, timer, step)
    folder = parts.settings.generations.rollout_dir
    if folder is not None:
        with timer.phase("dump_rollout_generations"):  # verl's timing_s name
            if parts.env.rank == 0:
                scores = drawn.batch.token_level_scores.sum(-1).tolist()  # host sync
                write_generations(folder, step, batch_generations(drawn.batch, parts.tokenizer, scores))
    return drawn


def _draw_and_score(parts: PPOParts, timer: PhaseTimer, step: int) -> StepBatch:
    if parts.settings.filter_groups is None:
        records = next_prompts(parts)
        batch = step_responses(parts, records, timer, step).to(parts.device)
        # ReMax: the greedy responses come from the weights that just sampled, before the scoring forwards
        remax = parts.settings.advantage.estimator == "remax"
        greedy = greedy_responses(parts, records, timer, step).to(parts.device) if remax else None
        shards = step_shards(parts, batch)  # every rank holds the whole batch; each scores and trains on its rows
        score_batch(parts, batch, shards, timer, [r.where for r in records])
        if greedy is None:
            return StepBatch(records, batch, shards)
        baselines = greedy_scores(parts, greedy, timer, records)  # (prompts,)
        return StepBatch(records, batch, shards, {"critic/reward_baseline/mean": baselines.mean().item()},
                         reward_baselines=baselines[batch.group_index])
    records, batch, metrics = groups_with_spread(parts, timer, step)
    shards = step_shards(parts, batch)
    score_log_probs(parts, batch, shards, timer)
    return StepBatch(records, batch, shards, metrics)


def greedy_scores(parts: PPOParts, greedy: RolloutBatch, timer: PhaseTimer, records: list[PromptRecord]
                  ) -> torch.Tensor:
    """(prompts,) the score of each prompt's greedy response, as its sampled responses are scored
    (reward function or reward models; no KL penalty, as verl's ReMax baseline)."""
    score_rewards(parts, greedy, whole_batch_shards(parts, greedy), timer, [r.where for r in records])
    return greedy.token_level_scores.sum(-1)


def next_prompts(parts: PPOParts) -> list[PromptRecord]:
    """The next batch of prompts, in the sampler's resumable order."""
    return [parts.train_records[i] for i in parts.batches.next_batch()]


def groups_with_spread(parts: PPOParts, timer: PhaseTimer, step: int
                       ) -> tuple[list[PromptRecord], RolloutBatch, dict[str, float]]:
    """(prompts, rewarded batch, metrics): generation batches drawn until ``train_batch_size`` prompts
    whose responses' scores differ are kept; the first that many of them, in the order drawn."""
    fg, n = parts.settings.filter_groups, parts.settings.n
    limit = draw_limit(parts)
    kept_records: list[PromptRecord] = []
    kept_batches: list[RolloutBatch] = []
    draws = dropped = 0
    while len(kept_records) < fg.prompts:
        if limit is not None and draws >= limit:
            raise UserError(too_few_groups_message(parts, step, draws, len(kept_records)))
        records = next_prompts(parts)
        batch = step_responses(parts, records, timer, step, draw=draws).to(parts.device)
        draws += 1
        score_rewards(parts, batch, whole_batch_shards(parts, batch), timer, [r.where for r in records])
        keep = dynamic_sampling_keep(filter_values(batch, fg.component, records), batch.group_index)  # (B,)
        rows = keep.nonzero().squeeze(-1).tolist()  # host sync; the same rows on every rank
        groups = sorted(set(batch.group_index[rows].tolist()))  # kept prompts, in the batch's order
        dropped += len(records) - len(groups)
        kept_records += [records[g] for g in groups]
        if rows:
            kept_batches.append(batch.select(rows))
    joined = concat_batches(kept_batches, parts.tokenizer.pad_token_id)
    metrics = {f"{METRICS}/gen_batches": float(draws), f"{METRICS}/kept_groups": float(len(kept_records)),
               f"{METRICS}/dropped_groups": float(dropped)}
    # Groups are whole (n rows each, the groups in order): the first prompts * n rows are the first prompts.
    return kept_records[: fg.prompts], joined.select(list(range(fg.prompts * n))), metrics


def filter_values(batch: RolloutBatch, component: Optional[str], records: list[PromptRecord]) -> torch.Tensor:
    """(B,) what must differ within a group: each response's score, or the reward component named
    ``component`` (algorithm.filter_groups.metric, e.g. verl's "acc"). ``records``: the batch's
    prompts (``batch.group_index`` indexes them), whose place the error names when a response lacks it."""
    if component is None:
        return batch.token_level_scores.sum(-1)
    if batch.reward_components is None:
        raise UserError(f"algorithm.filter_groups.metric = '{component}' names an entry of the dict a reward function "
                        "returns, but this batch's scores were recorded in the data (its `scores` or rankings column): "
                        "they have no entries; set algorithm.filter_groups.metric=score")
    for row, parts in enumerate(batch.reward_components):
        if component not in parts:
            returned = ", ".join(f"'{name}'" for name in sorted(parts)) or "none"
            where = records[int(batch.group_index[row])].where
            raise UserError(f"{where}: algorithm.filter_groups.metric = '{component}', but the reward function "
                            f"returned no numeric '{component}' for this response (its numeric entries besides 'score': "
                            f"{returned}); return a dict with '{component}' (verl's reward_extra_info), or set "
                            "algorithm.filter_groups.metric=score")
    return torch.tensor([parts[component] for parts in batch.reward_components], dtype=torch.float32,
                        device=batch.response_mask.device)


def draw_limit(parts: PPOParts) -> Optional[int]:
    """The most generation batches one step may draw: max_num_gen_batches, else none online and
    one epoch's offline (recorded responses repeat from epoch to epoch)."""
    limit = parts.settings.filter_groups.max_gen_batches
    if limit is None and parts.settings.rollout == "offline":
        return parts.batches.steps_per_epoch
    return limit


def whole_batch_shards(parts: PPOParts, batch: RolloutBatch) -> StepShards:
    """Equal contiguous shares of a generation batch's rows, for scoring its rewards."""
    world = parts.env.world_size
    size = len(batch) // world  # data.gen_batch_size splits over the ranks (config/batch_sizes.py)
    return StepShards([list(range(r * size, (r + 1) * size)) for r in range(world)], parts.env.rank)


def too_few_groups_message(parts: PPOParts, step: int, draws: int, found: int) -> str:
    fg, offline = parts.settings.filter_groups, parts.settings.rollout == "offline"
    got = (f"step {step} drew {draws} generation batches of data.gen_batch_size={fg.gen_batch_prompts} prompts and "
           f"kept {found} prompts whose responses' rewards differ, fewer than data.train_batch_size={fg.prompts} "
           "(algorithm.filter_groups)")
    if offline and fg.max_gen_batches is None:
        return (f"{got}: one epoch of the recorded data holds too few such prompts; lower data.train_batch_size, "
                "record responses whose rewards differ, or set algorithm.filter_groups.enable=false")
    return (f"{got}; generated too many: the prompts may be too difficult (or too easy) for the policy; raise "
            "algorithm.filter_groups.max_num_gen_batches (0: no limit), lower data.train_batch_size, or use other data")
