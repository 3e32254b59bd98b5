"""Log-probs and entropies straight from the final hidden states, slice by slice of the LM head.

Legend: N tokens, H hidden size, V vocab, W vocabulary entries per slice.

The naive path materialises the (N, V) logits, upcasts them to fp32, and autograd keeps several
(N, V) tensors alive for backward (logits, softmax, products): about 7 fp32 (N, V) tensors at
peak. Here the logits of all N tokens for W vocabulary entries at a time are computed, folded
into per-token running statistics and dropped; backward recomputes each slice's logits from the
saved hidden states and weight (verl's ``FusedLinearForPPO``: ``use_fused_kernels`` with
``impl_backend: torch``). Only (N, W) slices, the inputs and (N,) statistics exist at a time;
W = ceil(chunk_logits / N), so a slice holds about ``chunk_logits`` logits whatever N is. Where
one slice holds the whole vocabulary, its logits are kept for backward instead (``_keeps_logits``):
no more memory than a slice, and one matmul less.

Why slices of the vocabulary, not chunks of tokens: the weight's gradient is a sum over tokens,
so token chunks add a (V, H) product per chunk (V x H memory traffic each time), while a slice
of the vocabulary sees all tokens and writes its rows of the weight's gradient in one matmul;
and every matmul keeps N rows, which a CPU or GPU runs faster than a chunk of a hundred tokens.
The price: logsumexp is accumulated slice by slice (the running-max form of the online
softmax, Milakov & Gimelshein 2018), so values match the naive path to float rounding, not bit
for bit.

The math per token, with z = (h W^T + b) / temperature in fp32, p = softmax(z):
  log_prob = z[label] - logsumexp(z)
  entropy  = logsumexp(z) - sum_j p_j z_j  (= lse - mu)
  d log_prob / dz = onehot(label) - p
  d entropy  / dz = -p * (z - mu)          (from H = -sum p log p)
so dz = g_lp * onehot - p * (g_lp + g_H * (z - mu)), and d(h W^T + b) = dz / temperature.
The sum of squared probabilities (the optimal token baseline's input) rides along as one more
running sum, sum_j p_j^2 = sum_j exp(2 (z_j - m)) / s^2 with s = sum_j exp(z_j - m); it is
measured, never differentiated.

``fused_lm_head`` plugs this into a Hugging Face causal LM without calling its parts separately:
for the duration of one forward, the output embedding's ``forward`` (an instance attribute, so
the state dict and tied embeddings are untouched) returns [log-prob, entropy] per position
instead of logits. The head still runs inside the model's own forward, which is where FSDP2
has the root's parameters (embeddings, norm, head) gathered, and the result is the root's
output, whose backward hook gathers them again before this backward runs.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from klppo.errors import UserError

DEFAULT_CHUNK_LOGITS = 2**24  # 64 MB of fp32 per slice; see benchmarks/README.md ("Logits memory")


def _slice_width(tokens: int, vocab: int, chunk_logits: int) -> int:
    return min(vocab, max(1, -(-chunk_logits // max(tokens, 1))))


def _slice_logits(hidden, weight, bias, start: int, width: int) -> torch.Tensor:
    """(N, W) logits of vocabulary entries [start, start + W) in the model's dtype, as its head computes them."""
    cols = slice(start, start + width)
    return F.linear(hidden, weight[cols], None if bias is None else bias[cols])


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature, upcast as the naive path does (a fresh tensor: safe to modify)."""
    z = z.float()
    return z.div_(temperature) if temperature != 1.0 else z


def _fold_slice(z, labels, m, s, t, q, picked, temperature: float):
    """One slice's logits (N, W), in the model's dtype, folded into the running max ``m``, sum of
    exp(z - m) ``s``, sum of exp(z - m) * z ``t`` (None without entropy), sum of exp(2 (z - m)) ``q``
    (None without the sum of squared probabilities) and ``picked`` z[label] (``labels`` relative to
    the slice): the running-max form of the online softmax. Returns the five new (N,) statistics.
    Eager, this is 8 passes over the slice in fp32; compiled on CUDA (``_on_device``) inductor
    fuses them into two reads of the slice."""
    z = _scaled(z, temperature)
    new_m = torch.maximum(m, z.amax(-1))
    scale = torch.exp(m - new_m)  # 0 on the first slice (m = -inf)
    e = torch.sub(z, new_m[:, None]).exp_()
    s = s * scale + e.sum(-1)
    if q is not None:
        q = q * scale.square() + e.square().sum(-1)
    if t is not None:
        t = t * scale + e.mul_(z).sum(-1)
    return new_m, s, t, q, picked + _at_labels(z, labels)


def _slice_grad(z, labels, lse, mu, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """d(loss) / d(slice logits), (N, W) in the model's dtype (the gradient its head output would get),
    from the recomputed logits ``z`` in that dtype. Compiled on CUDA: one read and one write."""
    dz = _grad_logits(_scaled(z, temperature), labels, lse, mu, g_lp, g_ent)
    return dz.div_(temperature).to(z.dtype)


def _keeps_logits(width: int, vocab: int, needs_grad: bool, compiled: bool | None, device_tensor) -> bool:
    """Whether forward keeps its logits for backward: where one slice is the whole vocabulary and a
    gradient will be asked for, eager (where the head's numbers are pinned). Backward then reads
    the very values it would recompute (the same matmul of the same inputs, scaled the same way),
    so the gradients are the same bit for bit; at issue #33's size (512 tokens x 4,096) that
    spares a 512 x 256 x 4,096 matmul per micro-batch, about 5 ms on one CPU thread."""
    return width >= vocab and needs_grad and not _compiles(compiled, device_tensor)


# Where inductor could not compile the slice functions (a torch version or device it does not
# manage), the head runs them eagerly from then on, after one warning.
_COMPILED: dict[str, object] = {}
_COMPILE_FAILED: list[str] = []


def _on_device(fn, compiled: bool | None, *args):
    """``fn(*args)``, compiled by torch.compile (dynamic shapes: one compilation for every token count
    and slice width) where ``compiled`` says so (None: on CUDA), eagerly otherwise. Eager on CPU,
    where the head's results are pinned bit for bit; a compilation that fails (anything but running
    out of memory) warns once and runs eagerly, as every later call does."""
    if not _compiles(compiled, args[0]):
        return fn(*args)
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    try:
        return _COMPILED[fn.__name__](*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - an optimisation must never be why a run fails
        _COMPILE_FAILED.append(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        warnings.warn(f"fused LM head: torch.compile failed ({_COMPILE_FAILED[0]}); its slices run eagerly "
                      "(correct, slower on a GPU)", stacklevel=2)
        return fn(*args)


def _compiles(compiled: bool | None, tensor: torch.Tensor) -> bool:
    """Whether ``_on_device`` compiles for ``tensor``'s device (``compiled`` None: on CUDA)."""
    return (tensor.is_cuda if compiled is None else compiled) and not _COMPILE_FAILED


