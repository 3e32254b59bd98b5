"""Attention for packed rows: one implementation per run, chosen by device, dtype and what is installed.

Legend: N real tokens of a packed (1, N) row, H query heads, Hkv key/value heads, D head size.
A packed row (``klppo.models.forward``, verl's ``use_remove_padding``) holds many sequences,
its position ids restarting at 0 per sequence; each sequence must attend only to itself.

The candidates (``packed_attention_for`` picks one; benchmarks/README.md has the figures):
- ``PACKED_VARLEN`` (CUDA, bf16/fp16): PyTorch's own variable-length flash kernel,
  ``torch.nn.attention.varlen.varlen_attn``, forward and backward, one call per layer for
  the whole row; no extra package, no CPU kernel. Its arguments moved: torch 2.10 takes
  ``is_causal``; 2.11 replaced it with ``window_size`` (``(-1, 0)`` is causal); 2.12 added
  ``enable_gqa``, without which the key/value heads are expanded here (``torch_varlen_causal``).
- ``flash_attention_2`` (CUDA, bf16/fp16, the ``flash_attn`` package): transformers' own; it
  reads the same ``cu_seq_lens_*`` / ``max_length_*`` keyword arguments and runs varlen kernels.
- ``PACKED_MASKED``: one sdpa call per layer with an (N, N) block-diagonal causal mask built
  from the row's sequences as the attention receives them: N^2 work where the sequences need the
  sum of their squared lengths. transformers' own ``sdpa`` builds the same mask from the position
  ids it gets, which not every model hands it (OPT's packed tokens attended across sequences).
- ``PACKED_SDPA``: sdpa run causally on each sequence of the row, a Python loop. Free on CPU
  and the fastest there (2-3x the masked sdpa on 16 sequences of 64-512 tokens); on an H200 it
  left the GPU waiting on Python (32,800 sdpa calls = 55 s of host time in 2 steps), so CUDA
  never gets it for speed (STYLE.md rule 11).
- ``PACKED_DETERMINISTIC`` (CUDA under ``torch.use_deterministic_algorithms``): ``PACKED_SDPA``'s
  loop with every sdpa call held to the math backend. The fast kernels' backwards add with
  atomics in an order that changes from run to run: flash and varlen stay non-deterministic under
  ``warn_only=True`` (torch sets FlashAttention's deterministic flag only under the strict mode),
  memory-efficient attention too, and cuDNN warns it is not deterministic; an exact resume
  (``benchmarks/gpu_smoke.sh``) must get the same gradients twice. Math's memory is the squared
  length of each sequence, not of the row, which is why it runs per sequence; it is slow and
  only for runs that ask for determinism.

Sliding-window layers (Mistral, Gemma 3, Qwen2/3 with ``use_sliding_window``, Phi-3, ...):
token i sees the tokens j of its own sequence with i - W < j <= i. For rows without padding or
cache, transformers would build an (N, N) mask per forward and leave each layer one masked sdpa
call over the whole row; instead the run's mask function (``_packed_sdpa_mask``) hands those
layers ``SlidingWindow(W)``, and every choice applies the window itself: varlen's kernel with
``window_size=(W - 1, 0)`` (torch 2.11+), the loop with a banded mask on the sequences longer
than W. Chunked attention (Llama 4) and masks with overlays keep transformers' mask.

Rows that are not packed (the padded path, with its attention mask) and generation (a KV
cache: query and key lengths differ) run plain sdpa under every choice, so one choice serves
every model of a run: actor, reference, critic, reward models and the generation copy
(``set_packed_attention``; the copy shares the actor's config). None is saved with a model.
PACKED_VARLEN knows a packed row by its ``cu_seq_lens_q``, which every packed forward of
``klppo.models.forward`` passes (PACKED_SDPA also finds the sequences in the position ids).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

PACKED_SDPA = "klppo_packed_sdpa"
PACKED_VARLEN = "klppo_packed_varlen"
PACKED_DETERMINISTIC = "klppo_packed_deterministic"
PACKED_MASKED = "klppo_packed_masked"
# The keyword argument that hands PACKED_SDPA each row's sequence bounds once per forward.
ROW_BOUNDS = "klppo_row_bounds"
# What each choice is called on the command line of the benchmarks (benchmarks/gpu_check.py --attn).
ATTENTION_NAMES = {"varlen": PACKED_VARLEN, "flash_attention_2": "flash_attention_2", "sdpa_mask": PACKED_MASKED,
                   "sdpa_loop": PACKED_SDPA}
# The dtypes varlen kernels take (torch's and flash-attn's alike).
VARLEN_DTYPES = (torch.bfloat16, torch.float16)
# Measured on CPU (benchmarks/packed_attention.py): the per-sequence loop beats one masked sdpa call.
CPU_PACKED_ATTENTION = PACKED_SDPA
OUR_IMPLEMENTATIONS = (PACKED_SDPA, PACKED_VARLEN, PACKED_DETERMINISTIC, PACKED_MASKED)
# The implementations that read each row's sequence bounds from ROW_BOUNDS.
ROW_BOUNDS_IMPLEMENTATIONS = (PACKED_SDPA, PACKED_DETERMINISTIC)


@dataclass(frozen=True)
class SlidingWindow:
    """The mask of a sliding-window layer over rows without padding or cache, as the run's mask
    function gives it to klppo's attention functions in place of an (N, N) tensor: token i of a
    sequence sees its tokens j with i - ``size`` < j <= i (transformers' ``sliding_window_overlay``)."""

    size: int


# ---- which models can pack ----

# transformers' cache layer types of layers that carry a state from each token to the next
# (convolutions, state-space models, linear attention): in a packed row, from one sequence into the next.
STATEFUL_LAYER_TYPES = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})


