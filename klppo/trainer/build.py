"""Set-up for a PPO run: small builders that turn the config into models, data and settings.

The config reaches the pieces only here, through flat arguments; the loop in
``ppo_trainer.py`` receives the built ``PPOParts``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from klppo.algo import AdaptiveKLController, FixedKLController
from klppo.config import PPOConfig
from klppo.config.schema import FSDPConfig, GuardConfig
from klppo.data.parquet import parquet_columns
from klppo.data.ranked import RankedRecord, load_ranked_dataset
from klppo.data.rl_dataset import PromptRecord, load_rl_dataset
from klppo.data.sampler import PromptBatches
from klppo.distributed import DistEnv, apply_fsdp2, build_mesh, init_distributed
from klppo.errors import UserError
from klppo.models.forward import use_packed_attention
from klppo.models.load import check_same_tokenizer, load_causal_lm, load_critic, load_reward_model, load_tokenizer
from klppo.rewards.distill import with_ranking_rewards
from klppo.rewards.score import check_scorable, make_reward_fn
from klppo.rollout.hf import SamplingParams
from klppo.trainer.offload import Offloader
from klppo.trainer.optim import build_lr_scheduler, build_optimizer
from klppo.trainer.forwards import ForwardSettings
from klppo.trainer.update import ActorUpdateSettings, CriticUpdateSettings

RANKING_COLUMNS = {"ranking", "rankings", "chosen"}  # offline files with these are ranked data
CRITIC_FREE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclass
class PPOParts:
    cfg: PPOConfig
    run_dir: Path
    env: DistEnv  # this rank, the world, and the device
    tokenizer: object
    actor: torch.nn.Module
    actor_optimizer: torch.optim.Optimizer
    actor_scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: Optional[torch.nn.Module]
    reward_models: list[torch.nn.Module]  # reward_model.model.path, then its extra_paths; [] without one
    critic: Optional[torch.nn.Module]
    critic_optimizer: Optional[torch.optim.Optimizer]
    critic_scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]
    kl_ctrl: FixedKLController | AdaptiveKLController
    reward_fn: Callable
    train_records: list[PromptRecord]
    val_records: Optional[list[PromptRecord]]
    val_ranked: Optional[list[RankedRecord]]
    batches: PromptBatches
    total_steps: int
    offloader: Offloader  # param_offload / optimizer_offload: models on CPU between their phases

    @property
    def device(self) -> torch.device:
        return self.env.device


PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}  # None: no mixed precision


def fsdp_sections(cfg: PPOConfig) -> dict[str, FSDPConfig]:
    arf = cfg.actor_rollout_ref
    return {"actor_rollout_ref.actor.fsdp_config": arf.actor.fsdp_config,
            "actor_rollout_ref.ref.fsdp_config": arf.ref.fsdp_config,
            "critic.model.fsdp_config": cfg.critic.model.fsdp_config}


def join_world(trainer, fsdp_configs) -> DistEnv:
    """Join torchrun's process group and check it against ``trainer.n_gpus_per_node x nnodes``.

    A single process gets a group of one when an ``fsdp_config`` asks for something only FSDP2
    does (mixed precision, offload, ...), so it shards too.
    """
    env = init_distributed(trainer.device, group_of_one=any(f != FSDPConfig() for f in fsdp_configs))
    check_world(trainer.n_gpus_per_node, trainer.nnodes, env.world_size)
    return env


def start_processes(cfg: PPOConfig) -> DistEnv:
    """This PPO process's place in the world (``join_world`` with every model's ``fsdp_config``)."""
    return join_world(cfg.trainer, fsdp_sections(cfg).values())


def check_world(n_gpus_per_node: int, nnodes: int, world_size: int) -> None:
    if n_gpus_per_node * nnodes != world_size:
        raise UserError(
            f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus_per_node} x {nnodes} = {n_gpus_per_node * nnodes}, "
            f"but this run has {world_size} process(es); launch with torchrun --nnodes {nnodes} --nproc_per_node "
            f"{n_gpus_per_node}, or set the two keys to the world you launch"
        )


def check_divisible_over_ranks(cfg: PPOConfig, world_size: int) -> None:
    """Prompts and every mini-batch must split evenly over the ranks (verl's rule too)."""
    arf = cfg.actor_rollout_ref
    sizes = {"data.train_batch_size": cfg.data.train_batch_size,
             "actor_rollout_ref.actor.ppo_mini_batch_size": arf.actor.ppo_mini_batch_size * arf.rollout.n}
    if uses_critic(cfg):
        sizes["critic.ppo_mini_batch_size"] = cfg.critic.ppo_mini_batch_size * arf.rollout.n
    for key, size in sizes.items():
        if size % world_size:
            raise UserError(f"{key} gives {size} rows per batch, which do not split evenly over {world_size} ranks; "
                            f"make it a multiple of {world_size}")


def shard(model: torch.nn.Module, fsdp: FSDPConfig, env: DistEnv, meshes: dict,
          keep_root_gathered: bool = False) -> torch.nn.Module:
    """FSDP2 over the ranks when the run has a process group; the model as it is otherwise."""
    if not env.is_distributed:
        return model
    if fsdp.fsdp_size not in meshes:
        try:
            meshes[fsdp.fsdp_size] = build_mesh(env.world_size, fsdp.fsdp_size, env.device.type)
        except ValueError as exc:
            raise UserError(f"fsdp_config.fsdp_size: {exc}") from None
    return apply_fsdp2(model, meshes[fsdp.fsdp_size], param_dtype=PARAM_DTYPES[fsdp.dtype],
                       reshard_after_forward=fsdp.reshard_after_forward, cpu_offload=fsdp.offload_policy,
                       keep_root_gathered=keep_root_gathered)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def uses_critic(cfg: PPOConfig) -> bool:
    return cfg.algorithm.adv_estimator not in CRITIC_FREE_ESTIMATORS


def uses_reference(cfg: PPOConfig) -> bool:
    return cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss


def build_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: int):
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    return FixedKLController(kl_coef=kl_coef)


