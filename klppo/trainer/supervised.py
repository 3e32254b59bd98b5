"""What SFT and reward-model training share: the entry point's body, ranks and the sharded
model, the loop, checkpoints. ``main_sft`` and ``main_rm`` each add their data, model and
loss as a ``SupervisedJob``.

Each step's global batch of examples is split evenly over the ranks (``data.train_batch_size``
must be a multiple of the world size); each rank's loss is normalised by the global count of
its terms (tokens for SFT, ranked pairs or rankings for reward models) and FSDP2 sums the
gradients, so N ranks make the update one process would. Checkpoints (``trainer.save_freq``)
hold the model and optimiser shards, the schedule, the data position and each rank's RNG, as
PPO's do, and a resumed run continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from klppo.checkpoint.state import (
    load_checkpoint, load_rank_state, load_sharded_state, rng_state, save_checkpoint, set_rng_state,
)
from klppo.checkpoint.verify import find_resume_folder
from klppo.cli_support import quiet_libraries
from klppo.config import RMConfig, SFTConfig, format_config
from klppo.config.schema import FSDPConfig
from klppo.config.supervised import SFTTrainerConfig
from klppo.data.sampler import PromptBatches, run_length
from klppo.distributed import DistEnv, load_training_state, run_on_ranks, same_on_every_rank, shard_range, training_state
from klppo.errors import UserError
from klppo.monitoring.logger import METRICS_FILE, MetricsLogger
from klppo.run.adapters import export_model
from klppo.run.folder import RunFolder
from klppo.run.setup import (
    Sharder, build_optimizer_and_scheduler, check_run_dir, join_world, return_freed_memory, seed_everything,
)

SupervisedConfig = Union[SFTConfig, RMConfig]


def start_supervised(trainer: SFTTrainerConfig, fsdp: FSDPConfig, train_batch_size: int) -> DistEnv:
    """This process's place in the world (``join_world``); each batch must split evenly over it."""
    env = join_world(trainer.device, trainer.n_gpus_per_node, trainer.nnodes, [fsdp])
    if train_batch_size % env.world_size:
        raise UserError(f"data.train_batch_size = {train_batch_size} does not split evenly over {env.world_size} "
                        f"ranks; make it a multiple of {env.world_size}")
    return env


@dataclass
class SupervisedJob:
    """What SFT or reward-model training brings to the shared loop, once data and model have loaded."""

    model: torch.nn.Module  # sharded with FSDP2 when the run has a process group
    n_examples: int  # training examples (prompts, for reward models)
    console_keys: tuple[str, ...]  # the metrics the console table shows
    train_step: Callable[["SupervisedRun", list[int]], dict]  # (run, this rank's example indices) -> metrics
    evaluate: Optional[Callable[[], dict]]  # validation metrics, every rank in step; None without val_files
    saved: str  # the closing line, with {} for the exported folder
    kind: str  # "sft" or "rm": what its checkpoints are (a resume checks it)


# (config, this rank, tokenizer, sharder, print function) -> the job
PrepareJob = Callable[[SupervisedConfig, DistEnv, object, Sharder, Callable], SupervisedJob]


def run_supervised(cfg: SupervisedConfig, prepare: PrepareJob, print_fn: Callable = print) -> Path:
    """The body of ``klppo sft`` and ``klppo rm``: join the world, prepare the job, train, export.

    Runs on every rank of a torchrun launch; returns the Hugging Face folder written.
    """
    check_run_dir(cfg.trainer.default_local_dir)
    return_freed_memory()
    quiet_libraries()
    env = start_supervised(cfg.trainer, cfg.model.fsdp_config, cfg.data.train_batch_size)
    return run_on_ranks(env, lambda log: _train(cfg, env, prepare, log), print_fn)


def _train(cfg: SupervisedConfig, env: DistEnv, prepare: PrepareJob, print_fn: Callable) -> Path:
    from klppo.data.chat_template import template_kwargs_notes
    from klppo.models.load import load_tokenizer

    seed_everything(cfg.data.seed + env.rank)
    tokenizer = load_tokenizer(cfg.model.partial_pretrain, key="model.partial_pretrain")
    for note in template_kwargs_notes(tokenizer, cfg.data.apply_chat_template_kwargs):
        print_fn(note)
    job = prepare(cfg, env, tokenizer, Sharder(env), print_fn)
    run = prepare_run(cfg, env, job, print_fn)
    resume_from = same_on_every_rank(run.resume_target)  # the whole checkpoint is checked before anything is written
    start = run.resume(resume_from)  # and restored: its data position may not fit the data
    folder = RunFolder(run.run_dir, (METRICS_FILE,), format_config(cfg), env, None if resume_from is None else start)

    def open_logger() -> MetricsLogger:  # at the first step's log (klppo.run.folder)
        folder.open(print_fn)
        return MetricsLogger(run.run_dir, cfg.trainer.logger, print_fn=print_fn, rank=env.rank,
                             console_keys=job.console_keys)

    supervised_loop(run, lambda indices: job.train_step(run, indices), job.evaluate, open_logger, start)
    folder.open(print_fn)  # a resumed run that had no step left has logged nothing
    out = finish(run, tokenizer)
    print_fn(job.saved.format(out))
    return out


