"""klppo against TRL, side by side: the same model, tokenizer, prompts and settings, each in its own process.

    python benchmarks/vs_trl.py --mode cpu          # issue 33's workload: 5.0M-parameter Qwen2, fp32, 2 threads
    python benchmarks/vs_trl.py --mode gpu          # issue 31's: 181M-parameter Qwen2, bf16, one CUDA GPU
    python benchmarks/vs_trl.py --mode cpu --only grpo --no-trl   # klppo's workers alone

One invocation builds the shared inputs once (``--work``): a byte-level BPE tokenizer trained
here on a synthetic corpus, a random Qwen2 model folder of the mode's shape, a random reward-model
folder (the same backbone with a seeded score head), and the prompts: Parquet in verl's
RLHFDataset format for klppo (plain-string prompts, no chat template), the same strings (and
their token ids) for TRL. Every prompt is exactly ``prompt_tokens`` tokens long. Then each side
runs in a process of its own, klppo and TRL alternating:

- ``klppo-ppo``: ``python -m klppo.trainer.main_ppo`` (klppo's real trainer, overrides only):
  HF generate, a critic (GAE), a reference and the reward model, KL in the reward (k1, fixed);
- ``klppo-offline-ppo``: the same on recorded responses (``rollout.name=offline``; no
  generation), with the offline KL probe sampling ``probe_prompts`` prompts each step;
- ``trl-ppo``: TRL 1.12's ``trl.experimental.ppo.PPOTrainer`` (the last release that has one);
- ``klppo-grpo``: GRPO (group advantages, KL loss k3 to the reference, clip 0.2);
- ``trl-grpo``: TRL 1.16's ``GRPOTrainer`` with the same settings (``beta`` = the KL loss coefficient).

Every response is exactly ``response_tokens`` tokens on both sides, so both train on the same
tokens: klppo with ``actor_rollout_ref.rollout.ignore_eos=true`` (on hf: transformers'
``min_new_tokens`` = ``max_new_tokens``, EOS never sampled), TRL's GRPOTrainer with
``generation_kwargs={"min_new_tokens": max_completion_length}``, TRL's PPOTrainer with
``stop_token=None`` (it then decodes ``response_length`` tokens and never truncates); the offline
responses are ``response_tokens - 1`` digits (one token each) and the EOS klppo appends. The
workers record the mean response length they trained on and the table prints it.

One optimiser step per batch on both sides (klppo: ``ppo_mini_batch_size`` = the batch; TRL:
``per_device_train_batch_size x gradient_accumulation_steps`` = the batch), one PPO epoch, no
gradient checkpointing, no validation, no checkpoints. GRPO rewards come from the same cheap
deterministic function of the response text on both sides (``compute_score`` below).

Figures per side, the mean over the steps after the first (the first pays one-off costs):
- step s: klppo ``timing_s/step``; TRL the time between consecutive ``on_step_end`` callbacks;
- gen s: klppo ``timing_s/gen``; TRL the time in its generate call (GRPO ``_generate_single_turn``,
  PPO ``batch_generation``); on CUDA each clock read follows a synchronise;
- rest s: step - gen (scoring, log-probs, advantages, the update, logging);
- update s: klppo ``timing_s/update_actor`` (+ ``update_critic``); TRL GRPO the step less
  ``_generate_and_score_completions``; TRL PPO from its first training forward to the step's end;
- e2e tok/s: (prompt + response tokens of the batch) / step s; update tok/s: the same / update s;
- peak GB: CPU the worker process's peak resident set (``wait4``'s ru_maxrss, the same for both
  sides); CUDA ``torch.cuda.max_memory_allocated`` (klppo: the largest ``perf/peak_memory_gb/*``).
Ratios are speeds, TRL time / klppo time (> 1: klppo faster); memory TRL / klppo.

TRL is never klppo's dependency. It runs from environments of its own, found as ``.venv-trl``
(TRL 1.16, GRPO) and ``.venv-trl-ppo`` (TRL 1.12, PPO) at the repository root (built by
``bash benchmarks/setup_trl.sh``), or ``--trl-python`` / ``--trl-ppo-python``. Where no network
reaches (the GPU machine), ``--trl-wheels DIR`` installs the wheels that
``benchmarks/fetch_gpu_wheels.sh`` downloaded (``pip install --no-index --no-deps --target``
into the work folder, then ``PYTHONPATH``) and runs TRL with this Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("klppo-ppo", "trl-ppo", "klppo-offline-ppo", "klppo-grpo", "trl-grpo")
COMPARISONS = (("klppo-ppo", "trl-ppo"), ("klppo-offline-ppo", "trl-ppo"), ("klppo-grpo", "trl-grpo"))
TRL_VERSIONS = {"grpo": "1.16.0", "ppo": "1.12.0"}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One mode's shapes and settings, shared by every side (written to the work folder as JSON)."""

    device: str
    dtype: str  # float32 | bfloat16: klppo's fsdp_config.dtype; TRL fp32 weights, bf16 autocast
    threads: int  # torch threads per worker (CPU); 0 = torch's choice
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    prompt_tokens: int
    response_tokens: int
    steps: int
    ppo_prompts: int  # prompts per PPO step, one response each
    ppo_temperature: float
    ppo_kl_coef: float  # KL in the reward, k1, fixed coefficient
    grpo_prompts: int
    grpo_n: int
    grpo_temperature: float
    grpo_kl_coef: float  # KL loss, k3
    token_budget: int  # klppo's ppo_max_token_len_per_gpu (use_dynamic_bsz, use_remove_padding)
    trl_micro_batch: int  # TRL's per_device_train_batch_size (sequences); accumulation fills the batch
    probe_prompts: int  # offline KL probe: prompts sampled per step
    lr: float = 1e-6
    seed: int = 0