def sampling_params(cfg: PPOConfig, *, validation: bool = False) -> SamplingParams:
    rollout = cfg.actor_rollout_ref.rollout
    source = rollout.val_kwargs if validation else rollout
    return SamplingParams(
        n=source.n,
        max_new_tokens=rollout.response_length,
        temperature=source.temperature,
        top_p=source.top_p,
        top_k=source.top_k,
        do_sample=source.do_sample,
    )


def guard_settings(cfg: PPOConfig) -> GuardConfig:
    """The guard's thresholds; KL guards need a reference model and are off without one."""
    if uses_reference(cfg):
        return cfg.trainer.guard
    return dataclasses.replace(cfg.trainer.guard, early_stop_kl=None, rollback_kl=None)


def actor_settings(cfg: PPOConfig) -> ActorUpdateSettings:
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    mini_rows = actor.ppo_mini_batch_size * n
    return ActorUpdateSettings(
        mini_batch_rows=mini_rows,
        micro_batch_rows=actor.ppo_micro_batch_size_per_gpu or mini_rows,
        ppo_epochs=actor.ppo_epochs,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        grad_clip=actor.grad_clip,
        temperature=cfg.actor_rollout_ref.rollout.temperature,
        max_token_len=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
    )


def critic_settings(cfg: PPOConfig) -> CriticUpdateSettings:
    critic, n = cfg.critic, cfg.actor_rollout_ref.rollout.n
    mini_rows = critic.ppo_mini_batch_size * n
    return CriticUpdateSettings(
        mini_batch_rows=mini_rows,
        micro_batch_rows=critic.ppo_micro_batch_size_per_gpu or mini_rows,
        ppo_epochs=critic.ppo_epochs,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode,
        grad_clip=critic.grad_clip,
        max_token_len=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
        use_remove_padding=critic.model.use_remove_padding,
    )


def forward_settings(cfg: PPOConfig) -> dict[str, ForwardSettings]:
    """How the no-grad forwards split the batch: ``old_log_prob`` (actor), ``ref``, ``values`` (critic)."""
    arf, critic = cfg.actor_rollout_ref, cfg.critic
    rollout, ref = arf.rollout, arf.ref
    return {
        "old_log_prob": ForwardSettings(
            micro_batch_rows=rollout.log_prob_micro_batch_size_per_gpu,
            max_token_len=rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None,
            use_remove_padding=arf.model.use_remove_padding,
            budget_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        ),
        "ref": ForwardSettings(
            micro_batch_rows=ref.log_prob_micro_batch_size_per_gpu,
            max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
            use_remove_padding=arf.model.use_remove_padding,
            budget_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        ),
        "values": ForwardSettings(
            micro_batch_rows=critic.ppo_micro_batch_size_per_gpu,
            max_token_len=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
            use_remove_padding=critic.model.use_remove_padding,
            budget_key="critic.ppo_max_token_len_per_gpu",
        ),
    }