class _ChunkedHead(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) | None, labels (N,)) -> log-probs (N,) [, entropies (N,)]
    [, sums of squared probabilities (N,), never differentiable]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, chunk_logits: int, with_entropy: bool,
                entropy_grad: bool = True, compiled: bool | None = None, with_sum_pi_squared: bool = False):
        n, vocab = hidden.shape[0], weight.shape[0]
        width = _slice_width(n, vocab, chunk_logits)
        m = hidden.new_full((n,), float("-inf"), dtype=torch.float32)  # running max of z
        s = torch.zeros_like(m)  # running sum of exp(z - m)
        t = torch.zeros_like(m) if with_entropy else None  # running sum of exp(z - m) * z
        q = torch.zeros_like(m) if with_sum_pi_squared else None  # running sum of exp(2 (z - m))
        picked = torch.zeros_like(m)  # z[label]
        ctx.logits = None  # (N, V) fp32 logits / temperature of the one slice, kept for backward
        if _keeps_logits(width, vocab, any(ctx.needs_input_grad[:3]), compiled, hidden):
            ctx.logits = _scaled(_slice_logits(hidden, weight, bias, 0, width), temperature)  # what _fold_slice makes
            m, s, t, q, picked = _fold_slice(ctx.logits, labels, m, s, t, q, picked, 1.0)
        for start in range(0, vocab, width) if ctx.logits is None else ():
            z = _slice_logits(hidden, weight, bias, start, width)  # (N, W)
            m, s, t, q, picked = _on_device(_fold_slice, compiled, z, labels - start, m, s, t, q, picked, temperature)
        lse = m + s.log()
        mu = t / s if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mu)
        ctx.temperature, ctx.width, ctx.compiled = temperature, width, compiled
        ctx.set_materialize_grads(False)
        ctx.with_entropy = with_entropy
        outputs = [picked - lse]
        if with_entropy:
            outputs.append(lse - mu)
            if not entropy_grad:  # measured only: backward gets no gradient for it and skips its term
                ctx.mark_non_differentiable(outputs[-1])
        if with_sum_pi_squared:  # sum_j p_j^2 = sum_j exp(2 (z_j - m)) / s^2: a measurement, never differentiated
            outputs.append(q / s.square())
            ctx.mark_non_differentiable(outputs[-1])
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, grad_log_probs, *grad_measured):
        grad_entropy = grad_measured[0] if ctx.with_entropy else None
        hidden, weight, bias, labels, lse, mu = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if want_h else None  # summed over slices
        grad_w = torch.zeros_like(weight) if want_w else None  # one slice of rows at a time
        grad_b = torch.zeros_like(bias) if want_b else None
        if grad_log_probs is None and grad_entropy is None:
            return _as(grad_h, hidden), grad_w, grad_b, None, None, None, None, None, None, None
        for start in range(0, weight.shape[0], ctx.width):
            cols = slice(start, start + ctx.width)
            if ctx.logits is not None:  # the one slice's, kept: _slice_grad on them without its _scaled
                dz = _grad_logits(ctx.logits, labels, lse, mu, grad_log_probs, grad_entropy)
                dz, ctx.logits = dz.div_(ctx.temperature).to(hidden.dtype), None
            else:
                z = _slice_logits(hidden, weight, bias, start, ctx.width)
                dz = _on_device(_slice_grad, ctx.compiled, z, labels - start, lse, mu, grad_log_probs, grad_entropy,
                                ctx.temperature)  # (N, W) in the model's dtype
            if want_w:
                torch.mm(dz.T, hidden, out=grad_w[cols])
            if want_b:
                grad_b[cols] = dz.float().sum(0)
            if want_h:
                _accumulate(grad_h, dz, weight[cols])
        return _as(grad_h, hidden), grad_w, grad_b, None, None, None, None, None, None, None


