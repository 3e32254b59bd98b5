"""GPU check: tokens/s/GPU and MFU of the actor update of a ~0.5B Qwen2 model under FSDP2.

    python benchmarks/gpu_check.py                                   # 1 GPU (a few minutes)
    python benchmarks/gpu_check.py --compare-checkpointing           # and again with gradient checkpointing
    torchrun --nproc_per_node 8 benchmarks/gpu_check.py              # N GPUs, one rank each
    python benchmarks/gpu_check.py --device cpu --size tiny --batch 8   # CPU smoke run (seconds)

Workload: a Qwen2-shaped model built from a config (Qwen2.5-0.5B's shape, random weights), the
actor and a frozen reference each wrapped by ``klppo.distributed.apply_fsdp2`` (bf16 parameters, fp32
gradient reduction and master weights), a synthetic batch per rank of uniform prompt lengths
and log-normal response lengths (``throughput.synthetic_batch``), and a few GRPO-style PPO
iterations over it: old log-probs, reference log-probs, group advantages from the synthetic
scores, one actor update (ppo_epochs 1, one optimiser step of klppo's AdamW (``build_optimizer``:
fused on CUDA), micro-batches under a token budget, each run as one packed row, the fused LM
head). The first iteration is a warm-up (compilations, cuBLAS handles), left out of the figures.
``--compare-checkpointing`` then turns on the actor's gradient checkpointing and measures again
in the same process (one warm-up iteration more), so one call reports both.

MFU is ``model_flops(config, lengths, training=True, head_positions=response tokens)`` of the
actor update over its wall time and the device's dense peak for ``--dtype``
(``klppo.monitoring.flops``): the FLOPs the update runs, causal attention (half the pairs) and
the LM head only at the response positions where log-probs are read, no FLOPs for the
embedding lookup (verl's count charges the vocabulary twice for every token and attention
as non-causal: about 1.45x these figures on this workload). Target: MFU >= 45%. On CUDA the
MFU is also given against the bf16 matmul rate measured on the card (an 8192^3 product,
median of 10), the ceiling a run can reach, where the datasheet's peak is a lead. Gradient
checkpointing's recomputation is not counted (the same FLOPs, more time).

Each rank draws its own synthetic batch (seed + rank); every rank runs as many micro-batches as
the rank that needs the most, as in training. A single process runs FSDP2 over a group of one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from klppo.algo import compute_grpo_outcome_advantage
from klppo.data.batching import MicroBatching
from klppo.distributed import DistEnv, apply_fsdp2, build_mesh, close, init_distributed
from klppo.models.attention import ATTENTION_NAMES, choose_packed_attention, set_packed_attention, torch_varlen_runs
from klppo.models.load import enable_activation_checkpointing
from klppo.models.tiny import tiny_model_config
from klppo.monitoring.flops import max_memory_gb, mfu, model_flops, peak_flops
from klppo.monitoring.memory import PeakMemory
from klppo.monitoring.timer import PhaseTimer
from klppo.models.forward import HeadSettings
from klppo.rollout.batch import RolloutBatch
from klppo.run.settings import ActorUpdateSettings
from klppo.run.setup import build_optimizer
from klppo.trainer.forwards import compute_log_prob
from klppo.trainer.update import update_actor
from throughput import synthetic_batch

MFU_TARGET = 0.45
GROUP_SIZE = 8  # responses per prompt (rollout.n) for the group advantages
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--size", choices=["0.5b", "tiny"], default="0.5b",
                   help="0.5b: Qwen2.5-0.5B's shape (GPU); tiny: 2 layers, hidden 64 (CPU smoke run)")
    p.add_argument("--attn", choices=["auto", *ATTENTION_NAMES], default="auto",
                   help="attention for the packed rows: auto = what a run chooses here (klppo.models.attention); "
                        "varlen = torch's varlen kernel (CUDA, bf16); flash_attention_2 needs the flash_attn package; "
                        "sdpa_mask = one sdpa call with a block-diagonal mask; sdpa_loop = one sdpa call per sequence")
    p.add_argument("--batch", type=int, default=64, help="sequences per rank per iteration")
    p.add_argument("--prompt-len", type=int, default=512, help="longest prompt; lengths are uniform in [half, all] of it")
    p.add_argument("--max-response-len", type=int, default=1024,
                   help="longest response; lengths are log-normal, median a quarter of it, sigma 1, clipped")
    p.add_argument("--iterations", type=int, default=3, help="PPO iterations; the first is a warm-up, not counted")
    p.add_argument("--token-budget", type=int, default=16384,
                   help="tokens per micro-batch (ppo_max_token_len_per_gpu, also used for the log-prob forwards)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="FSDP2 parameter dtype in forward/backward; master weights and gradient reduction stay fp32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block's activations")
    p.add_argument("--compare-checkpointing", action="store_true",
                   help="then measure again with gradient checkpointing, in this process (figures under with_checkpointing)")
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                   help="FSDP2's reshard_after_forward (fsdp_config.reshard_after_forward): false keeps each block "
                        "gathered from forward to backward (no second gather; its parameters held whole meanwhile)")
    p.add_argument("--head", choices=["auto", "eager"], default="auto",
                   help="the fused LM head's slices: auto = compiled on CUDA (HeadSettings.compiled); eager = never")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file (rank 0)")
    return p.parse_args(argv)


def request_problem(args, device_type: str) -> str | None:
    """Why this request cannot run here, in one line, or None."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return "--device cuda but no CUDA device is visible; on CPU run with --device cpu --size tiny"
    if device_type == "cpu" and args.size == "0.5b":
        return ("the default 0.5b model is the GPU configuration; on CPU run "
                "`python benchmarks/gpu_check.py --device cpu --size tiny --batch 8`")
    half = args.dtype in ("bfloat16", "float16")
    if args.attn == "flash_attention_2" and (device_type != "cuda" or not half or not flash_attn_installed()):
        return "--attn flash_attention_2 needs a CUDA device, --dtype bfloat16 and the flash_attn package; use --attn auto"
    if args.attn == "varlen" and (not half or not torch_varlen_runs(device_type)):
        return ("--attn varlen needs torch's varlen kernel (torch >= 2.10 with flash attention, a CUDA card of "
                "compute capability 8.0+) and --dtype bfloat16; use --attn auto")
    if args.iterations < 2:
        return f"--iterations {args.iterations}: the first iteration is a warm-up, so at least 2 are needed"
    if args.prompt_len + args.max_response_len > args.token_budget:
        return (f"--token-budget {args.token_budget} cannot hold the longest sequence "
                f"({args.prompt_len} + {args.max_response_len} tokens); raise it or shorten the lengths")
    return None


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def attention_of(args, device_type: str) -> str:
    """The attention implementation ``--attn`` names (auto: a run's own choice for this device and dtype)."""
    if args.attn == "auto":
        return choose_packed_attention(device_type, [DTYPES[args.dtype]])
    return ATTENTION_NAMES[args.attn]


