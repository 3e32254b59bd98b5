"""Why each verl key that klppo does not act on has no effect, grouped by what it configures.

A rule is ``(patterns, reason)`` or ``(patterns, reason, REFUSE)``; patterns are shell globs
over dotted keys (``*`` crosses dots) and the first rule that matches a key wins. At the
``FOLLOWS`` entry, a key whose verl default copies a klppo field (``${oc.select:X,...}``) gets
"klppo reads X" (the rules above it say something more precise for their keys). ``REFUSE``
marks keys whose non-default value would change what is trained (another loss, other data,
other prompts): those are errors naming the key, not warnings, since ignoring them would
train something the user did not ask for. Every key in verl's key lists must match a rule or
be a schema field; ``tests/config/test_verl_keys.py`` walks them all.
"""

from __future__ import annotations

REFUSE = "refuse"
FOLLOWS = ((), "follows")

_ENGINE = ("vLLM/SGLang engine setting klppo does not have; its vLLM engine runs in every training process, "
           "one per tensor-parallel group, with the engine keys of actor_rollout_ref.rollout")
_RM_SERVER = "engine setting of verl's reward-model server; klppo scores reward models in-process"
_RAY = "Ray worker and resource-pool layout; klppo runs one SPMD process per device under torchrun"
_PROFILER = "profiler setting (Nsight, NPU, torch profiler); klppo has phase timers and MFU only"
_MEGATRON = "Megatron-LM engine setting; klppo trains with FSDP2"
_FSDP_TUNING = "FSDP engine tuning; klppo wraps each decoder block, then the root, with FSDP2"
_DTYPE = "klppo loads weights in fp32 and sets the mixed-precision dtype with fsdp_config.dtype"
_SEED = "klppo seeds data order, sampling and new heads from data.seed"
_ULYSSES = "Ulysses sequence parallelism; klppo keeps whole sequences on each device (same numbers)"
_TARGET = "verl's dataclass name for the section (verl's own bookkeeping)"
_CHECKPOINT = "klppo saves the complete state in one format (trainer.save_freq, max_actor_ckpt_to_keep)"
_MOE = "mixture-of-experts routing setting; klppo trains dense Hugging Face models as they are"
_VISION = "multimodal input setting; klppo trains on text prompts"
_SPEED = "a speed or memory option klppo does not have; the numbers are the same without it"
_DATA_IO = "what verl's dataset hands its workers; klppo's reader keeps the columns it needs"
_REWARD_MANAGER = ("verl's reward manager; klppo scores each response with its rule function or reward model, and "
                   "adds DAPO's overlong punishment with reward_model.reward_kwargs.overlong_buffer_cfg.enable")
_MICRO = "klppo sizes the critic's value forward by critic.ppo_micro_batch_size_per_gpu"
_NOT_IMPLEMENTED = "not implemented in klppo"

