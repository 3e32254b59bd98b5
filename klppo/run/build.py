"""Set-up of a PPO run: the config becomes settings (``settings.compile_ppo``) and parts.

This is the one place besides ``settings.py`` that reads the PPO config: it loads the data and
the models the config names and builds optimisers, schedules, the KL controller and the reward
function. The loop in ``ppo_trainer.py`` receives the built ``PPOParts`` and reads only their
``settings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from klppo.algo import AdaptiveKLController, FixedKLController
from klppo.config import PPOConfig
from klppo.config.batch_sizes import fsdp_sections
from klppo.config.lora import lora_enabled
from klppo.config.rollout_correction import rollout_correction_active
from klppo.config.schema import FSDPConfig
from klppo.data.chat_template import template_kwargs_notes
from klppo.data.parquet import RowSample, parquet_columns
from klppo.data.ranked import RankedRecord, load_ranked_dataset
from klppo.data.rollout_log_probs import LogProbsNeed
from klppo.data.rl_dataset import PromptRecord, load_rl_dataset
from klppo.data.sampler import PromptBatches, run_length
from klppo.distributed import DistEnv
from klppo.distributed.env import computed_by_first_rank, consecutive_group
from klppo.errors import UserError
from klppo.models.attention import choose_packed_attention
from klppo.models.load import (
    check_same_tokenizer, check_trained_score_head, load_tokenizer, packing_problem_of, read_generation_config,
)
from klppo.monitoring.memory import available_bytes
from klppo.plan.model_shape import GOLD_ROLE
from klppo.rewards.distill import with_ranking_rewards
from klppo.rewards.score import check_scorable, make_reward_fn
from klppo.rollout.hf import StaticCaches
from klppo.rollout.batch import eos_token_ids
from klppo.rollout.multi_turn import MultiTurn, check_conversation_rows, check_tool_format
from klppo.rollout.tools import load_interactions, load_tools
from klppo.rollout.vllm import VLLMEngine, require_vllm
from klppo.run.offload import Offloader
from klppo.run.settings import KLSettings, PPOSettings, compile_ppo, compute_dtype, uses_critic, uses_reference
from klppo.run.adapters import base_values, trained_values
from klppo.run.setup import (
    Sharder, build_optimizer_and_scheduler, join_world, load_model, lora_spec, seed_everything,
)

RANKING_COLUMNS = {"ranking", "rankings", "chosen"}  # offline files with these are ranked data
# The two settings that weigh every recorded response by pi / mu: a row without mu cannot be weighed.
ROLLOUT_CORRECTION_NEED = LogProbsNeed("algorithm.rollout_correction", "switch the correction off")
IMPORTANCE_WEIGHTED_KL_NEED = LogProbsNeed("algorithm.kl_ctrl.offline_kl=importance_weighted",
                                           "set algorithm.kl_ctrl.offline_kl=sampled (or auto)")


@dataclass
class PPOParts:
    settings: PPOSettings
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
    initial_adapters: Optional[dict[str, torch.Tensor]] = None  # LoRA actor: its adapters' starting values (rollback)
    reference_adapters: Optional[dict[str, torch.Tensor]] = None  # LoRA actor: its adapters' values in the reference
    engine: Optional[VLLMEngine] = None  # rollout.name: vllm; fed the actor's weights before each generation
    # trainer.gold_reward: scored at validation only (evaluate.gold_scorer), never trained on.
    gold_reward_fn: Optional[Callable] = None
    gold_reward_model: Optional[torch.nn.Module] = None
    # HF generation with a static KV cache (trainer.responses.keeps_generation_model): the actor's
    # generation copy, built once and refreshed in place, and the caches decoding writes into.
    kept_generation_model: Optional[torch.nn.Module] = None
    kv_caches: StaticCaches = field(default_factory=StaticCaches)
    multi_turn: Optional[MultiTurn] = None  # rollout.multi_turn.enable: conversations with tools, its tools built


    @property
    def device(self) -> torch.device:
        return self.env.device


def start_processes(cfg: PPOConfig) -> DistEnv:
    """This PPO process's place in the world (``join_world`` with every model's ``fsdp_config``)."""
    trainer = cfg.trainer
    return join_world(trainer.device, trainer.n_gpus_per_node, trainer.nnodes, fsdp_sections(cfg).values(),
                      timeout_s=cfg.actor_rollout_ref.nccl_timeout)


def run_attention(cfg: PPOConfig, env: DistEnv) -> str:
    """The attention for packed rows of every model this run builds, its generation copy included,
    chosen once (``choose_packed_attention``): varlen kernels only where all of them compute in
    bf16/fp16. Models that never see a packed row get it too; it runs their padded rows as sdpa."""
    arf = cfg.actor_rollout_ref
    built = [arf.actor.fsdp_config]
    if uses_reference(cfg) and not lora_enabled(arf.model):
        built.append(arf.ref.fsdp_config)
    if uses_critic(cfg):
        built.append(cfg.critic.model.fsdp_config)
    if cfg.reward_model.enable or cfg.trainer.gold_reward.model_path:
        built.append(cfg.reward_model.model.fsdp_config)
    return choose_packed_attention(env.device.type, [compute_dtype(f) for f in built])


def prompt_batches(cfg: PPOConfig, num_prompts: int) -> PromptBatches:
    """The resumable order of the training prompts, handed out a step's batch at a time, or with dynamic
    sampling (algorithm.filter_groups) a generation batch (data.gen_batch_size) at a time, as verl's
    dataloader; an epoch's steps then count generation batches, so a step drawing several reads more."""
    data = cfg.data
    if not cfg.algorithm.filter_groups.enable:
        return PromptBatches(num_prompts, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    return PromptBatches(num_prompts, data.gen_batch_size, shuffle=data.shuffle, seed=data.seed,
                         key="data.gen_batch_size")


def build_kl_controller(kl: KLSettings) -> FixedKLController | AdaptiveKLController:
    if kl.controller == "adaptive":
        return AdaptiveKLController(init_kl_coef=kl.coef, target_kl=kl.target, horizon=kl.horizon)
    return FixedKLController(kl_coef=kl.coef)


def behaviour_log_probs_need(cfg: PPOConfig) -> LogProbsNeed | None:
    """Why every offline training row must carry ``rollout_log_probs``, or None where they are optional.

    The importance-weighted KL (``evaluate.offline_policy_kl``) runs only where a KL term has a
    reference; ``auto`` falls back to the sampled probe where any row lacks them.
    """
    if cfg.actor_rollout_ref.rollout.name != "offline":
        return None
    if rollout_correction_active(cfg):
        return ROLLOUT_CORRECTION_NEED
    if uses_reference(cfg) and cfg.algorithm.kl_ctrl.offline_kl == "importance_weighted":
        return IMPORTANCE_WEIGHTED_KL_NEED
    return None


def build_multi_turn(cfg: PPOConfig) -> Optional[MultiTurn]:
    """``rollout.multi_turn`` with its tools built (once per run), or None where it is off."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    tools = load_tools(mt.tool_config_path, mt.function_tool_path)
    interactions = load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
    return MultiTurn(tools, mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls,
                     mt.max_tool_response_length, mt.tool_response_truncate_side,
                     dict(cfg.data.apply_chat_template_kwargs), interactions, mt.format)


def load_datasets(cfg: PPOConfig, tokenizer, reward_fn: Callable, log: Callable,
                  multi_turn: Optional[MultiTurn] = None):
    """(train prompts, validation prompts or None, held-out ranked records or None). With tools, each
    prompt is rendered with their schemas, as the chat template shows them to the model."""
    data, offline = cfg.data, cfg.actor_rollout_ref.rollout.name == "offline"
    tools = {"tools": multi_turn.tools.schemas} if multi_turn is not None and multi_turn.tools else {}
    common = dict(
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        template_kwargs={**data.apply_chat_template_kwargs, **tools},
        log=log,
    )
    for note in template_kwargs_notes(tokenizer, data.apply_chat_template_kwargs):
        log(note)
    needs_log_probs = behaviour_log_probs_need(cfg)  # checked here, before any model loads
    if offline and RANKING_COLUMNS & parquet_columns(data.train_files):
        ranking = cfg.reward_model.ranking
        ranked = load_ranked_dataset(data.train_files, tokenizer, require_rollout_log_probs=needs_log_probs,
                                     sample=RowSample.drawn(data.train_max_samples, data.shuffle, data.seed), **common)
        train = with_ranking_rewards(ranked, ranking.method, scale=ranking.scale, center=ranking.center)
    else:
        train = load_rl_dataset(data.train_files, tokenizer, require_responses=offline,
                                require_rollout_log_probs=needs_log_probs, reward_fn_key=data.reward_fn_key,
                                sample=RowSample.drawn(data.train_max_samples, data.shuffle, data.seed), **common)
    if offline:
        check_enough_responses(train, cfg.actor_rollout_ref.rollout.n)
    check_conversation_rows(multi_turn, train)
    rule_scored = not cfg.reward_model.enable  # else the reward model scores every response
    if rule_scored and not (offline and all(r.scores is not None for r in train)):  # recorded scores need none
        check_scorable(reward_fn, [(r.scored_as, r.ground_truth) for r in train], "data.train_files",
                       [r.where for r in train])
    val, val_ranked = load_val_datasets(cfg, tokenizer, common)
    if val is not None:
        check_conversation_rows(multi_turn, val)
    if val is not None and rule_scored:
        try:
            check_scorable(reward_fn, [(r.scored_as, r.ground_truth) for r in val], "data.val_files",
                           [r.where for r in val])
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
    files, sample = cfg.data.val_files, RowSample.drawn(cfg.data.val_max_samples, cfg.data.shuffle, cfg.data.seed)
    if not files:
        return None, None
    if not RANKING_COLUMNS & parquet_columns(files):
        return load_rl_dataset(files, tokenizer, sample=sample, reward_fn_key=cfg.data.reward_fn_key, **common), None
    ranked = load_ranked_dataset(files, tokenizer, sample=sample, **common)
    ranking = cfg.reward_model.ranking
    return with_ranking_rewards(ranked, ranking.method, scale=ranking.scale, center=ranking.center), ranked


def check_enough_responses(records: list[PromptRecord], n: int) -> None:
    """Offline runs use the first ``n`` recorded responses of each prompt: all must have them."""
    for record in records:
        if len(record.responses) < n:
            where = record.where or f"prompt {record.index} of data.train_files"
            raise UserError(
                f"{where}, column 'responses': has {len(record.responses)} recorded responses "
                f"but actor_rollout_ref.rollout.n={n}; lower rollout.n or record more responses"
            )


def build_offloader(device, fsdp: dict[str, FSDPConfig], actor, actor_optimizer, ref, reward_models, critic,
                    critic_optimizer) -> Offloader:
    """Which models stay on CPU between their phases (``param_offload`` / ``optimizer_offload``)."""
    offloader = Offloader(device)
    actor_fsdp, ref_fsdp = fsdp["actor_rollout_ref.actor.fsdp_config"], fsdp["actor_rollout_ref.ref.fsdp_config"]
    offloader.register("actor", actor, param_offload=actor_fsdp.param_offload, optimizer=actor_optimizer,
                       optimizer_offload=actor_fsdp.optimizer_offload)
    if ref is not None:
        offloader.register("ref", ref, param_offload=ref_fsdp.param_offload)
    for i, model in enumerate(reward_models):
        offloader.register(f"reward_model_{i}", model, param_offload=fsdp["reward_model.model.fsdp_config"].param_offload)
    if critic is not None:
        critic_fsdp = fsdp["critic.model.fsdp_config"]
        offloader.register("critic", critic, param_offload=critic_fsdp.param_offload, optimizer=critic_optimizer,
                           optimizer_offload=critic_fsdp.optimizer_offload)
    return offloader


def _load_actor_and_ref(cfg: PPOConfig, env: DistEnv, sharder: Sharder, attention: str):
    """The actor and, when a KL term needs it, the frozen reference (both from model.path).

    A LoRA actor needs no reference model: the actor with its adapters at their starting values
    (or with ``ref.lora_reference: base``, without them) is the reference (``forwards.reference_model``).
    """
    model_cfg, arf = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref
    common = dict(key="actor_rollout_ref.model.path", env=env, sharder=sharder, packed=model_cfg.use_remove_padding,
                  attention=attention)
    lora = lora_spec(model_cfg, "actor_rollout_ref.model")
    actor = load_model("causal_lm", model_cfg.path, fsdp=arf.actor.fsdp_config, seed=cfg.data.seed, lora=lora,
                       gradient_checkpointing=model_cfg.enable_gradient_checkpointing, **common)
    ref = None
    if uses_reference(cfg) and lora is None:
        ref = load_model("causal_lm", model_cfg.path, fsdp=arf.ref.fsdp_config, **common).eval().requires_grad_(False)
    return actor, ref


def _load_reward_models(cfg: PPOConfig, tokenizer, env: DistEnv, sharder: Sharder, attention: str
                        ) -> list[torch.nn.Module]:
    """reward_model.model.path and its extra_paths, frozen and sharded; [] without reward_model.enable."""
    if not cfg.reward_model.enable:
        return []
    paths = {"reward_model.model.path": cfg.reward_model.model.path}
    paths.update({f"reward_model.model.extra_paths[{i}]": path for i, path in enumerate(cfg.reward_model.model.extra_paths)})
    models, rm_model = [], cfg.reward_model.model
    for key, path in paths.items():
        check_same_tokenizer(tokenizer, path, key, cfg.actor_rollout_ref.model.path)
        check_trained_score_head(path, key)
        model = load_model("reward_model", path, key=key, env=env, sharder=sharder, fsdp=rm_model.fsdp_config,
                           packed=rm_model.use_remove_padding, attention=attention)
        models.append(model.eval().requires_grad_(False))
    return models


def _load_gold_reward_model(cfg: PPOConfig, tokenizer, env: DistEnv, sharder: Sharder, attention: str
                            ) -> Optional[torch.nn.Module]:
    """trainer.gold_reward.model_path, frozen and sharded as the reward models are; None without one."""
    path, key, rm_model = cfg.trainer.gold_reward.model_path, "trainer.gold_reward.model_path", cfg.reward_model.model
    if not path:
        return None
    check_same_tokenizer(tokenizer, path, key, cfg.actor_rollout_ref.model.path)
    check_trained_score_head(path, key)
    model = load_model("reward_model", path, key=key, env=env, sharder=sharder, fsdp=rm_model.fsdp_config,
                       packed=rm_model.use_remove_padding, attention=attention)
    return model.eval().requires_grad_(False)


def _load_critic(cfg: PPOConfig, tokenizer, env: DistEnv, sharder: Sharder, attention: str) -> torch.nn.Module:
    critic_cfg = cfg.critic.model
    check_same_tokenizer(tokenizer, critic_cfg.path, "critic.model.path", cfg.actor_rollout_ref.model.path)
    return load_model("critic", critic_cfg.path, key="critic.model.path", env=env, sharder=sharder,
                      fsdp=critic_cfg.fsdp_config, seed=cfg.data.seed, lora=lora_spec(critic_cfg, "critic.model"),
                      gradient_checkpointing=critic_cfg.enable_gradient_checkpointing,
                      packed=critic_cfg.use_remove_padding, attention=attention)


def _packed_model_paths(cfg: PPOConfig) -> list[tuple[str, object, dict[str, str]]]:
    """(section key, section, {path key: folder}) of each model section that packs its rows
    (``use_remove_padding``): the actor and reference, the critic, the reward models and the gold one."""
    arf, rm, out = cfg.actor_rollout_ref, cfg.reward_model, []
    out.append(("actor_rollout_ref.model", arf.model, {"actor_rollout_ref.model.path": arf.model.path}))
    if uses_critic(cfg):
        out.append(("critic.model", cfg.critic.model, {"critic.model.path": cfg.critic.model.path}))
    paths = {"reward_model.model.path": rm.model.path} if rm.enable else {}
    paths.update({f"reward_model.model.extra_paths[{i}]": p for i, p in enumerate(rm.model.extra_paths) if rm.enable})
    if cfg.trainer.gold_reward.model_path:
        paths["trainer.gold_reward.model_path"] = cfg.trainer.gold_reward.model_path
    if paths:
        out.append(("reward_model.model", rm.model, paths))
    return [(key, section, paths) for key, section, paths in out if section.use_remove_padding]


def resolve_packing(cfg: PPOConfig, log: Callable = print) -> None:
    """Turn a section's ``use_remove_padding`` off, in place and with a warning, where one of its
    models cannot keep the sequences of a packed row apart (``packing_problem``): its forwards run
    padded rows, the numbers packing would have given had it been exact. Left on, every token
    would see the sequences packed before its own (wrong log-probs, values and scores, silently)."""
    for section_key, section, paths in _packed_model_paths(cfg):
        for key, path in paths.items():
            problem = packing_problem_of(path, key)
            if problem is not None:
                section.use_remove_padding = False
                log(f"warning: {section_key}.use_remove_padding has no effect with {key} = {path}: {problem}; "
                    "its forwards run padded rows instead (the same numbers, more compute)")
                break


def build_ppo(cfg: PPOConfig, log: Callable = print, env: DistEnv | None = None) -> PPOParts:
    """Compile the settings, load data and models, build optimisers, schedules, KL controller and
    reward function.

    ``env`` (from ``start_processes``) says which rank this is; each model is sharded with
    FSDP2 over the ranks when there is a process group. Every rank reads the data and draws
    the same batches; rank r samples from its own random stream (seed + r).
    """
    env = env or start_processes(cfg)
    resolve_packing(cfg, log)  # before the settings read it
    settings = compile_ppo(cfg, env.world_size)
    if settings.engine is not None:
        require_vllm()  # before any model loads
    seed_everything(cfg.data.seed + env.rank)
    sharder, trainer = Sharder(env), cfg.trainer
    custom = cfg.custom_reward_function
    reward_fn = make_reward_fn(custom.path, custom.name, reward_kwargs=custom.reward_kwargs)
    gold = cfg.trainer.gold_reward  # its file is checked here too, before any model loads
    gold_fn = make_reward_fn(gold.path, gold.name, "trainer.gold_reward", gold.reward_kwargs) if gold.path else None
    actor_model = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(actor_model.path, chat_template=actor_model.custom_chat_template,
                               tokenizer_path=actor_model.tokenizer_path)
    multi_turn = build_multi_turn(cfg)  # its tools' file is read here, before any model loads
    if multi_turn is not None:  # its calls must end a turn: the actor's EOS ids, read before it loads
        generation_config = read_generation_config(Path(actor_model.path), "actor_rollout_ref.model.path")
        check_tool_format(multi_turn, tokenizer, eos_token_ids(tokenizer, generation_config))
    train, val, val_ranked = load_datasets(cfg, tokenizer, reward_fn, log, multi_turn)
    batches = prompt_batches(cfg, len(train))
    total_steps = run_length(trainer.total_training_steps, trainer.total_epochs, batches.steps_per_epoch)
    attention = run_attention(cfg, env)  # once, for every model
    actor, ref = _load_actor_and_ref(cfg, env, sharder, attention)
    actor_optimizer, actor_scheduler = build_optimizer_and_scheduler(actor, cfg.actor_rollout_ref.actor.optim, total_steps)
    reward_models = _load_reward_models(cfg, tokenizer, env, sharder, attention)
    gold_model = _load_gold_reward_model(cfg, tokenizer, env, sharder, attention)
    critic = critic_optimizer = critic_scheduler = None
    if uses_critic(cfg):
        critic = _load_critic(cfg, tokenizer, env, sharder, attention)
        critic_optimizer, critic_scheduler = build_optimizer_and_scheduler(critic, cfg.critic.optim, total_steps)
    offloader = build_offloader(env.device, fsdp_sections(cfg), actor, actor_optimizer, ref, reward_models, critic,
                                critic_optimizer)
    if gold_model is not None:
        offloader.register(GOLD_ROLE, gold_model, param_offload=cfg.reward_model.model.fsdp_config.param_offload)
    initial = trained_values(actor) if settings.actor_lora else None
    engine = None
    if settings.engine is not None:  # last: on a GPU it takes its share of the memory the models left
        # Conversations' answers are shared within a tensor-parallel group (collective: before the engine's own).
        group = consecutive_group(settings.engine.tensor_parallel_size) if multi_turn is not None else None
        engine = VLLMEngine(cfg.actor_rollout_ref.model.path, actor.config, settings.engine, env.device,
                            env.world_size > 1, available_bytes(env.device),  # a group of one needs no launcher
                            generation_config=getattr(actor, "generation_config", None),
                            share_answers=computed_by_first_rank(group))
    return PPOParts(
        settings=settings, env=env, tokenizer=tokenizer, actor=actor, actor_optimizer=actor_optimizer,
        actor_scheduler=actor_scheduler, ref=ref, reward_models=reward_models, critic=critic,
        critic_optimizer=critic_optimizer, critic_scheduler=critic_scheduler,
        kl_ctrl=build_kl_controller(settings.kl), reward_fn=reward_fn, train_records=train, val_records=val,
        val_ranked=val_ranked, batches=batches, total_steps=total_steps, offloader=offloader,
        initial_adapters=initial, reference_adapters=_reference_adapters(cfg, initial), engine=engine,
        gold_reward_fn=gold_fn, gold_reward_model=gold_model, multi_turn=multi_turn,
    )


def _reference_adapters(cfg: PPOConfig, initial: Optional[dict[str, torch.Tensor]]):
    """A LoRA actor's adapter values in its reference (``actor_rollout_ref.ref.lora_reference``):
    their starting values, or values that add nothing (the base model)."""
    if initial is None:
        return None
    return initial if cfg.actor_rollout_ref.ref.lora_reference == "starting_adapter" else base_values(initial)