def requested_device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ---- models ----


def model_config(size: str, max_len: int) -> Qwen2Config:
    """Qwen2.5-0.5B's shape (494M parameters with the tied embedding), or a tiny one for CPU."""
    if size == "tiny":
        return tiny_model_config(1024, hidden_size=64, num_hidden_layers=2, max_position_embeddings=max_len)
    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
        pad_token_id=0, use_cache=False,
    )


def build_models(config: Qwen2Config, args, env: DistEnv):
    """Actor and a frozen reference with the actor's initial weights, each FSDP2-wrapped.

    The reference is a second FSDP2 model, not the actor's weights: klppo's trainer holds a
    separate reference too, so memory and the reference forward (its own all-gathers) are
    those of a real run, and after the first update the two differ as they would in training.
    """
    mesh = build_mesh(env.world_size, device_type=env.device.type)
    with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []), env.device:
        torch.manual_seed(args.seed)  # the same weights on every rank before sharding
        actor = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    ref.load_state_dict(actor.state_dict())
    ref.requires_grad_(False).eval()
    if args.gradient_checkpointing:
        checkpoint_blocks(actor)
    param_dtype = DTYPES[args.dtype] if args.dtype != "float32" else None
    for model in (actor, ref):
        model.config.use_cache = False
        set_packed_attention(model, attention_of(args, env.device.type))
        apply_fsdp2(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32,
                    reshard_after_forward=args.reshard_after_forward == "true")
    return actor, ref


def checkpoint_blocks(model) -> None:
    """Gradient checkpointing of every decoder block, as klppo's loader turns it on (non-reentrant)."""
    enable_activation_checkpointing(model)


# ---- one iteration ----


