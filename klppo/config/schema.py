"""The typed config tree.

Every field uses verl's key name for the same knob (``actor_rollout_ref.actor.clip_ratio``,
``algorithm.kl_ctrl.target_kl``, ...), so a verl YAML file runs with at most a path changed.
Each field carries a one-line docstring (the comment above it). ``None`` means "derive from
another field" (documented on the field) and is resolved by ``klppo.config.parse``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from klppo.config.health import GoldRewardConfig, GuardConfig
from klppo.config.rollout import RolloutConfig, ValKwargsConfig  # noqa: F401 (part of the tree)

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k2+", "k3+", "low_var_kl+"]
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                     "grpo_vectorized", "rloo_vectorized", "opo", "grpo_passk", "gpg", "remax",
                     "optimal_token_baseline", "tir_optimal_token_baseline"]


@dataclass
class DataConfig:
    # Parquet file(s) of RL prompts (verl's RLHFDataset columns, optionally with `responses`).
    train_files: Union[str, list[str]] = ""
    # Parquet file(s) for validation; None disables validation.
    val_files: Optional[Union[str, list[str]]] = None
    # Column holding the chat messages of the prompt.
    prompt_key: str = "prompt"
    # Column whose value picks each row's reward function (handed to it as data_source), as verl's
    # reward managers read it; validation's metrics stay grouped by the data_source column.
    reward_fn_key: str = "data_source"
    # Extra arguments to the chat template when it renders chat-message prompts (as verl passes
    # them), e.g. {enable_thinking: false} for Qwen3 or {reasoning_effort: medium} for gpt-oss.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Longest prompt in tokens (after the chat template); longer ones are truncated or filtered.
    max_prompt_length: int = 512
    # Longest response in tokens (generated, or recorded responses truncated to it).
    max_response_length: int = 512
    # Prompts per PPO step (before rollout.n responses each).
    train_batch_size: int = 1024
    # Prompts per generation batch of dynamic sampling (algorithm.filter_groups): each step draws
    # batches of this many until train_batch_size prompts have rewards with spread. null =
    # train_batch_size; another value needs algorithm.filter_groups.enable.
    gen_batch_size: Optional[int] = None
    # Prompts per validation batch (over all ranks); None = the whole validation set at once.
    val_batch_size: Optional[int] = None
    # What to do with an over-long prompt (as verl): error, `left` cuts its start, `right` its end,
    # `middle` its middle (the first and last halves of data.max_prompt_length stay).
    truncation: Literal["error", "left", "right", "middle"] = "error"
    # Drop prompts longer than max_prompt_length instead of truncating them.
    filter_overlong_prompts: bool = False
    # Shuffle prompts each epoch (deterministically from `seed`).
    shuffle: bool = True
    # Seed of the data order; also seeds sampling and initialisation of new heads.
    seed: int = 1
    # Train (validate) on at most this many rows of data.train_files (val_files); -1: every row.
    # The rows are drawn at random (seeded by `seed`) with `shuffle`, else the first ones, as in verl.
    train_max_samples: int = -1
    val_max_samples: int = -1


@dataclass
class FSDPConfig:
    # Keep parameters on CPU between the phases that use them (a no-op on CPU runs).
    param_offload: bool = False
    # Keep optimiser state on CPU between updates (a no-op on CPU runs).
    optimizer_offload: bool = False
    # FSDP2's CPUOffloadPolicy: parameters, gradients and optimiser state live on CPU.
    offload_policy: bool = False
    # Free gathered parameters after each forward (FSDP2).
    reshard_after_forward: bool = True
    # Ranks per FSDP shard group; -1 = all ranks (HSDP when it divides the world).
    fsdp_size: int = -1
    # Mixed-precision compute dtype; master weights stay fp32 and gradients are reduced in fp32.
    # float16 only for frozen models (reference, reward models): training in it would need a
    # gradient scaler, which klppo does not have.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class FusedKernelOptionsConfig:
    # Backend of the fused kernels; klppo has the torch one only (verl also offers triton).
    impl_backend: str = "torch"


@dataclass
class LoraKeys:
    """verl's LoRA keys, flat in every model section that trains (actor_rollout_ref.model,
    critic.model, and klppo sft's and rm's model): the sections inherit them."""

    # LoRA rank; 0 trains every parameter. Above 0 only LoRA adapters (peft) train, plus the new
    # head of a critic or reward model; the adapter alone is also exported next to the model.
    lora_rank: int = 0
    # LoRA scaling alpha (the update is scaled by lora_alpha / lora_rank).
    lora_alpha: int = 16
    # Modules that get adapters: "all-linear" (every linear layer of the backbone: nn.Linear and
    # GPT-2's Conv1D), a list of module names such as [q_proj, v_proj], or a regex that peft
    # matches in full against module names (model.layers.0.self_attn.q_proj, or without the
    # backbone's prefix). Only linear layers can be adapted; others are refused by name.
    target_modules: Union[str, list[str]] = "all-linear"
    # Modules never given adapters (names or a regex, matched as target_modules); None excludes none.
    exclude_modules: Optional[Union[str, list[str]]] = None
    # Folder of a saved LoRA adapter (peft's layout) to start from; it turns LoRA on, and its
    # adapter_config.json decides rank, alpha and target modules. An adapter with options klppo
    # does not model (biases, modules_to_save outside a new head, trainable tokens, DoRA, ...) or
    # with tensors it would not load is refused. None starts new adapters.
    lora_adapter_path: Optional[str] = None


@dataclass
class ModelConfig(LoraKeys):
    # (LoRA: with lora_rank > 0 the reference policy is the actor with its adapters at their
    # starting values, ref.lora_reference, so no second model is loaded.)
    # Local Hugging Face folder of the model (no hub downloads).
    path: str = ""
    # A folder with the tokenizer, where it is not saved next to the model; None: model.path. Every
    # model of the run reads the token ids it gives, and the exported actor carries it.
    tokenizer_path: Optional[str] = None
    # A Jinja chat template that replaces the tokenizer's own for every chat prompt of the run (as
    # verl's); the exported actor's tokenizer carries it. None: the template saved with the tokenizer.
    custom_chat_template: Optional[str] = None
    # Recompute activations in the backward pass to save memory.
    enable_gradient_checkpointing: bool = False
    # Pack sequences without padding (sequence packing).
    use_remove_padding: bool = False
    # Compute log-probs and entropy through the LM head one vocabulary slice at a time, never
    # holding the (tokens x vocab) logits whole. None (klppo's default; verl's is false): on
    # wherever the model's head allows it (a Linear head the model does not rescale afterwards).
    use_fused_kernels: Optional[bool] = None
    fused_kernel_options: FusedKernelOptionsConfig = field(default_factory=FusedKernelOptionsConfig)


@dataclass
class OptimConfig:
    # The optimiser: a class of optimizer_impl (verl's keys), e.g. AdamW, Adam or SGD of torch.optim;
    # AdamW8bit of bitsandbytes.optim or torchao.optim where installed.
    optimizer: str = "AdamW"
    # The module it comes from.
    optimizer_impl: str = "torch.optim"
    # Peak learning rate.
    lr: float = 1e-6
    # Weight decay (never on biases and norm weights).
    weight_decay: float = 0.01
    # Betas of an Adam-like optimiser (its name has "adam"), as verl passes them.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # More arguments of the optimiser (e.g. {momentum: 0.9} for SGD); they win over those above.
    override_optimizer_config: Optional[dict[str, Any]] = None
    # Warm-up steps; -1 = use lr_warmup_steps_ratio.
    lr_warmup_steps: int = -1
    # Warm-up as a fraction of the total training steps.
    lr_warmup_steps_ratio: float = 0.0
    # Schedule after warm-up.
    warmup_style: Literal["constant", "cosine"] = "constant"
    # Floor of the cosine schedule as a fraction of lr.
    min_lr_ratio: float = 0.0


@dataclass
class PolicyLossConfig:
    # The policy loss, as verl computes each: vanilla (PPO's clipped surrogate with dual clip), gspo
    # (sequence-level ratios, Zheng et al. 2025; the paper's clip_ratio_low/high are 3e-4/4e-4),
    # cispo (REINFORCE weighted by the clipped, detached ratio, MiniMax 2025), sapo (a smooth gate
    # on the ratio, actor.tau_pos/tau_neg), gpg (the plain policy gradient) or geo_mean (GMPO: the
    # geometric mean of a sequence's clipped ratios).
    # clip_cov and kl_cov (Cui et al. 2025) hold back the tokens whose log-prob and advantage covary
    # most, picked over the whole mini-batch (verl: within each micro-batch), which costs one no-grad
    # forward per mini-batch.
    loss_mode: Literal["vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean", "clip_cov", "kl_cov"] = "vanilla"
    # clip_cov: the share of tokens whose gradient is cut, picked at random among those with a
    # covariance in (clip_cov_lb, clip_cov_ub) that the ratio clip left alone.
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    # kl_cov: the share of tokens, those of largest covariance, whose loss gets ppo_kl_coef * |log pi - log pi_old|.
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


@dataclass
class ActorConfig:
    # Training engine: FSDP2 (`fsdp` is accepted as verl's spelling of the same; verl's `megatron`
    # trains with FSDP2 too, with a warning).
    strategy: Literal["fsdp", "fsdp2", "megatron"] = "fsdp2"
    # Prompts per mini-batch (each optimiser step sees ppo_mini_batch_size * rollout.n samples).
    ppo_mini_batch_size: int = 256
    # Samples per forward/backward on one device; None = the whole mini-batch.
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Size micro-batches by a token budget instead of a sample count.
    use_dynamic_bsz: bool = False
    # Token budget of one micro-batch when use_dynamic_bsz is on.
    ppo_max_token_len_per_gpu: int = 16384
    # PPO clip range (used for both sides unless clip_ratio_low/high are set).
    clip_ratio: float = 0.2
    # Lower clip range; None = clip_ratio.
    clip_ratio_low: Optional[float] = None
    # Upper clip range; None = clip_ratio.
    clip_ratio_high: Optional[float] = None
    # Dual-clip constant c > 1 bounding the loss for negative advantages (Ye et al. 2020).
    clip_ratio_c: float = 3.0
    # How token losses are reduced to one number (GSPO's and SAPO's policy losses are always
    # seq-mean-token-mean and GMPO's a mean over sequences, as verl's).
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # SAPO's gate temperatures (policy_loss.loss_mode=sapo) for tokens with a positive / other
    # advantage: larger fades a token's gradient sooner as its ratio leaves 1.
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # Weight of the entropy bonus (subtracted from the loss).
    entropy_coeff: float = 0.0
    # Add a KL(pi || ref) loss term to the actor loss (GRPO style).
    use_kl_loss: bool = False
    # Weight of the KL loss.
    kl_loss_coef: float = 0.001
    # KL estimator of the KL loss.
    kl_loss_type: KLPenalty = "low_var_kl"
    # Passes over each batch.
    ppo_epochs: int = 1
    # Max global gradient norm.
    grad_clip: float = 1.0
    # Compute the entropy from the logits in chunks of entropy_from_logits_chunk_size tokens.
    entropy_from_logits_with_chunking: bool = False
    # Tokens per chunk of the chunked entropy.
    entropy_from_logits_chunk_size: int = 2048
    # Recompute the entropy in the backward pass instead of keeping its activations.
    entropy_checkpointing: bool = False
    # Measure each response token's sum of squared probabilities in pi_old's forward: the optimal
    # token baseline reads it (it is on for those estimators whatever this says), and every step
    # logs verl's variance_proxy/ metrics from it. pi_old then always has its own forward.
    calculate_sum_pi_squared: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    # Engine of the reference model.
    strategy: Literal["fsdp", "fsdp2", "megatron"] = "fsdp2"
    # Samples per no-grad reference forward; None = all at once.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Size reference micro-batches by tokens; None = actor.use_dynamic_bsz (as verl).
    log_prob_use_dynamic_bsz: Optional[bool] = None
    # Token budget of one reference micro-batch; None = actor.ppo_max_token_len_per_gpu (as verl).
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # A LoRA actor's reference (a klppo key): starting_adapter, the actor as it started (the
    # adapters of model.lora_adapter_path; new adapters add nothing, so the base model), so the
    # KL to the reference is 0 before the first update; base, the base model without adapters
    # (verl's reference, also with lora_adapter_path). Either costs no second model.
    lora_reference: Literal["starting_adapter", "base"] = "starting_adapter"
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    # Seconds a collective waits for the other ranks before the run fails (NCCL, and gloo on
    # CPU). Every model of a klppo run shares this one process group.
    nccl_timeout: int = 600


@dataclass
class CriticModelConfig(LoraKeys):
    # Backbone of the critic; None = the actor's model.path.
    path: Optional[str] = None
    # Recompute activations in the backward pass.
    enable_gradient_checkpointing: bool = False
    # Pack sequences without padding.
    use_remove_padding: bool = False
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    # Engine of the critic.
    strategy: Literal["fsdp", "fsdp2", "megatron"] = "fsdp2"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=_critic_optim)
    # Prompts per critic mini-batch; None = the actor's.
    ppo_mini_batch_size: Optional[int] = None
    # Samples per critic forward/backward; None = the whole mini-batch.
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Size critic micro-batches by tokens; None = actor.use_dynamic_bsz (as verl).
    use_dynamic_bsz: Optional[bool] = None
    # Token budget of one critic micro-batch (values and update).
    ppo_max_token_len_per_gpu: int = 32768
    # Critic passes over each batch; None = the actor's ppo_epochs.
    ppo_epochs: Optional[int] = None
    # Max global gradient norm of the critic.
    grad_clip: float = 1.0
    # Value clip range around the old values.
    cliprange_value: float = 0.5
    # How token value losses are reduced; None = actor.loss_agg_mode (as verl).
    loss_agg_mode: Optional[LossAggMode] = None


@dataclass
class RewardModelInnerConfig:
    # Local folder of a sequence-classification reward model.
    path: Optional[str] = None
    # Further reward models (same tokenizer). Their raw scores are averaged with path's; with
    # rank_responses each model's ranking of a prompt's responses counts as one annotator's,
    # and the rankings are distilled together (method below).
    extra_paths: list[str] = field(default_factory=list)
    # Score packed sequences without padding.
    use_remove_padding: bool = False
    # FSDP2 options of the reward models (offload, sharding, dtype), as the actor's.
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RewardModelRolloutConfig:
    # Longest prompt the reward model sees, in its tokens (a longer one keeps its last tokens);
    # None = data.max_prompt_length. verl sizes its reward-model server with it.
    prompt_length: Optional[int] = None
    # Longest response the reward model sees (a longer one keeps its first tokens);
    # None = actor_rollout_ref.rollout.response_length.
    response_length: Optional[int] = None


@dataclass
class RankingRewardConfig:
    # How offline rankings become one scalar reward per response: Bradley-Terry strengths
    # from the pairwise comparisons a ranking implies, or Plackett-Luce from the whole order.
    method: Literal["bradley_terry", "plackett_luce"] = "bradley_terry"
    # Multiplier of the (log-)strengths.
    scale: float = 1.0
    # Subtract each prompt's mean so rewards are relative within the prompt.
    center: bool = True


@dataclass
class OverlongBufferConfig:
    # DAPO's soft overlong punishment (Yu et al. 2025; verl's dapo reward manager): a response
    # longer than max_resp_len - len tokens loses (length - (max_resp_len - len)) / len x
    # penalty_factor from its reward function's score, the full penalty_factor at max_resp_len.
    enable: bool = False
    # Tokens of the buffer before max_resp_len in which the penalty grows.
    len: int = 4096
    # The penalty at max_resp_len.
    penalty_factor: float = 1.0
    # Log each response's penalty as the reward components overlong_reward and overlong (0/1).
    log: bool = False


@dataclass
class RewardKwargsConfig:
    # verl's reward_model.reward_kwargs, as its dapo reward manager takes them.
    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # The length the overlong buffer ends at; None = data.max_response_length.
    max_resp_len: Optional[int] = None


@dataclass
class RewardModelConfig:
    # Score responses with the reward model at model.path instead of a reward function.
    enable: bool = False
    # With enable: rank each prompt's rollout.n responses by the reward model's scores and
    # distil the ranking into rewards (method below) instead of using the raw scores.
    rank_responses: bool = False
    # How rankings become rewards: of offline data with `ranking` / `rankings` /
    # `chosen`+`rejected`, and of responses ranked by the reward model (rank_responses).
    ranking: RankingRewardConfig = field(default_factory=RankingRewardConfig)
    model: RewardModelInnerConfig = field(default_factory=RewardModelInnerConfig)
    # Samples per reward-model forward.
    micro_batch_size_per_gpu: Optional[int] = None
    # Truncation lengths of the reward model's inputs (verl's reward_model.rollout section).
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    # Shaping of the reward function's scores (DAPO's overlong punishment), whatever reward_manager names.
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)


@dataclass
class CustomRewardFunctionConfig:
    # Python file defining the reward function; None = built-in rules chosen by data_source.
    path: Optional[str] = None
    # Name of the function in that file: f(data_source, solution_str, ground_truth, extra_info);
    # it may be async def (a batch's calls are awaited together).
    name: str = "compute_score"
    # Keyword arguments passed on every call besides those four (as verl passes them).
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class KLControlConfig:
    # Fixed coefficient, or adaptive (Ziegler et al. 2019) towards target_kl.
    type: Literal["fixed", "adaptive"] = "fixed"
    # The (initial) KL coefficient beta.
    kl_coef: float = 0.001
    # Steps over which the adaptive controller closes its error.
    horizon: int = 10000
    # KL per token the adaptive controller aims at.
    target_kl: float = 0.1
    # Offline runs (rollout.name: offline): how the KL(pi || ref) that the adaptive controller and
    # the KL guards read is measured. Recorded responses were not sampled from the policy, so
    # their log-ratio to the reference estimates nothing (logged as actor/kl_to_ref_recorded).
    # sampled: the policy samples rollout.n responses for each of probe_prompts prompts of the step
    # and the KL is measured on them (k3, unbiased and low-variance there); importance_weighted: on the recorded responses, reweighted by
    # pi / mu (needs the rollout_log_probs column); auto: importance_weighted where every row has
    # rollout_log_probs (and rollout correction's bypass mode is off), sampled otherwise.
    offline_kl: Literal["auto", "sampled", "importance_weighted"] = "auto"
    # Prompts of each step the sampled probe generates for (rollout.n responses each).
    probe_prompts: int = 8
    # Sample the offline KL every this many steps (the controller and the KL guards act on those),
    # and on the step after each checkpoint (its KL certifies the checkpoint for rollbacks); null:
    # every step with an adaptive controller reading it (the KL in the reward), else every 4th.
    probe_every: Optional[int] = None


@dataclass
class RolloutCorrectionConfig:
    # Importance weights pi_old / mu on the policy loss: null (none), per token, or one per sequence.
    rollout_is: Optional[Literal["token", "sequence"]] = None
    # A number truncates the weights at it (TIS); "lower_upper" (e.g. "0.5_5.0") zeroes those outside (IcePop).
    rollout_is_threshold: Union[float, str] = 2.0
    # Divide the weights by their mean over the batch (tokens, or sequences for rollout_is=sequence).
    rollout_is_batch_normalize: bool = False
    # Rejection criteria, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3; null = none.
    rollout_rs: Optional[str] = None
    # One bound for all criteria or one each (comma-separated); k1 takes "lower_upper" on mu / pi_old.
    rollout_rs_threshold: Optional[Union[float, str]] = None
    # Take pi_old = mu (the recorded log-probs) and skip the old log-prob forward; weights use the current policy.
    bypass_mode: bool = False
    # Policy loss in bypass mode: ppo_clip (the ratio to mu is clipped) or reinforce (-A log pi, weighted).
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"


# What dynamic sampling compares within a group, besides a reward component's name: the response's
# score ("reward", verl 0.9.1's default, "score" and "seq_reward" name it), or its reward after the
# KL penalty ("seq_final_reward").
SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476; verl's recipe/dapo), for group estimators."""

    # Drop the prompts whose responses' rewards all tie (their advantages are 0) and draw further
    # batches of data.gen_batch_size prompts until data.train_batch_size prompts with spread are kept.
    enable: bool = False
    # What must differ within a group: reward / score / seq_reward (the response's score, the sum of
    # its token-level scores), seq_final_reward (its reward after the KL penalty, the same unless
    # algorithm.use_kl_in_reward), or the name of a numeric entry of the dict the reward function
    # returns (verl's reward_extra_info, e.g. "acc" as verl's DAPO recipe uses it).
    metric: Optional[str] = "reward"
    # Most generation batches one step may draw; 0 or less: no limit (offline: one epoch of the data).
    max_num_gen_batches: int = 0
    # verl's cap on generation batches in flight at once; klppo draws one at a time, so it has no effect.
    max_inflight_gen_batches: int = 1


