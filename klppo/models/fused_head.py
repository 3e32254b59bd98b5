"""Log-probs and entropies straight from the final hidden states, chunk by chunk through the LM head.

Legend: N tokens, H hidden size, V vocab, C tokens per chunk.

The naive path materialises the (N, V) logits, upcasts them to fp32, and autograd keeps several
(N, V) tensors alive for backward (logits, softmax, products): about 7 fp32 (N, V) tensors at
peak. Here the logits of C tokens at a time are computed, reduced to per-token numbers and
dropped; backward recomputes each chunk's logits from the saved hidden states and weight
(verl's ``FusedLinearForPPO``, ``use_fused_kernels`` with ``impl_backend: torch``). Only
(C, V) chunks, the inputs and the (N,) statistics exist at any time.

The math per token, with z = (h W^T + b) / temperature in fp32, p = softmax(z):
  log_prob = z[label] - logsumexp(z)
  entropy  = logsumexp(z) - sum_j p_j z_j  (= lse - mu)
  d log_prob / dz = onehot(label) - p
  d entropy  / dz = -p * (z - mu)          (from H = -sum p log p)
so dz = g_lp * onehot - p * (g_lp + g_H * (z - mu)), and d(h W^T + b) = dz / temperature.

``fused_lm_head`` plugs this into a Hugging Face causal LM without calling its parts separately:
for the duration of one forward, the output embedding's ``forward`` (an instance attribute, so
the state dict and tied embeddings are untouched) returns [log-prob, entropy] per position
instead of logits. The head still runs inside the model's own forward, which is where FSDP2
has the root's parameters (embeddings, norm, head) gathered, and the result is the root's
output, whose backward hook gathers them again before this backward runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 128  # tokens; see benchmarks/README.md ("Logits memory") for the measurements


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """(C, H) -> (C, V) fp32 logits / temperature; the matmul runs in the model's dtype, as the model's head does."""
    z = F.linear(h, weight, bias).float()  # a fresh tensor (a new one when upcast), safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedHead(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) | None, labels (N,)) -> log-probs (N,) [, entropies (N,)]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, chunk_size: int, with_entropy: bool):
        n = hidden.shape[0]
        lse = hidden.new_empty(n, dtype=torch.float32)
        log_probs = torch.empty_like(lse)
        mu = torch.empty_like(lse) if with_entropy else None
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(hidden[rows], weight, bias, temperature)  # (C, V)
            # The same ops as klppo.algo's logprobs_from_logits / entropy_from_logits, row for row.
            lse[rows] = torch.logsumexp(z, dim=-1)
            log_probs[rows] = z.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:
                mu[rows] = torch.softmax(z, dim=-1).mul_(z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mu)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return (log_probs, lse - mu) if with_entropy else log_probs

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        hidden, weight, bias, labels, lse, mu = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if want_h else None
        # Accumulated over chunks in fp32: a bf16 sum of many chunk products would round each time.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
        if grad_log_probs is None and grad_entropy is None:
            return grad_h, _as(grad_w, weight), _as(grad_b, bias), None, None, None, None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g_lp = None if grad_log_probs is None else grad_log_probs[rows]
            g_ent = None if grad_entropy is None else grad_entropy[rows]
            z = _chunk_logits(hidden[rows], weight, bias, ctx.temperature)
            dz = _grad_logits(z, labels[rows], lse[rows], None if mu is None else mu[rows], g_lp, g_ent)
            dz = dz.div_(ctx.temperature).to(hidden.dtype)  # the gradient the model's head output would get
            if want_h:
                grad_h[rows] = dz @ weight
            if want_w:
                _accumulate(grad_w, dz.T, hidden[rows])
            if want_b:
                grad_b += dz.float().sum(0)
        return grad_h, _as(grad_w, weight), _as(grad_b, bias), None, None, None, None


def _grad_logits(z, labels, lse, mu, g_lp, g_ent) -> torch.Tensor:
    """d(loss)/dz for one chunk: g_lp * onehot - p * (g_lp + g_ent * (z - mu)); z (C, V) is reused in place."""
    p = torch.sub(z, lse[:, None]).exp_()  # softmax(z), from the forward's logsumexp
    if g_ent is not None:
        coef = z.sub_(mu[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        dz = p.mul_(coef).neg_()
    else:
        dz = p.mul_(g_lp[:, None]).neg_()
    if g_lp is not None:
        dz.scatter_add_(-1, labels[:, None], g_lp[:, None])
    return dz


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b: in place when a, b are fp32 (no (V, H) temporary), else via a product in their dtype."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += (a @ b).float()  # CPU has no mixed-dtype mm; a (V, H) product in the model's dtype


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h W^T + b / temperature)[label] (N,) and optionally its entropy (N,), both
    differentiable w.r.t. ``hidden`` (N, H), ``weight`` (V, H) and ``bias`` (V,), never holding
    more than ``chunk_size`` rows of logits. Equals ``logprobs_from_logits`` /
    ``entropy_from_logits`` on ``(F.linear(hidden, weight, bias).float() / temperature)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: the tokens per logits chunk must be at least 1")
    out = _ChunkedHead.apply(hidden, weight, bias, labels, float(temperature), int(chunk_size), with_entropy)
    return out if with_entropy else (out, None)


# Heads whose logits the model changes after the head runs (Gemma2's soft-capping, Cohere's
# scale): the numbers this head returns are not logits and must not be transformed.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale")


@contextmanager
def fused_lm_head(
    model: torch.nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> Iterator[None]:
    """While open, ``model(...).logits`` is (..., 2) [log-prob, entropy] (or (..., 1) [log-prob])
    of ``labels`` at the positions the head sees, instead of (..., V) logits.

    ``labels`` has the shape of the head's input without the hidden dim (what ``logits_to_keep``
    selects): (B, T') for the padded path, (1, n) or (n,) for a packed row. One forward only.
    """
    config = getattr(model, "config", None)
    changed = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1.0)]
    if changed:
        raise ValueError(f"{type(model).__name__} transforms its logits after the LM head ({changed[0]}); "
                         f"the chunked head cannot; set actor_rollout_ref.model.use_fused_kernels=false")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}'s output embedding is a {type(head).__name__}, not a Linear; "
                         f"set actor_rollout_ref.model.use_fused_kernels=false")
    calls = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., 1 or 2)
        assert not calls, "fused_lm_head serves one forward; open it again for the next"
        calls.append(1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        lp, ent = chunked_logprobs(flat, head.weight, labels.reshape(-1), bias=head.bias, temperature=temperature,
                                   chunk_size=chunk_size, with_entropy=with_entropy)
        out = torch.stack([lp, ent], -1) if with_entropy else lp[:, None]
        return out.view(*hidden.shape[:-1], out.shape[-1])

    had_own = "forward" in vars(head)
    own = vars(head).get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward
    if not calls:
        raise ValueError(f"{type(model).__name__}'s forward never called its output embedding; "
                         f"set actor_rollout_ref.model.use_fused_kernels=false")
