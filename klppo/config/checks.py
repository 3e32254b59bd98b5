"""Derived defaults and value checks of a typed config tree.

``load.py`` builds the tree (unknown keys and wrong types are its problems); this module fills
the fields whose ``None`` means "derive from another field" and then checks sizes, ranges and
the knobs that later work will enable. Every check appends a ``Problem`` instead of raising,
so a user sees all problems of a config at once. Each message names the full dotted key, what
is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Optional

from klppo.config.batch_sizes import (
    batch_size_problems, divisor_below, fsdp_size_problems, launch_mismatch, measures_sum_pi_squared, mini_batch_notes,
    world_size,
)
from klppo.config.lora import lora_enabled, lora_problems
from klppo.config.optimizers import optimizer_problems
from klppo.config.problems import Problem, check_at_least, check_positive
from klppo.config.group_checks import filter_groups_notes, group_of_one_notes, group_problems
from klppo.config.hydra import resolve_megatron
from klppo.config.reward_checks import reward_notes, reward_problems
from klppo.config.rollout_checks import engine_problems, multi_turn_problems, resolve_rollout_engine, rollout_notes
from klppo.config.rollout_correction import parse_is_threshold, parse_rs, rollout_correction_active
from klppo.config.schema import (
    ActorConfig,
    CriticConfig,
    OptimConfig,
    PPOConfig,
    RolloutConfig,
    TrainerConfig,
    ValKwargsConfig,
)
from klppo.config.supervised import RMConfig, SFTConfig, SFTTrainerConfig

ARF = "actor_rollout_ref"
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
# apply_chat_template's own arguments: klppo renders each prompt to text with the generation prompt
# and encodes the text itself, and the template is the one saved with the tokenizer.
_TEMPLATE_CALL_ARGS = ("conversation", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                       "tokenizer_kwargs")


# ---- derived defaults ----


def resolve_ppo(cfg: PPOConfig, notes: Optional[list[str]] = None) -> None:
    """Fill, in place, every PPO field whose ``None`` means "derive from another field", and pick
    the response source that can run here (``notes`` gets a line when it differs from the asked one)."""
    arf = cfg.actor_rollout_ref
    actor, critic = arf.actor, cfg.critic
    notes = notes if notes is not None else []
    if arf.rollout.response_length is None:
        arf.rollout.response_length = cfg.data.max_response_length
    resolve_rollout_engine(arf.rollout, cfg.data.max_prompt_length, notes)
    resolve_megatron(cfg, notes)
    _note_rollout_correction(cfg, notes)
    notes += rollout_notes(cfg)
    notes += filter_groups_notes(cfg) + reward_notes(cfg) + not_yet_supported_notes(cfg) + _generations_notes(cfg)
    if cfg.algorithm.use_pf_ppo and cfg.algorithm.adv_estimator != "gae":
        notes.append(f"warning: algorithm.use_pf_ppo has no effect with algorithm.adv_estimator = "
                     f"'{cfg.algorithm.adv_estimator}': PF-PPO resamples the batch after GAE only, as in verl")
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size
    if arf.rollout.n is None:  # ranking needs several responses per prompt
        arf.rollout.n = 4 if cfg.reward_model.rank_responses else 1
    notes += group_of_one_notes(cfg)
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    _follow_actor_budgets(cfg)
    notes += mini_batch_notes(cfg, world_size(cfg))
    if critic.model.path is None:
        critic.model.path = arf.model.path
    rm_rollout = cfg.reward_model.rollout
    if rm_rollout.prompt_length is None:
        rm_rollout.prompt_length = cfg.data.max_prompt_length
    if rm_rollout.response_length is None:
        rm_rollout.response_length = arf.rollout.response_length
    _resolve_trainer(cfg.trainer, notes)


def _follow_actor_budgets(cfg: PPOConfig) -> None:
    """verl's defaults: the log-prob, reference and critic forwards size their micro-batches as the
    actor does (``${oc.select:actor_rollout_ref.actor.use_dynamic_bsz}`` and its token budget),
    and the critic aggregates its loss as the actor does."""
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if critic.use_dynamic_bsz is None:
        critic.use_dynamic_bsz = actor.use_dynamic_bsz
    if critic.loss_agg_mode is None:
        critic.loss_agg_mode = actor.loss_agg_mode


def resolve_sft(cfg: SFTConfig | RMConfig, notes: Optional[list[str]] = None) -> None:
    """Fill, in place, every SFT (or reward-model training) field whose ``None`` means "derive"."""
    _resolve_trainer(cfg.trainer, notes if notes is not None else [])


def _note_rollout_correction(cfg: PPOConfig, notes: list[str]) -> None:
    """Settings that have no effect where they are, said once (verl ignores them there too)."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if rollout_correction_active(cfg) and cfg.actor_rollout_ref.rollout.name == "hf":
        notes.append(f"warning: {key} has no effect with {ROLLOUT}.name = 'hf': the actor itself samples, so the "
                     "behaviour policy is pi_old and every weight pi_old / mu is 1; it corrects offline responses "
                     "that carry rollout_log_probs, and vLLM rollouts (rollout.name=vllm)")
    elif rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        notes.append(f"warning: {key}.loss_type = '{rc.loss_type}' applies in bypass mode only (as in verl); "
                     f"set {key}.bypass_mode=true, or leave loss_type at ppo_clip")