def layer_types(config) -> list[str]:
    """Each layer's type as transformers' caches read it (``full_attention``, ``sliding_attention``,
    ``linear_attention``, ``conv``, ...), from the config alone."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    except (ImportError, AttributeError, TypeError):  # a transformers or a config without per-layer types
        return list(getattr(config, "layer_types", None) or [])


def packing_problem(config) -> str | None:
    """Why a model of ``config`` cannot keep the sequences of a packed row apart, or None.

    klppo's packed rows rely on two things: every layer that mixes tokens is attention, and that
    attention runs through transformers' attention interface (``_supports_attention_backend``),
    where the implementation chosen here sees each sequence's bounds. A model with stateful
    layers (Mamba, convolutions, linear attention: Jamba, Bamba, Falcon-H1, LFM2, Qwen3.5) would
    carry a state from one sequence into the next; one with its own attention code (BLOOM's
    ALiBi, MPT, XGLM) would let every token attend to the sequences before its own. transformers
    marks the classes whose attention takes the interface; the few that take it unmarked
    (StableLM, Falcon) are counted out with the rest.
    """
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    stateful = sorted(set(layer_types(config)) & STATEFUL_LAYER_TYPES)
    if stateful:
        return (f"its {' and '.join(stateful)} layers carry a state from each token to the next, across "
                "the sequences of a packed row")
    try:
        backbone = MODEL_MAPPING[type(config)]
    except KeyError:
        return f"transformers has no backbone class for model type '{config.model_type}'"
    if not getattr(backbone, "_supports_attention_backend", False):
        return (f"{backbone.__name__} does not declare transformers' attention interface "
                "(_supports_attention_backend), through which klppo keeps the sequences of a packed row apart")
    return None


# ---- the choice ----


def packed_attention_for(device_type: str, compute_dtypes: Iterable[torch.dtype | None], *, torch_varlen: bool,
                         flash_installed: bool, deterministic: bool = False) -> str:
    """The attention every model of a run uses for packed rows.

    ``compute_dtypes``: what each model's forward runs in (None: float32); the varlen kernels
    take bf16/fp16 only, so they are chosen only when every model computes in one of those.
    ``torch_varlen``: this torch has ``varlen_attn`` and its flash kernels (``torch_varlen_runs``).
    CUDA: torch's varlen > flash-attn's varlen > one masked sdpa call per layer (``PACKED_MASKED``); under
    ``deterministic`` algorithms ``PACKED_DETERMINISTIC`` instead; elsewhere the fastest measured
    there (``CPU_PACKED_ATTENTION``, deterministic on CPU as it is).
    """
    if device_type != "cuda":
        return CPU_PACKED_ATTENTION
    if deterministic:
        return PACKED_DETERMINISTIC
    half = all(dtype in VARLEN_DTYPES for dtype in compute_dtypes)
    if torch_varlen and half:
        return PACKED_VARLEN
    if flash_installed and half:
        return "flash_attention_2"
    return PACKED_MASKED


def torch_varlen_runs(device_type: str) -> bool:
    """Whether this torch has ``varlen_attn`` and can run it on ``device_type``: CUDA only (its CPU
    build has no flash kernel), built with flash attention, on a card of compute capability 8.0+."""
    if device_type != "cuda" or _varlen_api() is None or not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def choose_packed_attention(device_type: str, compute_dtypes: Iterable[torch.dtype | None]) -> str:
    """``packed_attention_for`` with what this process has installed and whether it asked for
    deterministic algorithms (``torch.use_deterministic_algorithms``, read now); call once per run,
    after that switch."""
    return packed_attention_for(device_type, list(compute_dtypes), torch_varlen=torch_varlen_runs(device_type),
                                flash_installed=importlib.util.find_spec("flash_attn") is not None,
                                deterministic=torch.are_deterministic_algorithms_enabled())


def set_packed_attention(model: torch.nn.Module, implementation: str) -> str:
    """Switch an sdpa model (or one already switched) to ``implementation``; other implementations
    (eager, flash) are kept. Returns the one in use. Not saved: ``save_pretrained`` writes sdpa."""
    if model.config._attn_implementation in ("sdpa", *OUR_IMPLEMENTATIONS):
        model.set_attn_implementation(implementation)
    return model.config._attn_implementation


def use_packed_attention(model: torch.nn.Module, compute_dtype: torch.dtype | None = None,
                         device_type: str | None = None) -> str:
    """``set_packed_attention`` with the choice for this one model (a run of several models chooses
    once for all of them, ``choose_packed_attention``). ``device_type``: where the model will run
    (default: where its parameters are; a model built on the meta device must say)."""
    device_type = device_type or next(model.parameters()).device.type
    return set_packed_attention(model, choose_packed_attention(device_type, [compute_dtype]))


# ---- torch's varlen kernel ----


@functools.cache
def _varlen_api() -> tuple[Callable, frozenset[str]] | None:
    """torch's ``varlen_attn`` and the names of its parameters, or None where torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_takes_windows() -> bool:
    """Whether this torch's ``varlen_attn`` takes a sliding window (2.11+; 2.10 has only ``is_causal``)."""
    api = _varlen_api()
    return api is not None and "window_size" in api[1]