@dataclass
class PFPPOConfig:
    # How a response's score weighs its chance to be drawn: pow (|score|^weight_pow), max_min (only
    # the batch's best and worst scores), max_random (the best 0.4, the others 0.1), as verl's.
    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    # The exponent of pow.
    weight_pow: float = 2.0


@dataclass
class AlgorithmConfig:
    # Discount factor of GAE.
    gamma: float = 1.0
    # GAE lambda.
    lam: float = 1.0
    # Advantage estimator; gae needs a critic, the others do not: grpo (and grpo_vectorized, its
    # variance floored), rloo (rloo_vectorized: 0 for a group of one), reinforce_plus_plus(_baseline),
    # opo (a length-weighted group baseline), grpo_passk (only each group's best answer, by its
    # margin over the second), gpg (the group-centred score scaled up by the share of non-zero scores),
    # remax (the score of a greedy response to the prompt, generated each step, as the baseline).
    adv_estimator: AdvEstimator = "gae"
    # Divide GRPO advantages by the group's std (grpo, grpo_vectorized, grpo_passk).
    norm_adv_by_std_in_grpo: bool = True
    # Subtract beta * KL(old || ref) from the token rewards.
    use_kl_in_reward: bool = False
    # KL estimator used in the reward.
    kl_penalty: KLPenalty = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # DAPO's dynamic sampling: train only on prompts whose responses' rewards differ.
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # Off-policy correction for responses sampled by another policy mu (offline data's rollout_log_probs).
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # PF-PPO (policy filtration, verl's): with gae, each step trains on a batch of the same size drawn
    # with replacement from its responses, weighted by their scores (algorithm.pf_ppo).
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)


