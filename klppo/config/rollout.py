"""``actor_rollout_ref.rollout``: where responses come from, how they are sampled, and the vLLM
engine's knobs (verl's key names), with the checks and warnings that belong to them.

The engine keys act only with ``name: vllm``; set with ``hf`` to anything but klppo's or verl's
default they are named in one warning (they configure an engine that run does not build).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from klppo.config.rollout_correction import rollout_correction_active

if TYPE_CHECKING:
    from klppo.config.schema import PPOConfig

ROLLOUT = "actor_rollout_ref.rollout"
VLLM_INSTALL = "bash scripts/setup.sh --vllm (or: pip install 'klppo[vllm]')"
# The keys that configure the vLLM engine alone (max_model_len is derived when not set).
ENGINE_KEYS = ("tensor_model_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
               "max_num_batched_tokens", "max_num_seqs", "enforce_eager", "enable_chunked_prefill",
               "enable_prefix_caching", "dtype", "load_format", "free_cache_engine", "calculate_log_probs",
               "logprobs_mode", "ignore_eos", "seed")


@dataclass
class ValKwargsConfig:
    # Sampling temperature for validation.
    temperature: float = 0.0
    # Nucleus sampling for validation.
    top_p: float = 1.0
    # Top-k sampling for validation; -1 disables it.
    top_k: int = -1
    # Responses per validation prompt.
    n: int = 1
    # Sample (True) or decode greedily (False).
    do_sample: bool = False


@dataclass
class RolloutConfig:
    # Where responses come from: recorded in the data (offline), generated with Hugging Face
    # generate (hf) or with vLLM (vllm: the `klppo[vllm]` extra). verl's sglang is accepted
    # and generates with hf.
    name: Literal["offline", "hf", "vllm", "sglang"] = "offline"
    # Responses per prompt (offline: the first n recorded responses of each row; a row with
    # fewer is an error). None: 4 when reward_model.rank_responses ranks them, else 1.
    n: Optional[int] = None
    # Sampling temperature.
    temperature: float = 1.0
    # Nucleus sampling.
    top_p: float = 1.0
    # Top-k sampling; -1 disables it.
    top_k: int = -1
    # Sample (True) or decode greedily (False).
    do_sample: bool = True
    # Longest generated response; None = data.max_response_length.
    response_length: Optional[int] = None
    # Samples per no-grad forward when computing old log-probs; None = all at once.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Size log-prob micro-batches by tokens; None = actor.use_dynamic_bsz (as verl).
    log_prob_use_dynamic_bsz: Optional[bool] = None
    # Token budget of one log-prob micro-batch; None = actor.ppo_max_token_len_per_gpu (as verl).
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # How an FSDP2-wrapped actor generates (hf; several ranks, or one process under bf16 or
    # offload_policy): `gathered` decodes with a plain model of its weights in the compute dtype,
    # all-gathered once per generation (one process in fp32 shares the actor's parameters: no
    # copy), so no FSDP2 hook or collective runs per token; `sharded` decodes with the actor
    # itself, its hooks (and on several ranks an all-gather) in every layer for every token (least
    # memory, slow); `auto`: gathered when what it adds fits in half the free memory (with a
    # warning otherwise).
    generation_weights: Literal["auto", "gathered", "sharded"] = "auto"
    # How Hugging Face generate decodes (hf; a klppo key): `dynamic` is transformers' default KV
    # cache, grown at every token, run eagerly; `static` allocates the cache once for
    # data.max_prompt_length + response_length tokens per row; `compiled` is the static cache with
    # the decoding step compiled by torch.compile (CUDA graphs on a GPU), which compiles on the
    # first generation (and again at the first batch of another size, and at a batch of one row)
    # and then replays for every token; `auto`: compiled on CUDA, dynamic on CPU (compiling took
    # a minute there and saved a fifth). The sharded actor (generation_weights: sharded) always
    # decodes dynamically: FSDP2's per-layer hooks cannot be compiled.
    hf_decoding: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    # ---- the vLLM engine (rollout.name: vllm) ----
    # Ranks that hold one engine's tensor-parallel shards: consecutive ranks form a group that
    # samples the same prompts together; the groups split the step's prompts (data parallel).
    # Must divide the number of ranks. verl's default is 2; klppo's is 1 (every rank an engine).
    tensor_model_parallel_size: int = 1
    # Share of the GPU's memory the engine may take (weights and KV cache); GPU only.
    gpu_memory_utilization: float = 0.5
    # Bytes of the engine's KV cache; None = gpu_memory_utilization on a GPU, and on a CPU the
    # KV of every sequence this rank samples in a step at max_model_len (within a quarter of
    # the free memory, at least 64 MiB).
    kv_cache_memory_bytes: Optional[int] = None
    # Tokens the engine schedules per forward.
    max_num_batched_tokens: int = 8192
    # Sequences the engine decodes at once.
    max_num_seqs: int = 256
    # Longest prompt + response the engine holds; None = data.max_prompt_length + response_length.
    max_model_len: Optional[int] = None
    # Run the engine's model eagerly (no CUDA graphs / torch.compile); None = true on CPU (a
    # compiled engine starts 10x slower there and decodes no faster), false on GPU (as verl).
    enforce_eager: Optional[bool] = None
    # Split long prefills into chunks scheduled with decodes.
    enable_chunked_prefill: bool = True
    # Reuse the KV of prompt prefixes across requests (reset whenever the weights change).
    enable_prefix_caching: bool = True
    # The engine's weight dtype; auto = the actor's compute dtype (fsdp_config.dtype), so the
    # sampler and the trainer compute with the same precision.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How the engine starts: dummy (random weights, nothing read) or a format vLLM reads from
    # model.path (auto, safetensors). Either way it generates with the actor's weights, synced
    # from the trainer before every generation.
    load_format: str = "dummy"
    # GPU: the engine sleeps while the models train (its KV cache and weights released) and
    # wakes for each generation; no effect on CPU, where vLLM has no sleep mode.
    free_cache_engine: bool = True
    # Keep the engine's log-probs of the sampled tokens as the batch's rollout_log_probs
    # (rollout correction and the rollout-vs-trainer metrics use them).
    calculate_log_probs: bool = True
    # Which log-probs the engine returns: processed_logprobs (of the distribution it samples:
    # after temperature, top_k and top_p) or raw_logprobs (of the model's logits at temperature 1).
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    # Generate to response_length even past EOS (benchmarking); the response still ends at
    # its first EOS for training, as in verl.
    ignore_eos: bool = False
    # Seed of the per-request sampling seeds: request (step, prompt, sample) draws from a
    # stream of its own, so the same responses come on any number of ranks and after a resume.
    seed: int = 42
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


# ---- derived values, checks and warnings ----


def resolve_rollout_engine(rollout: RolloutConfig, max_prompt_length: int, notes: list[str]) -> None:
    """sglang generates with hf (one warning says so); vLLM's derived lengths are filled in."""
    if rollout.name == "sglang":
        notes.append(f"warning: {ROLLOUT}.name = 'sglang': generating with 'hf' (Hugging Face generate) instead, "
                     "since klppo has no SGLang backend; the same sampling settings apply (temperature, top_p, "
                     "top_k, n, response_length); rollout.name=vllm generates with vLLM")
        rollout.name = "hf"
    if rollout.max_model_len is None and rollout.response_length is not None:
        rollout.max_model_len = max_prompt_length + rollout.response_length


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
    needed = cfg.data.max_prompt_length + (rollout.response_length or 0)
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        out.append(((f"{ROLLOUT}.max_model_len",), f"{ROLLOUT}.max_model_len = {rollout.max_model_len} is shorter "
                    f"than data.max_prompt_length + rollout.response_length = {needed}; raise it or leave it null"))
    return out


