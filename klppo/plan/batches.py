"""The Batches table of ``klppo plan``: one PPO step's batch arithmetic, worked out from the config.

Units are verl's (``klppo.config.batch_sizes``, which also holds the rules a config must meet):
prompts per step and per mini-batch, times ``rollout.n`` samples, over W ranks. One PPO step
makes ``ppo_epochs x mini-batches`` optimiser steps per trained model; a rank accumulates the
gradient of its share of each mini-batch over its micro-batches.

With a token budget (``use_dynamic_bsz``) the micro-batch count depends on the data: the
sampled lengths are cut into the batches, mini-batches and rank shares the trainer makes
(``rank_shards``) and each share is split as the trainer splits it (``micro_batch_plan``,
Karmarkar-Karp under the budget); every rank runs the largest count any rank needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from klppo.config.batch_sizes import (
    UpdateSizes, batch_size_problems, mini_batch_rows, shard_chunk_rows, update_sizes, uses_reference,
)
from klppo.config.schema import PPOConfig
from klppo.data.batching import MicroBatching, micro_batch_plan, rank_shards
from klppo.data.parquet import parquet_num_rows, read_parquet_sample
from klppo.data.ranked import check_pair
from klppo.data.rl_dataset import check_prompt, check_responses, encode_prompts, tokenize_responses
from klppo.data.sampler import PromptBatches, run_length
from klppo.data.tool_config import read_function_tools, read_tool_config
from klppo.errors import UserError

SAMPLED_BATCHES = 64  # batches of the length sample a token-budget estimate looks at, at most


@dataclass(frozen=True)
class LengthSample:
    """Token lengths of a sample of the training data, one entry per sample (prompt x response).

    Samples are grouped by prompt, ``rollout.n`` each, as the trainer's batches are.
    """

    prompt_tokens: tuple[int, ...]  # each sample's prompt tokens (chat template applied, truncated)
    response_tokens: tuple[int, ...]  # each sample's response tokens (recorded), or the configured bound
    # rows in data.train_files (Parquet footers; at most data.train_max_samples), before filter_overlong_prompts
    num_prompts: int
    note: str  # what these lengths are: measured, or upper bounds
    bounds: bool = False  # True: every length is the configured maximum, not a measurement

    @property
    def sequence_tokens(self) -> list[int]:
        """Prompt + response tokens of each sample: what a micro-batch's token budget counts."""
        return [p + r for p, r in zip(self.prompt_tokens, self.response_tokens)]


@dataclass(frozen=True)
class RoleBatches:
    """One trained model's updates in one PPO step (actor or critic)."""

    name: str  # actor | critic
    mini_batch_prompts: int  # ppo_mini_batch_size
    mini_batch_samples: int  # over all ranks: ppo_mini_batch_size x rollout.n (floored to a multiple of the ranks)
    mini_batches_per_step: int  # data.train_batch_size / ppo_mini_batch_size (the last may be smaller)
    ppo_epochs: int
    optimizer_steps_per_ppo_step: int  # ppo_epochs x mini_batches_per_step
    share_samples: int  # one rank's samples of each mini-batch: mini_batch_samples / ranks
    micro_batch_rows: Optional[int]  # samples per micro-batch (fixed sizes); None under a token budget
    max_tokens: Optional[int]  # the token budget per micro-batch (use_dynamic_bsz); None with fixed sizes
    micro_batches_per_mini_batch: int  # per rank; under a budget the largest the length sample needs
    micro_batches_mean: float  # per rank, the mean over the sampled mini-batches (= the count when fixed)
    estimated: bool  # the counts come from the length sample (token budget)

    @property
    def gradient_accumulation(self) -> int:
        """Micro-batches whose gradients a rank adds up before each optimiser step (verl's name)."""
        return self.micro_batches_per_mini_batch


