"""Generation time: HF generate vs vLLM (``--backends``), and on sharded ranks the sharded actor vs a
whole copy gathered once per step (the default).

``--backends`` (run it in .venv-vllm: ``bash scripts/setup.sh --vllm``) measures, one model per
child process (vLLM allows one engine per process), HF generate and the vLLM engine side by side
on the same weights and prompts: sampled tokens/s of each (64 prompts x 128 new tokens,
temperature 1, no EOS so every row decodes all 128; interleaved repeats, best of each), and the
time of one weight sync (the actor's whole tensors streamed into the engine). Models:
SmolLM2-135M-Instruct (``examples/smollm2``'s converted folder) and Qwen2.5-0.5B's shape from
its config (random weights). Then one online GRPO step of ``examples/smollm2/ppo_online.yaml``
with each backend: ``timing_s/gen``, ``timing_s/weight_sync`` and the step's time.

    python benchmarks/generation.py --backends [--smollm2 outputs/smollm2] [--prompts 64] [--tokens 128]

The default mode runs the demo's PPO config (``klppo demo``'s task and tiny Qwen2-shaped model, untrained
initialisation, HF generate rollouts) for a few steps, one process at a time, each with one
thread: as one process, and on 2 ranks with ``rollout.generation_weights=sharded`` (every layer
all-gathered for every generated token) and ``=gathered`` (one all-gather of the actor per step,
then decoding without collectives). Prints the mean ``timing_s/gen`` of each, side by side.

    python benchmarks/generation.py [--steps 4] [--repeats 2]

``--decoding`` measures, in this process on its device (CUDA when there is one), how HF generate
decodes (``rollout.hf_decoding``): dynamic, static and compiled KV caches, each from a fresh
generation copy and cache per call, and the static ones also as a PPO step runs them now ("kept":
the copy refreshed in place, the cache kept; on CUDA the compiled step's graphs then replay rather
than being recorded again at every call) (an actor wrapped by FSDP2 over a group of one,
fp32 masters, computing in ``--dtype``; random weights of a Qwen2 shape, no EOS): the first call
(compilation included), a call at another batch size (a validation batch: the recompilation),
sampled tokens/s (best of ``--repeats`` further calls), and on CUDA the peak memory and what stays
allocated once the copy is dropped (a compiled step must not keep it alive). ``--before`` adds
the path one process took before: decoding through the FSDP2 actor itself, with its hook count.
Greedy tokens of compiled vs dynamic decoding are compared too (bf16 kernels may round apart).

    python benchmarks/generation.py --decoding [--shape 181m] [--prompts 32] [--n 8] [--tokens 256] [--before]
        [--modes dynamic static compiled]
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
RUNS = (("1 process", 1, "auto"), ("2 ranks, sharded", 2, "sharded"), ("2 ranks, gathered", 2, "gathered"))


def overrides(data: Path, model: Path, run_dir: Path, steps: int, world: int, weights: str) -> list[str]:
    from klppo.commands.demo_recipe import ppo_overrides

    base = [o for o in ppo_overrides(data, model, run_dir, seed=0, steps=steps) if not o.startswith("data.val_files")]
    return base + ["data.val_files=null", "trainer.test_freq=-1", "trainer.logger=[]",
                   f"trainer.n_gpus_per_node={world}", f"actor_rollout_ref.rollout.generation_weights={weights}"]


def gen_seconds(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["timing_s/gen"] for r in records if "timing_s/gen" in r]


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(done.stderr[-4000:])


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, interleaved")
    parser.add_argument("--backends", action="store_true", help="HF generate vs vLLM (in .venv-vllm)")
    parser.add_argument("--smollm2", type=Path, default=ROOT / "outputs" / "smollm2",
                        help="the folder examples/smollm2/README.md's commands write (model/ and the online data)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--decoding", action="store_true", help="dynamic vs static vs compiled KV cache (HF)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="--decoding: 181m on CUDA, 20m on CPU")
    parser.add_argument("--n", type=int, default=None, help="--decoding: samples per prompt (8 on CUDA, 2 on CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="--decoding: bf16 on CUDA")
    parser.add_argument("--before", action="store_true", help="--decoding: also through the FSDP2 actor itself")
    parser.add_argument("--modes", nargs="+", choices=["dynamic", "static", "compiled"],
                        default=["dynamic", "static", "compiled"], help="--decoding: these modes (dynamic always)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decoding:
        return compare_decoding(args)
    if args.child:
        return backends_child(Path(args.child), args.prompts, args.tokens, args.repeats)
    if args.backends:
        return compare_backends(args)
    from klppo.commands.demo_recipe import prepare

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, model = prepare(work, seed=0, print_fn=lambda *_: None)
        seconds: dict[str, list[float]] = {name: [] for name, _, _ in RUNS}
        for repeat in range(args.repeats):
            for name, world, weights in RUNS:
                run_dir = work / f"run_{world}_{weights}_{repeat}"
                launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={world}"]
                run([sys.executable, *launcher, "-m", "klppo.commands.main_ppo",
                     *overrides(data, model, run_dir, args.steps, world, weights)])
                seconds[name] += gen_seconds(run_dir)
    means = {name: sum(v) / len(v) for name, v in seconds.items()}
    print(f"mean timing_s/gen over {args.steps} steps x {args.repeats} runs (one thread per process):")
    for name, mean in means.items():
        print(f"  {name:20s} {mean:6.3f} s")
    print(f"gathered / sharded on 2 ranks: {means['2 ranks, gathered'] / means['2 ranks, sharded']:.2f}x")
    return means


# ---- HF generate vs vLLM ----


def qwen_05b_folder(out: Path) -> Path:
    """Qwen2.5-0.5B's config (tied embeddings; the weights come from the trainer's random init)."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                eos_token_id=151645, pad_token_id=151643, bos_token_id=None).save_pretrained(out)
    return out


