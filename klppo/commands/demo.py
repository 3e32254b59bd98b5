"""``klppo demo``: a complete KL-regularised PPO run that needs nothing from outside.

1. writes an arithmetic word-problem task in GSM8K's format (train / val / SFT Parquet), its
   validation problems disjoint from every training problem (no shared (a, op, b) triple);
2. trains a tokenizer on it and builds a tiny Qwen2-shaped model (random init);
3. warm-starts the model with SFT on solutions of which a fixed share carry a systematic
   off-by-one error, so the warm-started policy is often wrong in a consistent way;
4. runs PPO of LoRA adapters (HF generate rollouts, GSM8K rule reward, critic with GAE, KL to
   the SFT model in the reward; ``--full``: every weight) and prints a before/after table.

Every setting is an ordinary config override, printed at the start, so the run can be
reproduced with ``klppo sft`` and ``klppo ppo``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from klppo.cli_support import quiet_libraries, run_cli
from klppo.commands.demo_rankings import run_rankings_demo
from klppo.commands.demo_recipe import demo_overrides, summary_table, warm_start
from klppo.commands.demo_reward_hacking import run_reward_hacking_demo


def run_demo(out: Path, seed: int, ppo_steps: int, lora: bool = True, print_fn=print) -> list[dict]:
    from klppo.commands.main_ppo import run_ppo

    quiet_libraries()
    start = time.perf_counter()
    data_dir, sft_dir = warm_start(out, seed, print_fn)
    run_dir = out / ("ppo" if lora else "ppo_full")
    ppo = demo_overrides(data_dir, sft_dir, run_dir, seed, ppo_steps, lora)
    print_fn("[demo] KL-regularised PPO" + (" of LoRA adapters" if lora else " of every weight") + ": klppo ppo "
             + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    print_fn("\n" + summary_table(records))
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s")
    print_fn(f"[demo] metrics: {run_dir / 'metrics.jsonl'}  checkpoint: {run_dir}  exported actor: "
             f"{run_dir / 'actor_hf'}" + (f"  adapter: {run_dir / 'actor_adapter'}" if lora else ""))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="demo_runs/arithmetic", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, model and run")
    parser.add_argument("--ppo-steps", type=int, default=None,
                        help="PPO iterations (default: 40; 80 with --reward-hacking)")
    parser.add_argument("--offline-rankings", action="store_true",
                        help="learn from ranked responses instead: a reward model, then offline KL-PPO on the "
                             "recorded rankings and on the reward model's")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--full", action="store_true", help="PPO trains every weight instead of LoRA adapters")
    weights.add_argument("--lora", action="store_true", help="PPO trains LoRA adapters (rank 16): the default")
    parser.add_argument("--reward-hacking", action="store_true",
                        help="train on a biased grader that pays more for the answer one too many than for the right one, with "
                             "exact match as the held-out gold reward the divergence detector compares it with "
                             "(always LoRA adapters)")
    args = parser.parse_args(argv)
    demo = run_rankings_demo if args.offline_rankings else run_demo
    if args.reward_hacking:
        demo = run_reward_hacking_demo
    steps = args.ppo_steps or (80 if args.reward_hacking else 40)
    return run_cli(lambda: demo(Path(args.out), args.seed, steps, not args.full))


if __name__ == "__main__":
    sys.exit(main())