WORKLOADS = {
    # issue 33: 5.0M parameters; 16 x (32 + 32) tokens; PPO 16 x 1, GRPO 4 x 4
    "cpu": Workload(device="cpu", dtype="float32", threads=2, vocab=4096, hidden=256, layers=4, heads=4, kv_heads=2,
                    mlp=688, tied=False, prompt_tokens=32, response_tokens=32, steps=4, ppo_prompts=16,
                    ppo_temperature=0.7, ppo_kl_coef=0.05, grpo_prompts=4, grpo_n=4, grpo_temperature=0.7,
                    grpo_kl_coef=0.05, token_budget=4096, trl_micro_batch=16, probe_prompts=8),
    # issue 31: 181M parameters (gpu_smoke's shape); 32 prompts x 8 samples x 256 new tokens
    "gpu": Workload(device="cuda", dtype="bfloat16", threads=0, vocab=384, hidden=1024, layers=16, heads=16,
                    kv_heads=4, mlp=2816, tied=True, prompt_tokens=32, response_tokens=256, steps=4, ppo_prompts=32,
                    ppo_temperature=1.0, ppo_kl_coef=0.04, grpo_prompts=32, grpo_n=8, grpo_temperature=1.0,
                    grpo_kl_coef=0.04, token_budget=32768, trl_micro_batch=64, probe_prompts=8),
}
# --tiny: the CPU mode's settings on a model small enough for a test (seconds per side)
TINY = dict(vocab=384, hidden=32, layers=2, heads=2, kv_heads=1, mlp=64, prompt_tokens=16, response_tokens=8, steps=2,
            ppo_prompts=4, grpo_prompts=2, grpo_n=2, trl_micro_batch=4, probe_prompts=2)


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The GRPO reward on both sides: a deterministic pseudo-random number in [0, 1) from the
    response text, so groups have spread (non-zero advantages) and scoring costs nothing."""
    return zlib.crc32(solution_str.encode("utf-8")) / 2**32


# ---- shared inputs (klppo's Python) ----


def corpus(n: int, seed: int) -> list[str]:
    """Pseudo-words and numbers, varied enough for a 4,096-entry BPE vocabulary."""
    import random

    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"

    def word() -> str:
        return "".join(rng.choice(consonants) + rng.choice(vowels) + (rng.choice(consonants) if rng.random() < 0.3
                       else "") for _ in range(rng.randint(1, 4)))

    return [" ".join(word() for _ in range(20)) + ". " + " ".join(str(rng.randint(0, 999)) for _ in range(3))
            for _ in range(n)]


def exact_prompt(tokenizer, words: list[str], length: int) -> str:
    """Words, then a space and digits (one token each) up to exactly ``length`` tokens."""
    text = ""
    for word in words:
        longer = f"{text} {word}".strip()
        if len(tokenizer(longer + " ")["input_ids"]) > length - 2:
            break
        text = longer
    text += " "
    text += "7" * (length - len(tokenizer(text)["input_ids"]))
    assert len(tokenizer(text)["input_ids"]) == length, text
    return text


def write_rows(path: Path, prompts: list[str], responses: list[list[str]] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "vs_trl", "prompt": p, "ability": "benchmark",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]
    for row, recorded in zip(rows, responses or []):
        row["responses"] = recorded
    pq.write_table(pa.Table.from_pylist(rows), path)


def build_inputs(work: Path, w: Workload) -> None:
    """Tokenizer + model folder, reward-model folder, prompts for every side; written once per work folder."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

    from transformers.utils import logging

    from klppo.models.tiny import save_tokenizer, train_tiny_tokenizer

    logging.set_verbosity_error()  # the reward model's fresh score head is meant
    logging.disable_progress_bar()
    tokenizer = train_tiny_tokenizer(corpus(4000, w.seed), vocab_size=w.vocab, chat_template=False)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=w.hidden, intermediate_size=w.mlp,
                         num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.kv_heads,
                         max_position_embeddings=max(512, 2 * (w.prompt_tokens + w.response_tokens)),
                         tie_word_embeddings=w.tied, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(w.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = config.pad_token_id, config.eos_token_id
    model.save_pretrained(work / "model")
    save_tokenizer(tokenizer, work / "model")  # reloads with one entry per embedding row
    torch.manual_seed(w.seed + 1)
    reward = AutoModelForSequenceClassification.from_pretrained(work / "model", num_labels=1)
    reward.save_pretrained(work / "reward_model")
    save_tokenizer(tokenizer, work / "reward_model")
    texts = corpus(w.steps * max(w.ppo_prompts, w.grpo_prompts), w.seed + 2)
    prompts = [exact_prompt(tokenizer, t.split(), w.prompt_tokens) for t in texts]
    ppo, grpo = prompts[: w.steps * w.ppo_prompts], prompts[: w.steps * w.grpo_prompts]
    write_rows(work / "ppo.parquet", ppo)
    write_rows(work / "grpo.parquet", grpo)
    digits = ["".join(str((i * 7 + k) % 10) for k in range(w.response_tokens - 1)) for i in range(len(ppo))]
    write_rows(work / "ppo_offline.parquet", ppo, [[d] for d in digits])
    ids = {name: [tokenizer(p)["input_ids"] for p in ps] for name, ps in (("ppo", ppo), ("grpo", grpo))}
    (work / "prompts.json").write_text(json.dumps({"ppo": ppo, "grpo": grpo, "ppo_ids": ids["ppo"]}))
    (work / "workload.json").write_text(json.dumps(dataclasses.asdict(w)))
    params = sum(p.numel() for p in model.parameters())
    print(f"inputs in {work}: Qwen2 {params / 1e6:.2f}M parameters (vocab {len(tokenizer)}, hidden {w.hidden}, "
          f"{w.layers} layers, {w.heads}/{w.kv_heads} heads, MLP {w.mlp}, {'tied' if w.tied else 'untied'}); "
          f"{len(ppo)} PPO and {len(grpo)} GRPO prompts of {w.prompt_tokens} tokens", flush=True)


# ---- klppo's side: its CLI, then its metrics.jsonl ----


def klppo_overrides(side: str, w: Workload, work: Path, run_dir: Path) -> list[str]:
    arf, grpo, offline = "actor_rollout_ref", side == "klppo-grpo", side == "klppo-offline-ppo"
    prompts = w.grpo_prompts if grpo else w.ppo_prompts
    data = work / ("grpo.parquet" if grpo else "ppo_offline.parquet" if offline else "ppo.parquet")
    settings = {
        "data.train_files": data, "data.max_prompt_length": w.prompt_tokens,
        "data.max_response_length": w.response_tokens, "data.train_batch_size": prompts, "data.shuffle": "false",
        f"{arf}.model.path": work / "model", f"{arf}.model.use_remove_padding": "true",
        f"{arf}.rollout.name": "offline" if offline else "hf", f"{arf}.rollout.n": w.grpo_n if grpo else 1,
        f"{arf}.rollout.temperature": w.grpo_temperature if grpo else w.ppo_temperature,
        f"{arf}.rollout.ignore_eos": "true",
        f"{arf}.actor.ppo_mini_batch_size": prompts, f"{arf}.actor.ppo_epochs": 1,
        f"{arf}.actor.use_dynamic_bsz": "true", f"{arf}.actor.ppo_max_token_len_per_gpu": w.token_budget,
        f"{arf}.actor.clip_ratio": 0.2, f"{arf}.actor.entropy_coeff": 0, f"{arf}.actor.optim.lr": w.lr,
        f"{arf}.actor.fsdp_config.dtype": w.dtype, f"{arf}.ref.fsdp_config.dtype": w.dtype,
        "trainer.total_training_steps": w.steps, "trainer.save_freq": -1, "trainer.test_freq": -1,
        "trainer.val_before_train": "false", "trainer.logger": "[console]", "trainer.device": w.device,
        "trainer.default_local_dir": run_dir, "trainer.resume_mode": "disable",
    }
    if grpo:
        settings.update({"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "false",
                         f"{arf}.actor.use_kl_loss": "true", f"{arf}.actor.kl_loss_coef": w.grpo_kl_coef,
                         f"{arf}.actor.kl_loss_type": "low_var_kl",
                         "custom_reward_function.path": Path(__file__).resolve(),
                         "custom_reward_function.name": "compute_score"})
    else:
        settings.update({"algorithm.adv_estimator": "gae", "algorithm.gamma": 1.0, "algorithm.lam": 0.95,
                         "algorithm.use_kl_in_reward": "true", "algorithm.kl_penalty": "kl",
                         "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": w.ppo_kl_coef,
                         f"{arf}.actor.use_kl_loss": "false", "critic.model.use_remove_padding": "true",
                         "critic.model.fsdp_config.dtype": w.dtype, "critic.optim.lr": w.lr,
                         "critic.cliprange_value": 0.2, "reward_model.enable": "true",
                         "reward_model.model.path": work / "reward_model",
                         "reward_model.model.use_remove_padding": "true"})
    if offline:
        settings["algorithm.kl_ctrl.probe_prompts"] = w.probe_prompts
        settings["trainer.total_training_steps"] = offline_steps(w.steps)
    return [f"{k}={v}" for k, v in settings.items()]


def offline_steps(steps: int) -> int:
    """The offline side's steps: its steady steps (all but the first) whole cycles of the KL probe's
    default cadence (every PROBE_EVERY-th step from the first), so their mean carries the probe's
    cost as a run pays it, amortised; ``steps`` steady steps round up to whole cycles."""
    from klppo.config.kl_probe import PROBE_EVERY

    return 1 + PROBE_EVERY * max(1, -(-(steps - 1) // PROBE_EVERY))


def klppo_steps(run_dir: Path) -> tuple[list[dict], float | None, float]:
    """Per-step figures from klppo's metrics.jsonl; its peak memory (CUDA) and mean response length."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("step", 0) > 0 and "timing_s/step" in r]
    steps = []
    for r in records:
        update = r.get("timing_s/update_actor", 0.0) + r.get("timing_s/update_critic", 0.0)
        phases = {k.removeprefix("timing_s/"): v for k, v in r.items() if k.startswith("timing_s/")}
        steps.append({"step_s": r["timing_s/step"], "gen_s": r.get("timing_s/gen", 0.0), "update_s": update,
                      "phases": phases})
    peaks = [v for r in records for k, v in r.items() if k.startswith("perf/peak_memory_gb/")]
    lengths = [r["response_length/mean"] for r in records if "response_length/mean" in r]
    return steps, max(peaks) if peaks else None, statistics.mean(lengths) if lengths else float("nan")


def versions() -> dict:
    """klppo's side runs with this Python's packages."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers")}


# ---- running the sides ----


def run_process(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, float]:
    """Run ``cmd`` with output to ``log``; (exit status, the process's peak resident set in GB)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode, usage.ru_maxrss / 2**20  # KiB -> GiB
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                return 124, 0.0
            time.sleep(0.05)


def worker_env(w: Workload, extra_path: str | None = None) -> dict:
    env = {**os.environ, "KLPPO_QUIET": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    if w.threads:
        env.update(OMP_NUM_THREADS=str(w.threads), MKL_NUM_THREADS=str(w.threads))
    paths = [extra_path] if extra_path else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_side(side: str, run: int, w: Workload, work: Path, trl: dict, timeout: float) -> dict:
    """Run ``run`` of one side in its own process; its figures (written to ``work/<side>-<run>.json``)."""
    name = f"{side}-{run}"
    out, log = work / f"{name}.json", work / f"{name}.log"
    if side.startswith("klppo"):
        run_dir = work / f"run_{name}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
        cmd = [sys.executable, "-m", "klppo.trainer.main_ppo", *klppo_overrides(side, w, work, run_dir)]
        status, rss = run_process(cmd, worker_env(w), log, timeout)
        if status == 0:
            steps, cuda_peak, length = klppo_steps(run_dir)
            out.write_text(json.dumps({"side": side, "steps": steps, "cuda_peak_gb": cuda_peak,
                                       "response_length": length, "versions": versions()}))
    else:
        python, path = trl[side]
        cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--work", str(work), "--json", str(out)]
        status, rss = run_process(cmd, worker_env(w, path), log, timeout)
    if status != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{side} failed (exit status {status}); the last lines of {log}:\n{tail}")
    result = json.loads(out.read_text())
    result["rss_peak_gb"] = rss
    out.write_text(json.dumps(result))
    return result


def order(sides: list[str], repeats: int) -> list[str]:
    """klppo and TRL alternate; every other repeat runs the list backwards (ABBA), so drift in the
    machine's load falls on both sides alike."""
    runs = []
    for rep in range(repeats):
        runs += sides if rep % 2 == 0 else sides[::-1]
    return runs


# ---- TRL's environments ----

SETUP_HINT = ("TRL is not installed for vs_trl.py: run `bash benchmarks/setup_trl.sh` (builds .venv-trl with TRL "
              "1.16 and .venv-trl-ppo with TRL 1.12), pass --trl-python / --trl-ppo-python, or --trl-wheels DIR "
              "with the wheels of benchmarks/fetch_gpu_wheels.sh (no network); --no-trl runs klppo's sides alone")


def trl_environments(args, work: Path) -> dict:
    """side -> (python, extra PYTHONPATH) for the TRL sides whose TRL is found; a missing one is left out."""
    found = {}
    if args.trl_wheels:
        for kind, side in (("grpo", "trl-grpo"), ("ppo", "trl-ppo")):
            site = install_wheels(Path(args.trl_wheels), TRL_VERSIONS[kind], work / f"trl-site-{kind}")
            if site:
                found[side] = (sys.executable, str(site))
        return found
    candidates = {"trl-grpo": args.trl_python or ROOT / ".venv-trl/bin/python",
                  "trl-ppo": args.trl_ppo_python or ROOT / ".venv-trl-ppo/bin/python"}
    for side, python in candidates.items():
        kind = side.removeprefix("trl-")
        version = trl_version(str(python))
        if version == TRL_VERSIONS[kind] or (version and kind == "grpo"):
            found[side] = (str(python), None)
        elif version:
            print(f"note: {python} has TRL {version}; {side} needs {TRL_VERSIONS[kind]} (PPOTrainer)", flush=True)
    return found


def trl_version(python: str) -> str | None:
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip() or None if probe.returncode == 0 else None


def install_wheels(wheels: Path, trl: str, site: Path) -> Path | None:
    """``pip install --no-index --no-deps --target site`` of every wheel in ``wheels`` but the other
    TRL release; None when the folder has no wheel of TRL ``trl``."""
    chosen = [p for p in sorted(wheels.glob("*.whl")) if not p.name.startswith("trl-") or
              p.name.startswith(f"trl-{trl}-")]
    if not any(p.name.startswith(f"trl-{trl}-") for p in chosen):
        return None
    if not (site / "trl").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(site), *map(str, chosen)], check=True)
    return site


