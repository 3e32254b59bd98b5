"""The Memory and Time tables of ``klppo plan`` and the run-start block, as text."""

from __future__ import annotations

from typing import Optional

from klppo.plan.estimate import GiB, Estimate, Knob
from klppo.plan.memory import PhaseMemory
from klppo.plan.time import PhaseFlops, phase_seconds

# Table columns: which estimate items each sums (by the item's name).
COLUMNS = (
    ("weights", lambda k: k.endswith(" weights")),
    ("optim", lambda k: k.endswith(" optimiser")),
    ("grads", lambda k: k in ("gradients", "head gradients")),
    ("activ", lambda k: k == "activations"),
    ("logits", lambda k: "logits" in k),
    ("fsdp", lambda k: k == "gathered units"),
    ("gen", lambda k: k in ("generation copy", "KV cache") or k.startswith("vLLM")),
)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _columns(phase: PhaseMemory) -> list[float]:
    sums = [sum(b for k, b in phase.items if pick(k)) for _, pick in COLUMNS]
    return sums + [phase.total - sum(sums), phase.total]


def format_memory(e: Estimate) -> str:
    """One row per phase (GiB per rank): what it holds, by kind, and its total; then the verdict."""
    s = e.settings
    head = f"{'phase':<14}" + "".join(f"{name:>8}" for name, _ in COLUMNS) + f"{'other':>8}{'total':>8}"
    lines = [f"Memory per rank (GiB), {s.world_size} rank(s) on {s.device}, {_gib(s.device_bytes)} GiB each; "
             "steady state (optimiser state held from the first update on)", head, "-" * len(head)]
    for phase in e.phases:
        mark = " <- peak" if phase is e.peak else ""
        lines.append(f"{phase.phase:<14}" + "".join(f"{_gib(v):>8}" for v in _columns(phase)) + mark)
    other = [k for k, b in e.peak.items if b and not any(pick(k) for _, pick in COLUMNS)]
    lines.append(f"other = {', '.join(other) or 'nothing'} (in the peak phase)")
    return "\n".join(lines)


def format_verdict(e: Estimate, knobs: list[Knob]) -> str:
    peak, limit = e.peak.total, e.settings.device_bytes
    verdict = "fits" if peak <= limit else "does NOT fit"
    lines = [f"peak: {e.peak.phase}, {_gib(peak)} GiB of {_gib(limit)} GiB ({peak / limit:.0%}): {verdict}"]
    if peak > limit and knobs:
        lines.append("knobs that lower the peak, cheapest first: the estimated peak with each and those above it")
        lines += [f"  {k.override:<64} {_gib(k.peak_bytes):>7} GiB{'  fits' if k.fits else ''}" for k in knobs]
    return "\n".join(lines)


def format_time(flops: list[PhaseFlops], *, mfu: float, peak_flops: Optional[float], devices: int,
                device_name: str) -> str:
    """FLOPs per step by phase, and the seconds they take at ``mfu`` of the device's peak."""
    known = peak_flops is not None
    title = (f"Time per step at {mfu:.0%} MFU of {devices} x {device_name} ({peak_flops / 1e12:.0f} TFLOP/s each)"
             if known else f"FLOPs per step ({device_name}: no known peak; give --peak-tflops for the time)")
    lines = [title, f"{'phase':<14}{'TFLOPs':>12}{'seconds':>10}"]
    total = 0.0
    for f in flops:
        seconds = phase_seconds(f.flops, mfu, peak_flops, devices) if known else float("nan")
        total += seconds
        lines.append(f"{f.phase:<14}{f.flops / 1e12:>12.2f}{seconds:>10.2f}")
    lines.append(f"{'step':<14}{sum(f.flops for f in flops) / 1e12:>12.2f}{total:>10.2f}")
    return "\n".join(lines)


def format_start_block(e: Estimate, knobs: list[Knob], mode: str) -> str:
    """The run-start check's few lines: every phase's total on one line, the peak and the verdict."""
    phases = ", ".join(f"{p.phase} {_gib(p.total)}" for p in e.phases)
    lines = [f"[plan] memory per rank (GiB): {phases}", f"[plan] {format_verdict(e, knobs)}"]
    if mode != "off":
        lines.append(f"[plan] (trainer.plan_check={mode}; klppo plan CONFIG prints the whole plan)")
    return "\n".join(lines)
