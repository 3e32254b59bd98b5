"""The PPO loop, top-down: batch, responses, score, shape, advantages, guard, update, log, save.

Everything it needs is built beforehand (``klppo.run.build.build_ppo``); it reads only the
run's ``PPOSettings``, never the config. This file orders the phases of one iteration
(DESIGN.md, "One PPO iteration"); the scoring forwards live in ``forwards``, the updates in
``update``, validation in ``evaluate``, a step's own metrics in ``step_metrics``, what a
checkpoint holds and a rollback restores in ``klppo.run.state``, the guards' decisions in
``klppo.safety.guards``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from klppo.algo import apply_kl_penalty, masked_mean
from klppo.checkpoint.state import checkpoint_steps
from klppo.distributed import max_over_ranks, mean_over_ranks, on_rank_zero
from klppo.monitoring.jsonl import EVENTS_FILE, append_jsonl
from klppo.monitoring.logger import METRICS_FILE, MetricsLogger
from klppo.monitoring.memory import PeakMemory
from klppo.monitoring.overlap import OverlapMeasure, profiled
from klppo.monitoring.progress import Progress
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch
from klppo.run import state as run_state
from klppo.run.adapters import export_model
from klppo.run.build import GOLD_ROLE, PPOParts
from klppo.run.collector import FrozenSetup
from klppo.run.folder import RunFolder
from klppo.safety.guards import GRAD_MODELS, Action, RunGuard, most_severe
from klppo.trainer.advantages import estimate_advantages
from klppo.trainer.dynamic_sampling import scored_step_batch
from klppo.trainer.evaluate import importance_weighted, offline_policy_kl, sampled_offline_kl, validation_metrics
from klppo.trainer.forwards import forwards_first, reward_model_roles
from klppo.trainer.step_metrics import data_metrics, memory_metrics, performance_metrics
from klppo.trainer.update import Forwarded, OnPolicy, OptimizerSteps, update_actor, update_critic

PROGRESS_KEYS = {"score": "critic/score/mean", "kl": "actor/kl_to_ref"}  # what the progress bar shows
# Distributed runs profile the first micro-batch of the updates of step 1 and every this many steps
# for perf/overlap_ratio (monitoring/overlap.py: profiling whole updates cost more than they showed).
OVERLAP_EVERY = 10


class PPOTrainer:
    """Runs ``parts.total_steps`` PPO iterations, resuming from the latest checkpoint if asked."""

    def __init__(self, parts: PPOParts, print_fn: Callable = print, setup_peak_gb: float | None = None,
                 config_text: str | None = None) -> None:
        self.p, self.s, self.env = parts, parts.settings, parts.env
        self.memory = PeakMemory(self.env.device)  # each phase's peak (perf/peak_memory_gb/<phase>)
        self.setup_peak_gb = setup_peak_gb  # loading data and models; logged with the first step
        self.print = on_rank_zero(print_fn, self.env)
        # config_text: what config.yaml gets with the first step's log (RunFolder); None writes none.
        self.folder = RunFolder(self.s.run_dir, (METRICS_FILE, EVENTS_FILE), config_text, self.env)
        self.logger: MetricsLogger | None = None  # made with the folder's first writes (``_open``)
        self.progress = None
        self.guard = RunGuard(self.s.guard)
        self.step = 0
        self.frozen = FrozenSetup()  # no garbage collection walks what was built before training

    def fit(self, resume_from: Path | None = None) -> list[dict[str, float]]:
        """Train to the last step (or until a guard stops the run), continuing after checkpoint
        ``resume_from`` if given (``run_state.resume_target``); returns the metrics logged."""
        self._resume(resume_from)
        self.progress = Progress(total=self.p.total_steps, initial=self.step, desc="ppo",
                                 quiet=None if self.env.rank == 0 else True)
        if self.print is print:  # console lines go above the bar
            self.print = self.progress.write
        try:
            with self.frozen:
                return self._train_to_the_end()
        finally:
            self.progress.close()
            if self.logger is not None:
                self.logger.close()

    def _open(self) -> None:
        """The run folder's first writes and the logger (TensorBoard and W&B start writing too), once."""
        if self.logger is None:
            self.folder.open(self.print)
            log = self.s.logger
            self.logger = MetricsLogger(self.s.run_dir, list(log.backends), print_fn=self.print, rank=self.env.rank,
                                        project_name=log.project_name, experiment_name=log.experiment_name,
                                        config=log.config)

    def _log(self, metrics: dict) -> dict[str, float]:
        """Log this step's guard events and metrics (the first call opens the run folder)."""
        self._open()
        for event in self.guard.drain_events():
            if self.env.rank == 0:
                append_jsonl(self.s.run_dir / EVENTS_FILE, event.to_record())
            self.print(f"[guard] step {event.step}: {event.message}")
        return self.logger.log(self.step, metrics, total=self.p.total_steps)

    def _train_to_the_end(self) -> list[dict[str, float]]:
        s, records = self.s, []
        has_val = bool(self.p.val_records or self.p.val_ranked)
        if s.val_only or (has_val and s.val_before_train and self.step == 0):
            first, _ = self._validate()  # the baseline of the divergence window; its guard cannot act yet
            records.append(self._log(first))
        if s.val_only:
            return records
        while self.step < self.p.total_steps:
            self.step += 1
            last = self.step == self.p.total_steps
            metrics, action = self.train_step()
            if action is Action.ROLLBACK:
                run_state.roll_back(self.p, self.guard)
            if action is Action.CONTINUE and has_val and s.test_freq > 0 and (self.step % s.test_freq == 0 or last):
                validated, action = self._validate()
                metrics.update(validated)
            # Log before saving: a crash in between leaves a logged step that resume truncates and
            # repeats, never a checkpointed step whose metrics were lost.
            records.append(self._log(metrics))
            if action is Action.CONTINUE and (last or (s.save_freq > 0 and self.step % s.save_freq == 0)):
                self.save()
            self.progress.advance(postfix={name: records[-1][k] for name, k in PROGRESS_KEYS.items() if k in records[-1]})
            if action is Action.STOP:
                self.print(f"run stopped by its guard at step {self.step}; the newest checkpoint holds good weights")
                return records
        self._open()  # a resumed run that had no step left has logged nothing
        run_state.release_training_state(self.p)
        self.frozen.collect_everything()  # rank 0 needs the room for the gathered actor
        with self.p.offloader.resident("actor"):  # a LoRA actor: merged, and its adapter alone
            written = export_model(self.p.actor, self.p.tokenizer, self.s.run_dir / "actor_hf",
                                   self.s.run_dir / "actor_adapter", self.env)
        self.print(f"actor exported to {' and '.join(str(folder) for folder in written)}")
        return records

    def train_step(self) -> tuple[dict[str, float | torch.Tensor], Action]:
        p, timer = self.p, PhaseTimer(self.progress, self.memory)
        with timer.phase("step"):
            # steps 1-3. batch, responses, score: the next prompts in a resumable order, their responses
            # (with vLLM: the actor's weights streamed into the engine first), old and reference log-probs,
            # values and rewards; with algorithm.filter_groups drawn until enough prompts have spread.
            drawn = scored_step_batch(p, timer, self.step)
            batch, records, shards = drawn.batch, drawn.records, drawn.shards
            # offline: the KL probe where due, before the updates' forwards (pi_old, values) hold their graphs
            sampled = sampled_offline_kl(p, batch, records, self.step, self.guard, timer)
            forwarded = forwards_first(p, batch, shards, timer) if self.s.forwards.update_forwards_first else {}
            # the sampling policy's KL to the reference
            kl, metrics = self._policy_kl(batch, records, timer, sampled)
            metrics.update(drawn.metrics)
            # step 4. shape: token rewards = scores - beta * KL(old || ref)
            metrics.update(self._shape_rewards(batch, kl))
            # step 5. advantages (with algorithm.use_pf_ppo, the batch redrawn by its scores)
            with timer.phase("adv"):
                batch, adv_metrics = estimate_advantages(p, batch, drawn.reward_baselines, self.step)
            metrics.update(adv_metrics)
            # step 6. guard: KL of the sampling policy to the reference, finite rewards; an on-policy update
            # measured pi_old itself and asks the guard before it moves any weight (``update.OnPolicy``)
            on_policy = OnPolicy(lambda kl: self._guard_before_update(batch, kl)) if self.s.actor.on_policy else None
            action = self._guard_before_update(batch, kl) if on_policy is None else Action.CONTINUE
            # step 7. update: critic, then actor (once trainer.critic_warmup critic-only steps are done)
            if action is Action.CONTINUE:
                steps = {m: OptimizerSteps(self.guard.grad_limit(m)) for m in GRAD_MODELS}  # spike limits
                updated = self._update(batch.select(shards.mine), timer, steps, on_policy, forwarded)
                if on_policy is not None:
                    batch.old_log_prob, action = shards.gather(on_policy.log_prob), on_policy.action
                if action is Action.CONTINUE:
                    metrics.update(updated)
                    action = self._guard_after_update(metrics, steps)
        # step 8. metrics
        metrics.update(data_metrics(p, batch, kl, self.guard, metrics.get("actor/grad_norm")))
        metrics.update(timer.metrics())
        metrics.update(memory_metrics(timer, self.setup_peak_gb))
        self.setup_peak_gb = None  # the setup's peak is logged with the first step only
        metrics.update(performance_metrics(p, batch, shards, timer.seconds))
        metrics.update({"training/epoch": p.batches.epoch, "guard/rollbacks": self.guard.rollbacks})
        return metrics, action

    def _policy_kl(self, batch: RolloutBatch, records, timer: PhaseTimer, sampled: tuple[float, dict] | None
                   ) -> tuple[float | None, dict]:
        """KL(pi_old || ref) per token, or None (no reference; an offline step between probes; an on-policy update).

        Online, the batch's own responses were sampled by pi_old: the mean log-ratio (k1) on them.
        Offline, they were not: importance-weighted on them, or ``sampled`` (``evaluate.sampled_offline_kl``;
        ``algorithm.kl_ctrl.offline_kl``). The mean over ranks: the guard and the controller decide by it."""
        if batch.ref_log_prob is None or batch.old_log_prob is None:  # the on-policy update measures it (OnPolicy)
            return None, {}
        if self.s.rollout != "offline":
            sampled = float(masked_mean(batch.old_log_prob - batch.ref_log_prob, batch.response_mask)), {}  # sync
        elif sampled is None and importance_weighted(self.p, batch):  # the recorded behaviour log-probs: no forward
            with timer.phase("kl_probe"):
                sampled = offline_policy_kl(self.p, batch, records, self.step)
        return (None, {}) if sampled is None else (mean_over_ranks({"kl": sampled[0]})["kl"], sampled[1])

    def _shape_rewards(self, batch: RolloutBatch, kl_estimate: float | None) -> dict[str, torch.Tensor]:
        kl = self.s.kl
        if not kl.in_reward:
            batch.token_level_rewards = batch.token_level_scores
            return {}
        batch.token_level_rewards, stats = apply_kl_penalty(
            batch.token_level_scores, batch.old_log_prob, batch.ref_log_prob, batch.response_mask,
            kl_coef=self.p.kl_ctrl.value, kl_penalty=kl.penalty)
        # Ziegler et al.: the controller moves beta by the step's KL, n_steps = responses seen: the
        # batch's penalty online (verl), the offline estimate on the steps that measure it.
        current = kl_estimate  # the same on every rank, as the controller's value must stay
        if self.s.rollout != "offline":
            current = mean_over_ranks({"kl": float(stats["actor/reward_kl_penalty"])})["kl"]  # host sync
        if current is not None:
            self.p.kl_ctrl.update(current_kl=current, n_steps=len(batch))
        return stats

    def _update(self, batch: RolloutBatch, timer: PhaseTimer, steps: dict[str, OptimizerSteps],
                on_policy: OnPolicy | None, forwarded: dict[str, Forwarded]) -> dict[str, torch.Tensor | float]:
        # Losses normalised by global counts, metric shares summed, equal micro-batch counts: the
        # ranks together make the update one process would make on the whole batch (``update``). An
        # on-policy update goes first: until its guard's check passes, no weight or schedule may move.
        # ``forwarded``: by model, the updates' forwards that ran first (``forwards.forwards_first``).
        p, metrics = self.p, {}
        overlap = OverlapMeasure()
        measured = self.env.is_distributed and (self.step == 1 or self.step % OVERLAP_EVERY == 0)

        def critic() -> None:
            with (timer.phase("update_critic"), p.offloader.resident("critic"),
                  profiled(p.device, overlap, measured) as micro_done):
                metrics.update(update_critic(p.critic, p.critic_optimizer, batch, self.s.critic, micro_done,
                                             steps["critic"], forwarded.get("critic")))
            metrics["critic/lr"] = p.critic_scheduler.get_last_lr()[0]
            p.critic_scheduler.step()

        if p.critic is not None and on_policy is None:
            critic()
        if self.step > self.s.critic_warmup:
            with (timer.phase("update_actor"), p.offloader.resident("actor"),
                  profiled(p.device, overlap, measured) as micro_done):
                metrics.update(update_actor(p.actor, p.actor_optimizer, batch, self.s.actor, micro_done,
                                            steps["actor"], on_policy, forwarded.get("actor"), self.step))
            if on_policy is not None and on_policy.action is not Action.CONTINUE:
                return metrics
            metrics["actor/lr"] = p.actor_scheduler.get_last_lr()[0]
            p.actor_scheduler.step()
        if p.critic is not None and on_policy is not None:
            critic()
        if measured:
            metrics.update(overlap.metrics())
        return metrics

    def _guard_before_update(self, batch: RolloutBatch, kl: float | None) -> Action:
        if kl is not None:
            action = self.guard.check_kl(self.step, kl, existing=set(checkpoint_steps(self.s.run_dir)))
            if action is not Action.CONTINUE:
                return action
        # Every value the guards decide by is agreed over the ranks (mean_over_ranks: a NaN anywhere is one
        # everywhere), so no rank skips, rolls back or stops alone and waits in another collective.
        finite = bool(torch.isfinite(batch.token_level_scores.sum(-1)).all())  # host sync
        if math.isfinite(mean_over_ranks({"score": 0.0 if finite else math.nan})["score"]):
            return Action.CONTINUE
        return self.guard.check_finite(self.step, {"critic/score": math.nan})

    def _guard_after_update(self, metrics: dict, steps: dict[str, OptimizerSteps]) -> Action:
        """Finite numbers, then each optimiser step's gradient norm and the entropy trend (adds the
        grad-norm window's metrics). Every rank has the same full gradient norms (FSDP2)."""
        watched = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
        health = ("actor/entropy", "actor/pg_clipfrac")  # not during the critic's warm-up
        agreed = mean_over_ranks({k: float(metrics[k]) for k in watched + health if k in metrics})  # host sync
        action = self.guard.check_finite(self.step, {k: agreed[k] for k in watched if k in agreed})
        if "actor/entropy" in agreed:
            self.guard.check_health(self.step, agreed["actor/entropy"], agreed["actor/pg_clipfrac"])
        grads = {m: s.on_host() for m, s in steps.items() if s.norms}  # host sync
        after, grad_metrics = self.guard.check_update(self.step, grads, agreed.get("actor/entropy"),
                                                      existing=set(checkpoint_steps(self.s.run_dir)))
        metrics.update(grad_metrics)
        return most_severe(action, after)

    def _validate(self) -> tuple[dict[str, float], Action]:
        """Validation's metrics, and the divergence guard's action on its training and gold reward (with
        ``trainer.gold_reward``; both are gathered over the ranks, so every rank decides alike)."""
        timer = PhaseTimer(self.progress, self.memory)
        models = ("actor", "ref", *reward_model_roles(self.p), GOLD_ROLE)  # the roles a run has
        with timer.phase("validate"), self.p.offloader.resident(*models):
            m = validation_metrics(self.p, self.step)
        m = {**m, **timer.metrics(), **max_over_ranks(timer.peak_metrics())}
        if "val-gold/reward/mean" not in m:
            return m, Action.CONTINUE
        return m, self.guard.check_validation(self.step, (m["val-core/reward/mean"], m["val-core/reward/std"]),
                                              (m["val-gold/reward/mean"], m["val-gold/reward/std"]))

    # ---- checkpoints, resume, rollback ----

    def save(self) -> Path:
        self.guard.checkpoint_saved(self.step)  # first: a run resumed from this checkpoint certifies it too
        with self.p.offloader.resident("actor", "critic"):
            return run_state.save(self.p, self.step, self.guard, keep=self.s.max_ckpt_to_keep)

    def _resume(self, folder: Path | None) -> None:
        """Restore checkpoint ``folder``'s state (None: a fresh run); nothing is written yet (``RunFolder``)."""
        if folder is None:
            return
        with self.p.offloader.resident("actor", "critic"):
            self.step = run_state.resume(self.p, folder, self.guard)
        self.folder.resumed_at = self.step
        self.print(f"resumed from {folder} at step {self.step}")
