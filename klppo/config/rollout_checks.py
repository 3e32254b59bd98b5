"""The checks and warnings of ``actor_rollout_ref.rollout`` (``config/rollout.py`` holds its keys).

The engine keys act only with ``name: vllm``; set with ``hf`` to anything but klppo's or verl's
default they are named in one warning (they configure an engine that run does not build).
"""

from __future__ import annotations

from klppo.config.lora import lora_enabled
from klppo.config.rollout import ENGINE_KEYS, HF_KEYS, ROLLOUT, RolloutConfig
from klppo.config.rollout_correction import rollout_correction_active
from klppo.config.schema import PPOConfig
from klppo.config.verl import verl_defaults

ENGINES_KLPPO_LACKS = {"sglang": "SGLang", "trtllm": "TensorRT-LLM"}  # verl's rollout names, generated with hf


def resolve_rollout_engine(rollout: RolloutConfig, max_prompt_length: int, notes: list[str]) -> None:
    """sglang and trtllm generate with hf (one warning says so); vLLM's derived lengths are filled in."""
    if rollout.name in ENGINES_KLPPO_LACKS:
        notes.append(f"warning: {ROLLOUT}.name = '{rollout.name}': generating with 'hf' (Hugging Face generate) "
                     f"instead, since klppo has no {ENGINES_KLPPO_LACKS[rollout.name]} backend; the same sampling "
                     "settings apply (temperature, top_p, top_k, n, response_length); rollout.name=vllm generates "
                     "with vLLM")
        rollout.name = "hf"
    if rollout.max_model_len is None and rollout.response_length is not None:
        rollout.max_model_len = max_prompt_length + rollout.response_length


def engine_dtype(cfg: PPOConfig) -> str:
    """The vLLM engine's weight dtype: ``rollout.dtype``, where ``auto`` is the actor's compute dtype
    (``fsdp_config.dtype``), so the sampler computes as the trainer does, but float32 for a LoRA
    actor computing in half precision.

    The engine takes each adapted weight merged, W + alpha / r * B @ A (``run/adapters.merged_weights``),
    and bf16 rounds away every change below its resolution of W, which early LoRA updates are
    (lora_B starts at zero), so a bf16 engine would sample from a policy that lags the one PPO
    trains. The fp32 engine samples from the policy of the fp32 weights the optimiser updates.
    Measured on the tiny model after 4 bf16 LoRA steps at lr 1e-5 (log-probs of sampled tokens):
    the fp32 merge agreed with the fp32 adapters to 1e-6, and its change from the base was the
    update's; the bf16 merge's change pointed along the update's at cos 0.22. The bf16 actor's own
    pi_old, adapters apart but rounded in every layer, is as far (7e-4) from either engine, so
    bf16 runs keep a sampler-trainer gap of that size either way. The price is the engine's
    weights in fp32: twice their memory, and slower generation (README, "vLLM rollouts")."""
    rollout, fsdp = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor.fsdp_config
    if rollout.dtype != "auto":
        return rollout.dtype
    if lora_enabled(cfg.actor_rollout_ref.model) and fsdp.dtype != "float32":
        return "float32"
    return fsdp.dtype


def engine_problems(cfg: PPOConfig) -> list[tuple[tuple[str, ...], str]]:
    """(keys, message) of every engine key whose value cannot work (checked whatever the engine)."""
    rollout, out = cfg.actor_rollout_ref.rollout, []
    if rollout.tensor_model_parallel_size < 1:
        out.append(((f"{ROLLOUT}.tensor_model_parallel_size",), f"{ROLLOUT}.tensor_model_parallel_size = "
                    f"{rollout.tensor_model_parallel_size} must be >= 1 (ranks per engine)"))
    if not 0 < rollout.gpu_memory_utilization <= 1:
        out.append(((f"{ROLLOUT}.gpu_memory_utilization",), f"{ROLLOUT}.gpu_memory_utilization = "
                    f"{rollout.gpu_memory_utilization!r} must lie in (0, 1], e.g. 0.5"))
    for key in ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_bytes"):
        value = getattr(rollout, key)
        if value is not None and value < 1:
            out.append(((f"{ROLLOUT}.{key}",), f"{ROLLOUT}.{key} = {value} must be >= 1"))
    if rollout.name == "vllm" and rollout_correction_active(cfg) and not rollout.calculate_log_probs:
        out.append(((f"{ROLLOUT}.calculate_log_probs", "algorithm.rollout_correction"),
                    f"algorithm.rollout_correction needs the engine's log-probs of the sampled tokens; set "
                    f"{ROLLOUT}.calculate_log_probs=true, or switch the correction off"))
    if raw_log_probs_off_temperature(rollout) and rollout_correction_active(cfg):
        out.append(((f"{ROLLOUT}.logprobs_mode", "algorithm.rollout_correction"),
                    f"{ROLLOUT}.logprobs_mode = 'raw_logprobs' at temperature = {rollout.temperature} gives log softmax(z), "
                    f"while the trainer's pi_old is log softmax(z / T), so algorithm.rollout_correction's weights and "
                    f"rejections would be biased; set {ROLLOUT}.logprobs_mode=processed_logprobs, or temperature=1.0"))
    needed = cfg.data.max_prompt_length + (rollout.response_length or 0)
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        out.append(((f"{ROLLOUT}.max_model_len",), f"{ROLLOUT}.max_model_len = {rollout.max_model_len} is shorter "
                    f"than data.max_prompt_length + rollout.response_length = {needed}; raise it or leave it null"))
    return out