def rollout_notes(cfg: PPOConfig) -> list[str]:
    """Warnings about the rollout that is asked for: engine keys that configure nothing, and
    sampling that is not from the policy's own distribution softmax(z / T)."""
    rollout, notes = cfg.actor_rollout_ref.rollout, []
    if rollout.name == "hf":
        from klppo.config.verl import verl_defaults  # verl.py reads the checks, which read this module

        defaults, verl = RolloutConfig(), verl_defaults()
        set_keys = [key for key in ENGINE_KEYS if getattr(rollout, key) not in
                    (getattr(defaults, key), verl.get(f"{ROLLOUT}.{key}", getattr(defaults, key)))]
        if set_keys:
            notes.append(f"warning: {ROLLOUT}.{{{', '.join(set_keys)}}} configure the vLLM engine and have no "
                         f"effect with {ROLLOUT}.name = 'hf'; set {ROLLOUT}.name=vllm to use them")
    notes += _decoding_notes(rollout)
    notes += _truncated_sampling_notes(cfg)
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


def _truncated_sampling_notes(cfg: PPOConfig) -> list[str]:
    """Online, PPO's ratio, the KL in the reward and the guards assume the responses were sampled
    from the policy whose log-probs the trainer computes, softmax(z / T) over the whole vocabulary.
    top_p < 1, top_k > 0 or greedy decoding sample from another distribution."""
    rollout = cfg.actor_rollout_ref.rollout
    truncated = [f"{k} = {v}" for k, v, off in (("top_p", rollout.top_p, 1.0), ("top_k", rollout.top_k, -1))
                 if v != off]
    if not rollout.do_sample:
        truncated.append("do_sample = false")
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
