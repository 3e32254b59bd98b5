"""A PPO run's settings: the validated config compiled once, every derived number computed here.

``compile_ppo(cfg, world_size)`` is the one place that reads the PPO config for the loop; the
loop, the scoring forwards, the updates and validation read only the frozen ``PPOSettings``.
Sizes are already per rank where a rank acts on its share (the updates' mini-batches); token
budgets are set only where ``use_dynamic_bsz`` switches them on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from klppo.config import PPOConfig
from klppo.config.batch_sizes import (
    batch_size_problems, measures_sum_pi_squared, mini_batch_rows, on_policy_update, shard_chunk_rows,
    update_forwards_first, update_sizes, uses_critic, uses_reference,
)
from klppo.config.group_checks import GROUP_ESTIMATORS
from klppo.config.rollout_correction import rollout_correction_active
from klppo.config.kl_probe import probe_every, probe_prompts
from klppo.config.lora import lora_enabled
from klppo.config.rollout_checks import engine_dtype
from klppo.config.rollout_correction import parse_is_threshold, parse_rs
from klppo.config.schema import SCORE_METRICS, FSDPConfig
from klppo.data.batching import MicroBatching
from klppo.errors import UserError
from klppo.models.forward import HeadSettings
from klppo.rewards.overlong import OverlongPenalty
from klppo.rollout.hf import Decoding, SamplingParams
from klppo.rollout.vllm import EngineSettings
from klppo.safety.guards import GuardSettings
from klppo.run.setup import PARAM_DTYPES

ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ACTOR_BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
CRITIC_BUDGET_KEY = "critic.ppo_max_token_len_per_gpu"


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """algorithm.rollout_correction, parsed; the defaults switch every correction off.

    With behaviour log-probs in the batch the ``rollout_corr/`` diagnostics are logged whatever
    these say (as verl); the weights, rejection and bypass act only in offline runs.
    """

    rollout_is: Optional[str] = None  # None | token | sequence
    is_threshold: float = 2.0  # upper bound of the weights
    is_threshold_lower: Optional[float] = None  # IcePop's lower bound; None = truncate at the upper (TIS)
    batch_normalize: bool = False
    rs: tuple[tuple[str, Optional[float], float], ...] = ()  # rejection criteria (option, lower, upper)
    bypass_mode: bool = False  # pi_old = mu: the loss corrects against the current policy
    loss_type: str = "ppo_clip"  # bypass mode's policy loss: ppo_clip | reinforce


@dataclass(frozen=True)
class CovSettings:
    """actor.policy_loss.loss_mode clip_cov or kl_cov: its tokens picked over each mini-batch (``trainer.cov_selection``)."""

    mode: str  # clip_cov | kl_cov
    ratio: float  # the share of a mini-batch's tokens picked: clip_cov_ratio or kl_cov_ratio
    clip_cov_lb: float
    clip_cov_ub: float
    ppo_kl_coef: float
    seed: int  # data.seed: with the step, the epoch and the mini-batch, seeds Clip-Cov's random pick


@dataclass(frozen=True)
class ActorUpdateSettings:
    mini_batch_rows: int  # this rank's rows per mini-batch: ppo_mini_batch_size * rollout.n // ranks
    micro: MicroBatching  # how a mini-batch splits (ppo_micro_batch_size_per_gpu or a token budget)
    ppo_epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    temperature: float  # the rollout's: log-probs of the distribution the responses came from
    head: HeadSettings = HeadSettings()  # how log-probs and entropies come out of the LM head
    rollout_correction: RolloutCorrectionSettings = RolloutCorrectionSettings()
    compute_dtype: torch.dtype = torch.float32  # fsdp_config.dtype: what forward/backward run in (MFU's peak)
    # The update's forward is pi_old (one epoch, one mini-batch, ``on_policy_update``): old =
    # log_prob.detach(), and the scoring phase ran no old_log_prob forward (``update.OnPolicy``).
    on_policy: bool = False
    policy_loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode (klppo.algo.POLICY_LOSS_MODES)
    tau_pos: float = 1.0  # SAPO's gate temperatures
    tau_neg: float = 1.05
    cov: Optional[CovSettings] = None  # clip_cov / kl_cov's picking (None: another loss mode)


@dataclass(frozen=True)
class CriticUpdateSettings:
    mini_batch_rows: int  # this rank's rows per mini-batch
    micro: MicroBatching
    ppo_epochs: int
    cliprange_value: float
    loss_agg_mode: str
    grad_clip: float
    compute_dtype: torch.dtype = torch.float32  # fsdp_config.dtype: what forward/backward run in (MFU's peak)


@dataclass(frozen=True)
class RewardModelForward:
    """How reward models score a batch (``reward_model.*``)."""

    micro: MicroBatching  # micro_batch_size_per_gpu rows at a time; model.use_remove_padding packs them
    prompt_length: int  # the prompt's last tokens the reward model reads (reward_model.rollout.prompt_length)
    response_length: int  # the response's first tokens it reads (reward_model.rollout.response_length)


@dataclass(frozen=True)
class ForwardSettings:
    """How the no-grad scoring forwards split this rank's rows."""

    old_log_prob: MicroBatching  # the actor (rollout.log_prob_*)
    ref: MicroBatching  # the reference (ref.log_prob_*)
    values: MicroBatching  # the critic (critic.ppo_micro_batch_size_per_gpu / token budget)
    reward_model: RewardModelForward
    temperature: float
    head: HeadSettings = HeadSettings()  # how log-probs come out of the LM head (actor and reference)
    old_log_prob_from_rollout: bool = False  # rollout correction's bypass mode: pi_old = the recorded mu
    old_log_prob_from_update: bool = False  # no forward: the actor's update gives pi_old (``on_policy``)
    # Nor for the values: the updates' forwards run first and give both (``update_forwards_first``).
    update_forwards_first: bool = False
    # pi_old's forward also measures each token's sum of squared probabilities (``measures_sum_pi_squared``).
    sum_pi_squared: bool = False


