"""GPU smoke test: the paths a CPU run cannot show, in one online PPO run; one line per check.

    bash benchmarks/gpu_smoke.sh                  # one CUDA GPU: about 100 s on an H200 (budget 150 s)
    bash benchmarks/gpu_smoke.sh --budget-s 150   # and a check that the whole script kept to it
    bash benchmarks/gpu_smoke.sh --cpu            # the same checks on a tiny shape on CPU (under a minute)

The run: a Qwen2-shaped model built from a config (50M parameters on a GPU; random weights, saved as a Hugging Face
folder with a tokenizer trained on the arithmetic task), online PPO with Hugging Face
generation, a critic (GAE), a reference (KL in the reward), a reward model (the same backbone
with a score head, saved as a sequence-classification folder: PPO refuses a head it would have to
initialise) and validation before training and every 2 steps; every model in
bf16 under FSDP2 (a process group of one), packed sequences under a token budget
(the attention a run chooses: torch's varlen kernel on a recent CUDA GPU,
``klppo.models.attention``) and the actor under ``offload_policy`` (parameters, gradients and optimiser state
on CPU). It saves at step 2 and at the end; a second run resumes from step 2 and must repeat
the first run's last step exactly: on CUDA both runs use deterministic algorithms (see gpu_smoke.sh),
under which the packed attention is the math-backend loop (``PACKED_DETERMINISTIC``); the checks
after them run without, so the packed rows' check and the host syncs see the attention a run
chooses. Generation decodes with the dynamic cache (``--decoding auto``: a run's default, compiled
on CUDA, adds its compilations, 40-80 s; ``benchmarks/generation.py --decoding`` measures those).

Checks, each printed as ``PASS|FAIL|SKIP  <check>: <figure>``: the run, finite metrics,
validation with the reward model, offload_policy, the save, the exact resume, the export,
peak memory, MFU (known GPUs only), the memory plan's estimate per phase (judged on a GPU), the host syncs of a packed forward and backward,
packed rows against the padded path in bf16 with the attention a run chooses (judged on a GPU), an
offline step whose KL probe runs with the actor and reference under param_offload, and (where
vLLM is installed: ``bash scripts/setup.sh --vllm``) a bf16 run with vLLM rollouts in a process
of its own: TP=1, the engine asleep while the models train and woken weights -> sync -> KV cache
for each generation (GPU), validation after every step (several generations, each after a sleep
that discarded the weights: a sync before each), every wake past a cache filled with the device's
free memory (which it must empty first: ``vllm_smoke_run.py``), its log-probs against the
trainer's, the weight sync's time and the generation phase's peak memory, which counts the engine.
Each check line ends with the seconds it took; the last lines give each part's time and the
total, and ``--budget-s S`` adds a check that the whole script took at most S seconds.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from klppo.cli_support import quiet_libraries
from klppo.config import load_ppo_config
from klppo.data.arithmetic import arithmetic_corpus, write_arithmetic_offline_parquet, write_arithmetic_parquet
from klppo.distributed import close
from klppo.models.attention import use_packed_attention
from klppo.models.forward import response_logprobs
from klppo.models.tiny import build_tiny_model_folder
from klppo.monitoring.flops import peak_flops
from klppo.monitoring.logger import read_metrics

# name -> (model shape, prompts per step, responses per prompt, response tokens, steps). The GPU shape
# (50M parameters, 3 steps of 16 prompts x 4 responses of up to 48 tokens) keeps every check under the
# 150 s budget: the first H200 run took 167 s for 4 steps of a 181M model, then mostly Python (sdpa per
# sequence, FSDP2 hooks per token), since removed; see benchmarks/README.md for the estimate.
SHAPES = {
    "gpu": (dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048), 16, 4, 48, 3),
    "cpu": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1), 4, 2, 8, 3),
}
# host syncs per packed forward + backward: klppo reads the rows' spans, transformers looks for packed
# sequences in the position ids (tests/models/test_host_syncs.py counts both on CPU)
SYNC_LIMIT = 2
RESULTS: list[tuple[str, str, str]] = []
SECONDS: dict[str, float] = {}  # each part of the script: how long it took
_last = [time.perf_counter()]


def check(name: str, passed: bool | None, figure: str) -> None:
    """Record and print one check: passed True/False, or None for skipped; with the seconds since the
    previous check (what it took to reach this one)."""
    verdict = "SKIP" if passed is None else "PASS" if passed else "FAIL"
    RESULTS.append((verdict, name, figure))
    now = time.perf_counter()
    print(f"{verdict:<4}  {name}: {figure} [{now - _last[0]:.1f} s]", flush=True)
    _last[0] = now


@contextlib.contextmanager
def part(name: str):
    """Time one part of the script (SECONDS[name])."""
    start = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[name] = SECONDS.get(name, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def deterministic(device: torch.device):
    """Deterministic algorithms for the block on CUDA (the exact resume needs the same results twice):
    a run built inside chooses its attention then (``choose_packed_attention``); off again after."""
    if device.type != "cuda":
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def quiet(*args, **kwargs) -> None:
    pass


# ---- the run ----


def prepare(root: Path, shape: dict, prompts: int) -> tuple[Path, Path, Path, Path]:
    """The model, its reward model (the backbone with a seeded score head), training and validation prompts."""
    from transformers import AutoModelForSequenceClassification

    model = build_tiny_model_folder(root / "model", arithmetic_corpus(200, 0), seed=0, **shape)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(model, num_labels=1).save_pretrained(root / "reward_model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / name, root / "reward_model" / name)
    train = write_arithmetic_parquet(root / "train.parquet", 4 * prompts, seed=1)
    val = write_arithmetic_parquet(root / "val.parquet", prompts, seed=3, split="test")
    return model, root / "reward_model", train, val


def overrides(model: Path, reward_model: Path, train: Path, val: Path, run_dir: Path, device: str, prompts: int,
              n: int, response: int, steps: int, decoding: str = "dynamic") -> list[str]:
    arf = "actor_rollout_ref"
    settings = {
        f"{arf}.rollout.hf_decoding": decoding,
        "data.train_files": train, "data.val_files": val, "data.max_prompt_length": 64,
        "data.max_response_length": response, "data.train_batch_size": prompts,
        f"{arf}.model.path": model, f"{arf}.model.use_remove_padding": "true",
        f"{arf}.rollout.name": "hf", f"{arf}.rollout.n": n, f"{arf}.actor.ppo_mini_batch_size": prompts // 2,
        f"{arf}.actor.use_dynamic_bsz": "true", f"{arf}.actor.ppo_max_token_len_per_gpu": 2048,
        f"{arf}.actor.optim.lr": 1e-5, f"{arf}.actor.fsdp_config.dtype": "bfloat16",
        f"{arf}.actor.fsdp_config.offload_policy": "true", f"{arf}.ref.fsdp_config.dtype": "bfloat16",
        "critic.model.use_remove_padding": "true", "critic.model.fsdp_config.dtype": "bfloat16",
        "critic.optim.lr": 1e-5, "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": "true",
        "reward_model.enable": "true", "reward_model.model.path": reward_model,
        "trainer.total_training_steps": steps, "trainer.save_freq": 2, "trainer.test_freq": 2,
        "trainer.val_before_train": "true", "trainer.logger": "[]", "trainer.device": device,
        "trainer.default_local_dir": run_dir,
    }
    return [f"{k}={v}" for k, v in settings.items()]


def ppo_run(args: list[str]) -> tuple[list[dict], dict]:
    """One PPO run in this process (as ``main_ppo`` runs it); returns its records and what was
    seen of its models before training."""
    from klppo.run.build import build_ppo, start_processes
    from klppo.trainer.ppo_trainer import PPOTrainer
    from klppo.run.state import resume_target

    cfg = load_ppo_config(None, args)
    env = start_processes(cfg)
    try:
        parts = build_ppo(cfg, log=quiet, env=env)
        seen = {"device": env.device, "actor_params_on": {p.device.type for p in parts.actor.parameters()},
                "actor_fused": any(group.get("fused") for group in parts.actor_optimizer.param_groups),
                "attention": parts.actor.config._attn_implementation,
                "params": sum(p.numel() for p in parts.actor.parameters())}
        target = resume_target(parts)
        parts.settings.run_dir.mkdir(parents=True, exist_ok=True)
        return PPOTrainer(parts, print_fn=quiet).fit(target), seen
    finally:
        close(env)


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


# ---- the checks ----


def check_run(records: list[dict], seen: dict, seconds: float, steps: int) -> None:
    trained = [r for r in records if r["step"] > 0]
    check("online PPO: hf rollout, critic, reward model, validation, bf16, packed, offload_policy",
          len(trained) == steps, f"{len(trained)} of {steps} steps in {seconds:.1f} s, {seen['params'] / 1e6:.2f}M "
          f"actor parameters, attention {seen['attention']}")
    values = [v for r in records for v in r.values()]
    bad = [k for r in records for k, v in r.items() if not math.isfinite(v)]
    check("metrics finite", not bad, f"{len(values)} values" + (f", not finite: {sorted(set(bad))[:4]}" if bad else ""))
    val = [(r["step"], v) for r in records for k, v in r.items() if k.startswith("val-core/")]
    check("validation scored by the reward model on the device", [s for s, _ in val] == [0, 2, steps],
          "reward model score " + ", ".join(f"step {s}: {v:.3f}" for s, v in val) if val else "no val-core metric")
    offloaded = seen["actor_params_on"] == {"cpu"}  # and AdamW steps them there (fused on CPU too)
    check("offload_policy keeps the actor's parameters on CPU, stepped there by AdamW", offloaded,
          f"parameters on {sorted(seen['actor_params_on'])}, computing on {seen['device']}, AdamW "
          f"{'fused' if seen['actor_fused'] else 'not fused'}")
    grads = [(r.get("actor/grad_norm", math.nan), r.get("critic/grad_norm", math.nan)) for r in trained]
    check("actor and critic updated", all(a > 0 and c > 0 for a, c in grads),
          "grad norms " + ", ".join(f"{a:.3g}/{c:.3g}" for a, c in grads))


def check_save_resume_export(run_a: Path, full: list[dict], resume_args: list[str], steps: int) -> None:
    saved = sorted(p.name for p in run_a.glob("global_step_*"))
    size = sum(f.stat().st_size for f in run_a.glob("global_step_2/**/*") if f.is_file()) / 2**20
    check("save", saved == ["global_step_2", f"global_step_{steps}"], f"{saved}, step 2 holds {size:.1f} MiB")
    resumed, _ = ppo_run(resume_args)
    want = [comparable(r) for r in full if r["step"] > 2]
    got = [comparable(r) for r in resumed if r["step"] > 2]
    diff = max((abs(a[k] - b[k]) for a, b in zip(got, want) for k in a.keys() & b.keys()), default=math.nan)
    same = got == want
    check("exact resume from step 2", same, f"steps {[r['step'] for r in got]} "
          + ("identical" if same else f"differ (largest difference {diff:.3g})"))
    from transformers import AutoModelForCausalLM

    exported = run_a / "actor_hf"
    try:
        n = len(AutoModelForCausalLM.from_pretrained(exported).state_dict())
        check("export loads with transformers", n > 0, f"{n} tensors in {exported.name}")
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        check("export loads with transformers", False, f"{type(exc).__name__}: {exc}")


def check_offline_probe_offloaded(model: Path, root: Path, device: str, prompts: int, response: int) -> None:
    """An offline step whose actor and reference live on CPU between phases (param_offload): the KL
    probe samples with the actor and scores with both, so both must come to the device for it."""
    arf = "actor_rollout_ref"
    data = write_arithmetic_offline_parquet(root / "offline.parquet", 2 * prompts, seed=2, n_responses=2)
    args = [f"data.train_files={data}", "data.max_prompt_length=64", f"data.max_response_length={response}",
            f"data.train_batch_size={prompts}", f"{arf}.model.path={model}", f"{arf}.rollout.name=offline",
            f"{arf}.rollout.n=2", f"{arf}.actor.ppo_mini_batch_size={prompts}", f"{arf}.actor.optim.lr=1e-5",
            f"{arf}.actor.fsdp_config.param_offload=true", f"{arf}.ref.fsdp_config.param_offload=true",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.probe_prompts=2",
            "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[]", f"trainer.device={device}",
            f"trainer.default_local_dir={root / 'run_offline'}"]
    try:
        records, _ = ppo_run(args)
        kl = records[-1].get("actor/kl_to_ref_sampled", math.nan)
        check("offline KL probe with actor and reference offloaded", math.isfinite(kl), f"sampled KL {kl:.4g}")
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        check("offline KL probe with actor and reference offloaded", False, f"{type(exc).__name__}: {exc}")


VLLM_CHECK = "vLLM rollout: bf16, sleep/wake, weight sync, validation, TP=1"
VLLM_STEPS = 2


def check_vllm_rollout(root: Path, device: str, prompts: int, response: int) -> None:
    """A bf16 online GRPO run with vLLM rollouts and validation after every step, through the real
    entry point in a process of its own (``vllm_smoke_run.py``, one engine per process)."""
    import json
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        check(VLLM_CHECK, None, "vllm is not installed (bash scripts/setup.sh --vllm)")
        return
    shape = SHAPES["gpu"][0] if device == "cuda" else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                          num_key_value_heads=1)  # vLLM's CPU attention: heads of 32+
    model = build_tiny_model_folder(root / "vllm_model", arithmetic_corpus(200, 0), seed=0, **shape)
    train = write_arithmetic_parquet(root / "vllm_train.parquet", 4 * prompts, seed=1)
    val = write_arithmetic_parquet(root / "vllm_val.parquet", prompts, seed=3, split="test")
    arf, run_dir, out = "actor_rollout_ref", root / "run_vllm", root / "vllm_engine_calls.json"
    args = [f"data.train_files={train}", f"data.val_files={val}", f"data.val_batch_size={prompts // 2}",
            "data.max_prompt_length=64", f"data.max_response_length={response}",
            f"data.train_batch_size={prompts}", f"{arf}.model.path={model}", f"{arf}.rollout.name=vllm",
            f"{arf}.rollout.n=4", f"{arf}.rollout.tensor_model_parallel_size=1", f"{arf}.rollout.free_cache_engine=true",
            f"{arf}.rollout.gpu_memory_utilization=0.3", f"{arf}.actor.ppo_mini_batch_size={prompts // 2}",
            f"{arf}.actor.optim.lr=1e-5", f"{arf}.actor.fsdp_config.dtype=bfloat16", f"{arf}.actor.use_kl_loss=true",
            "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={VLLM_STEPS}", "trainer.save_freq=-1",
            "trainer.test_freq=1", "trainer.val_before_train=true",
            "trainer.logger=[]", f"trainer.device={device}", f"trainer.default_local_dir={run_dir}"]
    script = Path(__file__).with_name("vllm_smoke_run.py")
    done = subprocess.run([sys.executable, str(script), str(out), *args], capture_output=True, text=True)
    if done.returncode:
        check(VLLM_CHECK, False, done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else "failed")
        return
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calls, last = json.loads(out.read_text()), records[-1]
    ok = len(records) == VLLM_STEPS + 1 and vllm_calls_ok(calls, device, records) and last["timing_s/weight_sync"] > 0
    diff, outside = last["training/rollout_probs_diff_mean"], last["training/rollout_probs_ratio_outside"]
    ok = ok and diff < 0.05 and math.isfinite(last["actor/pg_loss"])
    check(VLLM_CHECK, ok, f"gen {last['timing_s/gen']:.2f} s, weight sync {last['timing_s/weight_sync']:.3f} s, "
          f"gen peak {last.get('perf/peak_memory_gb/gen', math.nan):.2f} GiB vs update "
          f"{last.get('perf/peak_memory_gb/update_actor', math.nan):.2f} GiB, |p_trainer - p_engine| mean {diff:.2e}, "
          f"{100 * outside:.1f}% of tokens with ratio outside [0.8, 1.25]; {calls['generations']} generations, "
          f"{calls['loads']} weight loads, {calls['wakes']} wakes each past {calls['cached_before_wake_gib']:.1f} GiB "
          f"held in PyTorch's cache")


def vllm_calls_ok(calls: dict, device: str, records: list[dict]) -> bool:
    """Every validation (before training and after each step) generated for its two batches and its
    KL probe's two, with the weights; on a GPU each generation after its own weight load (the sleep
    after the one before discarded them) and both wakes past a cache holding the device's free memory."""
    validations = sum("val-aux/kl_to_ref" in r for r in records)
    ok = calls["exit"] == 0 and validations == VLLM_STEPS + 1
    ok = ok and calls["generations"] == VLLM_STEPS + 4 * validations
    if device == "cuda":
        ok = ok and calls["loads"] == calls["generations"] and calls["wakes"] == 2 * calls["generations"]
        ok = ok and calls["cached_before_wake_gib"] > 1.0
    return ok