@dataclass
class TrainerConfig:
    # Passes over the training data. With algorithm.filter_groups a pass counts generation batches
    # (data.gen_batch_size prompts) as steps, and a step may draw several: more passes are read.
    total_epochs: int = 30
    # Stop after this many PPO steps; None = total_epochs worth of steps.
    total_training_steps: Optional[int] = None
    # Project name (used in the default output folder and by loggers).
    project_name: str = "klppo"
    # Experiment name (used in the default output folder and by loggers).
    experiment_name: str = "run"
    # Where metrics go besides <default_local_dir>/metrics.jsonl; a plain string is a list of one.
    logger: Union[str, list[str]] = field(default_factory=lambda: ["console"])
    # Devices per node (checked against the actual world).
    n_gpus_per_node: int = 1
    # Nodes (checked against the actual world).
    nnodes: int = 1
    # Steps that train the critic only; actor updates start after them (as verl's critic_warmup).
    critic_warmup: int = 0
    # Save a checkpoint every this many steps (and at the end); -1 = only at the end.
    save_freq: int = -1
    # Validate every this many steps (and at the end); -1 = never.
    test_freq: int = -1
    # Validate once before training.
    val_before_train: bool = True
    # Write each step's responses to <dir>/<step>.jsonl, verl's fields (input, output, gts, score,
    # step, and the reward function's other numbers); null writes none.
    rollout_data_dir: Optional[str] = None
    # The same for each validation's responses (validation before training is step 0).
    validation_data_dir: Optional[str] = None
    # Validation responses shown at each validation (console, TensorBoard text, a W&B table),
    # picked as verl picks them: the same ones every time; 0 shows none.
    log_val_generations: int = 0
    # Only validate the model (data.val_files, as val_before_train does) and stop: no training,
    # no checkpoint, no export. Measures a model, e.g. one trained elsewhere, with the run's reward.
    val_only: bool = False
    # Output folder for checkpoints, metrics and exports; None = checkpoints/<project>/<experiment>.
    default_local_dir: Optional[str] = None
    # auto: continue from the latest checkpoint if there is one; disable: start fresh;
    # resume_path: continue from resume_from_path.
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    # Checkpoint folder to resume from when resume_mode is resume_path.
    resume_from_path: Optional[str] = None
    # Keep only the newest N checkpoints; None keeps all.
    max_actor_ckpt_to_keep: Optional[int] = None
    # cpu, cuda, or auto (cuda when available).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Reorder each batch so every data-parallel rank gets the same number of sequences and a
    # similar token count (logs global_seqlen/*); takes effect on multi-process runs, a single
    # process has nothing to balance.
    balance_batch: bool = False
    # KL, NaN and entropy guards (early stop, rollback, skipped updates, warnings).
    guard: GuardConfig = field(default_factory=GuardConfig)
    # The memory plan at the start of the run (klppo plan's estimate, before any model loads):
    # error stops a run whose peak estimate exceeds the device's memory by more than the
    # estimate's calibrated error (klppo.plan.check.ERROR_MARGIN) and warns nearer the limit;
    # warn only warns; off skips it (YAML reads a bare off as false, which means off too; true: error).
    # An input the plan cannot read leaves the refusal to the run's own checks.
    plan_check: Union[Literal["error", "warn", "off"], bool] = "error"
    # Memory per device the plan checks against ("80GiB", "24GB", or bytes); None = what this
    # machine has free (CUDA: the device's free memory; CPU: MemAvailable shared by a node's ranks).
    plan_device_memory: Optional[Union[str, int]] = None
    # Held-out gold reward measured beside the training reward at validation (reward hacking).
    gold_reward: GoldRewardConfig = field(default_factory=GoldRewardConfig)


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
