"""Peak memory per rank and per phase of a real PPO run on a model shape built from a config.

Builds a folder with random weights (default: Qwen2.5-0.5B's shape: 24 layers, hidden 896,
14 heads / 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings; saved in bf16 as the
released checkpoint is) and a tokenizer with that many entries, writes a small Parquet task,
then runs ``klppo ppo`` on it as one process and under ``torchrun`` with 2 ranks, one after the
other (two such runs side by side would not fit this machine's memory), and prints one table:

- ``perf/peak_memory_gb/<phase>``: what klppo logs, the phase's own peak (the high-water mark
  is reset as each phase starts), the largest over ranks: setup (data and models loaded),
  gen, old_log_prob, ref, values, update_critic, update_actor, and the whole step;
- ``run peak``: the largest of those and of the run's tail (the final export), which
  ``ru_maxrss`` of the run's processes gives: the kernel reports the high-water mark since the
  last reset, i.e. since the last phase began (on 2 ranks: the larger rank). CPU resident set;
  on CUDA the phase peaks are ``max_memory_allocated``.

    python benchmarks/memory.py                      # offline GRPO + KL loss, 1 process vs 2 ranks
    python benchmarks/memory.py --mode online        # HF generate rollouts
    python benchmarks/memory.py --ranks 1 --extra actor_rollout_ref.model.use_fused_kernels=false
    python benchmarks/memory.py --compare actor_rollout_ref.model.lora_rank=16   # full fine-tuning vs LoRA

Runs the ranks with one thread each, so the two processes of a 2-rank run share the two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("setup", "gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step")
WORDS = ("the apples oranges pears were counted twice by every student in the class before lunch and after "
         "dinner so that nobody could say the answer was wrong seven eleven forty two hundred").split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=4864)
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--experts", type=int, default=0,
                   help="a mixture of experts (Qwen3-MoE) of this many experts per layer, each "
                        "--intermediate-size wide (default 0: the dense Qwen2 shape)")
    p.add_argument("--experts-per-token", type=int, default=2, help="the mixture's top-k")
    p.add_argument("--untied", action="store_true", help="an LM head of its own (default: tied to the embedding)")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the weights' dtype on disk (bfloat16, as the released 0.5B; float32: the dtype it trains in)")
    p.add_argument("--mode", choices=("offline", "online"), default="offline")
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes, run one after the other")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--responses", type=int, default=4, help="responses per prompt (rollout.n)")
    p.add_argument("--response-words", type=int, default=8, help="words per recorded response (offline)")
    p.add_argument("--response-length", type=int, default=32, help="tokens per generated response (online; offline, of the KL probe's samples)")
    p.add_argument("--extra", nargs="*", default=[], help="more klppo overrides for every run")
    p.add_argument("--compare", nargs="*", default=[],
                   help="overrides of a second configuration, run at every world size after the first and "
                        "printed beside it with the ratios (e.g. actor_rollout_ref.model.lora_rank=16)")
    p.add_argument("--workdir", help="keep the model, the runs and each run's whole output (run_*.log) here "
                                      "(default: a temporary folder)")
    return p.parse_args(argv)


# ---- the model folder and the task ----


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE with exactly ``vocab_size`` entries: the byte alphabet, then every pair of
    bytes, then byte triples, as merges (so ordinary text encodes to a few tokens per word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from klppo.models.tiny import CHAT_TEMPLATE, EOS, IM_START, PAD

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, IM_START, *alphabet])}
    merges = []
    pairs = [(a, b) for a in alphabet for b in alphabet]
    triples = ((a + b, c) for a, b in pairs for c in alphabet)
    for left, right in [*pairs, *triples]:
        if len(vocab) >= vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")
    fast.add_special_tokens({"additional_special_tokens": [IM_START]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_folder(out: Path, args) -> Path:
    """Random weights of the shape in ``args``, saved in ``args.save_dtype``, with the synthetic tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from klppo.models.tiny import save_tokenizer

    tokenizer = synthetic_tokenizer(args.vocab_size)
    shape = dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=not args.untied, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    if args.experts:
        shape.update(num_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     moe_intermediate_size=args.intermediate_size, head_dim=args.hidden_size // args.heads)
    config = AutoConfig.for_model("qwen3_moe" if args.experts else "qwen2", **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.save_dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)  # so that it reloads with exactly vocab_size entries
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[memory] model: {n_params / 1e6:.0f}M parameters, vocab {args.vocab_size}, saved in {args.save_dtype} to {out}")
    return out


def write_task(path: Path, args) -> Path:
    """Arithmetic prompts with ``args.responses`` recorded, ranked responses of ~``response_words`` words."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, rows = random.Random(0), []
    for i in range(args.prompts):
        a, b = rng.randrange(100), rng.randrange(100)
        responses = [" ".join(rng.choice(WORDS) for _ in range(args.response_words)) + f" #### {a + b + k}"
                     for k in range(args.responses)]
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"Tom has {a} apples and gets {b} more. How many?"}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "responses": responses,
                     "ranking": list(range(args.responses))})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---- the runs ----


def overrides(model: Path, data: Path, run_dir: Path, world: int, args) -> list[str]:
    """Offline GRPO with a KL loss (the issue's measurement), or the same with HF generate rollouts."""
    common = [
        f"data.train_files={data}", "data.max_prompt_length=64", "data.max_response_length=512",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={args.responses}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=1", "trainer.logger=[]", "trainer.device=cpu", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", f"trainer.n_gpus_per_node={world}", f"trainer.default_local_dir={run_dir}",
    ]
    # Offline, the rollout length is that of the KL probe's samples (algorithm.kl_ctrl.offline_kl).
    common.append(f"actor_rollout_ref.rollout.response_length={args.response_length}")
    if args.mode == "offline":
        return common + ["actor_rollout_ref.rollout.name=offline"] + args.extra
    return common + ["actor_rollout_ref.rollout.name=hf",
                     "custom_reward_function.path=" + str(_length_reward(run_dir.parent))] + args.extra


def _length_reward(folder: Path) -> Path:
    """Generated text has no arithmetic answer; a reward on its length keeps the run going."""
    path = folder / "length_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str)) / 100.0\n")
    return path


def run(cmd: list[str], env: dict, log: Path) -> tuple[int, float]:
    """(exit status, the largest resident set of any process the command started, GiB); the
    command's whole output (every rank's) goes to ``log``, and its tail to stderr if it fails."""
    probe = textwrap.dedent("""
        import json, resource, subprocess, sys
        code = subprocess.run(sys.argv[1:]).returncode
        print(json.dumps([code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))
    """)
    done = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True, text=True, cwd=ROOT)
    log.write_text(done.stderr)
    ok = done.returncode == 0 and done.stdout.strip()
    code, max_rss_kb = json.loads(done.stdout.strip().splitlines()[-1]) if ok else (done.returncode or 1, float("nan"))
    if code:
        sys.stderr.write(f"{done.stderr[-4000:]}\n[memory] the run failed; its whole output: {log}\n")
    return code, max_rss_kb / 2**20