# ---- report ----


def summarise(runs: list[dict], w: Workload, side: str) -> dict:
    """One side's row: means over the steady steps of all its runs (the first step of a run pays
    one-off costs), token rates from those means, the mean peak memory of its runs."""
    steady = [s for r in runs for s in (r["steps"][1:] or r["steps"])]
    mean = {k: statistics.mean(s[k] for s in steady) for k in ("step_s", "gen_s", "update_s")}
    rows = w.grpo_prompts * w.grpo_n if side.endswith("grpo") else w.ppo_prompts
    tokens = rows * (w.prompt_tokens + w.response_tokens)
    peaks = [r.get("cuda_peak_gb") if w.device == "cuda" else r["rss_peak_gb"] for r in runs]
    probe = [s["phases"]["kl_probe"] for s in steady if "kl_probe" in s.get("phases", {})]
    return {**mean, "rest_s": mean["step_s"] - mean["gen_s"], "e2e_tps": tokens / mean["step_s"],
            "update_tps": tokens / mean["update_s"] if mean["update_s"] else float("nan"),
            "peak_gb": statistics.mean(peaks) if None not in peaks else float("nan"), "steps": len(steady),
            "response_length": statistics.mean(r.get("response_length", float("nan")) for r in runs),
            "kl_probe_s": statistics.mean(probe) if probe else None}