def backends_child(model_dir: Path, n_prompts: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """HF generate and vLLM on one model in this process; prints one JSON line."""
    import time
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from klppo.data.rl_dataset import PromptRecord
    from klppo.rollout.hf import SamplingParams, hf_rollout
    from klppo.rollout.vllm import EngineSettings, VLLMEngine, request_seed
    from klppo.trainer.responses import engine_weights

    config = AutoConfig.from_pretrained(model_dir)
    if (model_dir / "model.safetensors").exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, config.vocab_size - 100, (int(n),), generator=generator).tolist()
               for n in torch.randint(24, 48, (n_prompts,), generator=generator)]
    records = [PromptRecord(i, "bench", None, ids, None, {}) for i, ids in enumerate(prompts)]
    # The last vocabulary entry stands in for EOS (the model's own generation config too, whose EOS
    # HF generate would stop at as well): vLLM ignores it (ignore_eos), and HF samples it with
    # probability ~1/vocabulary per token, so nearly every row decodes all its tokens.
    never = SimpleNamespace(pad_token_id=config.pad_token_id or 0, eos_token_id=config.vocab_size - 1)
    model.generation_config.eos_token_id = never.eos_token_id
    settings = EngineSettings(
        tensor_parallel_size=1, dtype=torch.float32, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
        max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=48 + new_tokens, enforce_eager=None,
        enable_chunked_prefill=True, enable_prefix_caching=True, load_format="dummy", sleep_between_generations=True,
        calculate_log_probs=True, logprobs_mode="processed_logprobs", ignore_eos=True, seed=0,
        rows_per_generation=n_prompts)
    from klppo.monitoring.memory import available_bytes

    engine = VLLMEngine(str(model_dir), config, settings, torch.device("cpu"), False, available_bytes(torch.device("cpu")))
    syncs = []
    for _ in range(6):  # the first sync pays one-off set-up; the engine repacks weights for its CPU matmuls each time
        start = time.perf_counter()
        engine.load_weights(engine_weights(model, torch.float32, torch.device("cpu"), engine.parameter_names))
        syncs.append(time.perf_counter() - start)
    first, syncs = syncs[0], sorted(syncs[1:])
    params = SamplingParams(n=1, max_new_tokens=new_tokens, temperature=1.0)
    warm_up = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)  # first calls pay one-off set-up
    hf_rollout(model, records[:4], never, warm_up)
    engine.generate(records[:4], warm_up, [0, 1, 2, 3], never)
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    for repeat in range(repeats):
        for name in ("vllm", "hf"):
            start = time.perf_counter()
            if name == "hf":
                torch.manual_seed(repeat)
                batch = hf_rollout(model, records, never, params)
            else:
                batch = engine.generate(records, params, [request_seed(repeat, 0, i, 0) for i in range(n_prompts)], never)
            rates[name].append(int(batch.response_mask.sum()) / (time.perf_counter() - start))
    engine.shutdown()
    result = {"model": model_dir.name, "threads": torch.get_num_threads(), "hf_tokens_per_s": max(rates["hf"]),
              "vllm_tokens_per_s": max(rates["vllm"]), "weight_sync_s": syncs[len(syncs) // 2],
              "weight_sync_best_s": syncs[0], "weight_sync_first_s": first,
              "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6}
    print(json.dumps(result))
    return result


def online_step(smollm2: Path, backend: str, work: Path) -> dict[str, float]:
    """Two steps of the online SmolLM2 example with ``backend`` (no validation); step 2's timings."""
    run_dir = work / f"online_{backend}"
    cmd = [sys.executable, "-m", "klppo.commands.main_ppo", "--config", str(ROOT / "examples/smollm2/ppo_online.yaml"),
           f"actor_rollout_ref.model.path={smollm2 / 'model'}", f"data.train_files={smollm2 / 'online_train.parquet'}",
           "data.val_files=null", "trainer.val_before_train=false", "trainer.test_freq=-1",
           "trainer.total_training_steps=2", "trainer.logger=[]", f"trainer.default_local_dir={run_dir}",
           f"actor_rollout_ref.rollout.name={backend}"]
    done = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return {k: last.get(f"timing_s/{k}", 0.0) for k in ("gen", "weight_sync", "step", "update_actor", "old_log_prob")}


def compare_backends(args) -> dict:
    from klppo.rollout.vllm import require_vllm

    require_vllm()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = [args.smollm2 / "model", qwen_05b_folder(work / "qwen2.5-0.5b-shape")]
        for model in models:
            done = subprocess.run([sys.executable, __file__, "--child", str(model), "--prompts", str(args.prompts),
                                   "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
            if done.returncode:
                sys.exit(done.stderr[-4000:])
            results[model.name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"sampled generation, {args.prompts} prompts x {args.tokens} new tokens, fp32, best of {args.repeats}:")
        print(f"  {'model':24s} {'hf tok/s':>9s} {'vllm tok/s':>11s} {'vllm/hf':>8s}  weight sync: median (best, first) of 6")
        for name, r in results.items():
            print(f"  {name:24s} {r['hf_tokens_per_s']:9.0f} {r['vllm_tokens_per_s']:11.0f} "
                  f"{r['vllm_tokens_per_s'] / r['hf_tokens_per_s']:7.2f}x  {r['weight_sync_s']:.2f} s "
                  f"({r['weight_sync_best_s']:.2f}, {r['weight_sync_first_s']:.2f})")
        steps = {backend: online_step(args.smollm2, backend, work) for backend in ("hf", "vllm")}
    print("one online GRPO step of examples/smollm2/ppo_online.yaml (step 2 of 2; 8 prompts x 8 samples, 48 tokens):")
    for backend, t in steps.items():
        print(f"  {backend:5s} gen {t['gen']:6.1f} s  weight_sync {t['weight_sync']:5.2f} s  "
              f"old_log_prob {t['old_log_prob']:5.1f} s  update_actor {t['update_actor']:6.1f} s  step {t['step']:6.1f} s")
    gen_ratio = (steps["vllm"]["gen"] + steps["vllm"]["weight_sync"]) / steps["hf"]["gen"]
    print(f"vllm / hf: timing_s/gen (weight sync included) {gen_ratio:.2f}x, step {steps['vllm']['step'] / steps['hf']['step']:.2f}x")
    return {"generation": results, "online_step": steps}


# ---- HF decoding: dynamic vs static vs compiled KV cache ----

# Qwen2 shapes with the arithmetic task's 384-token vocabulary: gpu_smoke.py's 181M, and one for CPU.
SHAPES = {"181m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=2816),
          "20m": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=1536),
          "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)}
VOCAB = 384


def sharded_actor(shape: str, dtype, device):
    """A random Qwen2 model of ``shape`` wrapped by FSDP2 over a group of one (fp32 masters, computing
    in ``dtype``), as a one-process bf16 run holds its actor."""
    import torch
    from transformers import AutoModelForCausalLM

    from klppo.distributed import apply_fsdp2, build_mesh, fill_sharded, materialize
    from klppo.models.sharded_load import empty_model
    from klppo.models.tiny import tiny_model_config

    config = tiny_model_config(VOCAB, max_position_embeddings=4096, **SHAPES[shape])
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    actor = empty_model(AutoModelForCausalLM, config)
    apply_fsdp2(actor, build_mesh(1, device_type=device.type), param_dtype=None if dtype == torch.float32 else dtype)
    materialize(actor, device)
    fill_sharded(actor, lambda name: state[name])
    return actor


def timed_generation(actor, records, params, decoding, dtype, device, copy: bool = True, kept: dict | None = None
                     ) -> dict:
    """One generation as a PPO step runs it: seconds, response tokens, peak and left-over CUDA memory.
    A fresh generation copy, dropped afterwards; or with ``kept`` (a dict this fills and reuses) the copy
    built once and the actor's weights written into it in place, and each shape's cache kept
    (``trainer.responses.keeps_generation_model``)."""
    import dataclasses
    import time

    import torch

    from klppo.rollout.hf import StaticCaches, hf_rollout
    from klppo.trainer.responses import generation_copy, refresh_generation_copy

    never = type("Tok", (), {"pad_token_id": 0, "eos_token_id": VOCAB})()  # outside the vocabulary: no EOS
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if kept is None:
        model = generation_copy(actor, dtype, device) if copy else actor
    elif "model" in kept:
        model = kept["model"]
        refresh_generation_copy(model, actor, dtype, device)
    else:
        model = kept["model"] = generation_copy(actor, dtype, device)
        kept["caches"] = StaticCaches()
    if kept is not None:
        decoding = dataclasses.replace(decoding, caches=kept["caches"])
    batch = hf_rollout(model, records, never, params, device=device, decoding=decoding)  # CPU tensors: synced
    seconds = time.perf_counter() - start
    del model
    out = {"s": seconds, "tokens": int(batch.response_mask.sum()), "ids": batch.response_ids}
    if cuda:
        torch.cuda.empty_cache()
        out.update(peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   left_gib=torch.cuda.memory_allocated(device) / 2**30)
    return out


def decoding_runs(actor, records, args, dtype, device) -> dict[str, dict]:
    """Per mode: the first call, a call at half the prompts, and the best of ``args.repeats``; each with a
    fresh generation copy and cache (every step before), and for a static cache also as a PPO step now
    runs it ("<mode> kept": the copy refreshed in place, each shape's cache kept)."""
    import dataclasses

    from klppo.rollout.hf import Decoding, SamplingParams

    params = SamplingParams(n=args.n, max_new_tokens=args.tokens)
    cache = max(len(r.prompt_ids) for r in records) + args.tokens
    results = {}
    modes = ["dynamic", *(m for m in args.modes if m != "dynamic")]  # dynamic first: the reference
    for mode, kept in [(m, None) for m in modes] + [(m, {}) for m in modes if m != "dynamic"]:
        decoding = Decoding(mode, cache)
        call = lambda rows, p=params: timed_generation(actor, rows, p, decoding, dtype, device, kept=kept)  # noqa: E731
        first = call(records)
        other = call(records[: max(1, len(records) // 2)])
        runs = [call(records) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["s"])
        greedy = call(records[:4], dataclasses.replace(params, do_sample=False))
        results[mode if kept is None else f"{mode} kept"] = {
            "first_call_s": first["s"], "other_batch_s": other["s"], "best_s": best["s"],
            "tokens_per_s": best["tokens"] / best["s"], "greedy_ids": greedy["ids"],
            **{k: best[k] for k in ("peak_gib", "left_gib") if k in best}}
    return results


def fsdp2_actor_run(actor, records, args, dtype, device) -> dict:
    """Decoding through the FSDP2 actor itself (one process's path before), counting its pre-forward hooks."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from klppo.rollout.hf import DYNAMIC, SamplingParams

    calls, original = [0], FSDPParamGroup.pre_forward

    def counted(self, *a, **k):
        calls[0] += 1
        return original(self, *a, **k)

    FSDPParamGroup.pre_forward = counted
    try:
        run = timed_generation(actor, records, SamplingParams(n=args.n, max_new_tokens=args.tokens), DYNAMIC, dtype,
                               device, copy=False)
    finally:
        FSDPParamGroup.pre_forward = original
    return {"best_s": run["s"], "tokens_per_s": run["tokens"] / run["s"], "pre_forward_hooks": calls[0]}


def compare_decoding(args) -> dict:
    import torch

    from klppo.data.rl_dataset import PromptRecord
    from klppo.distributed import close, init_distributed

    env = init_distributed("auto", group_of_one=True)
    cuda = env.device.type == "cuda"
    args.shape = args.shape or ("181m" if cuda else "20m")
    args.n = args.n or (8 if cuda else 2)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    actor = sharded_actor(args.shape, dtype, env.device)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(24, 48, (args.prompts,), generator=generator)
    records = [PromptRecord(i, "bench", None, torch.randint(2, VOCAB, (int(k),), generator=generator).tolist(), None,
                            {}) for i, k in enumerate(lengths)]
    results = decoding_runs(actor, records, args, dtype, env.device)
    if args.before:
        results["fsdp2 actor"] = fsdp2_actor_run(actor, records, args, dtype, env.device)
    report_decoding(results, args, dtype, env.device)
    close(env)
    return results


def report_decoding(results: dict, args, dtype, device) -> None:
    import torch

    rows = args.prompts * args.n
    print(f"HF decoding on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
          f"({torch.get_num_threads()} threads), shape {args.shape} in {dtype}, {rows} rows x {args.tokens} tokens, "
          f"a fresh generation copy and cache per call (kept: refreshed in place); best of {args.repeats}:")
    print(f"  {'mode':14s} {'tok/s':>9s} {'best s':>7s} {'first s':>8s} {'half-batch s':>13s} {'peak GiB':>9s} "
          f"{'left GiB':>9s}  greedy ids == dynamic's")
    dynamic_ids = results["dynamic"]["greedy_ids"]
    for mode, r in results.items():
        same = "" if "greedy_ids" not in r else f"{(r['greedy_ids'] == dynamic_ids).float().mean():.3f}"
        print(f"  {mode:14s} {r['tokens_per_s']:9.0f} {r['best_s']:7.2f} {r.get('first_call_s', float('nan')):8.2f} "
              f"{r.get('other_batch_s', float('nan')):13.2f} {r.get('peak_gib', float('nan')):9.2f} "
              f"{r.get('left_gib', float('nan')):9.2f}  {same}"
              + (f"  ({r['pre_forward_hooks']} FSDP2 pre-forward hooks)" if "pre_forward_hooks" in r else ""))
    summary = {mode: {k: v for k, v in r.items() if k != "greedy_ids"} for mode, r in results.items()}
    print(json.dumps({"decoding": summary, "shape": args.shape, "rows": rows, "tokens": args.tokens,
                      "dtype": str(dtype), "device": device.type}))


if __name__ == "__main__":
    main()