@dataclass(frozen=True)
class ForwardBatches:
    """A no-grad scoring forward over a rank's share of the step (old log-probs, reference)."""

    name: str  # old_log_prob | ref
    rows_per_rank: int  # samples each rank scores per step
    micro_batch_rows: Optional[int]  # log_prob_micro_batch_size_per_gpu (None: all rows at once)
    max_tokens: Optional[int]  # log_prob_max_token_len_per_gpu under log_prob_use_dynamic_bsz, else None
    micro_batches: int  # per rank per step; under a budget the largest the length sample needs
    estimated: bool


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    n: int  # rollout.n: samples per prompt
    prompts_per_step: int  # data.train_batch_size
    samples_per_step: int  # x rollout.n
    prompts_per_rank: int
    samples_per_rank: int
    tokens_per_step_mean: float  # samples_per_step x the sample's mean prompt + response tokens
    tokens_per_step_bound: int  # samples_per_step x (max_prompt_length + response_length)
    steps_per_epoch: int
    total_steps: int  # trainer.total_training_steps, else total_epochs x steps_per_epoch
    actor: RoleBatches
    critic: Optional[RoleBatches]  # None: a critic-free estimator
    old_log_prob: ForwardBatches
    ref: Optional[ForwardBatches]  # None: no KL term, so no reference forward
    lengths_note: str
    lengths_are_bounds: bool = False  # the sample's lengths are the configured maxima: the mean is the bound


def batch_problems(cfg: PPOConfig, world_size: int) -> list[str]:
    """The degenerate batch-size combinations of ``cfg`` on ``world_size`` ranks, each naming its fix.

    The same rules refuse a run at its start (``klppo.config.batch_sizes``, their one home).
    """
    return [message for _, message in batch_size_problems(cfg, world_size)]


def plan_batches(cfg: PPOConfig, world_size: int, lengths: LengthSample) -> BatchPlan:
    """The batch arithmetic of a resolved PPO config on ``world_size`` ranks (pure).

    A degenerate combination is a ``UserError`` listing every problem with its fix.
    """
    problems = batch_problems(cfg, world_size)
    if problems:
        raise UserError("\n".join(problems))
    data, arf, trainer = cfg.data, cfg.actor_rollout_ref, cfg.trainer
    n, prompts = arf.rollout.n, data.train_batch_size
    layout = _Layout(world_size, shard_chunk_rows(cfg, world_size), trainer.balance_batch)
    seqs = lengths.sequence_tokens
    actor, *critic = [_role(role, prompts, n, seqs, layout) for role in update_sizes(cfg)]
    samples = prompts * n
    old = _forward("old_log_prob", arf.rollout, samples, seqs, layout, "actor_rollout_ref.rollout")
    ref = _forward("ref", arf.ref, samples, seqs, layout, "actor_rollout_ref.ref") if uses_reference(cfg) else None
    # The trainer's own sampler and run length: a data set smaller than one step fails here as it would there.
    per_epoch = PromptBatches(lengths.num_prompts, prompts, shuffle=False, seed=0).steps_per_epoch
    return BatchPlan(
        world_size=world_size, n=n, prompts_per_step=prompts, samples_per_step=samples,
        prompts_per_rank=prompts // world_size, samples_per_rank=samples // world_size,
        tokens_per_step_mean=samples * sum(seqs) / len(seqs),
        tokens_per_step_bound=samples * (data.max_prompt_length + arf.rollout.response_length),
        steps_per_epoch=per_epoch, total_steps=run_length(trainer.total_training_steps, trainer.total_epochs, per_epoch),
        actor=actor, critic=critic[0] if critic else None, old_log_prob=old, ref=ref, lengths_note=lengths.note,
        lengths_are_bounds=lengths.bounds,
    )


@dataclass(frozen=True)
class _Layout:
    """How the trainer deals a step's rows to the ranks (``PPOSettings.shard_chunk_rows``, ``balance_batch``)."""

    world: int
    chunk_rows: int  # config.batch_sizes.shard_chunk_rows
    balance: bool


def _role(role: UpdateSizes, prompts: int, n: int, seqs: list[int], layout: _Layout) -> RoleBatches:
    share = mini_batch_rows(role, n, layout.world)
    mini_samples = share * layout.world
    mini_batches = math.ceil(prompts * n / mini_samples)
    if role.use_dynamic_bsz:
        split = MicroBatching(max_tokens=role.max_token_len_per_gpu, budget_key=role.budget_key)
        counts = _budget_counts(seqs, mini_samples, split, layout)
        rows, tokens, most, mean = None, role.max_token_len_per_gpu, max(counts), sum(counts) / len(counts)
    else:
        rows, tokens = role.micro_batch_size_per_gpu or share, None
        most = mean = math.ceil(share / rows)
    return RoleBatches(
        name=role.prefix.rsplit(".", 1)[-1], mini_batch_prompts=role.mini_batch_size, mini_batch_samples=mini_samples,
        mini_batches_per_step=mini_batches, ppo_epochs=role.ppo_epochs,
        optimizer_steps_per_ppo_step=role.ppo_epochs * mini_batches, share_samples=share, micro_batch_rows=rows,
        max_tokens=tokens, micro_batches_per_mini_batch=most, micro_batches_mean=float(mean),
        estimated=role.use_dynamic_bsz,
    )


