"""The PPO loop, top-down: batch, responses, score, shape, advantages, guard, update, log, save.

Everything it needs is built beforehand by ``klppo.trainer.build.build_ppo``; this file only
orders the phases of one iteration (DESIGN.md, "One PPO iteration"); what a checkpoint holds
lives in ``run_state`` and the guards' decisions in ``guards``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from klppo.algo import apply_kl_penalty, compute_advantage, masked_mean
from klppo.config import config_to_dict
from klppo.checkpoint.state import checkpoint_steps, export_hf, resume_folder, step_dir
from klppo.data.batching import rank_shards, restore_order, seqlen_balance_metrics
from klppo.distributed import (
    all_gather_padded, all_gather_rows, all_reduce_max_int, barrier, on_rank_zero, reduce_counts, reduce_stats, shard_range,
)
from klppo.monitoring.flops import max_memory_gb, mfu, model_flops, peak_flops
from klppo.monitoring.jsonl import EVENTS_FILE, append_jsonl, set_aside, truncate_jsonl
from klppo.monitoring.logger import METRICS_FILE, MetricsLogger
from klppo.monitoring.metrics import compute_data_metrics, compute_throughput_metrics
from klppo.monitoring.overlap import OverlapMeasure, profiled
from klppo.monitoring.progress import Progress
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch, assemble_batch
from klppo.rollout.hf import hf_rollout
from klppo.rollout.offline import offline_rollout
from klppo.rewards.distill import group_ranking_rewards
from klppo.rewards.token_scores import scores_at_last_token
from klppo.trainer import run_state
from klppo.trainer.build import (
    PPOParts,
    actor_settings,
    critic_settings,
    forward_settings,
    guard_settings,
    sampling_params,
)
from klppo.trainer.guards import Action, RunGuard
from klppo.trainer.forwards import compute_log_prob, compute_rm_scores, compute_scores, compute_values
from klppo.trainer.update import update_actor, update_critic
from klppo.trainer.evaluate import preference_agreement, sampled_kl_to_ref, validate


PROGRESS_KEYS = {"score": "critic/score/mean", "kl": "actor/kl_to_ref"}  # what the progress bar shows
# Distributed runs profile the updates of step 1 and every this many steps for perf/overlap_ratio:
# the profiler records every operation, which on CPU triples the update's time.
OVERLAP_EVERY = 10


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


def per_rank(settings, world_size: int):
    """Update settings for one rank's share: its mini-batches hold 1/world of the global rows."""
    return dataclasses.replace(settings, mini_batch_rows=settings.mini_batch_rows // world_size)


class PPOTrainer:
    """Runs ``parts.total_steps`` PPO iterations, resuming from the latest checkpoint if asked."""

    def __init__(self, parts: PPOParts, print_fn: Callable = print) -> None:
        self.p, self.cfg, self.env = parts, parts.cfg, parts.env
        self.print = on_rank_zero(print_fn, self.env)
        trainer = self.cfg.trainer
        self.logger = MetricsLogger(parts.run_dir, trainer.logger, print_fn=self.print, rank=self.env.rank,
                                    project_name=trainer.project_name, experiment_name=trainer.experiment_name,
                                    config=config_to_dict(self.cfg))
        self.progress = None
        self.guard = RunGuard(guard_settings(self.cfg))
        world = self.env.world_size
        self.actor_settings, self.step = per_rank(actor_settings(self.cfg), world), 0
        self.forwards = forward_settings(self.cfg)  # how old/ref log-probs and values split the batch
        self.critic_settings = per_rank(critic_settings(self.cfg), world) if parts.critic is not None else None
        # Rows are dealt to ranks in chunks that are whole mini-batches of both the actor and the critic.
        global_rows = [s.mini_batch_rows * world for s in (self.actor_settings, self.critic_settings) if s is not None]
        self.shard_chunk_rows = math.gcd(*global_rows)

    def fit(self) -> list[dict[str, float]]:
        """Train to the last step (or until a guard stops the run); returns the metrics logged."""
        self._resume()
        self.progress = Progress(total=self.p.total_steps, initial=self.step, desc="ppo",
                                 quiet=None if self.env.rank == 0 else True)
        if self.print is print:  # console lines go above the bar
            self.logger.print_fn = self.print = self.progress.write
        try:
            return self._train_to_the_end()
        finally:
            self.progress.close()
            self.logger.close()

    def _train_to_the_end(self) -> list[dict[str, float]]:
        trainer, records = self.cfg.trainer, []
        has_val = bool(self.p.val_records or self.p.val_ranked)
        if has_val and trainer.val_before_train and self.step == 0:
            records.append(self.logger.log(0, self._validate(), total=self.p.total_steps))
        while self.step < self.p.total_steps:
            self.step += 1
            last = self.step == self.p.total_steps
            metrics, action = self.train_step()
            if action is Action.ROLLBACK:
                self._rollback()
            if action is Action.CONTINUE and has_val and trainer.test_freq > 0 and (
                    self.step % trainer.test_freq == 0 or last):
                metrics.update(self._validate())
            # Log before saving: a crash in between leaves a logged step that resume truncates and
            # repeats, never a checkpointed step whose metrics were lost.
            self._log_events()
            records.append(self.logger.log(self.step, metrics, total=self.p.total_steps))
            if action is Action.CONTINUE and (last or (trainer.save_freq > 0 and self.step % trainer.save_freq == 0)):
                self.save()
            self.progress.advance(postfix={name: records[-1][k] for name, k in PROGRESS_KEYS.items() if k in records[-1]})
            if action is Action.STOP:
                self.print(f"run stopped by its guard at step {self.step}; the newest checkpoint holds good weights")
                return records
        with self.p.offloader.resident("actor"):
            export_hf(self.p.actor, self.p.tokenizer, self.p.run_dir / "actor_hf", self.env)
        self.print(f"actor exported to {self.p.run_dir / 'actor_hf'}")
        return records

    def train_step(self) -> tuple[dict[str, float | torch.Tensor], Action]:
        p, algo, timer = self.p, self.cfg.algorithm, PhaseTimer(self.progress)
        with timer.phase("step"):
            # step 1. batch: the next prompts, in a resumable order
            records = [p.train_records[i] for i in p.batches.next_batch()]
            # step 2. responses
            with timer.phase("gen"):
                batch = self._rollout(records).to(p.device)
            # Every rank holds the whole batch; each scores and trains on its own rows.
            shards = self._shards(batch)
            # step 3. score: old and reference log-probs, values, rewards
            self._score(batch, shards, timer)
            # step 4. shape: token rewards = scores - beta * KL(old || ref)
            metrics = self._shape_rewards(batch)
            # step 5. advantages
            with timer.phase("adv"):
                batch.advantages, batch.returns = compute_advantage(
                    algo.adv_estimator, batch.token_level_rewards, batch.response_mask, batch.group_index,
                    values=batch.values, gamma=algo.gamma, lam=algo.lam,
                    norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
            # step 6. guard: KL of the sampling policy to the reference, finite rewards
            action = self._guard_before_update(batch)
            # step 7. update: critic, then actor
            if action is Action.CONTINUE:
                metrics.update(self._update(batch.select(shards.mine), timer))
                action = self._guard_after_update(metrics)
        # step 8. metrics
        metrics.update(compute_data_metrics(batch, self.cfg.actor_rollout_ref.rollout.response_length))
        metrics.update(timer.metrics())
        metrics.update(compute_throughput_metrics(batch, timer.seconds["step"], n_devices=self.env.world_size))
        metrics.update(self._efficiency_metrics(batch.select(shards.mine), timer.seconds))
        if self.cfg.trainer.balance_batch:
            metrics.update(seqlen_balance_metrics(batch.attention_mask.sum(-1).tolist(), shards.rows))
        metrics.update({"training/epoch": p.batches.epoch, "guard/rollbacks": self.guard.rollbacks})
        return metrics, action

    def _rollout(self, records) -> RolloutBatch:
        """The step's whole batch, on every rank: recorded responses, or each rank samples for its
        share of the prompts and the responses are gathered."""
        rollout, tokenizer = self.cfg.actor_rollout_ref.rollout, self.p.tokenizer
        if rollout.name == "offline":
            return offline_rollout(records, n=rollout.n, tokenizer=tokenizer, max_response_length=rollout.response_length)
        mine = records[shard_range(len(records), self.env)]
        with self.p.offloader.resident("actor"):
            local = hf_rollout(self.p.actor, mine, tokenizer, sampling_params(self.cfg), synced_gpus=self.env.is_distributed)
        if not self.env.is_distributed:
            return local
        return assemble_batch(records, rollout.n, tokenizer.pad_token_id,
                              all_gather_padded(local.response_ids, tokenizer.pad_token_id),
                              all_gather_padded(local.response_mask, 0))

    def _shards(self, batch: RolloutBatch) -> StepShards:
        lengths = batch.attention_mask.sum(-1).tolist()  # host sync
        rows = rank_shards(lengths, self.env.world_size, self.shard_chunk_rows, self.cfg.trainer.balance_batch)
        return StepShards(rows, self.env.rank)

    def _score(self, batch: RolloutBatch, shards: StepShards, timer: PhaseTimer) -> None:
        """Each rank runs the forwards for its rows; the results are gathered into ``batch``."""
        p, f, temperature = self.p, self.forwards, self.actor_settings.temperature
        mine, sync, resident = batch.select(shards.mine), {"max_over_ranks": all_reduce_max_int}, p.offloader.resident
        with timer.phase("old_log_prob"), resident("actor"):
            batch.old_log_prob = shards.gather(
                compute_log_prob(p.actor, mine, temperature=temperature, **asdict(f["old_log_prob"]), **sync))
        if p.ref is not None:
            with timer.phase("ref"), resident("ref"):
                batch.ref_log_prob = shards.gather(
                    compute_log_prob(p.ref, mine, temperature=temperature, **asdict(f["ref"]), **sync))
        if p.critic is not None:
            with timer.phase("values"), resident("critic"):
                batch.values = shards.gather(compute_values(p.critic, mine, **asdict(f["values"]), **sync))
        with timer.phase("reward"), resident(*self.reward_model_roles):
            scores = shards.gather(self._sequence_scores(mine))
            batch.token_level_scores = self._token_scores(batch, scores)

    @property
    def reward_model_roles(self) -> list[str]:
        return [f"reward_model_{i}" for i in range(len(self.p.reward_models))]

    def _sequence_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """(B,) one score per response: recorded offline scores, or the reward function's; or
        (B, K) the scores of K reward models."""
        p, rm = self.p, self.cfg.reward_model
        if batch.recorded_scores is not None:
            return batch.recorded_scores.to(p.device)
        if not p.reward_models:
            return compute_scores(batch, p.tokenizer, p.reward_fn)
        return torch.stack([compute_rm_scores(model, batch, micro_batch_rows=rm.micro_batch_size_per_gpu)
                            for model in p.reward_models], dim=-1)

    def _token_scores(self, batch: RolloutBatch, scores: torch.Tensor, validation: bool = False) -> torch.Tensor:
        """(B, T) the scores at the last response tokens. Reward models' scores are averaged, or,
        for training batches with ``reward_model.rank_responses``, distilled from the rankings
        the models make of each prompt's responses."""
        rm = self.cfg.reward_model
        if scores.dim() == 2 and rm.rank_responses and not validation:
            scores = group_ranking_rewards(scores, batch.group_index, rm.ranking.method,
                                           scale=rm.ranking.scale, center=rm.ranking.center)
        elif scores.dim() == 2:
            scores = scores.mean(-1)
        return scores_at_last_token(scores, batch.response_mask)

    def _shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        algo = self.cfg.algorithm
        if not algo.use_kl_in_reward:
            batch.token_level_rewards = batch.token_level_scores
            return {}
        batch.token_level_rewards, stats = apply_kl_penalty(
            batch.token_level_scores, batch.old_log_prob, batch.ref_log_prob, batch.response_mask,
            kl_coef=self.p.kl_ctrl.value, kl_penalty=algo.kl_penalty)
        # Ziegler et al.: the controller moves beta by the step's KL, n_steps = responses seen.
        self.p.kl_ctrl.update(current_kl=float(stats["actor/reward_kl_penalty"]), n_steps=len(batch))
        return stats

    def _update(self, batch: RolloutBatch, timer: PhaseTimer) -> dict[str, torch.Tensor | float]:
        p, metrics = self.p, {}
        # Losses normalised by global counts, metric shares summed, equal micro-batch counts: the
        # ranks together make the update one process would make on the whole batch.
        sync = dict(reduce_counts=reduce_counts, reduce_stats=reduce_stats, max_over_ranks=all_reduce_max_int)
        overlap = OverlapMeasure()
        measured = self.env.is_distributed and (self.step == 1 or self.step % OVERLAP_EVERY == 0)
        if p.critic is not None:
            with timer.phase("update_critic"), p.offloader.resident("critic"), profiled(p.device, overlap, measured):
                metrics.update(update_critic(p.critic, p.critic_optimizer, batch, self.critic_settings, **sync))
            metrics["critic/lr"] = p.critic_scheduler.get_last_lr()[0]
            p.critic_scheduler.step()
        with timer.phase("update_actor"), p.offloader.resident("actor"), profiled(p.device, overlap, measured):
            metrics.update(update_actor(p.actor, p.actor_optimizer, batch, self.actor_settings, **sync))
        metrics["actor/lr"] = p.actor_scheduler.get_last_lr()[0]
        p.actor_scheduler.step()
        if measured:
            metrics.update(overlap.metrics())
        return metrics

    def _guard_before_update(self, batch: RolloutBatch) -> Action:
        if batch.ref_log_prob is not None:
            kl = float(masked_mean(batch.old_log_prob - batch.ref_log_prob, batch.response_mask))  # host sync
            action = self.guard.check_kl(self.step, kl, existing=set(checkpoint_steps(self.p.run_dir)))
            if action is not Action.CONTINUE:
                return action
        scores = batch.token_level_scores.sum(-1)
        if bool(torch.isfinite(scores).all()):  # host sync
            return Action.CONTINUE
        return self.guard.check_finite(self.step, {"critic/score": float("nan")})

    def _guard_after_update(self, metrics: dict) -> Action:
        watched = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
        action = self.guard.check_finite(self.step, {k: float(metrics[k]) for k in watched if k in metrics})
        self.guard.check_health(self.step, float(metrics["actor/entropy"]), float(metrics["actor/pg_clipfrac"]))
        return action

    def _efficiency_metrics(self, batch: RolloutBatch, seconds: dict[str, float]) -> dict[str, float]:
        """perf/mfu/{actor,critic} where the device's peak is known, and peak memory."""
        p = self.p
        lengths = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()  # host sync
        metrics = {"perf/max_memory_allocated_gb": max_memory_gb(p.device)}
        for role, model, epochs in (("actor", p.actor, self.actor_settings.ppo_epochs),
                                    ("critic", p.critic, self.critic_settings and self.critic_settings.ppo_epochs)):
            if model is None or f"update_{role}" not in seconds:
                continue
            flops = epochs * model_flops(model.config, lengths, training=True)
            value = mfu(flops, seconds[f"update_{role}"], peak_flops(p.device, next(model.parameters()).dtype))
            if value is not None:
                metrics[f"perf/mfu/{role}"] = value
        return metrics

    def _validate(self) -> dict[str, float]:
        with self.p.offloader.resident("actor", "ref", *self.reward_model_roles):
            return self._validate_resident()

    def _validate_resident(self) -> dict[str, float]:
        p, metrics = self.p, {}
        if p.val_records:
            # Each rank validates its share of the records; the results are gathered.
            metrics.update(validate(p.actor, p.val_records, p.tokenizer,
                                    lambda b: self._token_scores(b, self._sequence_scores(b), validation=True),
                                    sampling_params(self.cfg, validation=True), batch_size=self.cfg.data.val_batch_size,
                                    env=self.env))
            if p.ref is not None:
                metrics.update(sampled_kl_to_ref(p.actor, p.ref, p.val_records, p.tokenizer, sampling_params(self.cfg),
                                                 batch_size=self.cfg.data.val_batch_size, env=self.env))
        if p.val_ranked:
            metrics.update(preference_agreement(p.actor, p.val_ranked, p.tokenizer,
                                                self.cfg.actor_rollout_ref.rollout.response_length, env=self.env))
        return metrics

    def _log_events(self) -> None:
        for event in self.guard.drain_events():
            if self.env.rank == 0:
                append_jsonl(self.p.run_dir / EVENTS_FILE, event.to_record())
            self.print(f"[guard] step {event.step}: {event.message}")

    # ---- checkpoints, resume, rollback ----

    def save(self) -> Path:
        with self.p.offloader.resident("actor", "critic"):
            folder = run_state.save(self.p, self.step, self.guard, keep=self.cfg.trainer.max_actor_ckpt_to_keep)
        self.guard.checkpoint_saved(self.step)
        return folder

    def _rollback(self) -> None:
        target = self.guard.rollback_target(set(checkpoint_steps(self.p.run_dir)))
        with self.p.offloader.resident("actor", "critic", "ref"):
            if target is None:
                run_state.restore_initial_actor(self.p)
            else:
                run_state.restore(self.p, step_dir(self.p.run_dir, target), self.guard, weights_only=True)
        run_state.apply_lr_override(self.p, self.guard.lr_override)

    def _resume(self) -> None:
        trainer, run_dir = self.cfg.trainer, self.p.run_dir
        folder = resume_folder(run_dir, trainer.resume_mode, trainer.resume_from_path)
        if folder is None:
            if self.env.rank == 0:
                set_aside(run_dir, (METRICS_FILE, EVENTS_FILE), self.print)
            barrier()
            return
        with self.p.offloader.resident("actor", "critic"):
            self.step = run_state.restore(self.p, folder, self.guard)
        if self.guard.lr_override is not None:
            run_state.apply_lr_override(self.p, self.guard.lr_override)
        # Steps the interrupted run logged after this checkpoint will be run (and logged) again.
        if self.env.rank == 0:
            for name in (METRICS_FILE, EVENTS_FILE):
                truncate_jsonl(run_dir / name, self.step)
        self.print(f"resumed from {folder} at step {self.step}")
