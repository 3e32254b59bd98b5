"""Every GPU measurement in one call, under 8 minutes: ``benchmarks/gpu_all.sh`` runs this.

Steps, in order, each a process of its own under a time cap (killed with its children at the cap),
and all of them under one deadline (``DEADLINE_S``): a step gets the smaller of its cap and the time
left, a required step runs with what is left, an optional one only if its whole cap still fits.

    smoke         benchmarks/gpu_smoke.sh --budget-s 150: every check of the GPU smoke test
    gpu_check     benchmarks/gpu_check.py at the 0.5B shape, bf16, --attn auto, and again with
                  gradient checkpointing (--compare-checkpointing): the actor update's MFU
    vs_trl        benchmarks/vs_trl.py --mode gpu --only grpo, where that file exists: klppo's GRPO
                  step against TRL's GRPOTrainer (TRL from .whl/ when the wheels are there)
    packed_attn   benchmarks/packed_attention.py --device cuda --dtype bfloat16: each packed-row attention
    generation    benchmarks/generation.py --decoding --before: dynamic vs static vs compiled KV cache vs
                  decoding through the FSDP2 actor (the path before the generation copy)
    optional, while time is left (check_*): gpu_check with --attn sdpa_mask, --attn sdpa_loop, --head
    eager (the fused head's slices uncompiled) and --reshard-after-forward false, one timed iteration.

Everything goes to ``$OUT`` (default ./gpu_out), in three files (the device tool brings back at most
8): ``logs.txt`` (versions, nvidia-smi, every step's whole output), ``figures.json`` (every step's
figures, rewritten after each step, so a call cut short keeps what finished) and ``summary.txt``
(each step's status, seconds, cap and headline figures: the table printed last).

    bash benchmarks/gpu_all.sh              # the GPU machine (the device tool: timeout_s 540)
    bash benchmarks/gpu_all.sh --cpu        # every step on tiny shapes on CPU (2-3 minutes)
    bash benchmarks/gpu_all.sh --dry-run    # the steps, their caps and the deadline; runs nothing
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 8 minutes less 20 s for installing carried wheels and the summary, counted from this process's start
# (the probe of versions included); the device tool's call gets 540 s
DEADLINE_S = 460
MIN_STEP_S = 30  # a required step that would get less is skipped


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]  # {json}: a file the step writes its figures to
    cap_s: int
    required: bool = True
    what: str = ""


@dataclass
class Outcome:
    status: str  # ok | failed (rc) | timeout | skipped (why)
    seconds: float = 0.0
    cap_s: float = 0.0
    headline: str = ""
    figures: dict = field(default_factory=dict)


def gpu_check(extra: list[str], cpu: bool, iterations: int = 3) -> list[str]:
    """gpu_check.py at the 0.5B shape (a warm-up and ``iterations - 1`` timed), or its tiny CPU run."""
    shape = ["--device", "cpu", "--size", "tiny", "--batch", "4", "--iterations", "2"] if cpu else [
        "--iterations", str(iterations)]
    return ["{python}", "benchmarks/gpu_check.py", *shape, "--json", "{json}", *extra]


def trl_wheels() -> list[str]:
    """``--trl-wheels .whl`` where TRL's wheels were carried (benchmarks/fetch_gpu_wheels.sh)."""
    return ["--trl-wheels", ".whl"] if list((ROOT / ".whl").glob("trl-*.whl")) else []


def plan(cpu: bool) -> list[Step]:
    """The steps of a GPU call, or of ``--cpu`` (the same steps on tiny shapes)."""
    optional = [Step(f"check_{tag}", gpu_check(extra, cpu, iterations=2), 75, required=False, what=what)
                for tag, extra, what in (
        ("sdpa_mask", ["--attn", "sdpa_mask"], "one masked sdpa call per layer"),
        ("sdpa_loop", ["--attn", "sdpa_loop"], "one sdpa call per sequence"),
        ("head_eager", ["--head", "eager"], "the fused head's slices not compiled"),
        ("no_reshard", ["--reshard-after-forward", "false"], "blocks kept gathered from forward to backward"))]
    steps = [
        Step("smoke", ["bash", "benchmarks/gpu_smoke.sh", "--budget-s", "150", *(["--cpu"] if cpu else [])], 165,
             what="gpu_smoke.sh, every check, 150 s budget"),
        Step("gpu_check", gpu_check(["--compare-checkpointing"], cpu), 110,
             what="actor update MFU at the 0.5B shape, bf16, without and with gradient checkpointing"),
    ]
    if (ROOT / "benchmarks" / "vs_trl.py").exists():
        mode = ["--mode", "cpu", "--tiny"] if cpu else ["--mode", "gpu", "--steps", "3", *trl_wheels()]
        steps.append(Step("vs_trl", ["{python}", "benchmarks/vs_trl.py", *mode, "--only", "grpo", "--json", "{json}"],
                          150, what="klppo's GRPO step against TRL's GRPOTrainer"))
    attention = (["--device", "cpu", "--hidden", "128", "--sequences", "4", "--min-len", "16", "--max-len", "48",
                  "--repeats", "1"] if cpu else ["--device", "cuda", "--dtype", "bfloat16"])
    steps.append(Step("packed_attn", ["{python}", "benchmarks/packed_attention.py", *attention, "--json", "{json}"],
                      40, what="each packed-row attention, forward and forward + backward"))
    decoding = (["--shape", "tiny", "--prompts", "2", "--n", "2", "--tokens", "4", "--repeats", "1", "--modes",
                 "dynamic", "static"] if cpu else ["--prompts", "16", "--n", "8", "--tokens", "128", "--repeats", "1"])
    steps.append(Step("generation", ["{python}", "benchmarks/generation.py", "--decoding", "--before", *decoding], 120,
                      what="HF decoding: dynamic, static, compiled, through the FSDP2 actor"))
    return steps + optional