def _forward(name: str, section, samples: int, seqs: list[int], layout: _Layout, prefix: str) -> ForwardBatches:
    """``section``: the rollout or ref config, whose ``log_prob_*`` keys size the forward."""
    rows = samples // layout.world
    if section.log_prob_use_dynamic_bsz:
        split = MicroBatching(max_tokens=section.log_prob_max_token_len_per_gpu,
                              budget_key=f"{prefix}.log_prob_max_token_len_per_gpu")
        return ForwardBatches(name, rows, None, split.max_tokens, max(_budget_counts(seqs, samples, split, layout)), True)
    micro = section.log_prob_micro_batch_size_per_gpu
    return ForwardBatches(name, rows, micro, None, math.ceil(rows / (micro or rows)), False)


def _budget_counts(seqs: list[int], batch_rows: int, split: MicroBatching, layout: _Layout) -> list[int]:
    """For each batch of ``batch_rows`` samples the length sample fills (cycled through it, in order),
    the micro-batch count every rank runs: the largest over the ranks' shares, as the trainer's
    ``max_over_ranks`` makes it."""
    batches = max(1, min(SAMPLED_BATCHES, math.ceil(len(seqs) / batch_rows)))
    counts = []
    for b in range(batches):
        lens = [seqs[(b * batch_rows + i) % len(seqs)] for i in range(batch_rows)]
        shards = rank_shards(lens, layout.world, min(layout.chunk_rows, batch_rows), layout.balance)
        counts.append(max(len(micro_batch_plan([lens[i] for i in shard], split)) for shard in shards))
    return counts


# ---- the length sample ----


def bound_lengths(cfg: PPOConfig, num_prompts: int, why: str) -> LengthSample:
    """Every sample at the configured maxima: upper bounds where nothing can be measured."""
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    longest = data.max_prompt_length + rollout.response_length
    note = (f"{why}: every sequence counted at data.max_prompt_length + {_rollout_key('response_length')} = "
            f"{longest} tokens, so tokens and token-budget micro-batches are upper bounds")
    return LengthSample((data.max_prompt_length,) * rollout.n, (rollout.response_length,) * rollout.n, num_prompts,
                        note, bounds=True)


def _rollout_key(name: str) -> str:
    return f"actor_rollout_ref.rollout.{name}"


def sample_lengths(cfg: PPOConfig, tokenizer, rows: int = 256) -> LengthSample:
    """Token lengths of the first ``rows`` prompts of ``data.train_files`` (shared over its files).

    Offline runs measure the recorded responses (the first ``rollout.n`` of each prompt, cut to
    ``rollout.response_length`` as the trainer cuts them); online runs count every response at
    ``rollout.response_length``, the bound generation stops at. Without a tokenizer nothing is
    measured (``bound_lengths``). Reads the files' footers and first rows, never whole files.
    """
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    num_prompts = parquet_num_rows(data.train_files)
    if data.train_max_samples > 0:  # the run reads that many rows (``data.parquet.RowSample``)
        num_prompts = min(num_prompts, data.train_max_samples)
    if tokenizer is None:
        return bound_lengths(cfg, num_prompts, "no tokenizer")
    offline = rollout.name == "offline"
    columns = [data.prompt_key] + (["responses", "chosen", "rejected"] if offline else [])
    sample = read_parquet_sample(data.train_files, columns, rows)
    ids = encode_prompts(tokenizer, [check_prompt(row, data.prompt_key) for row in sample], sample, data.prompt_key,
                         prompt_template_kwargs(cfg))
    prompt_tokens, response_tokens = [], []
    for row, prompt in zip(sample, ids):
        if data.filter_overlong_prompts and len(prompt) > data.max_prompt_length:
            continue  # the trainer drops it
        prompt_tokens += [min(len(prompt), data.max_prompt_length)] * rollout.n
        response_tokens += (_recorded_response_tokens(row, tokenizer, rollout.n, rollout.response_length) if offline
                            else [rollout.response_length] * rollout.n)
    if not prompt_tokens:
        return bound_lengths(cfg, num_prompts, f"all {len(sample)} sampled prompts are over data.max_prompt_length")
    kept = len(prompt_tokens) // rollout.n
    responses = ("their recorded responses" if offline else
                 f"responses at {_rollout_key('response_length')} = {rollout.response_length} tokens, the bound "
                 "generation stops at (so tokens and token-budget micro-batches are upper bounds)")
    note = f"prompts: {kept} sampled from data.train_files, tokenised; {responses}"
    return LengthSample(tuple(prompt_tokens), tuple(response_tokens), num_prompts, note, bounds=False)


