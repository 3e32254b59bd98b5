"""Forwards over prompt + response sequences: per-token log-probs, entropies and values.

Legend: B batch, P prompt length (left-padded), T response length (right-padded), L = P + T,
V vocab, N real tokens of a packed batch. A sequence is ``cat(prompt_ids, response_ids)``; the
output at position ``i`` predicts the token at ``i + 1``, so the response's log-probs come
from positions ``P - 1 .. L - 2``. Whatever the path, results come back as (B, T) in the
batch's response slots, 0 where the response is padding, so nothing downstream changes.

Two paths:
- padded (default): the batch as it is, with columns that are padding in every row trimmed
  first (a micro-batch only pays for its own longest prompt and response).
- packed (``packed=True``, verl's ``use_remove_padding``): the real tokens of all rows in one
  (1, N) row, position ids restarting at 0 per sequence, no attention mask.

What transformers 5.24 does with a packed row (checked by tests/models/test_packed_forward.py):
``masking_utils._preprocess_mask_arguments`` looks for packed sequences in ``position_ids``
(a new sequence wherever the position does not grow by 1) only when the 2-D attention mask
is None AND there is no cache. With ``use_cache=False`` the sdpa and eager implementations
then get a block-diagonal causal mask and each sequence sees only itself: exact. With the
cache on (a causal LM's default when ``config.use_cache`` is true) the detection is skipped
and every token attends to the earlier sequences of the row, silently. So every forward here
passes ``use_cache=False``, and the sequences' bounds as flash-attention's ``cu_seq_lens_*`` /
``max_length_*`` keyword arguments. Which attention runs the row (one varlen kernel per layer
on CUDA, a loop over the sequences on CPU) is chosen once per run: ``klppo.models.attention``.

How log-probs are read from the head (``HeadSettings``): by default the (.., V) logits are
computed whole, upcast to fp32 and reduced; ``fused`` reads them chunk by chunk through the
head instead (``klppo.models.fused_head``), never holding the logits of all tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from klppo.algo import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from klppo.data.batching import PackedBatch, RowSpans, host_to, pack, row_spans, span_index
from klppo.models.attention import ROW_BOUNDS, ROW_BOUNDS_IMPLEMENTATIONS
from klppo.models.fused_head import DEFAULT_CHUNK_LOGITS, fused_head_unsupported, fused_lm_head


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool -> (B, L) long positions counting real tokens only (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ---- where the response is read ----


def _trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, spans: RowSpans):
    """Drop the columns that are padding in every row -> (ids, mask, P', T')."""
    prompt_length = input_ids.shape[1] - response_length
    assert prompt_length >= 1, "a sequence needs at least one prompt column"
    if spans.contiguous:  # the first and last real column of every row, on the host already
        used = [c for s, e in zip(spans.starts, spans.ends) if e > s for c in (s, e - 1)]
    else:
        used = attention_mask.any(0).nonzero().flatten().tolist()  # host sync
    first = min([c for c in used if c < prompt_length], default=prompt_length - 1)
    last = max([c for c in used if c >= prompt_length], default=prompt_length)
    return input_ids[:, first : last + 1], attention_mask[:, first : last + 1], prompt_length - first, last + 1 - prompt_length


# labels -> a context in which the model's head returns per-token scores of those labels (fused_lm_head)
Head = Callable[[torch.Tensor], AbstractContextManager] | None


def _padded_forward(model, input_ids, attention_mask, response_length, lm: bool, spans: RowSpans, head: Head = None):
    """(B, T', ...) model outputs at the positions that predict the response, the labels (B, T') and T'."""
    ids, mask, p, t = _trim_padding(input_ids, attention_mask, response_length, spans)
    labels = ids[:, p : p + t]
    extra = {"logits_to_keep": torch.arange(p - 1, p - 1 + t, device=ids.device)} if lm else {}
    extra.update(_bounds_kwargs(model, [[0, ids.shape[1]]] * ids.shape[0]))  # one sequence per row
    with head(labels) if head else nullcontext():
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                    use_cache=False, **extra)
    logits = out.logits if lm else out.logits[:, p - 1 : p - 1 + t]
    return logits, labels, t


def _bounds_kwargs(model, bounds: list[list[int]]) -> dict:
    """``{ROW_BOUNDS: bounds}`` for a model whose attention loops over the sequences (PACKED_SDPA,
    PACKED_DETERMINISTIC): transformers hands the model's keyword arguments to every attention call,
    and gradient checkpointing's recomputation keeps them; nothing for other attention
    implementations, which take no such argument."""
    return {ROW_BOUNDS: bounds} if model.config._attn_implementation in ROW_BOUNDS_IMPLEMENTATIONS else {}