def torch_varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_len: int, scale: float | None, window: int | None = None) -> torch.Tensor:
    """(N, H, D) queries, (N, Hkv, D) keys and values -> (N, H, D): causal attention within each
    sequence of ``cu_seqlens`` (int32, (S + 1,)), one kernel for all of them, with autograd; with a
    ``window`` (``varlen_takes_windows``), each token sees itself and the ``window - 1`` before it."""
    varlen_attn, params = _varlen_api()
    # torch 2.10 says causal with is_causal; 2.11 replaced it with a window, (-1, 0) = causal and
    # (W - 1, 0) the last W tokens (flash's window counts the tokens before the query).
    # varlen_attn compares the tuple itself to (-1, 0), so it must be a tuple, not a list.
    if window is not None:
        assert "window_size" in params, "this torch's varlen_attn takes no window (varlen_takes_windows)"
        extra = {"window_size": (window - 1, 0)}
    else:
        extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # query head h reads key/value head h // group, as transformers' repeat_kv lays them out
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **extra)


# ---- the attention functions ----


def _packed_row_sequences(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict
                          ) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens, longest) of a packed row as klppo's forwards pass it (one row, no mask, no
    cache), or None for any other row. The sequences come from ``cu_seq_lens_q`` and
    ``max_length_q`` (transformers' flash convention), or, where a model's layers do not hand
    those on to its attention (StableLM's), from the position ids (a host sync per layer)."""
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        return kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    if kwargs.get("position_ids") is None:
        return None
    bounds = _segment_bounds(kwargs["position_ids"].reshape(-1))
    if len(bounds) <= 2:  # one sequence: nothing is packed
        return None
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return torch.tensor(bounds, dtype=torch.int32, device=query.device), longest


def block_causal_mask(cu_seqlens: torch.Tensor, n: int, window: int | None = None) -> torch.Tensor:
    """(N, N) bool, True where token i may attend to token j: the same sequence and j <= i (and
    i - j < ``window``, where one is given)."""
    tokens = torch.arange(n, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)  # (N,) sequence of each token
    back = tokens[:, None] - tokens[None, :]
    mask = (sequence[:, None] == sequence[None, :]) & (back >= 0)
    return mask & (back < window) if window is not None else mask


# Each packed row's (1, 1, N, N) masks, by the row's ``cu_seqlens`` tensor (held weakly: a mask lives
# as long as its row's bounds, which klppo's forwards pass to every layer as the same tensor).
_ROW_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _row_mask(cu_seqlens: torch.Tensor, n: int, window: int | None) -> torch.Tensor:
    """``block_causal_mask`` of a packed row, built once per forward (as transformers builds its own
    mask once) where its layers share the row's bounds, instead of N^2 work in every layer."""
    masks = _ROW_MASKS.setdefault(cu_seqlens, {})
    if (n, window) not in masks:
        masks[(n, window)] = block_causal_mask(cu_seqlens, n, window)[None, None]
    return masks[(n, window)]


def _unmasked(attention_mask) -> tuple[torch.Tensor | None, int | None]:
    """(the mask, the window): a ``SlidingWindow`` is no mask, but a window."""
    if isinstance(attention_mask, SlidingWindow):
        return None, attention_mask.size
    return attention_mask, None


def _causal_sdpa(module, query, key, value, window: int | None, dropout: float, scaling) -> torch.Tensor:
    """sdpa over rows (B, H, L, D) that are each one sequence without padding: causal, and within
    ``window`` where one is given and the rows are longer -> (B, L, H, D)."""
    length = query.shape[2]
    mask = None
    if window is not None and length > window:
        mask = block_causal_mask(torch.tensor([0, length], device=query.device), length, window)[None, None]
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)[0]


def packed_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """torch's varlen kernel over a packed row (``cu_seq_lens_q``, ``max_length_q``); plain sdpa otherwise.

    query (1, H, N, D), key/value (1, Hkv, N, D) -> (1, N, H, D). Where the kernel cannot run
    (fp32, dropout, or a sliding window on torch 2.10) a packed row gets ``packed_masked_attention``'s
    one masked sdpa call instead: exact, still one kernel per layer; ``packed_attention_for``
    never picks this for an fp32 run.
    """
    return _one_call_per_packed_row(module, query, key, value, attention_mask, dropout, scaling, kwargs, kernel=True)


def packed_masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One sdpa call over a packed row with ``block_causal_mask`` built here from the row's
    sequences; plain sdpa otherwise. transformers' own sdpa would find the sequences in the
    position ids while it builds the mask, which not every model hands it (OPT does not: its packed
    tokens attended across sequences); here they come from what the attention receives."""
    return _one_call_per_packed_row(module, query, key, value, attention_mask, dropout, scaling, kwargs, kernel=False)


def _one_call_per_packed_row(module, query, key, value, attention_mask, dropout, scaling, kwargs: dict, *,
                             kernel: bool):
    """A packed row in one call: torch's varlen kernel where ``kernel`` and it can run, else sdpa
    with the row's block-diagonal causal mask; any other row as transformers' sdpa runs it."""
    attention_mask, window = _unmasked(attention_mask)
    sequences = _packed_row_sequences(query, key, attention_mask, kwargs)
    if sequences is None:
        if window is not None:  # rows of one sequence each, no padding (``_packed_sdpa_mask``)
            return _causal_sdpa(module, query, key, value, window, dropout, scaling), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    assert getattr(module, "is_causal", True), "packed rows are for causal models"
    cu_seqlens, max_len = sequences  # max_len: an int from klppo's forwards (a tensor would sync per layer)
    if (not kernel or query.dtype not in VARLEN_DTYPES or dropout
            or (window is not None and not varlen_takes_windows())):
        mask = _row_mask(cu_seqlens, query.shape[2], window)  # (1, 1, N, N)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (N, H or Hkv, D)
    out = torch_varlen_causal(q, k, v, cu_seqlens.to(torch.int32), max_len, scaling, window)
    return out.unsqueeze(0), None  # (1, N, H, D)


def _segment_bounds(position_ids: torch.Tensor) -> list[int]:
    """Start of each packed sequence in one row of position ids (the first at 0, each next where
    the positions do not go on by one), then the row length."""
    starts = (torch.diff(position_ids) != 1).nonzero().flatten() + 1
    return [0] + starts.tolist() + [position_ids.shape[0]]  # host-device sync


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa, run causally on each sequence of a packed row; plain sdpa otherwise.

    query (B, H, L, D), key/value (B, Hkv, L, D) -> (B, L, H, D). A row is packed when no mask
    is given and its position ids restart (or ``cu_seq_lens_q`` marks the sequences).

    klppo's forwards pass each row's bounds ``[0, end_1, ..., L]`` as ``klppo_row_bounds``
    (``_bounds_kwargs``), read on the host once per forward. Without them (generation, other
    callers) they are read here from ``cu_seq_lens_q`` or the position ids: a host-device sync
    in every layer, which also stalls FSDP2's prefetch of the next layer.
    """
    rows, length = query.shape[0], query.shape[2]
    attention_mask, window = _unmasked(attention_mask)
    bounds = kwargs.pop(ROW_BOUNDS, None)
    position_ids = kwargs.get("position_ids")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if window is None and (attention_mask is not None or length != key.shape[2] or (
            bounds is None and position_ids is None and cu_seqlens is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if bounds is None and cu_seqlens is not None and rows == 1:
        bounds = [cu_seqlens.tolist()]  # host-device sync
    elif bounds is None and position_ids is not None:
        bounds = [_segment_bounds(position_ids.expand(rows, -1)[r]) for r in range(rows)]
    elif bounds is None:  # a window's rows without positions: one sequence each
        bounds = [[0, length]] * rows
    if all(len(b) <= 2 for b in bounds):  # one sequence per row: nothing is packed
        if window is not None:
            return _causal_sdpa(module, query, key, value, window, dropout, scaling), None
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    out = []
    for r, row_bounds in enumerate(bounds):
        lengths = [b - a for a, b in zip(row_bounds[:-1], row_bounds[1:]) if b > a]
        # One split per tensor: its backward is one concatenation, where slicing per sequence
        # would add a zero-filled full-size gradient per sequence.
        splits = (t[r : r + 1].split(lengths, dim=2) for t in (query, key, value))
        pieces = [_causal_sdpa(module, q, k, v, window, dropout, scaling) for q, k, v in zip(*splits)]
        out.append(torch.cat(pieces, dim=1))  # (1, L, H, D)
    return torch.cat(out, dim=0), None


def deterministic_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``packed_sdpa_attention`` with sdpa held to its math backend (``PACKED_DETERMINISTIC``): plain
    matmuls and a softmax, whose backward is the same every run, for packed rows, padded rows and
    generation alike. The backend is chosen in forward; backward follows the ops it recorded."""
    with sdpa_kernel(SDPBackend.MATH):
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)


def _packed_sdpa_mask(*args, **kwargs):
    """sdpa's mask, except for rows without padding, cache or mask overlays, whose sequences klppo's
    attention functions read from the positions: no mask for a causal layer, ``SlidingWindow`` for a
    sliding-window one (``local_size`` is the config's ``sliding_window``; a chunked layer's
    ``attention_chunk_size`` keeps its mask)."""
    plain = (kwargs.get("attention_mask") is None and not kwargs.get("use_vmap") and not kwargs.get("q_offset")
             and not kwargs.get("kv_offset") and kwargs.get("q_length") == kwargs.get("kv_length"))
    local, config = kwargs.get("local_size"), kwargs.get("config")
    if plain and local is None:
        return None
    if plain and local == getattr(config, "sliding_window", None) and local != getattr(config, "attention_chunk_size", None):
        return SlidingWindow(local)
    return sdpa_mask(*args, **kwargs)


for _name, _function in ((PACKED_SDPA, packed_sdpa_attention), (PACKED_VARLEN, packed_varlen_attention),
                         (PACKED_DETERMINISTIC, deterministic_sdpa_attention), (PACKED_MASKED, packed_masked_attention)):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, _packed_sdpa_mask)
