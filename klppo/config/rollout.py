"""``actor_rollout_ref.rollout``: where responses come from, how they are sampled, and the vLLM
engine's knobs (verl's key names). Their checks and warnings are in ``rollout_checks``.

The engine keys act only with ``name: vllm``; set with ``hf`` to anything but klppo's or verl's
default they are named in one warning (they configure an engine that run does not build).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

ROLLOUT = "actor_rollout_ref.rollout"
# The keys that configure the vLLM engine alone (max_model_len is derived when not set).
ENGINE_KEYS = ("tensor_model_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
               "max_num_batched_tokens", "max_num_seqs", "enforce_eager", "enable_chunked_prefill",
               "enable_prefix_caching", "dtype", "load_format", "free_cache_engine", "calculate_log_probs",
               "logprobs_mode", "ignore_eos", "seed")
# Engine keys that hf acts on too.
HF_KEYS = ("ignore_eos",)


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
class MultiTurnConfig:
    # Each response is a conversation: where a turn of the policy calls tools (Hermes' <tool_call>
    # format), their replies are appended and the policy speaks again (hf or vllm; verl's sglang and
    # trtllm names generate with hf). The policy trains on its own turns only.
    enable: bool = False
    # Turns of the policy per response; None: until a turn calls no tool or response_length is reached.
    max_assistant_turns: Optional[int] = None
    # Answers per response (tool replies and users' turns); None: no limit but response_length.
    max_user_turns: Optional[int] = None
    # verl's tool config YAML (tools: class_name, config, tool_schema); verl.tools.gsm8k_tool.Gsm8kTool
    # is built in, any other class_name is imported. None: no tools (every response one turn).
    tool_config_path: Optional[str] = None
    # verl's function tools (verl 0.8+): a Python file whose @function_tool functions are tools, each
    # schema from the function's type hints and docstring. Runs without verl installed.
    function_tool_path: Optional[str] = None
    # Calls of one turn that run (the rest are dropped, as verl drops them).
    max_parallel_calls: int = 1
    # Characters of one tool reply kept; the rest is cut at tool_response_truncate_side.
    max_tool_response_length: int = 256
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    # verl's interaction config YAML (interaction: name, class_name, config): after a turn that calls
    # no tool, the interaction a row's extra_info.interaction_kwargs.name picks answers as the user, and
    # may end the conversation. verl.interactions.gsm8k_interaction.Gsm8kInteraction is built in.
    interaction_config_path: Optional[str] = None
    # How tool calls are written: hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>);
    # qwen, which verl's SGLang configs name, is the same layout (SGLang's Qwen 2.5 parser); gpt-oss
    # (OpenAI's harmony format: a commentary message to=functions.NAME, ended by <|call|>).
    format: Literal["hermes", "qwen", "gpt-oss"] = "hermes"


@dataclass
class AgentLoopConfig:
    # verl's loop for rows without an agent_name column: single_turn_agent (one turn), or tool_agent
    # (a conversation: needs multi_turn.enable). With multi_turn.enable, klppo lets such rows converse
    # whatever this says (the key's plain meaning); verl's other agent settings configure its workers.
    default_agent_loop: Literal["single_turn_agent", "tool_agent"] = "single_turn_agent"


@dataclass
class RolloutConfig:
    # Where responses come from: recorded in the data (offline), generated with Hugging Face
    # generate (hf) or with vLLM (vllm: the `klppo[vllm]` extra). verl's sglang and trtllm
    # (TensorRT-LLM) are accepted and generate with hf.
    name: Literal["offline", "hf", "vllm", "sglang", "trtllm"] = "offline"
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
    # sampler and the trainer compute with the same precision; but float32 for a LoRA actor in
    # bf16/fp16, whose merged weights would round its small updates away.
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
    # after temperature, top_k and top_p) or raw_logprobs (of the model's logits at temperature 1:
    # not the trainer's at any other temperature, so refused there with rollout correction).
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    # Generate to response_length even past EOS (benchmarking). vllm: EOS is sampled and decoding
    # goes on; the response still ends at its first EOS for training, as in verl. hf: no EOS is
    # sampled before response_length (transformers' min_new_tokens), so every response is exactly
    # response_length tokens (what TRL's generation_kwargs take; benchmarks/vs_trl.py). Without it
    # a response ends at any EOS the model lists (the tokenizer's and its generation_config.json's).
    ignore_eos: bool = False
    # Seed of the per-request sampling seeds: request (step, prompt, sample) draws from a
    # stream of its own, so the same responses come on any number of ranks and after a resume.
    seed: int = 42
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