def _packed_reads(packed: PackedBatch, attention_mask: torch.Tensor, response_length: int, spans: RowSpans):
    """Packed positions whose next token is a real response token, and that token's (row, slot)."""
    length = attention_mask.shape[1]
    prompt_length = length - response_length
    if spans.contiguous:  # columns max(start, P - 1) .. end - 2 of each row: host arithmetic
        first = [max(s, prompt_length - 1) for s in spans.starts]
        rows, cols, within = span_index(spans, first, [e - 1 for e in spans.ends])
        offsets = torch.tensor([0, *itertools.accumulate(spans.lengths)][:-1], dtype=torch.long)
        index = torch.stack([offsets[rows] + within, rows, cols + 1 - prompt_length])
        return host_to(index, attention_mask.device).unbind()
    nxt = (packed.cols + 1).clamp(max=length - 1)
    read = (packed.cols >= prompt_length - 1) & (packed.cols < length - 1) & attention_mask[packed.rows, nxt]
    positions = read.nonzero().flatten()  # (n,); host sync
    return positions, packed.rows[positions], packed.cols[positions] + 1 - prompt_length


def _packed_forward(model, input_ids, attention_mask, response_length, lm: bool, spans: RowSpans, head: Head = None):
    """(n, ...) outputs at the packed positions that predict real response tokens, their labels and slots."""
    packed = pack(input_ids, attention_mask, spans)
    positions, rows, slots = _packed_reads(packed, attention_mask.bool(), response_length, spans)
    labels = input_ids[rows, slots + input_ids.shape[1] - response_length]  # (n,)
    extra = {"logits_to_keep": positions} if lm else {}
    extra.update(_bounds_kwargs(model, [list(itertools.accumulate(packed.lengths, initial=0))]))
    with head(labels) if head else nullcontext():
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                    use_cache=False, **_varlen(packed), **extra)
    logits = out.logits[0] if lm else out.logits[0, positions]  # (n, V) or (n, 1)
    return logits, labels, rows, slots


def _varlen(packed: PackedBatch) -> dict:
    """flash-attention's varlen arguments: the packed attentions (PACKED_VARLEN, flash_attention_2) run
    the row's sequences from them; sdpa/eager ignore them (their mask comes from the position ids)."""
    return {"cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
            "max_length_q": packed.max_seqlen, "max_length_k": packed.max_seqlen}


def _row_groups(lengths: tuple[int, ...], max_tokens: int | None) -> list[slice]:
    """Consecutive rows whose real tokens (``lengths``, on the host) fit ``max_tokens`` (one group when it is None)."""
    rows = len(lengths)
    if max_tokens is None:
        return [slice(0, rows)]
    groups, start, used = [], 0, 0
    for row, n in enumerate(lengths):
        if used + n > max_tokens and row > start:
            groups.append(slice(start, row))
            start, used = row, 0
        used += n
    return groups + [slice(start, rows)]


# ---- the forwards ----


@dataclass(frozen=True)
class HeadSettings:
    """How response_logprobs reads log-probs and entropies from the LM head.

    fused: through the head one slice of the vocabulary at a time (``klppo.models.fused_head``),
        recomputing each slice's logits in backward; the (.., V) logits are never held whole. verl's
        ``actor_rollout_ref.model.use_fused_kernels`` with ``fused_kernel_options.impl_backend: torch``.
        None (the default): fused wherever the model's head allows it (a Linear head whose output
        the model changes by at most a constant factor, ``head_logit_scale``), the whole logits
        otherwise.
    chunk_logits: logits (tokens x vocabulary entries) the fused head computes at a time; it
        takes the vocabulary in slices of ceil(chunk_logits / tokens) entries. Memory grows
        with it (3 fp32 slices at peak), speed too up to a point (see benchmarks/README.md).
    entropy_chunking: unfused only; the entropy's softmax is computed for ``entropy_chunk_rows``
        rows at a time, which lowers the forward's peak (verl's ``actor.entropy_from_logits_with_chunking``).
    entropy_checkpointing: unfused only; the entropy's softmax is recomputed in backward
        instead of kept (verl's ``actor.entropy_checkpointing``).
    The fused head already does both; the two entropy options are ignored there.
    compiled: the fused head's per-slice elementwise work compiled by torch.compile (inductor fuses
        about 8 fp32 passes over each (tokens x slice) block into 2 in forward and 12 into 1 in
        backward); None (the default): on CUDA, never on CPU (where it would change pinned results).
    """

    fused: bool | None = None
    chunk_logits: int = DEFAULT_CHUNK_LOGITS
    entropy_chunking: bool = False
    entropy_chunk_rows: int = 2048
    entropy_checkpointing: bool = False
    compiled: bool | None = None

    def fused_for(self, model: torch.nn.Module, device: torch.device | None = None) -> bool:
        """Whether ``model``'s log-probs (inputs on ``device``) go through the fused head."""
        return self.fused if self.fused is not None else fused_head_unsupported(model, device) is None