@dataclass(frozen=True)
class PFPPOSettings:
    """algorithm.use_pf_ppo with GAE: each step's batch redrawn by its scores (``algo.pf_ppo_sample``)."""

    method: str  # algorithm.pf_ppo.reweight_method
    weight_pow: float
    seed: int  # data.seed: with the step, the draw's seed (the same on every rank, and after a resume)


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    grouped: bool = False  # a group estimator: each response against the others to its prompt
    pf_ppo: Optional[PFPPOSettings] = None


@dataclass(frozen=True)
class FilterGroupsSettings:
    """DAPO's dynamic sampling (algorithm.filter_groups, data.gen_batch_size): each step draws
    generation batches until ``prompts`` prompts whose responses' scores differ are kept."""

    prompts: int  # kept prompts a step trains on (data.train_batch_size)
    gen_batch_prompts: int  # prompts drawn per generation batch (data.gen_batch_size)
    max_gen_batches: Optional[int]  # most generation batches a step may draw; None = no limit
    # What must differ within a group: None, the response's score ("seq_final_reward", after the KL
    # penalty, is the same number: the checks refuse it with algorithm.use_kl_in_reward), or the name
    # of a component the reward function returns beside the score (verl's reward_extra_info, e.g. "acc").
    component: Optional[str] = None


@dataclass(frozen=True)
class KLSettings:
    in_reward: bool  # subtract beta * KL(old || ref) from the token rewards
    penalty: str  # estimator in the reward
    controller: str  # fixed | adaptive
    coef: float  # (initial) beta
    target: float
    horizon: int
    offline_kl: str = "sampled"  # offline runs: auto | sampled | importance_weighted (kl_ctrl.offline_kl)
    probe_prompts: int = 8  # the sampled probe's prompts per measurement
    probe_every: int = 1  # offline runs sample the KL every this many steps (``config.kl_probe``)


@dataclass(frozen=True)
class RankingSettings:
    method: str  # bradley_terry | plackett_luce
    scale: float
    center: bool


@dataclass(frozen=True)
class RewardSettings:
    rank_responses: bool  # distil reward models' rankings of each prompt's responses into rewards
    ranking: RankingSettings
    overlong: Optional[OverlongPenalty] = None  # DAPO's punishment of the reward function's scores


