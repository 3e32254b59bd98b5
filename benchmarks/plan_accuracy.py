"""The memory plan's estimate beside the measured peak of every phase, on the memory benchmark's runs.

Runs ``benchmarks/memory.py``'s configurations (its model folder, task and ``klppo ppo`` runs,
imported, not copied) one at a time, and prints per phase: the plan's estimate
(``klppo.plan``, from config.json, the safetensors header and the data only), the measured
``perf/peak_memory_gb/<phase>`` and the error. The runs take one step (as memory.py's do), so
the estimate compared is the plan's first step (``phase_estimates(first_step=True)``): the
optimiser state is created by the first update and is absent before it, and the weights of a
file mapped in fp32 come in with the phase that first reads them; ``klppo plan`` prints the
steady state, which adds that state (a known 8 bytes per trained parameter and rank) to every
phase, and every model's weights.

    python benchmarks/plan_accuracy.py --baseline                 # the CPU baseline the plan adds
    python benchmarks/plan_accuracy.py                            # every configuration but vllm
    .venv-vllm/bin/python benchmarks/plan_accuracy.py --configs vllm-1   # the vLLM engine (CPU build)
    python benchmarks/plan_accuracy.py --configs full-1,ckpt-1 --layers 4   # a quick look

A configuration is ``<name>-<ranks>``. On the 0.5B shape, where weights and optimiser state make
most of the peak: full (offline GRPO + KL loss, full fine-tuning), lora (rank 16), ckpt (gradient
checkpointing), online (HF generate), naive (the unfused LM head: the whole logits of the
151,936-entry vocabulary). On a small shape (4 layers, hidden 512, saved in fp32), where
activations and logits make most of it: long (responses of ~1,000 tokens, ~16k tokens per
micro-batch), longckpt (the same, checkpointed), longnaive (the unfused head), vllm (the vLLM
engine resident beside the models; run it with .venv-vllm's python).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import memory as bench  # noqa: E402

# Model shapes (memory.py's options). qwen05: memory.py's default, the 0.5B (its layers and vocabulary
# from --layers and --vocab-size), saved in bf16. small: 4 layers, hidden 512, an untied
# 32,000-entry head, saved in fp32 (the dtype it trains in, so one process maps the file instead
# of copying it): weights of 0.17 GiB, so activations and logits of long responses make the peak.
SHAPES = {
    "qwen05": [],
    "small": ["--layers", "4", "--hidden-size", "512", "--heads", "8", "--kv-heads", "2", "--intermediate-size", "1536",
              "--vocab-size", "32000", "--untied", "--save-dtype", "float32"],
    # small's layout as a Qwen3 mixture of 8 experts 768 wide, 2 per token: the routed width of
    # small's dense MLP (1536), at 4x its MLP weights
    "moe": ["--layers", "4", "--hidden-size", "512", "--heads", "8", "--kv-heads", "2", "--intermediate-size", "768",
            "--experts", "8", "--experts-per-token", "2", "--vocab-size", "32000", "--untied", "--save-dtype", "float32"],
}
# 4 prompts x 4 recorded responses of ~1,000 tokens (260 words), every row in one micro-batch of
# ~16k tokens (packed). No KL term: its reference brings the offline KL probe, which samples
# responses of that length with HF generate (half an hour of a 38-minute run on a shared CPU).
LONG_TASK = ["--response-words", "260", "--response-length", "1024"]
LONG = ["data.max_response_length=1024", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480",
        "actor_rollout_ref.actor.use_kl_loss=false"]
# vLLM (CPU build, .venv-vllm) generating 4 x 4 responses of 256 tokens: the engine's weights and KV
# cache stay resident through every phase (a CPU engine has no sleep mode).
VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.response_length=256",
        "data.max_response_length=256"]
# name -> (shape, memory.py mode, klppo overrides, memory.py task options)
VARIANTS = {
    "full": ("qwen05", "offline", [], []),
    "lora": ("qwen05", "offline", ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"], []),
    "ckpt": ("qwen05", "offline", ["actor_rollout_ref.model.enable_gradient_checkpointing=true"], []),
    "online": ("qwen05", "online", [], []),
    "naive": ("qwen05", "offline", ["actor_rollout_ref.model.use_fused_kernels=false"], []),
    "long": ("small", "offline", LONG, LONG_TASK),
    "longckpt": ("small", "offline", LONG + ["actor_rollout_ref.model.enable_gradient_checkpointing=true"], LONG_TASK),
    # the unfused head's whole logits: 4 rows (~4k response tokens) per micro-batch
    "longnaive": ("small", "offline", LONG + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
                                             "actor_rollout_ref.model.use_fused_kernels=false"], LONG_TASK),
    "vllm": ("small", "online", VLLM, []),
    "moelong": ("moe", "offline", LONG, LONG_TASK),
}
DEFAULT_CONFIGS = "full-1,full-2,lora-1,ckpt-1,online-1,naive-1,lora-2,ckpt-2,online-2,long-1,longckpt-1,longnaive-1,long-2"
# What a rank has resident before its models: the trainer's imports, a tokenizer, the data.
BASELINE_PROBE = """
import sys
from pathlib import Path
import pyarrow.parquet as pq
import klppo.run.build, klppo.trainer.ppo_trainer, klppo.commands.main_ppo  # what a run imports
from transformers import AutoTokenizer, Qwen2ForCausalLM  # noqa: F401  (the model classes' modules)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = pq.read_table(sys.argv[2]).to_pylist()
for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) * 1024)
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default: {DEFAULT_CONFIGS})")
    p.add_argument("--layers", type=int, default=24, help="decoder layers of the 0.5B shape (fewer: a quicker look)")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--workdir", help="keep the model folder, runs and logs here (default: a temporary folder)")
    p.add_argument("--baseline", action="store_true", help="measure the CPU baseline (VmRSS before any model) and stop")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return p.parse_args(argv)