def load_datasets(cfg: PPOConfig, tokenizer, reward_fn: Callable, log: Callable):
    """(train prompts, validation prompts or None, held-out ranked records or None)."""
    data, offline = cfg.data, cfg.actor_rollout_ref.rollout.name == "offline"
    common = dict(
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        log=log,
    )
    if offline and RANKING_COLUMNS & parquet_columns(data.train_files):
        ranking = cfg.reward_model.ranking
        train = with_ranking_rewards(load_ranked_dataset(data.train_files, tokenizer, **common), ranking.method,
                                     scale=ranking.scale, center=ranking.center)
    else:
        train = load_rl_dataset(data.train_files, tokenizer, require_responses=offline, **common)
    if offline:
        check_enough_responses(train, cfg.actor_rollout_ref.rollout.n)
    rule_scored = not cfg.reward_model.enable  # else the reward model scores every response
    if rule_scored and not (offline and all(r.scores is not None for r in train)):  # recorded scores need none
        check_scorable(reward_fn, [(r.data_source, r.ground_truth) for r in train], "data.train_files")
    val, val_ranked = load_val_datasets(cfg, tokenizer, common)
    if val is not None and rule_scored:
        try:
            check_scorable(reward_fn, [(r.data_source, r.ground_truth) for r in val], "data.val_files")
        except UserError as exc:
            if val_ranked is None:
                raise
            log(f"validation generates nothing ({exc}); it measures preference agreement only")
            val = None
    if len(train) < data.train_batch_size:
        raise UserError(
            f"data.train_batch_size={data.train_batch_size} is larger than the {len(train)} usable prompts "
            "in data.train_files; lower it or add data"
        )
    return train, val, val_ranked


def load_val_datasets(cfg: PPOConfig, tokenizer, common: dict):
    """Prompts to generate for, and held-out rankings (when data.val_files has ranking columns)."""
    files = cfg.data.val_files
    if not files:
        return None, None
    if not RANKING_COLUMNS & parquet_columns(files):
        return load_rl_dataset(files, tokenizer, **common), None
    ranked = load_ranked_dataset(files, tokenizer, **common)
    ranking = cfg.reward_model.ranking
    return with_ranking_rewards(ranked, ranking.method, scale=ranking.scale, center=ranking.center), ranked


def check_enough_responses(records: list[PromptRecord], n: int) -> None:
    """Offline runs use the first ``n`` recorded responses of each prompt: all must have them."""
    for record in records:
        if len(record.responses) < n:
            raise UserError(
                f"prompt {record.index} of data.train_files has {len(record.responses)} recorded responses "
                f"but actor_rollout_ref.rollout.n={n}; lower rollout.n or record more responses"
            )