RULES: tuple[tuple, ...] = (
    # -- changes what is trained: refused when set to anything but verl's default --
    (("actor_rollout_ref.rollout.multi_turn.completion_callback",), "verl 0.4's SGLang completion callback; klppo's "
     "multi-turn loop reads Hermes tool calls (multi_turn.format)", REFUSE),
    (("algorithm.rollout_correction.rollout_token_veto_threshold",), "verl 0.6-0.7's token veto, gone from verl "
     "0.9.1 and not in klppo; reject outlier tokens with algorithm.rollout_correction.rollout_rs=token_k1", REFUSE),
    (("algorithm.rollout_correction.rollout_rs_threshold_lower",), "verl 0.6-0.7 key; verl 0.9.1 and klppo write "
     "the lower bound into algorithm.rollout_correction.rollout_rs_threshold as 'lower_upper'", REFUSE),
    (("algorithm.rollout_correction.use_policy_gradient",), "verl 0.6.1 key; set "
     "algorithm.rollout_correction.loss_type=reinforce with bypass_mode=true", REFUSE),
    (("distillation.enabled",), "on-policy distillation is not implemented in klppo", REFUSE),
    (("*.qat.enable",), "quantisation-aware training is not implemented in klppo", REFUSE),
    (("data.custom_cls.path",), "klppo reads verl's RLHFDataset columns only (no custom dataset class)", REFUSE),
    (("*.model.tokenizer_path",), "every model of a klppo run reads the actor's token ids, from "
     "actor_rollout_ref.model.tokenizer_path (or model.path)", REFUSE),
    # -- verl's bookkeeping --
    (("*._target_",), _TARGET),
    # -- profilers --
    (("*.profiler", "*.profiler.*", "global_profiler.*", "*.profile.*", "trainer.profile_steps", "trainer.*nsight_options.*",
      "trainer.npu_profile.*"), _PROFILER),
    # -- Megatron-LM --
    (("*.megatron.*", "*.optim.muon_*", "*.checkpoint.mbridge_config", "*.optim.lr_warmup_init", "*.optim.lr_decay_steps",
      "*.optim.lr_decay_style", "*.optim.min_lr", "*.optim.weight_decay_incr_style", "*.optim.lr_wsd_decay_*",
      "*.optim.use_checkpoint_opt_param_scheduler", "*.optim.use_precision_aware_optimizer", "*.optim.main_grads_dtype",
      "*.optim.exp_avg_dtype", "*.optim.exp_avg_sq_dtype", "*.optim.use_layer_wise_distributed_optimizer",
      "actor_rollout_ref.rollout.layer_name_map.*", "*.model.lora.*"), _MEGATRON),
    # -- processes, Ray, resource pools --
    (("trainer.use_legacy_worker_impl", "trainer.use_v1", "trainer.v1.*", "trainer.ray_wait_register_center_timeout",
      "trainer.esi_redundant_time", "ray_kwargs.*", "ray_init.*", "actor_rollout_ref.hybrid_engine",
      "reward_model.num_workers", "reward.num_workers", "*.enable_resource_pool", "reward_model.n_gpus_per_node",
      "reward_model.nnodes", "reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes", "transfer_queue.*",
      "*.load_weight", "data.dataloader_num_workers", "data.filter_overlong_prompts_workers", "*.use_shm",
      "actor_rollout_ref.rollout.agent.num_workers", "distillation.n_gpus_per_node", "distillation.nnodes"), _RAY),
    (("critic.nccl_timeout", "reward_model.nccl_timeout"),
     "klppo's models share one process group, whose timeout is actor_rollout_ref.nccl_timeout"),
    # -- the rollout engine --
    (("actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node",
      "actor_rollout_ref.rollout.cudagraph_capture_sizes", "actor_rollout_ref.rollout.data_parallel_size",
      "actor_rollout_ref.rollout.expert_parallel_size", "actor_rollout_ref.rollout.pipeline_model_parallel_size",
      "actor_rollout_ref.rollout.*_parallel_size", "actor_rollout_ref.rollout.scheduling_policy",
      "actor_rollout_ref.rollout.layered_summon",
      "actor_rollout_ref.rollout.disable_log_stats", "actor_rollout_ref.rollout.multi_stage_wake_up",
      "actor_rollout_ref.rollout.engine_kwargs*", "actor_rollout_ref.rollout.router_config_path",
      "actor_rollout_ref.rollout.skip_tokenizer_init", "actor_rollout_ref.rollout.checkpoint_engine.*",
      "actor_rollout_ref.rollout.update_weights_bucket_megabytes", "actor_rollout_ref.rollout.quantization*",
      "actor_rollout_ref.rollout.disaggregation.*", "actor_rollout_ref.rollout.prometheus.*",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay", "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
      "actor_rollout_ref.rollout.mtp", "actor_rollout_ref.rollout.qat", "actor_rollout_ref.rollout.full_determinism",
      "actor_rollout_ref.rollout.over_sample_rate",
      "actor_rollout_ref.rollout.trace.*",
      "actor_rollout_ref.rollout.agent.*", "actor_rollout_ref.rollout.skip_rollout",
      "actor_rollout_ref.rollout.sglang_rollout_mode", "actor_rollout_ref.rollout.server.*",
      "actor_rollout_ref.rollout.skip_dump_dir"), _ENGINE),
    (("actor_rollout_ref.rollout.use_fire_sampling",), "FIRE sampling is " + _NOT_IMPLEMENTED),
    (("data.tool_config_path", "data.function_tool_path"), "verl's dataset reads the multi-turn tools to render "
     "prompts; klppo renders them from actor_rollout_ref.rollout.multi_turn.tool_config_path and function_tool_path"),
    (("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
      "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode"), "klppo renders each tool reply with the "
     "chat template and appends its tokens to the conversation's, never re-tokenising what the policy said"),
    (("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",), "verl's rollout repeats for its interaction "
     "curriculum; klppo samples rollout.n conversations per prompt"),
    (("reward_model.rollout.*", "reward.reward_model.rollout.*", "reward_model.use_reward_loop",
      "reward_model.launch_reward_fn_async"), _RM_SERVER),
    (("distillation.*",), "on-policy distillation (distillation.enabled) is " + _NOT_IMPLEMENTED),
    (("*.qat.*",), "quantisation-aware training setting, used only with qat.enable (not implemented in klppo)"),
    (("reward_model.strategy", "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu",
      "reward_model.max_length"), "klppo sizes reward-model forwards by reward_model.micro_batch_size_per_gpu and "
     "truncates with reward_model.rollout.prompt_length/response_length"),
    (("critic.model.custom_chat_template",), "the critic reads the actor's prompt tokens, which "
     "actor_rollout_ref.model.custom_chat_template renders"),
    (("reward_model.model.input_tokenizer",), "klppo requires reward models to share the actor's tokenizer"),
    (("reward_model.model.use_fused_kernels", "critic.model.use_fused_kernels", "critic.model.fused_kernel_options.*"),
     "fused kernels serve log-probs and entropy, which only the actor and reference compute"),
    FOLLOWS,
    # -- the FSDP engine --
    (("*.fsdp_config.ulysses_sequence_parallel_size", "*.fsdp.ulysses_sequence_parallel_size",
      "*.ulysses_sequence_parallel_size"), _ULYSSES),
    (("*.fsdp_config.model_dtype", "*.fsdp.model_dtype", "*.fsdp_config.mixed_precision.*", "*.model.torch_dtype"),
     _DTYPE),
    (("*.fsdp_config.seed", "*.fsdp.seed", "*.fsdp_config.full_determinism", "*.fsdp.full_determinism",
      "*.data_loader_seed"), _SEED),
    (("*.fsdp_config.*", "*.fsdp.*", "*.use_torch_compile", "*.pad_to_length", "*.model.use_liger",
      "*.model.tiled_mlp.*", "*.model.enable_activation_offload", "actor_rollout_ref.actor.use_prefix_grouper"),
     _SPEED),
    (("actor_rollout_ref.ref.entropy_*",), "the reference model computes no entropy in klppo"),
    # -- models --
    (("*.model.hf_config_path", "*.model.external_lib", "*.model.trust_remote_code", "*.model.override_config*"),
     "klppo loads local Hugging Face folders with their own config.json and no remote code"),
    (("*.model.mtp.*", "actor_rollout_ref.model.mtp"), "multi-token prediction / speculative decoding is " + _NOT_IMPLEMENTED),
    (("*.router_replay.*",), _MOE),
    (("actor_rollout_ref.actor.freeze_vision_tower", "data.image_*", "data.video_key", "data.audio_key",
      "data.mm_processor_kwargs", "data.return_multi_modal_inputs", "*.limit_images"), _VISION),
    # -- optimiser and losses --
    (("*.optim.total_training_steps",), "verl's trainer fills it in; klppo derives it from the run length"),
    (("*.optim.num_cycles",), "klppo's cosine schedule is verl's default half cycle"),
    (("*.optim.zero_indexed_step",), "klppo counts scheduler steps from 0, as verl's default"),
    (("actor_rollout_ref.actor.policy_loss.*",),
     "parameter of one of verl's policy losses klppo does not have (DRO); klppo's vanilla, gspo, cispo, gpg and "
     "geo_mean take none, sapo takes actor.tau_pos and tau_neg, clip_cov and kl_cov their policy_loss keys"),
    (("*.loss_scale_factor",), "klppo's seq-mean-token-sum-norm divides by the response length"),
    (("actor_rollout_ref.actor.calculate_entropy",), "klppo always computes and logs the entropy"),
    (("actor_rollout_ref.actor.sum_pi_squared_checkpointing",), "klppo measures the sum of squared probabilities "
     "without a graph (in pi_old's no-grad forward), so there is nothing to checkpoint"),
    (("trainer.wandb_proxy",), "klppo's wandb logger takes the proxy from the environment (HTTPS_PROXY)"),
    (("*.shuffle",), "klppo takes each batch's mini-batches in order (verl's default)"),
    (("*.checkpoint.*",), _CHECKPOINT),
    (("actor_rollout_ref.ref.model",), "the reference is the actor's starting model (actor_rollout_ref.model.path)"),
    # -- critic --
    (("critic.enable",), "klppo trains a critic exactly when algorithm.adv_estimator is gae"),
    (("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu"), _MICRO),
    # -- rewards --
    (("reward_model.reward_manager", "reward_model.reward_loop_*", "reward.reward_manager.*", "reward_manager.*",
      "reward_model.reward_kwargs.*"), _REWARD_MANAGER),
    (("sandbox_fusion.*", "reward.sandbox_fusion.*", "reward_model.sandbox_fusion.*"),
     "code-execution rewards through SandboxFusion are " + _NOT_IMPLEMENTED),
    # -- data and trainer --
    (("data.tokenizer",), "klppo loads the tokenizer saved next to actor_rollout_ref.model.path"),
    (("data.return_raw_input_ids", "data.return_raw_chat", "data.return_full_prompt"), _DATA_IO),
    (("data.validation_shuffle",), "klppo validates in file order"),
    (("data.trust_remote_code",), "klppo loads tokenizers without remote code"),
    (("data.custom_cls.name", "data.datagen.*", "data.sampler.*"), "klppo reads its Parquet files in (shuffled) order, "
     "with no custom dataset, generator or sampler class"),
    (("trainer.default_hdfs_dir", "trainer.del_local_ckpt_after_load", "trainer.checkpoint_callback_class",
      "trainer.max_critic_ckpt_to_keep"), _CHECKPOINT),
    (("skip.*",), "verl's rollout caching for debugging"),
)

# Values of verl's that klppo's schema does not offer, with why (the config error says it in place
# of a nearest valid value): (dotted key, value) -> reason.
REFUSED_VALUES: dict[tuple[str, str], str] = {
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "bypass_mode"):
        "verl's name for the loss of bypass-mode rollout correction; set algorithm.rollout_correction.bypass_mode=true "
        "(with rollout_correction.loss_type) instead",
}