# verl's loggers that klppo does not have: dropped from trainer.logger with one warning (the run's
# metrics.jsonl holds every step's metrics either way). verl's deprecated "tracking" is its wandb.
VERL_ONLY_LOGGERS = ("swanlab", "vemlp_wandb", "clearml", "trackio", "file")


def _resolve_trainer(trainer: TrainerConfig | SFTTrainerConfig, notes: list[str]) -> None:
    if isinstance(trainer.logger, str):  # verl accepts trainer.logger=console
        trainer.logger = [trainer.logger]
    trainer.logger = ["wandb" if name == "tracking" else name for name in trainer.logger]
    dropped = [name for name in trainer.logger if name in VERL_ONLY_LOGGERS]
    if dropped:
        trainer.logger = [name for name in trainer.logger if name not in VERL_ONLY_LOGGERS]
        notes.append(f"warning: trainer.logger {', '.join(repr(name) for name in dropped)} has no effect: a logger "
                     "of verl's that klppo does not have (klppo logs to console, jsonl, tensorboard, wandb and mlflow); "
                     "every step's metrics are in metrics.jsonl in the run folder")
    if trainer.default_local_dir is None:
        trainer.default_local_dir = f"checkpoints/{trainer.project_name}/{trainer.experiment_name}"


# ---- small check helpers (each appends at most one Problem) ----


def _between(out: list[Problem], key: str, value: float, low: float, high: float, high_open: bool = False) -> None:
    """``low <= value <= high`` (``< high`` when ``high_open``)."""
    too_high = value >= high if high_open else value > high
    if value < low or too_high or math.isnan(value):
        interval = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        out.append(Problem((key,), f"{key} = {value!r} must lie in {interval}; set it inside that range"))


def _freq(out: list[Problem], key: str, value: int) -> None:
    if value != -1 and value < 1:
        out.append(Problem((key,), f"{key} = {value!r} must be -1 (off) or >= 1 (every that many steps)"))


def _divides(
    out: list[Problem], key: str, part: Optional[int], whole: int, whole_text: str, whole_keys: tuple[str, ...]
) -> None:
    """``part`` (when set and positive) must divide ``whole``, which comes from ``whole_keys``."""
    if part is None or part <= 0 or whole <= 0 or whole % part == 0:
        return
    hint = divisor_below(whole, part)
    out.append(Problem((key, *whole_keys), f"{key} = {part} must divide {whole_text}; set it to a divisor such as {hint}"))


# ---- PPO ----