@dataclass
class SupervisedRun:
    env: DistEnv
    run_dir: Path
    model: torch.nn.Module  # sharded with FSDP2 when the run has a process group
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: PromptBatches  # the global batches, the same on every rank
    total_steps: int
    trainer: SFTTrainerConfig
    kind: str  # "sft" or "rm"
    print: Callable = print

    def my_share(self, indices: list[int]) -> list[int]:
        """This rank's equal, contiguous share of a global batch."""
        return indices[shard_range(len(indices), self.env)]

    def sharded_state(self) -> dict:
        """The model and optimiser as DCP saves and loads them."""
        model_state, optimizer_state = training_state(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, step: int) -> Path:
        shared = {"step": step, "scheduler": self.scheduler.state_dict(), "data": self.batches.state_dict()}
        return save_checkpoint(self.run_dir, step, shared, sharded=self.sharded_state(),
                               rank_state={"rng": rng_state(self.env.device)}, env=self.env,
                               keep=self.trainer.max_ckpt_to_keep, kind=self.kind)

    def resume_target(self) -> Optional[Path]:
        """The checkpoint to continue from (``trainer.resume_mode``), checked whole; None: a fresh run."""
        return find_resume_folder(self.run_dir, self.trainer.resume_mode, self.trainer.resume_from_path,
                                  kind=self.kind, world_size=self.env.world_size, sharded=self.sharded_state,
                                  rank=self.env.rank)

    def resume(self, folder: Optional[Path]) -> int:
        """Restore checkpoint ``folder`` and return its step (None: a fresh run, step 0); writes nothing."""
        if folder is None:
            return 0
        shared, mine = load_checkpoint(folder), load_rank_state(folder, self.env)
        sharded = self.sharded_state()
        load_sharded_state(folder, sharded)
        load_training_state(self.model, self.optimizer, sharded["model"], sharded["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.batches.load_state_dict(shared["data"])
        set_rng_state(mine["rng"], self.env.device)
        self.print(f"resumed from {folder} at step {shared['step']}")
        return shared["step"]


def prepare_run(cfg: SupervisedConfig, env: DistEnv, job: SupervisedJob, print_fn: Callable) -> SupervisedRun:
    """Once data and model have loaded: the batches, optimiser and schedule (nothing is written)."""
    data, trainer = cfg.data, cfg.trainer
    batches = PromptBatches(job.n_examples, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    total_steps = run_length(trainer.total_training_steps, trainer.total_epochs, batches.steps_per_epoch)
    optimizer, scheduler = build_optimizer_and_scheduler(job.model, cfg.optim, total_steps)
    return SupervisedRun(env, Path(trainer.default_local_dir), job.model, optimizer, scheduler, batches, total_steps,
                         trainer, job.kind, print_fn)


def supervised_loop(run: SupervisedRun, train_step: Callable[[list[int]], dict],
                    evaluate: Optional[Callable[[], dict]], open_logger: Callable[[], MetricsLogger],
                    start: int = 0) -> None:
    """Optimiser steps of ``train_step(this rank's example indices) -> metrics`` after step ``start``
    to the last step; validation and the console table ten times a run, checkpoints every
    ``save_freq`` steps. ``open_logger`` is called once, when the first step is logged."""
    every = max(1, run.total_steps // 10)
    save_freq, backends = run.trainer.save_freq, run.trainer.logger
    logger = None
    try:
        for step in range(start + 1, run.total_steps + 1):
            metrics = train_step(run.my_share(run.batches.next_batch()))
            metrics["train/lr"] = run.scheduler.get_last_lr()[0]
            run.scheduler.step()
            shown = step % every == 0 or step == run.total_steps
            if evaluate is not None and shown:
                metrics.update(evaluate())
            if logger is None:
                logger = open_logger()
            logger.console = "console" in backends and shown
            logger.log(step, metrics, total=run.total_steps)
            if save_freq > 0 and (step % save_freq == 0 or step == run.total_steps):
                run.save(step)
    finally:
        if logger is not None:
            logger.close()


def finish(run: SupervisedRun, tokenizer) -> Path:
    """Export the trained model to ``<run dir>/hf`` (gathered onto rank 0; a LoRA model merged, and
    its adapter alone to ``<run dir>/adapter``); the optimiser's state, saved in the last
    checkpoint if any, is dropped first to make room for the gathered copy."""
    run.optimizer.state.clear()
    return export_model(run.model, tokenizer, run.run_dir / "hf", run.run_dir / "adapter", run.env)[0]