def check_memory_and_mfu(records: list[dict], device: torch.device) -> None:
    peak = max(r.get("perf/max_memory_allocated_gb", 0.0) for r in records)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        check("peak memory", 0 < peak < 0.9 * total, f"{peak:.2f} GiB of {total:.0f} GiB (max_memory_allocated)")
    else:
        check("peak memory", peak > 0, f"{peak:.2f} GiB (process peak RSS)")
    mfus = {k: v for r in records for k, v in r.items() if k.startswith("perf/mfu/")}
    if peak_flops(device, torch.bfloat16) is None:
        check("MFU against the bf16 peak", None, f"no known peak for {device}")
        return
    name = torch.cuda.get_device_name(device)
    check("MFU against the bf16 peak", bool(mfus) and all(0 < v <= 1 for v in mfus.values()),
          ", ".join(f"{k.removeprefix('perf/mfu/')} {100 * v:.1f}%" for k, v in mfus.items()) + f" ({name})")


def check_memory_plan(args: list[str], records: list[dict], device: torch.device) -> None:
    """``klppo plan``'s estimate of this run's phases (steady state, from config.json and the data
    alone) against their measured peaks in the last step: within 15% each on a GPU; on CPU the
    comparison is shown and not judged, as the interpreter's baseline is most of a tiny shape's."""
    from klppo.plan.check import length_sample, lengths_of, plan_run

    cfg = load_ppo_config(None, args)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 64 * 2**30
    e, _ = plan_run(cfg, world_size=1, device=device.type, device_bytes=total, lengths=lengths_of(length_sample(cfg)))
    last = next(r for r in reversed(records) if "perf/peak_memory_gb/update_actor" in r)
    errors = {p.phase: p.total / 2**30 / last[f"perf/peak_memory_gb/{p.phase}"] - 1 for p in e.phases
              if last.get(f"perf/peak_memory_gb/{p.phase}")}
    worst = max(errors, key=lambda k: abs(errors[k]))
    figure = (f"worst {worst} {100 * errors[worst]:+.0f}% of {len(errors)} phases ("
              + ", ".join(f"{k} {100 * v:+.0f}%" for k, v in errors.items()) + ")")
    check("memory plan within 15% per phase", all(abs(v) <= 0.15 for v in errors.values())
          if device.type == "cuda" else None, figure)