def check_ppo(cfg: PPOConfig, launched: Optional[int] = None) -> list[Problem]:
    """All value problems of a resolved PPO config (``resolve_ppo`` has run); ``launched``: the processes
    the run was started as, when it is a run (a launch that does not match the config comes first)."""
    out: list[Problem] = []
    mismatch = None if launched is None else launch_mismatch(cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes, launched)
    if mismatch is not None:
        out.append(Problem(("trainer.n_gpus_per_node", "trainer.nnodes"), mismatch))
    _check_ppo_paths(cfg, out)
    out += template_kwargs_problems(cfg.data.apply_chat_template_kwargs)
    _check_data_lengths(cfg, out)
    _check_ppo_batches(cfg, out)
    _check_actor(cfg.actor_rollout_ref.actor, out)
    _check_sampling(cfg.actor_rollout_ref.rollout, ROLLOUT, out)
    _check_sampling(cfg.actor_rollout_ref.rollout.val_kwargs, f"{ROLLOUT}.val_kwargs", out)
    _check_optim(cfg.actor_rollout_ref.actor.optim, f"{ACTOR}.optim", out)
    if cfg.algorithm.adv_estimator == "gae":  # the other estimators train no critic
        _check_critic(cfg.critic, cfg.actor_rollout_ref.actor, out)
        _check_optim(cfg.critic.optim, "critic.optim", out)
    _check_algorithm(cfg, out)
    group_problems(cfg, out)
    _check_rollout_correction(cfg, out)
    out += [Problem(keys, message) for keys, message in engine_problems(cfg) + multi_turn_problems(cfg)]
    _check_trainer(cfg.trainer, out)
    _check_guard(cfg.trainer.guard, out)
    out += reward_problems(cfg)
    _check_critic_warmup(cfg, out)
    check_positive(out, f"{ARF}.nccl_timeout", cfg.actor_rollout_ref.nccl_timeout, "number of seconds")
    out += [Problem(keys, message) for keys, message in fsdp_size_problems(cfg, world_size(cfg))]
    _refuse_fp16_training(out, f"{ACTOR}.fsdp_config", cfg.actor_rollout_ref.actor.fsdp_config)
    _check_lora(out, cfg.actor_rollout_ref.model, f"{ARF}.model")
    if cfg.algorithm.adv_estimator == "gae":  # the other estimators train no critic
        _refuse_fp16_training(out, "critic.model.fsdp_config", cfg.critic.model.fsdp_config)
        _check_lora(out, cfg.critic.model, "critic.model")
    out += not_yet_supported_ppo(cfg)
    return out


def _check_lora(out: list[Problem], model_cfg, prefix: str) -> None:
    out += [Problem((key,), message) for key, message in lora_problems(model_cfg, prefix)]
    if lora_enabled(model_cfg):
        for name in ("target_modules", "exclude_modules"):
            _check_regex(out, f"{prefix}.{name}", getattr(model_cfg, name))


def _check_regex(out: list[Problem], key: str, value) -> None:
    """A module-name key given as one string is a regular expression (peft matches it with
    re.fullmatch against each module's full name; a list is matched by names instead), and one
    that does not compile would fail only when the model is built. "all-linear" is a keyword."""
    if not isinstance(value, str) or value == "all-linear":
        return
    try:
        re.compile(value)
    except re.error as exc:
        out.append(Problem((key,), f"{key} = {value!r} is not a valid regular expression ({exc}); fix it (a single "
                           "string is matched as a regex against each module's dotted name, e.g. '.*\\.(q|v)_proj'), "
                           "or give a list of module names such as [q_proj, v_proj]"))


def _refuse_fp16_training(out: list[Problem], prefix: str, fsdp) -> None:
    """A model that trains in float16 needs loss scaling, which klppo does not have: its small
    gradients would underflow to 0 and its large ones overflow to inf. Frozen models (the
    reference, reward models) may compute in float16."""
    if fsdp.dtype == "float16":
        out.append(Problem((f"{prefix}.dtype",), f"{prefix}.dtype = float16 trains without a gradient scaler, so "
                           "gradients underflow or overflow; set it to bfloat16 (the same memory, float32's range, "
                           "no scaler needed) or float32"))


def _check_critic_warmup(cfg: PPOConfig, out: list[Problem]) -> None:
    warmup = cfg.trainer.critic_warmup
    check_at_least(out, "trainer.critic_warmup", warmup, 0)
    if warmup > 0 and cfg.algorithm.adv_estimator != "gae":
        out.append(Problem(("trainer.critic_warmup", "algorithm.adv_estimator"), f"trainer.critic_warmup = {warmup} "
                           f"holds back the actor while the critic trains, but algorithm.adv_estimator = "
                           f"'{cfg.algorithm.adv_estimator}' trains no critic, so those steps would train nothing; "
                           "set trainer.critic_warmup=0"))


# The shortest trainer.guard.window: the entropy trend compares the mean of its newest 3 steps
# with the median of at least 3 earlier ones (klppo/safety/health.py, RECENT_STEPS).
MIN_GUARD_WINDOW = 6