class TokenScores(NamedTuple):
    """What one forward reads at the response tokens, each (B, T) and 0 on padding (None where not asked)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None  # sum_j pi_j^2 of each token's distribution, measured (no graph)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packed: bool = False,
    max_tokens: int | None = None,
    head: HeadSettings = HeadSettings(),
    spans: RowSpans | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of the response tokens under ``model``, and optionally entropies (B, T).

    Logits are divided by the sampling ``temperature`` first, as verl does, so the log-probs
    are those of the distribution the responses were sampled from. ``packed`` runs the rows
    as packed rows of at most ``max_tokens`` tokens each (a batch over it is split).
    ``spans``: the rows' ``RowSpans`` where the caller read them for a whole batch (then this
    forward waits for the device nowhere); read here otherwise, one host sync.
    ``entropy_grad=False``: the entropies are measured, not differentiated (no loss term uses
    them), and backward skips their pass over the logits.
    """
    scores = response_token_scores(model, input_ids, attention_mask, response_length, temperature=temperature,
                                   with_entropy=with_entropy, entropy_grad=entropy_grad, packed=packed,
                                   max_tokens=max_tokens, head=head, spans=spans)
    return scores.log_probs, scores.entropy


def response_token_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    packed: bool = False,
    max_tokens: int | None = None,
    head: HeadSettings = HeadSettings(),
    spans: RowSpans | None = None,
) -> TokenScores:
    """``response_logprobs``, and with ``with_sum_pi_squared`` each response token's sum of squared
    probabilities (verl's ``actor.calculate_sum_pi_squared``, which the optimal token baseline
    reads) from the same forward, measured without a graph."""
    spans = spans if spans is not None else row_spans(attention_mask)
    groups = _row_groups(spans.lengths, max_tokens) if packed else [slice(None)]
    if len(groups) > 1:
        parts = [response_token_scores(model, input_ids[g], attention_mask[g], response_length, temperature=temperature,
                                       with_entropy=with_entropy, entropy_grad=entropy_grad,
                                       with_sum_pi_squared=with_sum_pi_squared, packed=True, head=head,
                                       spans=spans.select(g)) for g in groups]
        return TokenScores(*(None if part[0] is None else torch.cat(part) for part in zip(*parts)))
    rows, mask = input_ids.shape[0], attention_mask.bool()
    head = replace(head, fused=head.fused_for(model, input_ids.device))
    fused = partial(fused_lm_head, model, temperature=temperature, chunk_logits=head.chunk_logits,
                    with_entropy=with_entropy, entropy_grad=entropy_grad, with_sum_pi_squared=with_sum_pi_squared,
                    compiled=head.compiled) if head.fused else None
    measured = dict(with_entropy=with_entropy, entropy_grad=entropy_grad, with_sum_pi_squared=with_sum_pi_squared)
    if packed:
        out, labels, out_rows, slots = _packed_forward(model, input_ids, mask, response_length, lm=True, spans=spans,
                                                       head=fused)
        scores = _token_scores(out, labels, temperature, head, **measured)  # each (n,)
        blank = torch.zeros(rows, response_length, device=input_ids.device)
        return TokenScores(*(None if x is None else blank.index_put((out_rows, slots), x) for x in scores))
    out, labels, t = _padded_forward(model, input_ids, mask, response_length, lm=True, spans=spans, head=fused)
    scores = _token_scores(out, labels, temperature, head, **measured)  # each (B, T')
    real = mask[:, -response_length:]  # (B, T)
    return TokenScores(*(None if x is None else torch.where(real, _widen(x, response_length), 0.0) for x in scores))


