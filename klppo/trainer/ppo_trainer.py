"""The PPO loop, top-down: batch, responses, score, shape, advantages, update, log and save.

Everything it needs is built beforehand by ``klppo.trainer.build.build_ppo``; this file only
orders the phases of one iteration (DESIGN.md, "One PPO iteration") and keeps the run's state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch

from klppo.algo import (
    apply_kl_penalty,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from klppo.checkpoint.state import (
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from klppo.monitoring.logger import METRICS_FILE, MetricsLogger, truncate_metrics
from klppo.monitoring.metrics import compute_data_metrics, compute_throughput_metrics
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch
from klppo.rollout.hf import hf_rollout
from klppo.rollout.offline import offline_rollout
from klppo.rewards.token_scores import scores_at_last_token
from klppo.trainer.build import PPOParts, actor_settings, critic_settings, sampling_params
from klppo.trainer.score import compute_log_prob, compute_scores, compute_values
from klppo.trainer.update import update_actor, update_critic
from klppo.trainer.validate import validate


def compute_advantages(batch: RolloutBatch, estimator: str, gamma: float, lam: float, norm_by_std: bool):
    """(advantages, returns), each (B, T), by the configured estimator."""
    rewards, mask, index = batch.token_level_rewards, batch.response_mask, batch.group_index
    if estimator == "gae":
        return compute_gae_advantage_return(rewards, batch.values, mask, gamma, lam)
    if estimator == "grpo":
        return compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    if estimator == "rloo":
        return compute_rloo_outcome_advantage(rewards, mask, index)
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    return compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)


class PPOTrainer:
    """Runs ``parts.total_steps`` PPO iterations, resuming from the latest checkpoint if asked."""

    def __init__(self, parts: PPOParts, print_fn: Callable = print) -> None:
        self.p, self.cfg, self.print = parts, parts.cfg, print_fn
        self.logger = MetricsLogger(parts.run_dir, self.cfg.trainer.logger, print_fn=print_fn)
        self.actor_settings, self.step = actor_settings(self.cfg), 0
        self.critic_settings = critic_settings(self.cfg) if parts.critic is not None else None

    def fit(self) -> list[dict[str, float]]:
        """Train to the last step; returns the metrics records logged by this call."""
        trainer, records = self.cfg.trainer, []
        self._resume()
        if self.p.val_records and trainer.val_before_train and self.step == 0:
            records.append(self.logger.log(0, self._validate(), total=self.p.total_steps))
        while self.step < self.p.total_steps:
            self.step += 1
            last = self.step == self.p.total_steps
            metrics = self.train_step()
            if self.p.val_records and trainer.test_freq > 0 and (self.step % trainer.test_freq == 0 or last):
                metrics.update(self._validate())
            if last or (trainer.save_freq > 0 and self.step % trainer.save_freq == 0):
                self.save()
            records.append(self.logger.log(self.step, metrics, total=self.p.total_steps))
        export_hf(self.p.actor, self.p.tokenizer, self.p.run_dir / "actor_hf")
        self.print(f"actor exported to {self.p.run_dir / 'actor_hf'}")
        return records

    def train_step(self) -> dict[str, float | torch.Tensor]:
        p, algo, timer = self.p, self.cfg.algorithm, PhaseTimer()
        with timer.phase("step"):
            # step 1. batch: the next prompts, in a resumable order
            records = [p.train_records[i] for i in p.batches.next_batch()]
            # step 2. responses
            with timer.phase("gen"):
                batch = self._rollout(records).to(p.device)
            # step 3. score: old and reference log-probs, values, rewards
            temperature = self.actor_settings.temperature
            with timer.phase("old_log_prob"):
                batch.old_log_prob = compute_log_prob(
                    p.actor, batch, micro_batch_rows=self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu,
                    temperature=temperature)
            if p.ref is not None:
                with timer.phase("ref"):
                    batch.ref_log_prob = compute_log_prob(
                        p.ref, batch, micro_batch_rows=self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                        temperature=temperature)
            if p.critic is not None:
                with timer.phase("values"):
                    batch.values = compute_values(
                        p.critic, batch, micro_batch_rows=self.cfg.critic.ppo_micro_batch_size_per_gpu)
            with timer.phase("reward"):
                batch.token_level_scores = self._scores(batch)
            # step 4. shape: token rewards = scores - beta * KL(old || ref)
            metrics = self._shape_rewards(batch)
            # step 5. advantages
            with timer.phase("adv"):
                batch.advantages, batch.returns = compute_advantages(
                    batch, algo.adv_estimator, algo.gamma, algo.lam, algo.norm_adv_by_std_in_grpo)
            # step 6. update: critic, then actor
            if p.critic is not None:
                with timer.phase("update_critic"):
                    metrics.update(update_critic(p.critic, p.critic_optimizer, batch, self.critic_settings))
                metrics["critic/lr"] = p.critic_scheduler.get_last_lr()[0]
                p.critic_scheduler.step()
            with timer.phase("update_actor"):
                metrics.update(update_actor(p.actor, p.actor_optimizer, batch, self.actor_settings))
            metrics["actor/lr"] = p.actor_scheduler.get_last_lr()[0]
            p.actor_scheduler.step()
        # step 7. metrics (the guards of a later issue read these)
        metrics.update(compute_data_metrics(batch, self.cfg.actor_rollout_ref.rollout.response_length))
        metrics.update(timer.metrics())
        metrics.update(compute_throughput_metrics(batch, timer.seconds["step"]))
        metrics["training/epoch"] = p.batches.epoch
        return metrics

    def _rollout(self, records) -> RolloutBatch:
        rollout = self.cfg.actor_rollout_ref.rollout
        if rollout.name == "offline":
            return offline_rollout(records, n=rollout.n, tokenizer=self.p.tokenizer,
                                   max_response_length=rollout.response_length)
        return hf_rollout(self.p.actor, records, self.p.tokenizer, sampling_params(self.cfg))

    def _scores(self, batch: RolloutBatch) -> torch.Tensor:
        """Recorded offline scores when the data has them, else the reward function's."""
        if batch.recorded_scores is not None:
            return scores_at_last_token(batch.recorded_scores.to(batch.response_mask.device), batch.response_mask)
        return compute_scores(batch, self.p.tokenizer, self.p.reward_fn)

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

    def _validate(self) -> dict[str, float]:
        params = sampling_params(self.cfg, validation=True)
        return validate(self.p.actor, self.p.val_records, self.p.tokenizer, self.p.reward_fn, params,
                        batch_size=self.cfg.data.val_batch_size)

    # ---- state ----

    def state_dict(self) -> dict:
        p = self.p
        state = {
            "step": self.step,
            "actor": p.actor.state_dict(),
            "actor_optimizer": p.actor_optimizer.state_dict(),
            "actor_scheduler": p.actor_scheduler.state_dict(),
            "kl_ctrl": p.kl_ctrl.state_dict(),
            "data": p.batches.state_dict(),
            "rng": rng_state(),
        }
        if p.critic is not None:
            state.update(critic=p.critic.state_dict(), critic_optimizer=p.critic_optimizer.state_dict(),
                         critic_scheduler=p.critic_scheduler.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        p = self.p
        p.actor.load_state_dict(state["actor"])
        p.actor_optimizer.load_state_dict(state["actor_optimizer"])
        p.actor_scheduler.load_state_dict(state["actor_scheduler"])
        if p.critic is not None:
            p.critic.load_state_dict(state["critic"])
            p.critic_optimizer.load_state_dict(state["critic_optimizer"])
            p.critic_scheduler.load_state_dict(state["critic_scheduler"])
        p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        p.batches.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = state["step"]

    def save(self) -> Path:
        return save_checkpoint(self.p.run_dir, self.step, self.state_dict(), keep=self.cfg.trainer.max_actor_ckpt_to_keep)

    def _resume(self) -> None:
        trainer, run_dir = self.cfg.trainer, self.p.run_dir
        folder = None
        if trainer.resume_mode == "auto":
            folder = latest_checkpoint(run_dir)
        elif trainer.resume_mode == "resume_path":
            folder = Path(trainer.resume_from_path)
        if folder is None:
            self._set_aside_old_metrics()
            return
        self.load_state_dict(load_checkpoint(folder))
        # Steps the interrupted run logged after this checkpoint will be run (and logged) again.
        truncate_metrics(run_dir, self.step)
        self.print(f"resumed from {folder} at step {self.step}")

    def _set_aside_old_metrics(self) -> None:
        """A fresh run never appends to an earlier run's metrics: keep those as metrics.jsonl.prev."""
        path = self.p.run_dir / METRICS_FILE
        if path.exists():
            shutil.move(path, path.with_name(METRICS_FILE + ".prev"))
            self.print(f"an earlier run's metrics were moved to {path.name}.prev")