def _check_guard(guard, out: list[Problem]) -> None:
    key = "trainer.guard"
    for name in ("early_stop_kl", "rollback_kl", "rollback_lr", "entropy_floor", "clipfrac_max"):
        check_positive(out, f"{key}.{name}", getattr(guard, name))
    check_at_least(out, f"{key}.max_rollbacks", guard.max_rollbacks, 0)
    check_at_least(out, f"{key}.max_nonfinite_steps", guard.max_nonfinite_steps, 1)
    for name, low in (("grad_spike", 1), ("entropy_collapse", 0), ("entropy_surge", 0)):
        value = getattr(guard, name)
        if value is not None and not value > low:  # NaN too: every comparison with it would be False
            what = "a ratio to the norms' median, " if low else ""
            out.append(Problem((f"{key}.{name}",), f"{key}.{name} = {value!r} must be > {low}; set it to {what}a "
                               f"number above {low}, or to null to switch this detector off"))
    check_at_least(out, f"{key}.max_grad_skips", guard.max_grad_skips, 0)
    if guard.window < MIN_GUARD_WINDOW:
        out.append(Problem((f"{key}.window",), f"{key}.window = {guard.window} is too short: the entropy trend "
                           f"compares its newest 3 steps with at least 3 earlier ones; set it to {MIN_GUARD_WINDOW} "
                           "or more (default 20)"))
    check_at_least(out, f"{key}.divergence_validations", guard.divergence_validations, 2)
    check_positive(out, f"{key}.divergence_margin", guard.divergence_margin)
    if guard.rollback_kl is not None and guard.early_stop_kl is not None and guard.rollback_kl > guard.early_stop_kl:
        out.append(Problem(
            (f"{key}.rollback_kl", f"{key}.early_stop_kl"),
            f"{key}.rollback_kl = {guard.rollback_kl} is above {key}.early_stop_kl = {guard.early_stop_kl}: "
            "a run would stop before it could roll back; set rollback_kl <= early_stop_kl",
        ))


def _check_files(out: list[Problem], key: str, files: str | list[str] | None, required: bool) -> None:
    """A Parquet file or a non-empty list of them; ``None`` (when not required) switches the use off."""
    if files is None and not required:
        return
    names = [files] if isinstance(files, str) else files
    if names and all(names):
        return
    if required:
        out.append(Problem((key,), f"{key} is required: set it to a Parquet file or a list of them, e.g. {key}=data/train.parquet"))
    else:
        out.append(Problem((key,), f"{key} = {files!r} names no file: set it to a Parquet file or a list of them, or to null to turn validation off"))


def _check_ppo_paths(cfg: PPOConfig, out: list[Problem]) -> None:
    _check_files(out, "data.train_files", cfg.data.train_files, required=True)
    _check_files(out, "data.val_files", cfg.data.val_files, required=False)
    if cfg.trainer.val_only and not cfg.data.val_files:
        out.append(Problem(("trainer.val_only", "data.val_files"), "trainer.val_only validates the model on "
                           "data.val_files, which is not set: set it, or set trainer.val_only=false to train"))
    if not cfg.actor_rollout_ref.model.path:
        key = f"{ARF}.model.path"
        out.append(Problem((key,), f"{key} is required: set it to a local Hugging Face model folder, e.g. {key}=models/Qwen2.5-0.5B-Instruct"))


def template_kwargs_problems(kwargs: dict, prefix: str = "data.apply_chat_template_kwargs") -> list[Problem]:
    """Chat-template arguments may name the template's own inputs only (enable_thinking, tools, ...)."""
    out: list[Problem] = []
    for name in kwargs:
        key = f"{prefix}.{name}"
        if name == "chat_template":
            out.append(Problem((key,), f"{key}: klppo renders prompts with the chat template saved with the "
                               "tokenizer; save yours there (tokenizer.chat_template = ...; save_pretrained)"))
        elif name in _TEMPLATE_CALL_ARGS:
            out.append(Problem((key,), f"{key}: klppo sets this argument of apply_chat_template itself (it renders "
                               "each prompt as text with the generation prompt, then encodes it); remove it"))
    return out