@contextlib.contextmanager
def counting_syncs(device: torch.device):
    """Counts host-device syncs: CUDA's sync debug mode, or on CPU the tensor methods that would sync."""
    counts: Counter = Counter()
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts["sync"] = sum("synchroniz" in str(w.message) for w in caught)
        return
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "nonzero")}

    def counted(name):
        def wrapper(self, *a, **k):
            counts[name] += 1
            return originals[name](self, *a, **k)
        return wrapper

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def check_host_syncs(model_dir: Path, device: torch.device) -> None:
    """A packed forward + backward of the model in bf16 on the device, its host syncs counted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model.config.use_cache = False
    attention = use_packed_attention(model, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 48), generator=g).to(device)
    mask = (torch.arange(48) >= torch.tensor([[0], [5], [9], [2]])).to(device)  # left padding, 4 lengths
    step = lambda: response_logprobs(model, ids, mask, 16, packed=True, with_entropy=True)[0].sum().backward()  # noqa: E731
    step()  # warm-up (kernels, caches)
    with counting_syncs(device) as counts:
        step()
    total = sum(counts.values())
    check("host syncs per packed forward + backward", total <= SYNC_LIMIT,
          f"{total} with {model.config.num_hidden_layers} layers ({attention}; at most {SYNC_LIMIT}, whatever the depth)")


def _logprobs_and_grads(model, ids, mask, response: int, packed: bool):
    """Response log-probs (fp32) and the flattened gradient of their sum."""
    model.zero_grad(set_to_none=True)
    log_probs, _ = response_logprobs(model, ids, mask, response, packed=packed)
    log_probs.sum().backward()
    return log_probs.detach().float(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


def check_packed_matches_padded(model_dir: Path, device: torch.device) -> None:
    """Packed rows against the padded path in bf16 on the device, with the attention a run chooses
    there (torch's varlen kernel on a recent CUDA GPU): each path's log-probs and gradient are
    measured against the fp32 padded path, and the packed path may differ from it by at most twice
    what the padded path does in the same bf16 (plus 1e-3). Judged on a GPU; shown on CPU."""
    from transformers import AutoModelForCausalLM

    models = {dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
              for dtype in (torch.float32, torch.bfloat16)}
    attention = use_packed_attention(models[torch.bfloat16], torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(24, 96, (8,), generator=g)
    ids = torch.randint(3, models[torch.float32].config.vocab_size, (8, 96), generator=g).to(device)
    mask = (torch.arange(96) >= 96 - lengths[:, None]).to(device)  # left-padded, 8 lengths
    reference = _logprobs_and_grads(models[torch.float32], ids, mask, 16, packed=False)
    errors = {}
    for packed in (False, True):
        lp, grad = _logprobs_and_grads(models[torch.bfloat16], ids, mask, 16, packed)
        errors[packed] = ((lp - reference[0]).abs().max().item(),  # host sync
                          ((grad - reference[1]).norm() / reference[1].norm()).item())  # host sync
    within = all(errors[True][i] <= 2 * errors[False][i] + 1e-3 for i in range(2))
    check("packed rows match the padded path in bf16", within if device.type == "cuda" else None,
          f"{attention}: max |log-prob - fp32| packed {errors[True][0]:.3g} vs padded {errors[False][0]:.3g}; "
          f"gradient relative error packed {errors[True][1]:.3g} vs padded {errors[False][1]:.3g}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shape on CPU (what tests/benchmarks/test_gpu_smoke.py runs)")
    p.add_argument("--keep", type=Path, default=None, help="write the model, data and runs here and keep them")
    p.add_argument("--budget-s", type=float, default=None, help="also check that the whole script took at most this")
    p.add_argument("--decoding", choices=["dynamic", "auto"], default="dynamic",
                   help="rollout.hf_decoding of the PPO runs: auto = a run's default (compiled on CUDA)")
    return p.parse_args(argv)


def run_checks(root: Path, device: torch.device, args) -> None:
    """Every check, in order; each part's time in SECONDS."""
    shape, prompts, n, response, steps = SHAPES["cpu" if args.cpu else "gpu"]
    with part("prepare"):
        common = prepare(root, shape, prompts)
    model, run_a, run_b = common[0], root / "run_a", root / "run_b"
    args_a = overrides(*common, run_a, device.type, prompts, n, response, steps, args.decoding)
    resume = overrides(*common, run_b, device.type, prompts, n, response, steps, args.decoding) + [
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run_a / 'global_step_2'}"]
    with deterministic(device):
        start = time.perf_counter()
        try:
            with part("run"):
                records, seen = ppo_run(args_a)
        except Exception as exc:  # noqa: BLE001 - the run is the first check; nothing else can follow
            check("online PPO run", False, f"{type(exc).__name__}: {exc}")
            return
        check_run(records, seen, time.perf_counter() - start, steps)
        with part("resume"):
            check_save_resume_export(run_a, read_metrics(run_a), resume, steps)
    with part("memory, MFU, plan"):
        check_memory_and_mfu(records, device)
        check_memory_plan(args_a, records, device)
    with part("host syncs, packed vs padded"):
        check_host_syncs(model, device)
        check_packed_matches_padded(model, device)
    with part("offline probe"):
        check_offline_probe_offloaded(model, root, device.type, prompts, response)
    with part("vllm"):
        check_vllm_rollout(root, device.type, prompts, response)


def process_seconds(fallback: float) -> float:
    """Seconds since this process started (its imports and CUDA's start included), from /proc; the
    time since ``fallback`` (a perf_counter reading) where there is no /proc."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start time
        return float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - fallback


def print_times(total: float, budget: float | None) -> None:
    """Each part's seconds and the process's total; with a budget, the check that the total kept to it."""
    print("gpu_smoke: seconds per part: " + ", ".join(f"{k} {v:.1f}" for k, v in SECONDS.items())
          + f"; total {total:.1f} since the process started (imports included)", flush=True)
    if budget is not None:
        check(f"the whole smoke test within --budget-s {budget:g}", total <= budget, f"{total:.1f} s")


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device is visible; run `bash benchmarks/gpu_smoke.sh --cpu` for the CPU smoke mode",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    quiet_libraries()
    root = args.keep or Path(tempfile.mkdtemp(prefix="klppo-gpu-smoke-"))
    flash = importlib.util.find_spec("flash_attn") is not None
    print(f"gpu_smoke: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, flash_attn {'installed' if flash else 'not installed'}, files in {root}", flush=True)
    _last[0] = time.perf_counter()
    try:
        run_checks(root, device, args)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print_times(process_seconds(start), args.budget_s)
    counts = Counter(verdict for verdict, _, _ in RESULTS)
    print(f"gpu_smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