# ---- running a step ----


def run_step(step: Step, cap_s: float, python: str, work: Path, log) -> tuple[int | None, str, float]:
    """Run ``step`` for at most ``cap_s`` seconds, its output line by line into ``log`` (and its last
    lines kept); at the cap its whole process group is stopped. (return code or None at the cap,
    its output's tail, seconds)."""
    figures = work / f"{step.name}.json"
    command = [python if part == "{python}" else str(figures) if part == "{json}" else part for part in step.command]
    log.write(f"\n===== {step.name}: {' '.join(command)} (cap {cap_s:.0f} s)\n")
    log.flush()
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail: collections.deque[str] = collections.deque(maxlen=400)
    reader = threading.Thread(target=_copy_lines, args=(process.stdout, log, tail), daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        _stop(process)
        code = None
    reader.join(timeout=10)
    seconds = time.perf_counter() - start
    log.write(f"===== {step.name}: {'timed out' if code is None else f'exit {code}'} after {seconds:.1f} s\n")
    log.flush()
    return code, "".join(tail), seconds


def _copy_lines(stream, log, tail) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        tail.append(line)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL 10 s later if it is still there."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# ---- headlines ----


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def smoke_headline(output: str, figures: dict) -> str:
    counts = re.findall(r"gpu_smoke: (\d+) passed, (\d+) failed, (\d+) skipped", output)
    total = re.findall(r"total ([\d.]+) since", output)
    failed = [line[6:].split(":")[0] for line in output.splitlines() if line.startswith("FAIL")]
    text = f"{'/'.join(counts[-1])} passed/failed/skipped" if counts else "no verdict line"
    figures.update(counts=counts[-1] if counts else None, total_s=float(total[-1]) if total else None, failed=failed)
    return text + (f" in {total[-1]} s" if total else "") + (f"; FAIL: {', '.join(failed)}" if failed else "")


def gpu_check_headline(output: str, figures: dict) -> str:
    if "actor_update_mfu" not in figures:
        return "no figures"
    f, text = figures, ""
    text = (f"MFU {_pct(f['actor_update_mfu'])} (vs measured peak {_pct(f['actor_update_mfu_vs_measured_peak'])}), "
            f"{f['actor_update_tokens_per_s_per_gpu']:.0f} tok/s, update {f['phase_seconds_mean']['update_actor']:.3f} s, "
            f"peak {f['peak_memory_gb']:.1f} GB, {f['attn_implementation']}")
    if "with_checkpointing" in f:
        c = f["with_checkpointing"]
        text += f"; ckpt MFU {_pct(c['actor_update_mfu'])}, {c['actor_update_tokens_per_s_per_gpu']:.0f} tok/s"
    return text


def packed_attn_headline(output: str, figures: dict) -> str:
    rows = figures.get("rows", [])
    widest = max((r["hidden"] for r in rows), default=None)
    return f"hidden {widest}, fwd+bwd s: " + ", ".join(
        f"{r['attn']} {r['forward_backward_s']:.3f}" for r in rows if r["hidden"] == widest) if rows else "no figures"


def generation_headline(output: str, figures: dict) -> str:
    lines = [line for line in output.splitlines() if line.startswith('{"decoding"')]
    if not lines:
        return "no figures"
    figures.update(json.loads(lines[-1]))
    return "tok/s " + ", ".join(f"{mode} {r['tokens_per_s']:.0f}" + (f" (first call {r['first_call_s']:.1f} s)"
                                                                    if mode == "compiled" else "")
                                for mode, r in figures["decoding"].items())


def vs_trl_headline(output: str, figures: dict) -> str:
    ratios = [" ".join(line.split()) for line in output.splitlines() if " / trl-" in line]
    return "; ".join(ratios[-2:]) if ratios else "no comparison line"


HEADLINES = {"smoke": smoke_headline, "packed_attn": packed_attn_headline, "generation": generation_headline,
             "vs_trl": vs_trl_headline}


def headline(step: Step, output: str, figures: dict) -> str:
    try:
        return HEADLINES.get(step.name, gpu_check_headline)(output, figures)
    except (KeyError, TypeError, ValueError) as error:  # a step that printed less than expected
        return f"(no headline: {type(error).__name__}: {error})"


# ---- the call ----


def environment(python: str) -> str:
    """Versions (in a child process: this one makes no CUDA context) and nvidia-smi's report."""
    probe = ("import platform, torch, transformers; c = torch.cuda.is_available(); "
             "print(f'python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), '"
             "f'transformers {transformers.__version__}, device {torch.cuda.get_device_name(0) if c else \"cpu\"}')")
    lines = []
    for command in ([python, "-c", probe], ["nvidia-smi"], ["git", "-C", str(ROOT), "log", "-1", "--oneline"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
            lines.append((done.stdout + done.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as error:
            lines.append(f"{command[0]}: {error}")
    return "\n".join(lines)


def step_budget(step: Step, left: float) -> tuple[float | None, str]:
    """(seconds the step may run, or None with why it is skipped) given the seconds ``left``."""
    if step.required and left >= MIN_STEP_S:
        return min(step.cap_s, left), ""
    if not step.required and left >= step.cap_s:
        return step.cap_s, ""
    return None, f"skipped: {left:.0f} s left of the {DEADLINE_S} s deadline"


def run_all(steps: list[Step], python: str, out: Path, deadline_s: float) -> dict[str, Outcome]:
    """Every step under the deadline; figures.json rewritten after each."""
    start, outcomes = time.perf_counter(), {}
    work = Path(tempfile.mkdtemp(prefix="gpu_all_"))
    with open(out / "logs.txt", "a") as log:
        for step in steps:
            cap, why = step_budget(step, deadline_s - (time.perf_counter() - start))
            if cap is None:
                outcomes[step.name] = Outcome(why, cap_s=step.cap_s)
                continue
            print(f"gpu_all: {step.name} (cap {cap:.0f} s): {step.what}", flush=True)
            code, output, seconds = run_step(step, cap, python, work, log)
            figures_file = work / f"{step.name}.json"
            figures = json.loads(figures_file.read_text()) if figures_file.exists() else {}
            status = "timeout" if code is None else "ok" if code == 0 else f"failed ({code})"
            outcomes[step.name] = Outcome(status, seconds, cap, headline(step, output, figures), figures)
            print(f"gpu_all: {step.name}: {status} in {seconds:.1f} s: {outcomes[step.name].headline}", flush=True)
            (out / "figures.json").write_text(json.dumps(
                {name: {"status": o.status, "seconds": o.seconds, "figures": o.figures} for name, o in outcomes.items()},
                indent=1, default=str) + "\n")
    return outcomes


def summary(outcomes: dict[str, Outcome], versions: str, total_s: float) -> str:
    rows = [(name, o.status, f"{o.seconds:.0f}", f"{o.cap_s:.0f}", o.headline) for name, o in outcomes.items()]
    widths = [max(len(r[i]) for r in rows + [("step", "status", "s", "cap", "")]) for i in range(4)]
    lines = [versions.splitlines()[0] if versions else "", f"total {total_s:.0f} s (deadline {DEADLINE_S} s)",
             "  ".join(h.ljust(w) for h, w in zip(("step", "status", "s", "cap"), widths)) + "  headline"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join(lines) + "\n"


def dry_run(steps: list[Step], deadline_s: float) -> None:
    for step in steps:
        kind = "required" if step.required else "optional"
        print(f"{step.name:<17} {kind:<8} cap {step.cap_s:>4} s  {' '.join(step.command)}")
    required = sum(s.cap_s for s in steps if s.required)
    print(f"deadline {deadline_s:.0f} s (8 minutes: 480 s); required steps' caps add up to {required} s; "
          "each step runs for at most the smaller of its cap and the time left; a required step that would get "
          f"under {MIN_STEP_S} s and an optional one whose cap no longer fits are skipped")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="every step on tiny shapes on CPU")
    p.add_argument("--dry-run", action="store_true", help="list the steps, their caps and the deadline")
    p.add_argument("--only", nargs="+", help="these steps only (names as --dry-run lists them)")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu_out"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = [s for s in plan(args.cpu) if not args.only or s.name in args.only]
    if args.dry_run:
        dry_run(steps, args.deadline_s)
        return 0
    start = time.perf_counter()
    python = os.environ.get("PYTHON", sys.executable)
    versions = environment(python)
    if not args.cpu and "device cpu" in versions.splitlines()[0]:
        print("gpu_all: no CUDA device is visible; `bash benchmarks/gpu_all.sh --cpu` runs every step on CPU",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs.txt").write_text(versions + "\n")
    print(versions, flush=True)
    outcomes = run_all(steps, python, args.out, args.deadline_s - (time.perf_counter() - start))
    text = summary(outcomes, versions, time.perf_counter() - start)
    (args.out / "summary.txt").write_text(text)
    print("\n" + text, flush=True)
    return 0 if all(o.status == "ok" or o.status.startswith("skipped") for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