def workload(args, vocab_size: int, env: DistEnv) -> RolloutBatch:
    """``throughput.synthetic_batch`` at this check's lengths (this rank's own draw), in groups of ``GROUP_SIZE``."""
    spec = argparse.Namespace(
        batch_size=args.batch, prompt_min=max(1, args.prompt_len // 2), prompt_max=args.prompt_len,
        response_min=min(16, args.max_response_len), response_max=args.max_response_len,
        response_median=args.max_response_len / 4, response_sigma=1.0, seed=args.seed + env.rank,
    )
    batch = synthetic_batch(spec, vocab_size)
    batch.group_index = torch.arange(len(batch)) // GROUP_SIZE
    return batch.to(env.device)


def actor_settings(args) -> ActorUpdateSettings:
    """One optimiser step over the whole batch, micro-batches under the token budget, packed."""
    return ActorUpdateSettings(
        mini_batch_rows=args.batch, micro=token_budget(args), ppo_epochs=1, clip_ratio_low=0.2,
        clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=True,
        kl_loss_coef=0.001, kl_loss_type="low_var_kl", grad_clip=1.0, temperature=1.0, head=head_settings(args),
    )


def head_settings(args) -> HeadSettings:
    """The fused head, its slices compiled on CUDA unless ``--head eager``."""
    return HeadSettings(compiled=False if args.head == "eager" else None)


def token_budget(args) -> MicroBatching:
    """Packed micro-batches of at most ``--token-budget`` tokens."""
    return MicroBatching(max_tokens=args.token_budget, packed=True)


def ppo_iteration(actor, ref, optimizer, batch: RolloutBatch, args, memory: PeakMemory) -> PhaseTimer:
    """Score, advantages, actor update; PhaseTimer synchronises CUDA at the end of each phase and
    records each phase's own peak memory."""
    forward = token_budget(args)
    timer = PhaseTimer(memory=memory)
    with timer.phase("step"):
        # step 1. old log-probs: the actor before the update
        with timer.phase("old_log_prob"):
            batch.old_log_prob = compute_log_prob(actor, batch, forward, temperature=1.0, head=head_settings(args))
        # step 2. reference log-probs, for the KL loss
        with timer.phase("ref"):
            batch.ref_log_prob = compute_log_prob(ref, batch, forward, temperature=1.0, head=head_settings(args))
        # step 3. GRPO advantages from the synthetic outcome scores
        with timer.phase("advantages"):
            batch.advantages, batch.returns = compute_grpo_outcome_advantage(
                batch.token_level_scores, batch.response_mask, batch.group_index)
        # step 4. one actor update: clipped surrogate + low-var KL loss
        with timer.phase("update_actor"):
            update_actor(actor, optimizer, batch, actor_settings(args))
    return timer


# ---- figures ----


def figures(args, env: DistEnv, config, n_params: int, batch: RolloutBatch, timers: list[PhaseTimer],
            measured_peak: float | None) -> dict:
    """Per-GPU tokens/s and MFU over the timed iterations, from rank 0's batch and times."""
    seq_lens = batch.attention_mask.sum(-1).tolist()  # host sync, after the timing
    tokens, response_tokens = sum(seq_lens), int(batch.response_mask.sum())
    update_s = sum(t.seconds["update_actor"] for t in timers)
    step_s = sum(t.seconds["step"] for t in timers)
    update_flops = model_flops(config, seq_lens, training=True, head_positions=response_tokens) * len(timers)
    update_mfu = mfu(update_flops, update_s, peak_flops(env.device, DTYPES[args.dtype]))
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    return {
        "device": device_name, "world_size": env.world_size, "size": args.size, "params_b": n_params / 1e9,
        "dtype": args.dtype, "attn": args.attn,
        "attn_implementation": attention_of(args, env.device.type), "gradient_checkpointing": args.gradient_checkpointing,
        "reshard_after_forward": args.reshard_after_forward == "true", "head": args.head,
        "sequences_per_gpu": len(seq_lens), "tokens_per_iteration_per_gpu": tokens,
        "response_tokens_per_iteration_per_gpu": response_tokens,
        "median_sequence_tokens": statistics.median(seq_lens), "token_budget": args.token_budget,
        "timed_iterations": len(timers),
        "actor_update_tokens_per_s_per_gpu": tokens * len(timers) / update_s,
        "actor_update_mfu": update_mfu,
        "measured_peak_tflops": None if measured_peak is None else measured_peak / 1e12,
        "actor_update_mfu_vs_measured_peak": mfu(update_flops, update_s, measured_peak),
        "iteration_tokens_per_s_per_gpu": tokens * len(timers) / step_s,
        "peak_memory_gb": max_memory_gb(env.device),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if env.device.type == "cuda" else "process peak RSS",
        "mfu_target": MFU_TARGET,
        "meets_target": None if update_mfu is None else update_mfu >= MFU_TARGET,
        "phase_seconds_mean": {name: statistics.mean(t.seconds[name] for t in timers) for name in timers[0].seconds},
        "phase_peak_memory_gb": {name: max(t.peak_gb[name] for t in timers) for name in timers[0].peak_gb},
    }


def percent(value: float | None, missing: str = "n/a (no known peak for this device)") -> str:
    return missing if value is None else f"{100 * value:.1f}"


def print_table(f: dict) -> None:
    target = "n/a" if f["meets_target"] is None else ("yes" if f["meets_target"] else "no")
    measured = f["actor_update_mfu_vs_measured_peak"]
    rows = [
        ("device", f["device"]),
        ("world size", f["world_size"]),
        ("params (B)", f"{f['params_b']:.3g}"),
        ("dtype", f"{f['dtype']} ({f['attn']}: {f['attn_implementation']}{', grad ckpt' if f['gradient_checkpointing'] else ''})"),
        ("tokens per iteration per GPU", f"{f['tokens_per_iteration_per_gpu']} ({f['sequences_per_gpu']} sequences)"),
        ("actor update tokens/s/GPU", f"{f['actor_update_tokens_per_s_per_gpu']:.0f}"),
        ("actor update MFU (%)", percent(f["actor_update_mfu"])),
        ("  vs the measured matmul peak (%)", "n/a" if measured is None
         else f"{100 * measured:.1f} (of {f['measured_peak_tflops']:.0f} TFLOP/s)"),
        ("iteration tokens/s/GPU", f"{f['iteration_tokens_per_s_per_gpu']:.0f}"),
        ("peak memory (GB)", f"{f['peak_memory_gb']:.2f} ({f['peak_memory_kind']})"),
        (f"MFU >= {100 * f['mfu_target']:.0f}% target", target),
    ]
    if "with_checkpointing" in f:
        c = f["with_checkpointing"]
        mfu_text = "n/a" if c["actor_update_mfu"] is None else f"{100 * c['actor_update_mfu']:.1f}%"
        rows.append(("with gradient checkpointing", f"MFU {mfu_text}, {c['actor_update_tokens_per_s_per_gpu']:.0f} "
                     f"tokens/s/GPU, peak {c['peak_memory_gb']:.2f} GB"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("phase seconds (mean of timed iterations): "
          + ", ".join(f"{k} {v:.3f}" for k, v in f["phase_seconds_mean"].items()))
    print("phase peak memory (GB, largest over timed iterations): "
          + ", ".join(f"{k} {v:.2f}" for k, v in f["phase_peak_memory_gb"].items()))


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float | None:
    """FLOP/s of an (n x n) @ (n x n) product in ``dtype`` on this card: random data (zeros run faster),
    3 warm-ups, the median of 10 timed with CUDA events; None off CUDA."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()  # host sync: the timing
        if i >= 3:
            seconds.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(seconds)


def timed_iterations(actor, ref, optimizer, batch: RolloutBatch, args, env: DistEnv, memory: PeakMemory,
                     label: str = "") -> list[PhaseTimer]:
    """``args.iterations`` PPO iterations; the timers of all but the first (a warm-up)."""
    timers = []
    for i in range(args.iterations):
        timer = ppo_iteration(actor, ref, optimizer, dataclasses.replace(batch), args, memory)
        if env.rank == 0:
            print(f"iteration {i}{label}{' (warm-up)' if i == 0 else ''}: {timer.seconds['step']:.2f} s, "
                  f"actor update {timer.seconds['update_actor']:.2f} s", flush=True)
        if i > 0:
            timers.append(timer)
    return timers


def run(args, env: DistEnv) -> dict:
    config = model_config(args.size, args.prompt_len + args.max_response_len)
    actor, ref = build_models(config, args, env)
    n_params = sum(p.numel() for p in actor.parameters())  # DTensor numel is the full size
    optimizer = build_optimizer(actor, lr=1e-6, weight_decay=0.01, betas=(0.9, 0.999))  # a run's: fused on CUDA
    batch, memory = workload(args, config.vocab_size, env), PeakMemory(env.device)
    measured_peak = matmul_peak(env.device, DTYPES[args.dtype])
    result = figures(args, env, config, n_params, batch, timed_iterations(actor, ref, optimizer, batch, args, env,
                                                                        memory), measured_peak)
    if args.compare_checkpointing and not args.gradient_checkpointing:
        checkpoint_blocks(actor)
        memory.reset()  # the process's peak too (max_memory_allocated on CUDA)
        with_ckpt = argparse.Namespace(**{**vars(args), "gradient_checkpointing": True})
        timers = timed_iterations(actor, ref, optimizer, batch, with_ckpt, env, memory, " (gradient checkpointing)")
        result["with_checkpointing"] = figures(with_ckpt, env, config, n_params, batch, timers, measured_peak)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = request_problem(args, requested_device_type(args.device))
    if problem is not None:
        print(f"gpu_check.py: {problem}", file=sys.stderr)
        return 2
    env = init_distributed(args.device, group_of_one=True)  # FSDP2 needs a process group, even of one
    try:
        result = run(args, env)
        if env.rank == 0:
            print()
            print_table(result)
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        close(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
