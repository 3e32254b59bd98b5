"""Peak memory and time of log-probs + entropy + backward through the LM head: naive vs chunked.

What one measurement runs (CPU): hidden states (N, H) and an LM head weight (V, H), both
requiring grad, then
- naive: ``F.linear(hidden, weight).float() / temperature``, klppo.algo's
  ``logprobs_from_logits`` and ``entropy_from_logits`` on the whole (N, V) logits (what
  ``response_logprobs`` does today);
- chunked: ``klppo.models.fused_head.chunked_logprobs`` (``HeadSettings(fused=True)``),
and backward of an actor-like loss ``sum(log_prob * a) + sum(entropy * b)`` (random a, b).

Memory: each measurement runs in a fresh child process, whose peak RSS is reset after the
inputs are made (``/proc/self/clear_refs`` "5") and read from ``VmHWM``; "extra" is that peak
minus the RSS before the call. The gradients themselves (hidden (N, H) and weight (V, H), the
same for both paths and needed by any optimiser) are part of it; the "net" column leaves them
out. Both are given as multiples of one fp32 (N, V) logits tensor.
Time: the first call in the child for the large vocab (one call takes tens of seconds); for the
small vocab, both paths in one child, alternated (ABBA) after an untimed warm-up, the median.

    python benchmarks/logits_memory.py                      # the two shapes of issue 13, ~1.5 min
    python benchmarks/logits_memory.py --chunk-logits 22,23,24,25   # powers of two
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from klppo.algo import entropy_from_logits, logprobs_from_logits  # noqa: E402
from klppo.models.fused_head import DEFAULT_CHUNK_LOGITS, chunked_logprobs  # noqa: E402

GB = 1e9


def _inputs(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(v, (n,), generator=g)
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01


def _step(inputs, chunk: int | None, temperature: float, keep: list | None = None) -> float:
    """One forward + backward; chunk (logits per slice) None is the naive path. Returns seconds;
    ``keep`` gets the log-probs, entropies and gradients."""
    hidden, weight, labels, a, b = inputs
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    if chunk is None:
        logits = F.linear(hidden, weight).float() / temperature  # (N, V)
        lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
        del logits
    else:
        lp, ent = chunked_logprobs(hidden, weight, labels, temperature=temperature, chunk_logits=chunk,
                                   with_entropy=True)
    ((lp * a).sum() + (ent * b).sum()).backward()
    seconds = time.perf_counter() - start
    if keep is not None:
        keep.extend([lp.detach(), ent.detach(), hidden.grad, weight.grad])
    return seconds


def _differences(inputs, chunk: int, temperature: float) -> dict:
    """Largest |chunked - naive| of log-probs and entropies, and of each gradient relative to its largest entry."""
    naive, chunked = [], []
    _step(inputs, None, temperature, naive)
    _step(inputs, chunk, temperature, chunked)
    names = ["log_prob", "entropy", "grad_hidden", "grad_weight"]
    out = {n: float((c - r).abs().max()) for n, c, r in zip(names[:2], chunked, naive)}
    out.update({n: float((c - r).abs().max() / r.abs().max()) for n, c, r in zip(names[2:], chunked[2:], naive[2:])})
    out["bit_identical"] = all(torch.equal(c, r) for c, r in zip(chunked[:2], naive[:2]))
    return out


def _kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _child_memory(spec: dict) -> dict:
    """Peak extra RSS and seconds of the first call of one path, in this (fresh) process."""
    inputs = _inputs(spec["n"], spec["v"], spec["h"], getattr(torch, spec["dtype"]))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = _kb("VmRSS")
    seconds = _step(inputs, spec["chunk"], spec["temperature"])
    extra = (_kb("VmHWM") - before) * 1024
    grads = sum(t.grad.numel() * t.grad.element_size() for t in inputs[:2])
    return {"extra": extra, "grads": grads, "seconds": seconds}


def _child_time(spec: dict) -> dict:
    """Median seconds of each path, alternated ABBA after one untimed call of each."""
    inputs = _inputs(spec["n"], spec["v"], spec["h"], getattr(torch, spec["dtype"]))
    chunks = [None, *spec["chunks"]]
    times = {str(c): [] for c in chunks}
    for c in chunks:
        _step(inputs, c, spec["temperature"])
    for r in range(spec["repeats"]):
        for c in chunks if r % 2 == 0 else chunks[::-1]:
            times[str(c)].append(_step(inputs, c, spec["temperature"]))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": medians, "differences": {str(c): _differences(inputs, c, spec["temperature"])
                                                for c in spec["chunks"]}}


def _spawn(mode: str, spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child {mode} {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shape(args, n: int, v: int, time_in_one_child: bool) -> list[dict]:
    """One row per path: memory from a fresh child each; time from the same child or an ABBA child."""
    base = dict(n=n, v=v, h=args.hidden, dtype=args.dtype, temperature=args.temperature)
    rows = []
    for chunk in [None, *args.chunks]:
        mem = _spawn("memory", {**base, "chunk": chunk})
        rows.append({"vocab": v, "path": "naive" if chunk is None else f"chunked 2^{chunk.bit_length() - 1}", "chunk": chunk, **mem})
    if time_in_one_child:
        timed = _spawn("time", {**base, "chunks": args.chunks, "repeats": args.repeats})
        for row in rows:
            row["seconds"] = timed["seconds"][str(row["chunk"])]
            row["differences"] = timed["differences"].get(str(row["chunk"]))
    return rows


def _print(rows: list[dict], n: int, timing: str) -> None:
    logits = n * rows[0]["vocab"] * 4
    print(f"\nN={n} tokens x V={rows[0]['vocab']} (one fp32 logits tensor {logits / GB:.3f} GB); time: {timing}")
    print("| path | peak extra GB | x logits | net of grads GB | net x logits | s | s / naive |")
    print("|---|---|---|---|---|---|---|")
    naive = rows[0]["seconds"]
    for r in rows:
        net = r["extra"] - r["grads"]
        print(f"| {r['path']} | {r['extra'] / GB:.3f} | {r['extra'] / logits:.2f} | {net / GB:.3f} | "
              f"{net / logits:.2f} | {r['seconds']:.2f} | {r['seconds'] / naive:.2f} |")
    for r in rows:
        if r.get("differences"):
            d = r["differences"]
            print(f"{r['path']} vs naive: max |d log_prob| {d['log_prob']:.1e}, max |d entropy| {d['entropy']:.1e}, "
                  f"gradients max |d| / max |g|: hidden {d['grad_hidden']:.1e}, weight {d['grad_weight']:.1e}; "
                  f"values bit-identical: {d['bit_identical']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab-large", type=int, default=151_936)
    parser.add_argument("--vocab-small", type=int, default=4096)
    parser.add_argument("--chunk-logits", default=str(DEFAULT_CHUNK_LOGITS.bit_length() - 1),
                        help="comma-separated k: the chunked path with 2^k logits per vocabulary slice")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=6, help="timed calls of each path at the small vocab")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, spec = args.child
        print(json.dumps((_child_memory if mode == "memory" else _child_time)(json.loads(spec))))
        return
    args.chunks = [2 ** int(k) for k in args.chunk_logits.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, hidden {args.hidden}, "
          f"temperature {args.temperature}")
    if not args.skip_large:
        _print(_shape(args, args.tokens, args.vocab_large, False), args.tokens, "the first call, in each child")
    _print(_shape(args, args.tokens, args.vocab_small, True), args.tokens,
           f"median of {args.repeats} alternated calls after a warm-up")


if __name__ == "__main__":
    main()