def bench_args(args, shape: str, mode: str, extra: list[str], task: list[str]) -> argparse.Namespace:
    """memory.py's options for a run: the shape's (qwen05: --layers and --vocab-size), the task's, the overrides."""
    sizes = SHAPES[shape] or ["--layers", str(args.layers), "--vocab-size", str(args.vocab_size)]
    return bench.parse_args([*sizes, *task, "--mode", mode, "--extra", *extra])


def inputs(work: Path, shape: str, bargs) -> tuple[Path, Path]:
    """The shape's model folder and the task's Parquet file, built once per work folder (kept: a run of
    an earlier call may still be reading them); qwen05's keep their first names."""
    model = work / ("model" if shape == "qwen05" else f"model_{shape}")
    if not (model / "config.json").is_file():
        bench.build_model_folder(model, bargs)
    words = "" if bargs.response_words == 8 else f"_{bargs.response_words}w"
    data = work / f"task{words}.parquet"
    if not data.is_file():
        bench.write_task(data, bargs)
    return model, data


def measure_baseline(model: Path, data: Path) -> int:
    """Bytes resident in a fresh process after the trainer's imports, the tokenizer and the data."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", BASELINE_PROBE, str(model), str(data)], env=env, check=True,
                          capture_output=True, text=True)
    return int(done.stdout.strip().splitlines()[-1])


def measured(model: Path, data: Path, work: Path, config: str, world: int, bargs) -> dict:
    """The run's last metrics record; kept in the work folder, so a second call reuses it."""
    kept = work / f"plan_accuracy_{config}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    print(f"[plan_accuracy] {config} ...", flush=True)
    result = bench.measure(model, data, work, world, bargs, label=config)
    if result["exit"]:
        raise SystemExit(f"[plan_accuracy] the {config} run failed (exit {result['exit']}); see its log in {work}")
    kept.write_text(json.dumps(result["record"]))
    return result["record"]


def planned(model: Path, data: Path, run_dir: Path, world: int, bargs, device: str) -> dict[str, float]:
    """The plan's estimate (GiB) of each phase of the run ``bench.measure`` makes."""
    from klppo.config import load_ppo_config
    from klppo.plan.check import plan_run
    from klppo.plan.check import length_sample, lengths_of

    cfg = load_ppo_config(None, bench.overrides(model, data, run_dir, world, bargs))
    e, _ = plan_run(cfg, world_size=world, device=device, device_bytes=64 * 2**30,
                    lengths=lengths_of(length_sample(cfg)), first_step=True)
    return {p.phase: p.total / 2**30 for p in e.phases}


def rows_of(name: str, estimate: dict[str, float], record: dict) -> list[tuple]:
    out = []
    for phase, value in estimate.items():
        measured = record.get(f"perf/peak_memory_gb/{phase}")
        if measured is not None:
            out.append((name, phase, value, measured, 100 * (value - measured) / measured))
    return out


def format_rows(rows: list[tuple]) -> str:
    lines = [f"{'config':<12}{'phase':<15}{'plan GiB':>9}{'measured':>9}{'error':>8}", "-" * 53]
    lines += [f"{c:<12}{p:<15}{e:>9.2f}{m:>9.2f}{err:>+7.1f}%" for c, p, e, m, err in rows]
    worst = max(rows, key=lambda r: abs(r[4]), default=None)
    if worst is not None:
        lines.append(f"worst: {worst[0]} {worst[1]} {worst[4]:+.1f}%; within 15%: "
                     f"{sum(abs(r[4]) <= 15 for r in rows)} of {len(rows)} phases")
    return "\n".join(lines)


def main(argv=None) -> list[tuple]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.baseline:
            model, data = inputs(work, "qwen05", bench_args(args, "qwen05", "offline", [], []))
            print(f"[plan_accuracy] baseline: {measure_baseline(model, data) / 2**30:.3f} GiB resident before any model")
            return []
        rows = []
        for config in args.configs.split(","):
            variant, world = config.rsplit("-", 1)
            shape, mode, extra, task = VARIANTS[variant]
            bargs = bench_args(args, shape, mode, extra, task)
            model, data = inputs(work, shape, bargs)
            record = measured(model, data, work, config, int(world), bargs)
            estimate = planned(model, data, work / f"run_{mode}_{world}_{config}", int(world), bargs, args.device)
            rows += rows_of(config, estimate, record)
            print(format_rows(rows_of(config, estimate, record)), flush=True)
        print(f"\nplan vs measured peak per rank and phase (qwen05: {args.layers} layers, vocab {args.vocab_size}):")
        print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