def _check_data_lengths(cfg: PPOConfig, out: list[Problem]) -> None:
    check_positive(out, "data.max_prompt_length", cfg.data.max_prompt_length, "number of tokens")
    check_positive(out, "data.max_response_length", cfg.data.max_response_length, "number of tokens")
    check_positive(out, f"{ROLLOUT}.response_length", cfg.actor_rollout_ref.rollout.response_length, "number of tokens")
    rollout, ref = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    check_positive(out, f"{ACTOR}.ppo_max_token_len_per_gpu", cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu, "number of tokens")
    check_positive(out, f"{ROLLOUT}.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, "number of tokens")
    check_positive(out, f"{ARF}.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, "number of tokens")
    check_positive(out, "critic.ppo_max_token_len_per_gpu", cfg.critic.ppo_max_token_len_per_gpu, "number of tokens")


def _check_ppo_batches(cfg: PPOConfig, out: list[Problem]) -> None:
    """Batch sizes and token budgets on the world the config names (``batch_sizes.py``, their one home)."""
    out += [Problem(keys, message) for keys, message in batch_size_problems(cfg, world_size(cfg))]


def _check_actor(actor: ActorConfig, out: list[Problem]) -> None:
    _between(out, f"{ACTOR}.clip_ratio", actor.clip_ratio, 0.0, 1.0, high_open=True)
    if actor.clip_ratio_high != actor.clip_ratio:  # a copy of clip_ratio has been checked with it
        _between(out, f"{ACTOR}.clip_ratio_high", actor.clip_ratio_high, 0.0, 1.0, high_open=True)
    # 1 or more: no lower bound (1 - low <= 0), as verl's CISPO example sets it (clip_ratio_low=10)
    if actor.clip_ratio_low != actor.clip_ratio:
        _between(out, f"{ACTOR}.clip_ratio_low", actor.clip_ratio_low, 0.0, math.inf)
    if actor.clip_ratio_c <= 1:
        key = f"{ACTOR}.clip_ratio_c"
        out.append(Problem((key,), f"{key} = {actor.clip_ratio_c!r} must be > 1 (dual-clip bound, Ye et al. 2020); the usual value is 3.0"))
    if actor.kl_loss_coef < 0:
        out.append(Problem((f"{ACTOR}.kl_loss_coef",), f"{ACTOR}.kl_loss_coef = {actor.kl_loss_coef!r} must be >= 0"))
    check_at_least(out, f"{ACTOR}.ppo_epochs", actor.ppo_epochs, 1)
    check_positive(out, f"{ACTOR}.grad_clip", actor.grad_clip, "max gradient norm")
    check_positive(out, f"{ACTOR}.entropy_from_logits_chunk_size", actor.entropy_from_logits_chunk_size, "number of tokens")
    for side in ("tau_pos", "tau_neg"):  # SAPO's gate divides by them
        check_positive(out, f"{ACTOR}.{side}", getattr(actor, side), "temperature (SAPO's gate, verl's default 1.0 / 1.05)")
    _check_cov_losses(actor, out)


def _check_cov_losses(actor: ActorConfig, out: list[Problem]) -> None:
    """Clip-Cov's and KL-Cov's shares in (0, 1] and Clip-Cov's window, where their mode is on (as verl)."""
    pl, key = actor.policy_loss, f"{ACTOR}.policy_loss"
    shares = {"clip_cov": "clip_cov_ratio", "kl_cov": "kl_cov_ratio"}
    if pl.loss_mode in shares and not 0 < (share := getattr(pl, shares[pl.loss_mode])) <= 1:
        out.append(Problem((f"{key}.{shares[pl.loss_mode]}",), f"{key}.{shares[pl.loss_mode]} = {share!r} must lie in "
                           "(0, 1]: the share of a mini-batch's tokens held back (verl's default 0.0002)"))
    if pl.loss_mode == "clip_cov":
        if not pl.clip_cov_lb < pl.clip_cov_ub:
            out.append(Problem((f"{key}.clip_cov_lb", f"{key}.clip_cov_ub"),
                               f"{key}.clip_cov_lb = {pl.clip_cov_lb!r} must be below clip_cov_ub = {pl.clip_cov_ub!r}: "
                               "Clip-Cov cuts tokens whose covariance lies between them (verl's 1.0 and 5.0)"))
    if pl.loss_mode == "kl_cov" and pl.ppo_kl_coef < 0:
        out.append(Problem((f"{key}.ppo_kl_coef",), f"{key}.ppo_kl_coef = {pl.ppo_kl_coef!r} must be >= 0"))


def _check_sampling(sampling: RolloutConfig | ValKwargsConfig, prefix: str, out: list[Problem]) -> None:
    """Sampling knobs shared by the rollout and its validation settings."""
    check_at_least(out, f"{prefix}.n", sampling.n, 1)
    if sampling.do_sample and not sampling.temperature > 0:
        key = f"{prefix}.temperature"
        out.append(Problem((key, f"{prefix}.do_sample"), f"{key} = {sampling.temperature!r} must be > 0 when {prefix}.do_sample is true; raise it, or set {prefix}.do_sample=false for greedy decoding"))
    if not 0 < sampling.top_p <= 1:
        out.append(Problem((f"{prefix}.top_p",), f"{prefix}.top_p = {sampling.top_p!r} must lie in (0, 1]; 1.0 disables nucleus sampling"))
    if sampling.top_k != -1 and sampling.top_k < 1:
        out.append(Problem((f"{prefix}.top_k",), f"{prefix}.top_k = {sampling.top_k!r} must be -1 (off) or >= 1"))


def _check_optim(optim: OptimConfig, prefix: str, out: list[Problem]) -> None:
    check_positive(out, f"{prefix}.lr", optim.lr, "learning rate such as 1e-6")
    out += optimizer_problems(optim.optimizer_impl, optim.optimizer, optim.override_optimizer_config, prefix)
    if optim.weight_decay < 0:
        out.append(Problem((f"{prefix}.weight_decay",), f"{prefix}.weight_decay = {optim.weight_decay!r} must be >= 0"))
    if len(optim.betas) != 2 or any(not 0 <= b < 1 for b in optim.betas):
        out.append(Problem((f"{prefix}.betas",), f"{prefix}.betas = {optim.betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.999]"))
    if optim.lr_warmup_steps < -1:
        out.append(Problem((f"{prefix}.lr_warmup_steps",), f"{prefix}.lr_warmup_steps = {optim.lr_warmup_steps} must be -1 (use lr_warmup_steps_ratio) or >= 0"))
    _between(out, f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0)
    _between(out, f"{prefix}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0)


def _check_critic(critic: CriticConfig, actor: ActorConfig, out: list[Problem]) -> None:
    """Only when the critic trains (adv_estimator == gae); its None sizes are resolved by now."""
    assert critic.ppo_mini_batch_size is not None and critic.ppo_epochs is not None
    if critic.ppo_epochs != actor.ppo_epochs:  # a copy of the actor's has been checked there
        check_at_least(out, "critic.ppo_epochs", critic.ppo_epochs, 1)
    check_positive(out, "critic.grad_clip", critic.grad_clip, "max gradient norm")
    check_positive(out, "critic.cliprange_value", critic.cliprange_value, "clip range such as 0.5")


def _check_algorithm(cfg: PPOConfig, out: list[Problem]) -> None:
    algo = cfg.algorithm
    _between(out, "algorithm.gamma", algo.gamma, 0.0, 1.0)
    _between(out, "algorithm.lam", algo.lam, 0.0, 1.0)
    if algo.kl_ctrl.kl_coef < 0:
        out.append(Problem(("algorithm.kl_ctrl.kl_coef",), f"algorithm.kl_ctrl.kl_coef = {algo.kl_ctrl.kl_coef!r} must be >= 0"))
    check_at_least(out, "algorithm.kl_ctrl.probe_prompts", algo.kl_ctrl.probe_prompts, 1)
    check_at_least(out, "algorithm.kl_ctrl.probe_every", algo.kl_ctrl.probe_every, 1)
    if algo.kl_ctrl.offline_kl == "importance_weighted" and algo.rollout_correction.bypass_mode:
        out.append(Problem(("algorithm.kl_ctrl.offline_kl", "algorithm.rollout_correction.bypass_mode"),
                           "algorithm.kl_ctrl.offline_kl = 'importance_weighted' needs the policy's log-probs, which "
                           "rollout_correction.bypass_mode skips (pi_old = mu); use offline_kl=sampled"))
    if algo.kl_ctrl.type == "adaptive":
        check_positive(out, "algorithm.kl_ctrl.horizon", algo.kl_ctrl.horizon, "number of steps (adaptive KL control)")
        check_positive(out, "algorithm.kl_ctrl.target_kl", algo.kl_ctrl.target_kl, "KL per token (adaptive KL control)")


def _check_rollout_correction(cfg: PPOConfig, out: list[Problem]) -> None:
    """Thresholds verl would accept, parsed as verl parses them (``config.rollout_correction``)."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.bypass_mode and mode != "vanilla" and cfg.actor_rollout_ref.rollout.name != "hf":
        out.append(Problem((f"{ACTOR}.policy_loss.loss_mode", f"{key}.bypass_mode"),
                           f"{ACTOR}.policy_loss.loss_mode = '{mode}' with {key}.bypass_mode = true: bypass mode "
                           f"trains with its own loss ({key}.loss_type: ppo_clip or reinforce, against the behaviour "
                           f"policy), where verl replaces the loss mode without a word; set bypass_mode=false to "
                           f"train {mode} with the correction's weights, or loss_mode=vanilla"))
    if rc.bypass_mode and measures_sum_pi_squared(cfg) and cfg.actor_rollout_ref.rollout.name != "hf":
        why = (f"algorithm.adv_estimator = '{cfg.algorithm.adv_estimator}'"
               if not cfg.actor_rollout_ref.actor.calculate_sum_pi_squared else f"{ACTOR}.calculate_sum_pi_squared")
        out.append(Problem((f"{key}.bypass_mode", "algorithm.adv_estimator", f"{ACTOR}.calculate_sum_pi_squared"),
                           f"{why} needs pi_old's forward (each token's sum of squared probabilities), which "
                           f"{key}.bypass_mode = true skips (pi_old = the recorded behaviour log-probs); set "
                           f"bypass_mode=false (decoupled correction: the optimal token baseline then weighs each "
                           f"token by its squared importance weight)"))
    if rc.rollout_is is not None:
        try:
            parse_is_threshold(rc.rollout_is_threshold)
        except ValueError as exc:
            out.append(Problem((f"{key}.rollout_is_threshold",), str(exc)))
    if rc.rollout_rs is not None:
        try:
            parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as exc:
            out.append(Problem((f"{key}.rollout_rs", f"{key}.rollout_rs_threshold"), str(exc)))


def _check_trainer_common(trainer: TrainerConfig | SFTTrainerConfig, out: list[Problem]) -> None:
    """Checks of the trainer fields PPO and SFT share."""
    check_at_least(out, "trainer.total_epochs", trainer.total_epochs, 1)
    check_at_least(out, "trainer.total_training_steps", trainer.total_training_steps, 1)
    check_at_least(out, "trainer.n_gpus_per_node", trainer.n_gpus_per_node, 1)
    check_at_least(out, "trainer.nnodes", trainer.nnodes, 1)
    _check_checkpointing(trainer, out)
    if not trainer.default_local_dir:
        out.append(Problem(("trainer.default_local_dir",), "trainer.default_local_dir is empty; set an output folder, or leave it unset for checkpoints/<project_name>/<experiment_name>"))


def _check_trainer(trainer: TrainerConfig, out: list[Problem]) -> None:
    _check_trainer_common(trainer, out)
    _freq(out, "trainer.test_freq", trainer.test_freq)
    check_at_least(out, "trainer.max_actor_ckpt_to_keep", trainer.max_actor_ckpt_to_keep, 1)
    check_at_least(out, "trainer.log_val_generations", trainer.log_val_generations, 0)
    for key in ("rollout_data_dir", "validation_data_dir"):
        folder = getattr(trainer, key)
        if folder is not None and (not folder.strip() or Path(folder).is_file()):
            problem = "names no folder" if not folder.strip() else "is a file"
            out.append(Problem((f"trainer.{key}",), f"trainer.{key} = {folder!r} {problem}: set it to the folder that "
                               "gets a <step>.jsonl file of responses per step, or to null to write none"))


def _generations_notes(cfg: PPOConfig) -> list[str]:
    """Validation's generations asked for where nothing is validated (verl says nothing)."""
    trainer = cfg.trainer
    asked = [f"trainer.{key}" for key in ("validation_data_dir", "log_val_generations") if getattr(trainer, key)]
    if not asked or cfg.data.val_files:
        return []
    return [f"warning: {' and '.join(asked)} show validation's responses, but data.val_files is not set, so "
            "nothing is validated; set data.val_files (and trainer.test_freq) to see them"]


def _check_checkpointing(trainer: TrainerConfig | SFTTrainerConfig, out: list[Problem]) -> None:
    _freq(out, "trainer.save_freq", trainer.save_freq)
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        out.append(Problem(
            ("trainer.resume_mode", "trainer.resume_from_path"),
            "trainer.resume_mode = 'resume_path' needs trainer.resume_from_path: set it to a checkpoint folder "
            "(e.g. checkpoints/<project>/<experiment>/global_step_100), or use trainer.resume_mode=auto",
        ))


# ---- SFT ----


def _check_supervised_inputs(cfg: SFTConfig | RMConfig, out: list[Problem]) -> None:
    """The data files and the starting model of SFT and reward-model training."""
    _check_files(out, "data.train_files", cfg.data.train_files, required=True)
    _check_files(out, "data.val_files", cfg.data.val_files, required=False)
    out += template_kwargs_problems(cfg.data.apply_chat_template_kwargs)
    if not cfg.model.partial_pretrain:
        key = "model.partial_pretrain"
        out.append(Problem((key,), f"{key} is required: set it to a local Hugging Face model folder, "
                           f"e.g. {key}=models/Qwen2.5-0.5B"))


def check_sft(cfg: SFTConfig) -> list[Problem]:
    """All value problems of a resolved SFT config (``resolve_sft`` has run)."""
    out: list[Problem] = []
    data = cfg.data
    _check_supervised_inputs(cfg, out)
    check_positive(out, "data.max_length", data.max_length, "number of tokens")
    check_positive(out, "data.train_batch_size", data.train_batch_size, "number of examples")
    check_positive(out, "data.micro_batch_size_per_gpu", data.micro_batch_size_per_gpu, "number of examples")
    whole_text = f"data.train_batch_size = {data.train_batch_size}"
    _divides(out, "data.micro_batch_size_per_gpu", data.micro_batch_size_per_gpu, data.train_batch_size, whole_text, ("data.train_batch_size",))
    _check_optim(cfg.optim, "optim", out)
    check_positive(out, "optim.clip_grad", cfg.optim.clip_grad, "max gradient norm")
    _check_trainer_common(cfg.trainer, out)
    _refuse_fp16_training(out, "model.fsdp_config", cfg.model.fsdp_config)
    _check_lora(out, cfg.model, "model")
    out += not_yet_supported_sft(cfg)
    return out


# ---- not supported yet: delete a line here when its feature lands ----



def not_yet_supported_ppo(cfg: PPOConfig) -> list[Problem]:
    """Knobs of later work, refused when set: left alone they would silently do nothing."""
    out: list[Problem] = []
    _refuse_loggers(out, cfg.trainer.logger)
    return out


def not_yet_supported_notes(cfg: PPOConfig) -> list[str]:
    """Knobs of later work that change no number: said once, as verl keys without effect are."""
    backend = f"{ARF}.model.fused_kernel_options.impl_backend"
    value = cfg.actor_rollout_ref.model.fused_kernel_options.impl_backend
    if value == "torch":
        return []
    return [f"warning: {backend} = {value!r} has no effect: klppo's fused kernels have the torch backend only, "
            "which computes the same log-probs and entropies"]


def check_rm(cfg: RMConfig) -> list[Problem]:
    """All value problems of a reward-model training config."""
    out: list[Problem] = []
    data = cfg.data
    _check_supervised_inputs(cfg, out)
    for key in ("max_prompt_length", "max_response_length", "train_batch_size", "micro_batch_size_per_gpu"):
        check_positive(out, f"data.{key}", getattr(data, key))
    if data.micro_batch_size_per_gpu and data.train_batch_size % data.micro_batch_size_per_gpu:
        out.append(Problem(("data.micro_batch_size_per_gpu",), f"data.micro_batch_size_per_gpu = "
                           f"{data.micro_batch_size_per_gpu} does not divide data.train_batch_size = "
                           f"{data.train_batch_size}; pick a divisor"))
    _check_optim(cfg.optim, "optim", out)
    _check_trainer_common(cfg.trainer, out)
    _refuse_fp16_training(out, "model.fsdp_config", cfg.model.fsdp_config)
    _check_lora(out, cfg.model, "model")
    _refuse_loggers(out, cfg.trainer.logger)
    return out


def not_yet_supported_sft(cfg: SFTConfig) -> list[Problem]:
    """SFT knobs of later work, refused when set."""
    out: list[Problem] = []
    _refuse_loggers(out, cfg.trainer.logger)
    return out


def _refuse_loggers(out: list[Problem], loggers: list[str]) -> None:
    """Unknown entries, and tensorboard / wandb when their package is not installed (before any model loads)."""
    from klppo.monitoring.backends import LOGGER_PACKAGES, missing_package  # stdlib only: no torch here

    known = tuple(LOGGER_PACKAGES)
    for name in loggers:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
            why = f"unknown logger{f' (did you mean {near[0]!r}?)' if near else ''}"
            out.append(Problem(("trainer.logger",), f"trainer.logger entry {name!r}: {why}; use a list of {', '.join(known)}"))
        elif (message := missing_package(name)) is not None:
            out.append(Problem(("trainer.logger",), message))