def _at_labels(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N,) z[i, labels[i]] where the label falls in this slice ([0, W)), else 0; no host-device sync."""
    inside = (labels >= 0) & (labels < z.shape[1])
    return z.gather(-1, labels.clamp(0, z.shape[1] - 1)[:, None]).squeeze(-1) * inside


def _grad_logits(z, labels, lse, mu, g_lp, g_ent) -> torch.Tensor:
    """d(loss)/dz for one vocabulary slice: g_lp * onehot - p * (g_lp + g_ent * (z - mu)).

    z (N, W) is reused in place; ``labels`` are relative to the slice (outside [0, W) where the
    label lies in another slice, which then gets no one-hot term).
    """
    p = torch.sub(z, lse[:, None]).exp_()  # softmax(z), from the forward's logsumexp
    if g_ent is not None:
        coef = z.sub_(mu[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        dz = p.mul_(coef).neg_()
    else:
        dz = p.mul_(g_lp[:, None]).neg_()
    if g_lp is not None:
        inside = (labels >= 0) & (labels < z.shape[1])
        dz.scatter_add_(-1, labels.clamp(0, z.shape[1] - 1)[:, None], (g_lp * inside)[:, None])
    return dz


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b: in place when a, b are fp32, else via their product in their dtype (CPU
    has no mixed-dtype matmul)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += (a @ b).float()


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_logits: int = DEFAULT_CHUNK_LOGITS,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((h W^T + b) / temperature)[label] (N,) and optionally the entropy (N,), both
    differentiable w.r.t. ``hidden`` (N, H), ``weight`` (V, H) and ``bias`` (V,), holding about
    ``chunk_logits`` logits at a time (vocabulary slices of ceil(chunk_logits / N) entries).
    Equals ``logprobs_from_logits`` / ``entropy_from_logits`` on
    ``F.linear(hidden, weight, bias).float() / temperature`` up to float rounding.
    ``entropy_grad=False``: the entropy is not differentiable (a metric), and backward skips its
    term, one pass less over each slice's logits.
    ``compiled``: each slice's elementwise work compiled by torch.compile (None: on CUDA; ``_on_device``).
    """
    log_probs, entropy, _ = chunked_token_scores(hidden, weight, labels, bias=bias, temperature=temperature,
                                                 chunk_logits=chunk_logits, with_entropy=with_entropy,
                                                 entropy_grad=entropy_grad, compiled=compiled)
    return log_probs, entropy