def _token_scores(out: torch.Tensor, labels: torch.Tensor, temperature: float, head: HeadSettings, *,
                  with_entropy: bool, entropy_grad: bool, with_sum_pi_squared: bool) -> tuple:
    """(..., V) logits, or the fused head's (..., 1 to 3) scores -> log-probs (...), and entropies (...)
    and sums of squared probabilities (...) where asked (None where not)."""
    if head.fused:  # the head's output stacks the wanted columns; a measured entropy is cut from the graph
        columns = iter(out.unbind(-1))
        log_probs = next(columns)
        entropy = next(columns) if with_entropy else None
        entropy = entropy.detach() if entropy is not None and not entropy_grad else entropy
        return log_probs, entropy, next(columns) if with_sum_pi_squared else None
    logits = out.float() / temperature
    squares = sum_pi_squared_from_logits(logits.detach()) if with_sum_pi_squared else None
    if not with_entropy:
        return logprobs_from_logits(logits, labels), None, squares
    entropy = partial(_chunked_entropy, rows=head.entropy_chunk_rows) if head.entropy_chunking else entropy_from_logits
    if not entropy_grad:
        return logprobs_from_logits(logits, labels), entropy(logits.detach()), squares
    if head.entropy_checkpointing and logits.requires_grad:
        return logprobs_from_logits(logits, labels), checkpoint(entropy, logits, use_reentrant=False), squares
    return logprobs_from_logits(logits, labels), entropy(logits), squares


def _chunked_entropy(logits: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """entropy_from_logits over (..., V), 2,048 rows at a time (verl's entropy_from_logits_with_chunking)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.cat([entropy_from_logits(chunk) for chunk in flat.split(rows)]).view(logits.shape[:-1])


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    packed: bool = False,
    max_tokens: int | None = None,
    spans: RowSpans | None = None,
) -> torch.Tensor:
    """Values (B, T): V(s_t) of the state before each response token (verl's convention).
    ``spans``: as in ``response_logprobs``."""
    spans = spans if spans is not None else row_spans(attention_mask)
    groups = _row_groups(spans.lengths, max_tokens) if packed else [slice(None)]
    if len(groups) > 1:
        return torch.cat([response_values(critic, input_ids[g], attention_mask[g], response_length, packed=True,
                                          spans=spans.select(g)) for g in groups])
    mask = attention_mask.bool()
    if packed:
        values, _, rows, slots = _packed_forward(critic, input_ids, mask, response_length, lm=False, spans=spans)
        out = torch.zeros(input_ids.shape[0], response_length, device=input_ids.device)
        return out.index_put((rows, slots), values[:, 0].float())
    values, _, _ = _padded_forward(critic, input_ids, mask, response_length, lm=False, spans=spans)
    return torch.where(mask[:, -response_length:], _widen(values[..., 0].float(), response_length), 0.0)


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T') -> (B, width), zeros on the right."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def sequence_scores(reward_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    *, packed: bool = False) -> torch.Tensor:
    """(B,) reward-model scores read at each sequence's last real token.

    The model runs as a whole (so FSDP2 gathers its parameters), and the score head's output
    at every position is taken from a hook; the last real position is picked here, so padding
    on either side (and pad == eos tokenizers) cannot move the read-out as Hugging Face's
    pad-token search would. ``packed`` runs the rows as one packed row without padding
    (``reward_model.model.use_remove_padding``); the scores are the same.
    """
    per_position = []
    hook = reward_model.score.register_forward_hook(lambda module, args, out: per_position.append(out))
    try:
        if packed:
            rows = pack(input_ids, attention_mask)
            bounds = _bounds_kwargs(reward_model, [list(itertools.accumulate(rows.lengths, initial=0))])
            reward_model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None,
                         use_cache=False, **_varlen(rows), **bounds)
        else:
            bounds = _bounds_kwargs(reward_model, [[0, input_ids.shape[1]]] * input_ids.shape[0])  # one sequence a row
            reward_model(input_ids=input_ids, attention_mask=attention_mask.long(),
                         position_ids=position_ids_from_mask(attention_mask), use_cache=False, **bounds)
    finally:
        hook.remove()
    if packed:  # (1, N, 1): each sequence ends just before the next one starts
        last = rows.cu_seqlens[1:].long() - 1
        return per_position[0][0, last, 0].float()
    scores = per_position[0][..., 0]  # (B, L): the head at every position
    last = attention_mask.shape[1] - 1 - attention_mask.long().flip(1).argmax(1)  # (B,) last True
    return scores[torch.arange(len(scores), device=scores.device), last].float()