def prompt_template_kwargs(cfg: PPOConfig) -> dict:
    """What the chat template renders a prompt with: data.apply_chat_template_kwargs, and the multi-turn
    tools' schemas, which the trainer shows the model in every prompt (a tool config's are read, no tool
    built; a function-tool file is run, as the trainer runs it, to read its functions' schemas)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    schemas = []
    if mt.enable and mt.tool_config_path:
        schemas += [t.schema for t in read_tool_config(mt.tool_config_path)]
    if mt.enable and mt.function_tool_path:
        schemas += [t.schema for t in read_function_tools(mt.function_tool_path)]
    return {**cfg.data.apply_chat_template_kwargs, **({"tools": schemas} if schemas else {})}


def _recorded_response_tokens(row: dict, tokenizer, n: int, limit: int) -> list[int]:
    """The first ``n`` recorded responses' tokens (cycled where a row has fewer; the trainer refuses
    such a row, and its own check names it)."""
    texts = check_pair(row) if row.get("chosen") is not None else check_responses(row, required=True)[0]
    ids, _ = tokenize_responses([texts[j % len(texts)] for j in range(n)], tokenizer, limit)
    return [len(x) for x in ids]


# ---- the table ----


def format_batches(plan: BatchPlan) -> str:
    """The Batches table: a few aligned lines, numbers as the plan holds them ("~" marks estimates)."""
    p = plan
    lines = [
        f"Batches on {p.world_size} rank{'s' if p.world_size != 1 else ''} (rollout.n = {p.n})",
        f"  per step    {p.prompts_per_step} prompts, {p.samples_per_step} samples "
        f"({p.prompts_per_rank} prompts, {p.samples_per_rank} samples per rank)",
        f"  tokens      at most {p.tokens_per_step_bound:,} per step" if p.lengths_are_bounds else
        f"  tokens      {round(p.tokens_per_step_mean):,} per step (the length sample's mean), "
        f"at most {p.tokens_per_step_bound:,}",
        f"  run         {p.steps_per_epoch} steps per epoch, {p.total_steps} steps in total",
        "",
    ]
    header = ("update", "mini-batches", "samples each", "per rank", "optimiser steps", "micro-batch",
              "micro-batches", "grad accum")
    rows = [_role_row(r) for r in (p.actor, p.critic) if r is not None]
    lines += _aligned([header, *rows])
    lines.append("")
    forwards = [_forward_row(f) for f in (p.old_log_prob, p.ref) if f is not None]
    lines += _aligned([("forward", "rows per rank", "micro-batch", "micro-batches"), *forwards])
    lines.append(f"  lengths: {p.lengths_note}")
    return "\n".join(lines)


def _size(rows: Optional[int], tokens: Optional[int]) -> str:
    return f"{tokens} tokens" if tokens is not None else "all at once" if rows is None else f"{rows} samples"


def _count(value: int, estimated: bool) -> str:
    return f"~{value}" if estimated else str(value)


def _role_row(r: RoleBatches) -> tuple[str, ...]:
    micro = _count(r.micro_batches_per_mini_batch, r.estimated)
    return (r.name, str(r.mini_batches_per_step), str(r.mini_batch_samples), str(r.share_samples),
            f"{r.optimizer_steps_per_ppo_step} ({r.ppo_epochs} x {r.mini_batches_per_step})",
            _size(r.micro_batch_rows, r.max_tokens), micro, micro)


def _forward_row(f: ForwardBatches) -> tuple[str, ...]:
    return (f.name, str(f.rows_per_rank), _size(f.micro_batch_rows, f.max_tokens), _count(f.micro_batches, f.estimated))


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell: the first left-aligned, numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]