@dataclass(frozen=True)
class LoggerSettings:
    backends: tuple[str, ...]
    project_name: str
    experiment_name: str
    config: dict  # the resolved config as plain data, for W&B / TensorBoard


@dataclass(frozen=True)
class GenerationsSettings:
    """Where a run's responses go as text (``klppo.monitoring.generations``)."""

    rollout_dir: Optional[Path] = None  # trainer.rollout_data_dir: each step's, <step>.jsonl
    validation_dir: Optional[Path] = None  # trainer.validation_data_dir: each validation's
    log_val: int = 0  # trainer.log_val_generations: validation responses shown to the loggers

    @property
    def of_validation(self) -> bool:
        """Whether validation keeps its responses' text."""
        return self.validation_dir is not None or self.log_val > 0


@dataclass(frozen=True)
class PPOSettings:
    run_dir: Path
    world_size: int
    rollout: str  # offline | hf | vllm
    n: int  # responses per prompt
    response_length: int
    sampling: SamplingParams
    generation_weights: str  # auto | gathered | sharded (rollout.generation_weights)
    hf_decoding: Decoding  # rollout.hf_decoding, its static cache sized for data.max_prompt_length + response_length
    engine: Optional[EngineSettings]  # the vLLM engine (rollout.name: vllm); None otherwise
    val_sampling: SamplingParams
    val_batch_size: Optional[int]  # prompts per validation batch over all ranks; None = all at once
    actor: ActorUpdateSettings
    critic: Optional[CriticUpdateSettings]  # None: a critic-free estimator
    forwards: ForwardSettings
    advantage: AdvantageSettings
    kl: KLSettings
    uses_reference: bool
    actor_lora: bool  # the actor trains LoRA adapters only (actor_rollout_ref.model.lora_rank / lora_adapter_path)
    actor_offloaded: bool  # param_offload or offload_policy: the actor's device memory is freed between its phases
    ref_in_actor: bool  # verl's name: the reference is the LoRA actor (ref.lora_reference); no model of its own
    reward: RewardSettings
    guard: GuardSettings  # KL guards off without a reference
    critic_warmup: int  # steps that update the critic only; the actor's updates start after them
    shard_chunk_rows: int  # global rows dealt to the ranks at a time: whole mini-batches of actor and critic
    balance_batch: bool
    save_freq: int
    test_freq: int
    val_before_train: bool
    val_only: bool  # validate once and stop
    max_ckpt_to_keep: Optional[int]
    resume_mode: str
    resume_from_path: Optional[str]
    logger: LoggerSettings
    filter_groups: Optional[FilterGroupsSettings] = None  # None: a step trains on the prompts it draws
    generations: GenerationsSettings = GenerationsSettings()