MULTI_TURN = f"{ROLLOUT}.multi_turn"


def multi_turn_problems(cfg: PPOConfig) -> list[tuple[tuple[str, ...], str]]:
    """(keys, message) of multi-turn settings that cannot work: where its turns are generated, and limits below 1."""
    rollout, mt, out = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.rollout.multi_turn, []
    for key in ("max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length"):
        value = getattr(mt, key)
        if value is not None and value < 1:
            out.append(((f"{MULTI_TURN}.{key}",), f"{MULTI_TURN}.{key} = {value} must be >= 1"
                        + (" (or null: no limit)" if key.endswith("_turns") else "")))
    if not mt.enable:
        if rollout.agent.default_agent_loop == "tool_agent":
            out.append(((f"{ROLLOUT}.agent.default_agent_loop", f"{MULTI_TURN}.enable"),
                        f"{ROLLOUT}.agent.default_agent_loop = 'tool_agent' makes every row without an agent_name a "
                        f"conversation with tools (as verl runs it), but {MULTI_TURN}.enable is false; set it to true "
                        "(with multi_turn.tool_config_path)"))
        return out
    enabled = f"{MULTI_TURN}.enable"
    if rollout.name == "offline":
        out.append(((enabled, f"{ROLLOUT}.name"), f"{enabled} = true needs generated conversations, but "
                    f"{ROLLOUT}.name = 'offline' reads recorded responses; set {ROLLOUT}.name=hf"))
    if rollout.hf_decoding in ("static", "compiled"):
        out.append(((enabled, f"{ROLLOUT}.hf_decoding"), f"{ROLLOUT}.hf_decoding = '{rollout.hf_decoding}' sizes one "
                    f"static cache per batch shape, and a conversation's length changes at every turn; with "
                    f"{enabled} set {ROLLOUT}.hf_decoding=dynamic (or auto)"))
    if rollout.ignore_eos:
        out.append(((enabled, f"{ROLLOUT}.ignore_eos"), f"{ROLLOUT}.ignore_eos = true never ends a turn, so no turn "
                    f"could call a tool; set it to false with {enabled}"))
    return out


def multi_turn_notes(cfg: PPOConfig) -> list[str]:
    """Tools or interactions that are configured but never reached, and a loop with nothing to answer."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    given = [key for key in ("tool_config_path", "function_tool_path", "interaction_config_path")
             if getattr(mt, key) is not None]
    if not mt.enable and given:
        verb = "has" if len(given) == 1 else "have"
        return [f"warning: {MULTI_TURN}.{' and '.join(given)} {verb} no effect while {MULTI_TURN}.enable = false: "
                "every response is one turn; set enable=true for conversations"]
    if mt.enable and not given:
        return [f"warning: {MULTI_TURN}.enable = true without {MULTI_TURN}.tool_config_path, function_tool_path or "
                "interaction_config_path: "
                "nothing answers a turn, so every response is one turn"]
    return []


def rollout_notes(cfg: PPOConfig) -> list[str]:
    """Warnings about the rollout that is asked for: engine keys that configure nothing, and
    sampling that is not from the policy's own distribution softmax(z / T)."""
    rollout, notes = cfg.actor_rollout_ref.rollout, []
    if rollout.name == "hf":
        defaults, verl = RolloutConfig(), verl_defaults()
        set_keys = [key for key in ENGINE_KEYS if key not in HF_KEYS and getattr(rollout, key) not in
                    (getattr(defaults, key), verl.get(f"{ROLLOUT}.{key}", getattr(defaults, key)))]
        if set_keys:
            notes.append(f"warning: {ROLLOUT}.{{{', '.join(set_keys)}}} configure the vLLM engine and have no "
                         f"effect with {ROLLOUT}.name = 'hf'; set {ROLLOUT}.name=vllm to use them")
    notes += _decoding_notes(rollout)
    notes += _truncated_sampling_notes(cfg)
    notes += multi_turn_notes(cfg)
    if rollout.name == "vllm" and rollout.dtype in ("bfloat16", "float16") and lora_enabled(cfg.actor_rollout_ref.model):
        notes.append(f"warning: {ROLLOUT}.dtype = '{rollout.dtype}' with a LoRA actor: the engine takes the merged "
                     f"weights W + s * B @ A rounded to {rollout.dtype}, which loses every update below its resolution "
                     f"of W (early LoRA steps), so the engine samples from a policy behind the one PPO trains; "
                     f"{ROLLOUT}.dtype=auto gives a LoRA actor a float32 engine")
    if raw_log_probs_off_temperature(rollout) and not rollout_correction_active(cfg):  # with it: an error
        notes.append(f"warning: {ROLLOUT}.logprobs_mode = 'raw_logprobs' at temperature = {rollout.temperature}: the "
                     f"engine's log-probs are log softmax(z), the trainer's log softmax(z / T), so "
                     f"training/rollout_probs_diff_* measure the temperature, not the engine; set "
                     f"{ROLLOUT}.logprobs_mode=processed_logprobs")
    return notes