def chunked_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_logits: int = DEFAULT_CHUNK_LOGITS,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``chunked_logprobs``, and with ``with_sum_pi_squared`` each token's sum of squared
    probabilities sum_j softmax(z)_j^2 (N,) from the same pass over the slices (one more running
    sum; measured, never differentiable)."""
    if chunk_logits < 1:
        raise ValueError(f"chunk_logits={chunk_logits}: the logits per chunk must be at least 1")
    out = _ChunkedHead.apply(hidden, weight, bias, labels, float(temperature), int(chunk_logits), with_entropy,
                             entropy_grad, compiled, with_sum_pi_squared)
    out = list(out) if isinstance(out, tuple) else [out]
    log_probs, entropy = out.pop(0), out.pop(0) if with_entropy else None
    return log_probs, entropy, out.pop(0) if with_sum_pi_squared else None


# What the output embedding returns in the probe forward: 1.0 first, so the scale is read off
# directly; magnitudes far apart, so a soft-capping (tanh) cannot pass for a constant factor.
_PROBE_VALUES = (1.0, -2.0, 8.0, -32.0)
_SCALES: "weakref.WeakKeyDictionary[torch.nn.Module, float | None]" = weakref.WeakKeyDictionary()


def _probe_output(shape: torch.Size, vocab: int, device: torch.device) -> torch.Tensor:
    """(..., V) fp32 ``_PROBE_VALUES`` repeated along the vocabulary."""
    row = torch.tensor(_PROBE_VALUES, device=device).repeat(-(-vocab // len(_PROBE_VALUES)))[:vocab]
    return row.expand(*shape, vocab).contiguous()


@contextmanager
def _head_forward(head: torch.nn.Module, forward) -> Iterator[None]:
    """``head``'s forward replaced by ``forward`` (an instance attribute: the state dict and tied
    embeddings are untouched) until the block ends, however it ends."""
    own = vars(head).get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if own is not None:
            head.forward = own
        else:
            del head.forward


@torch.no_grad()
def _measure_logit_scale(model: torch.nn.Module, device: torch.device) -> float | None:
    """One forward of two tokens in eval mode (no dropout: no random stream moves) in which the
    output embedding returns known numbers; the logits the model returns are compared with them."""
    head, sent = model.get_output_embeddings(), []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        sent.append(_probe_output(hidden.shape[:-1], head.out_features, hidden.device))
        return sent[-1]

    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with _head_forward(head, forward):
            logits = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False).logits
    finally:
        for module, mode in modes:
            module.training = mode
    if len(sent) != 1 or logits is None or logits.shape != sent[0].shape:
        return None
    logits = logits.float()
    scale = logits.flatten()[0].item()  # host-device sync, once per model
    if not (math.isfinite(scale) and scale > 0):
        return None
    return scale if torch.allclose(logits, scale * sent[0], rtol=1e-6, atol=0.0) else None


def head_logit_scale(model: torch.nn.Module, device: torch.device | None = None) -> float | None:
    """The constant c with ``model(...).logits == c * (its output embedding's output)``, or None where
    the model changes its logits otherwise after the head (Gemma2's soft-capping) or computes them
    without it.

    c is 1 for most models; Granite and GraniteMoe* divide by ``logits_scaling``, FalconH1
    multiplies by ``lm_head_multiplier``, HyperCLOVAX by ``logits_scaling`` (the same key, the
    other way round), Cohere by ``logit_scale``. A list of config keys would miss the next such
    model, so the model's own forward is measured, once per model, and cached. ``device``: where
    the model's inputs go (default: where its parameters are). Collective for a sharded model on
    its first call: every rank makes it at the same point, as every rank runs the same forwards.
    """
    if model not in _SCALES:
        device = device if device is not None else next(model.parameters()).device
        _SCALES[model] = _measure_logit_scale(model, device)
    return _SCALES[model]


def fused_head_unsupported(model: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """Why ``fused_lm_head`` cannot serve ``model`` (a reason naming the fix), or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return (f"{type(model).__name__}'s output embedding is a {type(head).__name__}, not a Linear; "
                f"set actor_rollout_ref.model.use_fused_kernels=false")
    if head_logit_scale(model, device) is None:
        return (f"{type(model).__name__} changes its logits after the LM head by more than a constant factor "
                f"(a soft-capping, for one), which the chunked head cannot do; "
                f"set actor_rollout_ref.model.use_fused_kernels=false")
    return None


@contextmanager
def fused_lm_head(
    model: torch.nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_logits: int = DEFAULT_CHUNK_LOGITS,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    compiled: bool | None = None,
) -> Iterator[None]:
    """While open, ``model(...).logits`` is (..., 1 to 3) [log-prob, entropy if ``with_entropy``, sum
    of squared probabilities if ``with_sum_pi_squared``] of ``labels`` at the positions the head
    sees, instead of (..., V) logits (``entropy_grad``: as ``chunked_logprobs``').

    ``labels`` has the shape of the head's input without the hidden dim (what ``logits_to_keep``
    selects): (B, T') for the padded path, (1, n) or (n,) for a packed row. One forward only.
    The scores are those of the model's own logits: a constant factor c the model applies after
    the head (``head_logit_scale``) is folded into the temperature, z = c * head / T = head / (T / c),
    and the scores leave the head divided by c, which the model's own rescaling then undoes.
    ``compiled``: as in ``chunked_logprobs``.
    """
    unsupported = fused_head_unsupported(model, labels.device)
    if unsupported:
        raise UserError(unsupported)
    head, scale = model.get_output_embeddings(), head_logit_scale(model, labels.device)
    calls = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., 1 to 3)
        assert not calls, "fused_lm_head serves one forward; open it again for the next"
        calls.append(1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        scores = chunked_token_scores(flat, head.weight, labels.reshape(-1), bias=head.bias,
                                      temperature=temperature / scale, chunk_logits=chunk_logits,
                                      with_entropy=with_entropy, entropy_grad=entropy_grad,
                                      with_sum_pi_squared=with_sum_pi_squared, compiled=compiled)
        out = torch.stack([score for score in scores if score is not None], -1)
        out = out if scale == 1.0 else out / scale
        return out.view(*hidden.shape[:-1], out.shape[-1])

    with _head_forward(head, forward):
        yield
    if not calls:
        raise UserError(f"{type(model).__name__}'s forward never called its output embedding; "
                        f"set actor_rollout_ref.model.use_fused_kernels=false")