def compile_ppo(cfg: PPOConfig, world_size: int) -> PPOSettings:
    """The frozen settings of a validated PPO config on ``world_size`` ranks."""
    arf, trainer = cfg.actor_rollout_ref, cfg.trainer
    check_batch_sizes(cfg, world_size)
    rows = {role.prefix: mini_batch_rows(role, arf.rollout.n, world_size) for role in update_sizes(cfg)}
    actor = _actor(cfg, rows["actor_rollout_ref.actor"], world_size)
    critic = _critic(cfg, rows["critic"]) if uses_critic(cfg) else None
    rm, algo, kl = cfg.reward_model, cfg.algorithm, cfg.algorithm.kl_ctrl
    return PPOSettings(
        run_dir=Path(trainer.default_local_dir), world_size=world_size, rollout=arf.rollout.name, n=arf.rollout.n,
        response_length=arf.rollout.response_length, sampling=sampling_params(cfg),
        generation_weights=arf.rollout.generation_weights, engine=engine_settings(cfg, world_size),
        hf_decoding=Decoding("dynamic" if arf.rollout.multi_turn.enable else arf.rollout.hf_decoding,
                             cfg.data.max_prompt_length + arf.rollout.response_length),
        val_sampling=sampling_params(cfg, validation=True), val_batch_size=cfg.data.val_batch_size,
        actor=actor, critic=critic, forwards=_forwards(cfg, world_size),
        advantage=AdvantageSettings(algo.adv_estimator, algo.gamma, algo.lam, algo.norm_adv_by_std_in_grpo,
                                    grouped=algo.adv_estimator in GROUP_ESTIMATORS, pf_ppo=_pf_ppo(cfg)),
        kl=KLSettings(algo.use_kl_in_reward, algo.kl_penalty, kl.type, kl.kl_coef, kl.target_kl, kl.horizon,
                      offline_kl="sampled" if algo.rollout_correction.bypass_mode else kl.offline_kl,
                      probe_prompts=probe_prompts(cfg), probe_every=probe_every(cfg)),
        uses_reference=uses_reference(cfg), actor_lora=lora_enabled(arf.model),
        actor_offloaded=arf.actor.fsdp_config.param_offload or arf.actor.fsdp_config.offload_policy,
        ref_in_actor=uses_reference(cfg) and lora_enabled(arf.model),
        reward=RewardSettings(rm.rank_responses, RankingSettings(rm.ranking.method, rm.ranking.scale, rm.ranking.center),
                              overlong_penalty(cfg)),
        guard=_guard(cfg), critic_warmup=trainer.critic_warmup, shard_chunk_rows=shard_chunk_rows(cfg, world_size), balance_batch=trainer.balance_batch,
        save_freq=trainer.save_freq, test_freq=trainer.test_freq, val_before_train=trainer.val_before_train,
        val_only=trainer.val_only,
        max_ckpt_to_keep=trainer.max_actor_ckpt_to_keep, resume_mode=trainer.resume_mode,
        resume_from_path=trainer.resume_from_path,
        logger=LoggerSettings(tuple(trainer.logger), trainer.project_name, trainer.experiment_name,
                              dataclasses.asdict(cfg)),
        filter_groups=filter_groups_settings(cfg),
        generations=GenerationsSettings(_folder(trainer.rollout_data_dir), _folder(trainer.validation_data_dir),
                                        trainer.log_val_generations),
    )


def _pf_ppo(cfg: PPOConfig) -> Optional[PFPPOSettings]:
    algo = cfg.algorithm
    if not (algo.use_pf_ppo and algo.adv_estimator == "gae"):  # verl resamples after GAE only
        return None
    return PFPPOSettings(algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow, cfg.data.seed)


def _folder(path: Optional[str]) -> Optional[Path]:
    return None if path is None else Path(path)


def check_batch_sizes(cfg: PPOConfig, world_size: int) -> None:
    """The batch-size rules (``klppo.config.batch_sizes``) on the world this run has, before any model loads."""
    problems = [message for _, message in batch_size_problems(cfg, world_size)]
    if problems:
        raise UserError("\n".join(problems))


def filter_groups_settings(cfg: PPOConfig) -> Optional[FilterGroupsSettings]:
    """Dynamic sampling's sizes, or None when algorithm.filter_groups is off."""
    fg, data = cfg.algorithm.filter_groups, cfg.data
    if not fg.enable:
        return None
    limit = fg.max_num_gen_batches if fg.max_num_gen_batches > 0 else None  # verl: <= 0 draws without end
    return FilterGroupsSettings(prompts=data.train_batch_size, gen_batch_prompts=data.gen_batch_size,
                                max_gen_batches=limit, component=None if fg.metric in SCORE_METRICS else fg.metric)


def sampling_params(cfg: PPOConfig, *, validation: bool = False) -> SamplingParams:
    rollout = cfg.actor_rollout_ref.rollout
    source = rollout.val_kwargs if validation else rollout
    return SamplingParams(n=source.n, max_new_tokens=rollout.response_length, temperature=source.temperature,
                          top_p=source.top_p, top_k=source.top_k, do_sample=source.do_sample,
                          ignore_eos=rollout.ignore_eos and rollout.name == "hf")