def _decoding_notes(rollout: RolloutConfig) -> list[str]:
    """``hf_decoding`` set where it decodes nothing: with vLLM, or for the sharded actor."""
    if rollout.hf_decoding in ("auto", "dynamic"):
        return []
    if rollout.name == "vllm":
        return [f"warning: {ROLLOUT}.hf_decoding = '{rollout.hf_decoding}' configures Hugging Face generate and has "
                f"no effect with {ROLLOUT}.name = 'vllm'"]
    if rollout.generation_weights == "sharded":
        return [f"warning: {ROLLOUT}.hf_decoding = '{rollout.hf_decoding}' has no effect with {ROLLOUT}."
                "generation_weights = 'sharded': the sharded actor decodes with the dynamic cache (FSDP2's "
                "per-layer hooks cannot be compiled); generation_weights=auto decodes with a plain copy"]
    return []


def raw_log_probs_off_temperature(rollout: RolloutConfig) -> bool:
    """Whether the engine's log-probs of the sampled tokens are not the trainer's: vLLM's raw_logprobs
    are "the values before applying any logit processors", temperature among them
    (``vllm/config/model.py``, ``logprobs_mode``), the trainer's pi_old is log softmax(z / T)
    (``forward.response_logprobs``), so the two differ at every temperature but 1."""
    return (rollout.name == "vllm" and rollout.calculate_log_probs and rollout.logprobs_mode == "raw_logprobs"
            and rollout.temperature != 1.0)


def _truncated_sampling_notes(cfg: PPOConfig) -> list[str]:
    """Online, PPO's ratio, the KL in the reward and the guards assume the responses were sampled
    from the policy whose log-probs the trainer computes, softmax(z / T) over the whole vocabulary.
    top_p < 1, top_k > 0 or greedy decoding sample from another distribution."""
    rollout = cfg.actor_rollout_ref.rollout
    truncated = [f"{k} = {v}" for k, v, off in (("top_p", rollout.top_p, 1.0), ("top_k", rollout.top_k, -1))
                 if v != off]
    if not rollout.do_sample:
        truncated.append("do_sample = false")
    if rollout.ignore_eos and rollout.name == "hf":
        truncated.append("ignore_eos = true (hf: EOS is not sampled)")
    if not truncated:
        return []
    offline = rollout.name == "offline"
    uses_reference = cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
    if offline and not (uses_reference and cfg.algorithm.kl_ctrl.offline_kl != "importance_weighted"):
        return []  # nothing samples
    what = ("the offline KL probe samples with them, so the KL it measures (for the controller and the guards) is "
            "biased" if offline else "PPO's ratio treats them as on-policy when they are not, and the KL estimated "
            "on them (in the reward, for the controller and the guards) is biased")
    notes = [f"warning: {ROLLOUT}.{', '.join(truncated)}: responses are not sampled from softmax(logits / T), the "
             f"distribution the trainer scores; {what}"]
    if rollout_correction_active(cfg) and rollout.name == "vllm" and rollout.do_sample:
        notes.append("warning: algorithm.rollout_correction with truncated sampling: the engine's log-probs are "
                     "renormalised over the tokens top_p / top_k keep, while the trainer's pi_old spans the whole "
                     "vocabulary, so every weight pi_old / mu is biased below 1 by the probability mass cut off")
    return notes