def build_optimizer_and_scheduler(model, optim, total_steps: int):
    """AdamW and its schedule from an ``optim`` config section (actor, critic or SFT)."""
    optimizer = build_optimizer(model, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas)
    scheduler = build_lr_scheduler(
        optimizer,
        total_steps=total_steps,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        warmup_style=optim.warmup_style,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return optimizer, scheduler


def build_offloader(device, fsdp: dict[str, FSDPConfig], actor, actor_optimizer, ref, reward_models, critic,
                    critic_optimizer) -> Offloader:
    """Which models stay on CPU between their phases (``param_offload`` / ``optimizer_offload``)."""
    offloader = Offloader(device)
    actor_fsdp, ref_fsdp = fsdp["actor_rollout_ref.actor.fsdp_config"], fsdp["actor_rollout_ref.ref.fsdp_config"]
    offloader.register("actor", actor, param_offload=actor_fsdp.param_offload, optimizer=actor_optimizer,
                       optimizer_offload=actor_fsdp.optimizer_offload)
    for role, model in (("ref", ref), *((f"reward_model_{i}", rm) for i, rm in enumerate(reward_models))):
        if model is not None:
            offloader.register(role, model, param_offload=ref_fsdp.param_offload)
    if critic is not None:
        critic_fsdp = fsdp["critic.model.fsdp_config"]
        offloader.register("critic", critic, param_offload=critic_fsdp.param_offload, optimizer=critic_optimizer,
                           optimizer_offload=critic_fsdp.optimizer_offload)
    return offloader


def build_ppo(cfg: PPOConfig, log: Callable = print, env: DistEnv | None = None) -> PPOParts:
    """Load data and models and build optimisers, schedules, KL controller and reward function.

    ``env`` (from ``start_processes``) says which rank this is; each model is sharded with
    FSDP2 over the ranks when there is a process group. Every rank reads the data and draws
    the same batches; rank r samples from its own random stream (seed + r).
    """
    env = env or start_processes(cfg)
    check_divisible_over_ranks(cfg, env.world_size)
    seed_everything(cfg.data.seed + env.rank)
    device, meshes, fsdp = env.device, {}, fsdp_sections(cfg)
    model_cfg, trainer = cfg.actor_rollout_ref.model, cfg.trainer
    reward_fn = make_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    tokenizer = load_tokenizer(model_cfg.path)
    train, val, val_ranked = load_datasets(cfg, tokenizer, reward_fn, log)
    batches = PromptBatches(len(train), cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    total_steps = trainer.total_training_steps or trainer.total_epochs * batches.steps_per_epoch
    key = "actor_rollout_ref.model.path"
    actor = load_causal_lm(model_cfg.path, key=key, device=device,
                           gradient_checkpointing=model_cfg.enable_gradient_checkpointing)
    ref = None
    if uses_reference(cfg):
        ref = load_causal_lm(model_cfg.path, key=key, device=device).eval().requires_grad_(False)
    if model_cfg.use_remove_padding:  # packed rows: attention per sequence, no N x N mask
        use_packed_attention(actor, PARAM_DTYPES[fsdp["actor_rollout_ref.actor.fsdp_config"].dtype])
        if ref is not None:
            use_packed_attention(ref, PARAM_DTYPES[fsdp["actor_rollout_ref.ref.fsdp_config"].dtype])
    actor = shard(actor, fsdp["actor_rollout_ref.actor.fsdp_config"], env, meshes)
    actor_optimizer, actor_scheduler = build_optimizer_and_scheduler(actor, cfg.actor_rollout_ref.actor.optim, total_steps)
    if ref is not None:
        ref = shard(ref, fsdp["actor_rollout_ref.ref.fsdp_config"], env, meshes)
    reward_models = []
    if cfg.reward_model.enable:
        rm_paths = {"reward_model.model.path": cfg.reward_model.model.path}
        rm_paths.update({f"reward_model.model.extra_paths[{i}]": path
                         for i, path in enumerate(cfg.reward_model.model.extra_paths)})
        for rm_key, path in rm_paths.items():
            check_same_tokenizer(tokenizer, path, rm_key)
            reward_model = load_reward_model(path, key=rm_key, device=device).eval().requires_grad_(False)
            reward_models.append(shard(reward_model, fsdp["actor_rollout_ref.ref.fsdp_config"], env, meshes))
    critic = critic_optimizer = critic_scheduler = None
    if uses_critic(cfg):
        check_same_tokenizer(tokenizer, cfg.critic.model.path, "critic.model.path")
        critic = load_critic(cfg.critic.model.path, key="critic.model.path", device=device, seed=cfg.data.seed,
                             gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing)
        if cfg.critic.model.use_remove_padding:
            use_packed_attention(critic, PARAM_DTYPES[fsdp["critic.model.fsdp_config"].dtype])
        critic = shard(critic, fsdp["critic.model.fsdp_config"], env, meshes)
        critic_optimizer, critic_scheduler = build_optimizer_and_scheduler(critic, cfg.critic.optim, total_steps)
    offloader = build_offloader(device, fsdp, actor, actor_optimizer, ref, reward_models, critic, critic_optimizer)
    kl = cfg.algorithm.kl_ctrl
    return PPOParts(
        cfg=cfg, run_dir=Path(trainer.default_local_dir), env=env, tokenizer=tokenizer,
        actor=actor, actor_optimizer=actor_optimizer, actor_scheduler=actor_scheduler, ref=ref, reward_models=reward_models,
        critic=critic, critic_optimizer=critic_optimizer, critic_scheduler=critic_scheduler,
        kl_ctrl=build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon), reward_fn=reward_fn,
        train_records=train, val_records=val, val_ranked=val_ranked, batches=batches, total_steps=total_steps,
        offloader=offloader,
    )