def measure(model: Path, data: Path, work: Path, world: int, args, label: str = "base",
            changes: tuple[str, ...] = ()) -> dict:
    run_dir = work / f"run_{args.mode}_{world}" if label == "base" else work / f"run_{args.mode}_{world}_{label}"
    launcher = ["-m", "klppo.commands.main_ppo"] if world == 1 else [
        "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "-m", "klppo.commands.main_ppo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if world > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
           "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    code, peak = run([sys.executable, *launcher, *overrides(model, data, run_dir, world, args), *changes], env,
                     run_dir.with_name(run_dir.name + ".log"))
    record = {}
    if code == 0:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        record = json.loads(lines[-1])
    phases = [v for k, v in record.items() if k.startswith("perf/peak_memory_gb/")]
    return {"world": world, "label": label, "exit": code, "run_peak_gb": max([peak, *phases]), "record": record}


def table(results: list[dict]) -> str:
    head = (f"{'config':>7} {'ranks':>5} {'exit':>4} {'run peak':>9} " + " ".join(f"{p:>13}" for p in PHASES)
            + f" {'step s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        rec = r["record"]
        cells = " ".join(f"{rec.get(f'perf/peak_memory_gb/{p}', float('nan')):13.2f}" for p in PHASES)
        seconds = rec.get("timing_s/step", float("nan"))
        lines.append(f"{r['label']:>7} {r['world']:>5} {r['exit']:>4} {r['run_peak_gb']:9.2f} {cells} "
                     f"{seconds:7.1f}")
    return "\n".join(lines)


def ratios(results: list[dict]) -> list[str]:
    """Lines comparing the runs: N ranks against 1 process, and the compared config against the base."""
    out, ok = [], {(r["label"], r["world"]): r for r in results if r["exit"] == 0}
    for (label, world), r in ok.items():
        one = ok.get((label, 1))
        if world > 1 and one is not None:
            out.append(f"{label}: {world} ranks / 1 process, run peak: "
                       f"{r['run_peak_gb'] / one['run_peak_gb']:.2f}x")
    for (label, world), r in ok.items():
        base = ok.get(("base", world))
        if label != "base" and base is not None:
            step = r["record"].get("timing_s/step", float("nan")) / base["record"].get("timing_s/step", float("nan"))
            update = (r["record"].get("timing_s/update_actor", float("nan"))
                      / base["record"].get("timing_s/update_actor", float("nan")))
            out.append(f"{label} / base, {world} rank(s): run peak {r['run_peak_gb'] / base['run_peak_gb']:.2f}x,"
                       f" step time {step:.2f}x, actor update time {update:.2f}x")
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        if not (model / "config.json").is_file():
            build_model_folder(model, args)
        data = write_task(work / "task.parquet", args)
        results = []
        configs = [("base", ())] + ([("compare", tuple(args.compare))] if args.compare else [])
        for world in [int(w) for w in args.ranks.split(",")]:
            for label, changes in configs:
                print(f"[memory] {args.mode}, {world} rank(s), {label} ...", flush=True)
                results.append(measure(model, data, work, world, args, label, changes))
        print(f"\npeak memory (GiB), {args.mode}, {args.prompts} prompts x {args.responses} responses, "
              f"extra overrides: {' '.join(args.extra) or 'none'}"
              + (f"; compare: {' '.join(args.compare)}" if args.compare else ""))
        print(table(results))
        for line in ratios(results):
            print(line)
    return results


if __name__ == "__main__":
    main()