def report(results: dict[str, list[dict]], w: Workload) -> dict[str, dict]:
    """Print one row per side and the ratios of each comparison; return the rows."""
    from klppo.config.kl_probe import PROBE_EVERY

    rows = {}
    print()
    for side, runs in results.items():
        versions = runs[0].get("versions", {})
        print(f"{side}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        rows[side] = summarise(runs, w, side)
    print(f"\n{'side':<18} {'step s':>8} {'gen s':>7} {'rest s':>7} {'update s':>8} {'e2e tok/s':>9} "
          f"{'upd tok/s':>9} {'peak GB':>8} {'resp tok':>8}")
    for side, r in rows.items():
        probe = (f"   (kl_probe {r['kl_probe_s']:.3f} s on the steps it runs, 1 in {PROBE_EVERY}: "
                 f"{r['kl_probe_s'] / PROBE_EVERY:.3f} s a step)" if r.get("kl_probe_s") else "")
        print(f"{side:<18} {r['step_s']:>8.3f} {r['gen_s']:>7.3f} {r['rest_s']:>7.3f} {r['update_s']:>8.3f} "
              f"{r['e2e_tps']:>9.0f} {r['update_tps']:>9.0f} {r['peak_gb']:>8.2f} {r['response_length']:>8.1f}{probe}")
    print(f"\n{'klppo / TRL (speed: TRL s / klppo s)':<40} {'step':>6} {'gen':>6} {'rest':>6} {'update':>7} "
          f"{'memory (TRL/klppo)':>19}")
    for ours, theirs in COMPARISONS:
        if ours in rows and theirs in rows:
            a, b = rows[ours], rows[theirs]
            speed = {k: f"{b[k] / a[k]:.2f}x" for k in ("step_s", "gen_s", "rest_s", "update_s")}
            if ours == "klppo-offline-ppo":
                speed["gen_s"] = "-"  # nothing generates offline
            print(f"{ours + ' / ' + theirs:<40} {speed['step_s']:>6} {speed['gen_s']:>6} {speed['rest_s']:>6} "
                  f"{speed['update_s']:>7} {b['peak_gb'] / a['peak_gb']:>18.2f}x")
    return rows


# ---- main ----


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(WORKLOADS), default="cpu")
    p.add_argument("--tiny", action="store_true", help="the mode's settings on a tiny model (the test's shape)")
    p.add_argument("--only", choices=["ppo", "grpo"], help="one algorithm's sides only")
    p.add_argument("--sides", nargs="+", choices=SIDES, help="these sides only")
    p.add_argument("--no-trl", action="store_true", help="klppo's sides only")
    p.add_argument("--steps", type=int, help="iterations per run (the first is left out); default: the mode's")
    p.add_argument("--threads", type=int, help="torch threads per worker; default: the mode's (cpu: 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every side, alternating (ABBA)")
    p.add_argument("--work", help="folder for the inputs, runs and figures (default: a new temporary folder)")
    p.add_argument("--trl-python", help="a Python with TRL 1.16 (GRPO); default .venv-trl/bin/python")
    p.add_argument("--trl-ppo-python", help="a Python with TRL 1.12 (PPO); default .venv-trl-ppo/bin/python")
    p.add_argument("--trl-wheels", help="install TRL from these wheels (fetch_gpu_wheels.sh) and run it with this Python")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    p.add_argument("--json", help="write the table's rows here (a worker: its figures)")
    p.add_argument("--worker", choices=["trl-grpo", "trl-ppo"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def workload(args) -> Workload:
    w = WORKLOADS[args.mode]
    if args.tiny:
        w = dataclasses.replace(w, **TINY)
    if args.threads is not None:
        w = dataclasses.replace(w, threads=args.threads)
    return dataclasses.replace(w, steps=args.steps) if args.steps else w


def chosen_sides(args, trl: dict) -> list[str]:
    sides = list(args.sides or SIDES)
    if args.only:
        sides = [s for s in sides if s.endswith(args.only)]
    wanted_trl = [s for s in sides if s.startswith("trl")]
    missing = [s for s in wanted_trl if s not in trl]
    if missing and not args.no_trl:
        print(f"note: {', '.join(missing)} skipped. {SETUP_HINT}", flush=True)
    return [s for s in sides if s.startswith("klppo") or (s in trl and not args.no_trl)]


def main(argv=None) -> dict[str, dict]:
    args = parse_args(argv)
    if args.worker:
        from benchmarks import vs_trl_workers

        vs_trl_workers.main(args.worker, Path(args.work), Path(args.json))
        return {}
    import tempfile

    w = workload(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    build_inputs(work, w)
    trl = {} if args.no_trl else trl_environments(args, work)
    sides = chosen_sides(args, trl)
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for side in order(sides, args.repeats):
        start = time.perf_counter()
        results[side].append(run_side(side, len(results[side]), w, work, trl, args.timeout))
        print(f"  {side}: {time.perf_counter() - start:.1f} s", flush=True)
    rows = report(results, w)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": dataclasses.asdict(w), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