def engine_settings(cfg: PPOConfig, world_size: int) -> Optional[EngineSettings]:
    """The vLLM engine of a ``rollout.name: vllm`` run on ``world_size`` ranks (None for other runs)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return None
    tp = rollout.tensor_model_parallel_size
    if world_size % tp:
        raise UserError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {world_size} "
                        f"ranks of this run; use a divisor of {world_size} (1 gives every rank an engine)")
    dtype = ROLLOUT_DTYPES[engine_dtype(cfg)]
    return EngineSettings(
        tensor_parallel_size=tp, dtype=dtype, gpu_memory_utilization=rollout.gpu_memory_utilization,
        kv_cache_memory_bytes=rollout.kv_cache_memory_bytes, max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_num_seqs=rollout.max_num_seqs, max_model_len=rollout.max_model_len, enforce_eager=rollout.enforce_eager,
        enable_chunked_prefill=rollout.enable_chunked_prefill, enable_prefix_caching=rollout.enable_prefix_caching,
        load_format=engine_load_format(rollout.load_format), sleep_between_generations=rollout.free_cache_engine,
        calculate_log_probs=rollout.calculate_log_probs, logprobs_mode=rollout.logprobs_mode,
        ignore_eos=rollout.ignore_eos, seed=rollout.seed,
        rows_per_generation=cfg.data.gen_batch_size * rollout.n * tp // world_size,
    )


def engine_load_format(value: str) -> str:
    """vLLM's name for verl's ``rollout.load_format``: verl's dummy_* formats start the engine with
    random weights (``dummy``), its hf / dtensor formats read the folder (``auto``)."""
    if value.startswith("dummy"):
        return "dummy"
    return "auto" if value in ("hf", "dtensor") else value


def _budget(use_dynamic_bsz: bool, max_tokens: int) -> Optional[int]:
    return max_tokens if use_dynamic_bsz else None


def _actor(cfg: PPOConfig, mini_batch_rows: int, world_size: int) -> ActorUpdateSettings:
    arf = cfg.actor_rollout_ref
    actor = arf.actor
    micro = MicroBatching(rows=actor.ppo_micro_batch_size_per_gpu,
                          max_tokens=_budget(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
                          packed=arf.model.use_remove_padding, budget_key=ACTOR_BUDGET_KEY)
    return ActorUpdateSettings(
        mini_batch_rows=mini_batch_rows, micro=micro,
        ppo_epochs=actor.ppo_epochs, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
        grad_clip=actor.grad_clip, temperature=arf.rollout.temperature, head=head_settings(cfg),
        rollout_correction=rollout_correction_settings(cfg), compute_dtype=compute_dtype(actor.fsdp_config),
        on_policy=on_policy_update(cfg) and not update_forwards_first(cfg, world_size),
        policy_loss_mode=actor.policy_loss.loss_mode, tau_pos=actor.tau_pos, tau_neg=actor.tau_neg,
        cov=_cov_settings(cfg),
    )


def _cov_settings(cfg: PPOConfig) -> Optional[CovSettings]:
    pl = cfg.actor_rollout_ref.actor.policy_loss
    if pl.loss_mode not in ("clip_cov", "kl_cov"):
        return None
    ratio = pl.clip_cov_ratio if pl.loss_mode == "clip_cov" else pl.kl_cov_ratio
    return CovSettings(pl.loss_mode, ratio, pl.clip_cov_lb, pl.clip_cov_ub, pl.ppo_kl_coef, cfg.data.seed)


def overlong_penalty(cfg: PPOConfig) -> Optional[OverlongPenalty]:
    """DAPO's overlong punishment (``reward_model.reward_kwargs``), where it is enabled and the scores
    are a reward function's (a reward model's keep none, as in verl)."""
    kwargs = cfg.reward_model.reward_kwargs
    buffer = kwargs.overlong_buffer_cfg
    if not buffer.enable or cfg.reward_model.enable:
        return None
    max_length = kwargs.max_resp_len if kwargs.max_resp_len is not None else cfg.data.max_response_length
    return OverlongPenalty(max_length, buffer.len, buffer.penalty_factor, buffer.log)


def rollout_correction_settings(cfg: PPOConfig) -> RolloutCorrectionSettings:
    """The parsed correction of an offline or vLLM run; off with hf, where the actor samples (mu = pi_old)."""
    rc = cfg.algorithm.rollout_correction
    if cfg.actor_rollout_ref.rollout.name == "hf" or not rollout_correction_active(cfg):
        return RolloutCorrectionSettings()
    # Thresholds of switched-off parts are not checked (as verl), so not parsed either.
    upper, lower = parse_is_threshold(rc.rollout_is_threshold) if rc.rollout_is is not None else (2.0, None)
    return RolloutCorrectionSettings(
        rollout_is=rc.rollout_is, is_threshold=upper, is_threshold_lower=lower,
        batch_normalize=rc.rollout_is_batch_normalize,
        rs=parse_rs(rc.rollout_rs, rc.rollout_rs_threshold) if rc.rollout_rs is not None else (),
        bypass_mode=rc.bypass_mode, loss_type=rc.loss_type,
    )


def _critic_micro(cfg: PPOConfig) -> MicroBatching:
    critic = cfg.critic
    return MicroBatching(rows=critic.ppo_micro_batch_size_per_gpu,
                         max_tokens=_budget(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
                         packed=critic.model.use_remove_padding, budget_key=CRITIC_BUDGET_KEY)


def _critic(cfg: PPOConfig, mini_batch_rows: int) -> CriticUpdateSettings:
    critic = cfg.critic
    return CriticUpdateSettings(
        mini_batch_rows=mini_batch_rows, micro=_critic_micro(cfg), ppo_epochs=critic.ppo_epochs, cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode, grad_clip=critic.grad_clip,
        compute_dtype=compute_dtype(critic.model.fsdp_config),
    )


def compute_dtype(fsdp: FSDPConfig) -> torch.dtype:
    """The dtype a model's forward and backward run in: FSDP2's mixed-precision parameter dtype,
    else float32 (its parameters' dtype, which under mixed precision are the fp32 masters)."""
    return PARAM_DTYPES[fsdp.dtype] or torch.float32


def _forwards(cfg: PPOConfig, world_size: int) -> ForwardSettings:
    arf = cfg.actor_rollout_ref
    rollout, ref, packed = arf.rollout, arf.ref, arf.model.use_remove_padding
    return ForwardSettings(
        old_log_prob=MicroBatching(
            rows=rollout.log_prob_micro_batch_size_per_gpu, packed=packed,
            max_tokens=_budget(rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu),
            budget_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        ref=MicroBatching(
            rows=ref.log_prob_micro_batch_size_per_gpu, packed=packed,
            max_tokens=_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
            budget_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
        values=_critic_micro(cfg),
        reward_model=RewardModelForward(
            MicroBatching(rows=cfg.reward_model.micro_batch_size_per_gpu, packed=cfg.reward_model.model.use_remove_padding),
            prompt_length=cfg.reward_model.rollout.prompt_length, response_length=cfg.reward_model.rollout.response_length),
        temperature=rollout.temperature, head=head_settings(cfg),
        old_log_prob_from_rollout=rollout_correction_settings(cfg).bypass_mode,
        old_log_prob_from_update=update_forwards_first(cfg, world_size) or on_policy_update(cfg),
        update_forwards_first=update_forwards_first(cfg, world_size),
        sum_pi_squared=measures_sum_pi_squared(cfg),
    )


def head_settings(cfg: PPOConfig) -> HeadSettings:
    """The LM head of the actor and reference: fused (``use_fused_kernels``) and the entropy options."""
    model, actor = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    return HeadSettings(fused=model.use_fused_kernels, entropy_chunking=actor.entropy_from_logits_with_chunking,
                        entropy_chunk_rows=actor.entropy_from_logits_chunk_size,
                        entropy_checkpointing=actor.entropy_checkpointing)


def _guard(cfg: PPOConfig) -> GuardSettings:
    """The guard's thresholds; KL guards need a reference model and are off without one. A
    rollback restores the initial weights from the reference, or a LoRA actor's starting adapters."""
    initial = uses_reference(cfg) or lora_enabled(cfg.actor_rollout_ref.model)
    settings = GuardSettings(**dataclasses.asdict(cfg.trainer.guard), initial_weights=initial)
    if uses_reference(cfg):
        return settings
    return dataclasses.replace(settings, early_stop_kl=None, rollback_kl=None)
