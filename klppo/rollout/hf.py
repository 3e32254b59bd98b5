"""Responses sampled from the actor with Hugging Face ``generate``.

How ``generate`` keeps its KV cache and runs its decoding steps is ``Decoding``
(``rollout.hf_decoding``): transformers' dynamic cache, grown by concatenation at every token and
run eagerly; or a static cache, allocated once for the run's longest prompt plus response, which
gives every decoding step the same shapes, so that ``torch.compile`` (inductor, with CUDA graphs:
transformers' ``CompileConfig`` default ``mode="reduce-overhead"``) can compile one step and replay
it for every token, without the per-kernel launch cost of eager decoding.

A CUDA graph replays on the addresses it was recorded with: the model's parameters and the cache's
tensors (transformers marks them static). transformers allocates a new static cache at every
``generate`` call, so each call would record the step's graphs again (torch 2.11 counts every such
re-recording, and past 128 decodes that function without CUDA graphs for the rest of the process).
``StaticCaches`` keeps one cache per shape across calls, for a model that is kept too
(``trainer.responses``), so every call after the first replays.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, StaticCache
from transformers.generation import utils as generation_utils

from klppo.data.rl_dataset import PromptRecord, collate_prompts, left_pad
from klppo.rollout.batch import RolloutBatch, assemble_batch, eos_token_ids, mask_after_eos
from klppo.rollout.multi_turn import MultiTurn, Turn, TurnGenerator, multi_turn_rollout
from klppo.rollout.sampling import with_sampling


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k, as in verl
    do_sample: bool = True
    # Decode all max_new_tokens: no EOS is sampled before them (benchmarks; rollout.ignore_eos).
    ignore_eos: bool = False


class StaticCaches:
    """Static KV caches kept across ``generate`` calls for one model, one per number of rows (training's
    generation, validation and the offline KL probe each have theirs): each call after the first
    takes its rows' cache back, emptied in place (``reset``), so the cache's tensors keep their
    addresses. A call with rows of another length replaces that cache (a run's length is fixed:
    ``Decoding.cache_length``)."""

    def __init__(self) -> None:
        self._caches: dict[int, tuple[int, StaticCache]] = {}

    def take(self, model, rows: int, length: int) -> StaticCache:
        """The cache for ``rows`` rows of ``length`` tokens of ``model``, empty."""
        kept_length, cache = self._caches.get(rows, (None, None))
        if kept_length != length:  # its tensors are allocated at the first forward, in the model's dtype and device
            cache = new_static_cache(model, rows, length)
            self._caches[rows] = (length, cache)
        else:
            cache.reset()
        return cache

    def __len__(self) -> int:
        return len(self._caches)

    def tensors(self) -> list[torch.Tensor]:
        """Every allocated key and value tensor of every kept cache."""
        return [t for _, cache in self._caches.values() for layer in cache.layers
                if getattr(layer, "is_initialized", False) for t in (layer.keys, layer.values)]


def new_static_cache(model, rows: int, length: int) -> StaticCache:
    """An empty static cache of ``rows`` x ``length`` tokens for ``model`` (transformers 5 takes the
    config and the length and sizes the rest at the first forward; 4.x also takes the others)."""
    return StaticCache(config=model.config, max_cache_len=length, max_batch_size=rows,
                       device=next(model.parameters()).device, dtype=model.dtype)


@dataclass(frozen=True)
class Decoding:
    """How ``generate`` decodes (``rollout.hf_decoding``): ``mode`` dynamic | static | compiled, or auto
    before ``on`` resolves it for the device.

    ``cache_length``: tokens a static cache holds per row, the run's longest prompt plus response
    (``data.max_prompt_length + rollout.response_length``); without it, each call's own prompt plus
    ``max_new_tokens`` (every new length would compile the step again).

    ``caches``: where a static cache outlives the call (``StaticCaches``, for a model that is kept
    from one generation to the next); without them each call has a cache of its own.
    """

    mode: str = "dynamic"
    cache_length: Optional[int] = None
    caches: Optional[StaticCaches] = field(default=None, compare=False)

    def on(self, device: torch.device) -> "Decoding":
        """``auto`` resolved: compiled on CUDA; dynamic elsewhere, where a compiled step saved too little
        for its compilation (CPU, 2 threads: a 20M-parameter model 1.2x faster, 60 s to compile)."""
        if self.mode != "auto":
            return self
        return replace(self, mode="compiled" if device.type == "cuda" else "dynamic")


DYNAMIC = Decoding()


@torch.no_grad()
def hf_rollout(model, records: list[PromptRecord], tokenizer, params: SamplingParams, *,
               synced_gpus: bool = False, device: torch.device | None = None,
               decoding: Decoding = DYNAMIC, multi_turn: Optional[MultiTurn] = None,
               keep_going: Optional[Callable[[bool], bool]] = None) -> RolloutBatch:
    """Sample ``params.n`` responses per prompt; rows grouped by prompt as in ``offline_rollout``.

    ``synced_gpus`` (sharded models): every rank keeps running forwards until all ranks have
    finished, so FSDP2's per-forward collectives line up.

    Sampling is from exactly softmax(logits / temperature), with ``params.top_p`` / ``top_k``
    and nothing else: ``generate`` would start from the model folder's generation_config and
    apply its other processors too (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``;
    others set ``no_repeat_ngram_size``, ``min_p``, ``suppress_tokens``, ...), so the responses
    would not come from the policy whose log-probs PPO uses (``neutral_generation_config``).

    Tokens after a response's first EOS (any of ``eos_token_ids``: the tokenizer's and those the
    model's generation config lists) are replaced by padding and masked out. Sampling
    draws from torch's global RNG, which checkpoints save and restore, so a resumed run
    samples the same responses as an uninterrupted one.

    ``device``: where the model computes (the rank's device; by default its parameters'). Say
    it for models whose parameters live elsewhere (FSDP2's ``offload_policy`` keeps them on
    CPU). The batch comes back on CPU; callers move it to their device once.

    ``decoding``: the KV cache and compilation (``Decoding``, resolved for ``device``); a model that
    runs FSDP2's hooks per layer decodes with the dynamic cache (``DYNAMIC``), eagerly.

    ``multi_turn``: each response is a conversation with tools (``multi_turn.multi_turn_rollout``),
    every turn sampled as above, with the dynamic cache (a conversation's length changes at every
    turn); ``keep_going`` is the ranks' agreement that ``synced_gpus`` needs (any rank has a
    conversation left).
    """
    device = device if device is not None else next(model.parameters()).device
    if multi_turn is not None:
        generate_turn = _turn_generator(model, tokenizer, params, device, synced_gpus)
        return multi_turn_rollout(records, params.n, tokenizer, generate_turn, multi_turn, params.max_new_tokens,
                                  **({"keep_going": keep_going} if keep_going is not None else {}))
    prompt_ids, prompt_mask = collate_prompts(records, tokenizer.pad_token_id)
    prompt_ids = prompt_ids.repeat_interleave(params.n, dim=0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(params.n, dim=0).to(device)
    was_training = model.training
    model.eval()
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    output = _generate(model, prompt_ids, prompt_mask, neutral_generation_config(params, tokenizer, eos),
                       decoding.on(device), synced_gpus)
    model.train(was_training)
    response_ids = output[:, prompt_ids.shape[1] :].cpu()  # (B, T) with T <= max_new_tokens
    if response_ids.shape[1] == 0:
        response_ids = torch.full((len(response_ids), 1), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = mask_after_eos(response_ids, eos)
    response_ids = response_ids.masked_fill(~response_mask, tokenizer.pad_token_id)
    return assemble_batch(records, params.n, tokenizer.pad_token_id, response_ids, response_mask)


def _turn_generator(model, tokenizer, params: SamplingParams, device: torch.device, synced_gpus: bool
                    ) -> TurnGenerator:
    """One turn of every conversation given: sampled as ``hf_rollout`` samples, up to the turn's
    first EOS and at most its budget of tokens."""
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))

    def generate_turn(rows: list[int], contexts: list[list[int]], budgets: list[int]) -> list[Turn]:
        ids, mask = left_pad(contexts, tokenizer.pad_token_id)
        config = neutral_generation_config(replace(params, n=1, max_new_tokens=max(budgets)), tokenizer, eos)
        was_training = model.training
        model.eval()
        rng = _rng_states(device)
        output = _generate(model, ids.to(device), mask.to(device), config, DYNAMIC, synced_gpus)
        if not rows:  # a stand-in turn: the stream goes on as if it had not been sampled
            _set_rng_states(rng)
        model.train(was_training)
        turns = output[:, ids.shape[1]:].cpu()
        kept = mask_after_eos(turns, eos)
        return [Turn(turn[keep][:budget].tolist()) for turn, keep, budget in zip(turns, kept, budgets)]

    return generate_turn


# Model classes whose compiled decoding failed in this process: they decode with the dynamic cache
# from then on (``_generate``), so the failure is paid and reported once, not at every step.
_COMPILE_FAILED: set[type] = set()


def _generate(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
              decoding: Decoding, synced_gpus: bool) -> torch.Tensor:
    """``model.generate`` decoding as ``decoding`` says; (B, P + T) ids.

    Compiled decoding is an optimisation that torch.compile may not manage for every architecture,
    torch version or device: where compiling or replaying the step raises (anything but running out
    of memory), one warning says so and the same call, from the same RNG state, decodes with the
    dynamic cache, as every later call of this model class does.
    """
    if decoding.mode == "compiled" and type(model) in _COMPILE_FAILED:
        decoding = DYNAMIC
    config, processors = with_sampling(config, prompt_ids.device)  # on CPU: one uniform per row and step
    rng = _rng_states(prompt_ids.device)
    try:
        with generating_with(model, with_decoding(config, decoding)):
            return _call_generate(model, prompt_ids, prompt_mask, synced_gpus, processors,
                                  static_cache(model, prompt_ids.shape, config, decoding))
    except Exception as error:  # noqa: BLE001 (the fallback re-raises what it cannot handle)
        if decoding.mode != "compiled" or isinstance(error, torch.OutOfMemoryError):
            raise
        _COMPILE_FAILED.add(type(model))
        warnings.warn(f"rollout.hf_decoding: compiled decoding failed for {type(model).__name__} "
                      f"({_root_cause(error)}); decoding with "
                      "the dynamic cache instead (set actor_rollout_ref.rollout.hf_decoding=dynamic to skip the attempt)",
                      stacklevel=2)
    _set_rng_states(rng)
    with generating_with(model, config):
        return _call_generate(model, prompt_ids, prompt_mask, synced_gpus, processors)


# transformers warns at every generate call whose inputs are on another device type than the model's
# first parameter. An actor sharded under FSDP2's offload_policy (rollout.generation_weights=sharded)
# keeps its parameters on CPU and computes every layer on the inputs' device, as klppo asks: the
# warning described nothing wrong, hundreds of times a run (issue #32 item 14).
_DEVICE_TYPE_WARNING = r"You are calling \.generate\(\) with the `input_ids` being on a device type different"


def _call_generate(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, synced_gpus: bool,
                   processors: LogitsProcessorList, cache: Optional[StaticCache] = None) -> torch.Tensor:
    """``model.generate`` on the prompts' device, with ``processors`` after its own and ``cache`` as its KV
    cache (else the one its config asks for), without transformers' device-type warning."""
    given = {CACHE_ARGUMENT: cache} if cache is not None else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEVICE_TYPE_WARNING, category=UserWarning)
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), synced_gpus=synced_gpus,
                              logits_processor=processors, **given)


# The name ``generate`` takes a cache under: ``cache`` since transformers 5.2x (``past_key_values`` is
# deprecated there), ``past_key_values`` before; the first of transformers' own list either way.
CACHE_ARGUMENT = getattr(generation_utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]


def static_cache(model, prompt_shape: torch.Size, config: GenerationConfig, decoding: Decoding
                 ) -> Optional[StaticCache]:
    """The static KV cache a call decodes into: ``decoding.caches``' for this shape where they are kept,
    else a new one; None for the dynamic cache. Rows of ``decoding.cache_length`` tokens, else of the
    prompt plus ``max_new_tokens``."""
    if decoding.mode == "dynamic":
        return None
    rows, length = prompt_shape[0], decoding.cache_length or prompt_shape[1] + config.max_new_tokens
    assert length >= prompt_shape[1] + config.max_new_tokens, "the cache holds every prompt and its response"
    return decoding.caches.take(model, rows, length) if decoding.caches is not None else new_static_cache(
        model, rows, length)


def _root_cause(error: BaseException) -> str:
    """The innermost cause's type and first line (torch.compile wraps what its backend raised, as
    ``inner_exception`` or the cause)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__ or error.__context__) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _rng_states(device: torch.device) -> tuple:
    return torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def neutral_generation_config(params: SamplingParams, tokenizer, eos: tuple[int, ...] = ()) -> GenerationConfig:
    """The generation config of sampling from softmax(z / T) with ``params``' top_p / top_k alone,
    stopping at each id of ``eos`` (default: the tokenizer's EOS).

    Every field left unset falls back to transformers' neutral global defaults (no repetition
    penalty, no n-gram blocking, no minimum length, no suppressed tokens, ...); ``ignore_eos``
    alone sets a minimum length, all of ``max_new_tokens``.
    """
    sampling = {}
    if params.do_sample:  # top_k 0 switches top-k off (transformers' own default is 50)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0)}
    if params.ignore_eos:  # transformers' MinNewTokensLengthLogitsProcessor masks every EOS id until then
        sampling["min_new_tokens"] = params.max_new_tokens
    return GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=list(eos or [tokenizer.eos_token_id]),
                            use_cache=True, **sampling)


def with_decoding(config: GenerationConfig, decoding: Decoding) -> GenerationConfig:
    """A copy of ``config`` set to decode as ``decoding`` says (resolved: not ``auto``); the static cache
    itself is given to ``generate`` (``static_cache``).

    transformers compiles the decoding step by itself whenever a static cache is used on CUDA
    (``_valid_auto_compile_criteria``, in 5.17 and 5.25 alike), and never on CPU unless the
    ``CompileConfig`` is flagged ``_compile_all_devices``: ``static`` switches the first off and
    ``compiled`` sets the second, so each mode means the same on any device. The compiled step is
    held by the model (``get_compiled_call``); torch.compile's cache of compiled code outlives it,
    so a new generation copy (same class, shapes and flags) reuses it.
    """
    assert decoding.mode in ("dynamic", "static", "compiled"), decoding
    if decoding.mode == "dynamic":
        return config
    config = copy.deepcopy(config)
    if decoding.mode == "static":
        config.disable_compile = True
        return config
    compile_config = CompileConfig()  # inductor, mode reduce-overhead (CUDA graphs), dynamic shapes when needed
    compile_config._compile_all_devices = True
    config.compile_config = compile_config
    return config


@contextmanager
def generating_with(model, config: GenerationConfig) -> Iterator[None]:
    """``model.generation_config`` is ``config`` inside the block.

    ``generate(generation_config=...)`` alone is not enough: transformers fills every field the
    given config leaves unset from the model's own generation_config (``_prepare_generation_config``),
    which is how the folder's processors come back.
    """
    own = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = own
