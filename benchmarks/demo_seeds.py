"""The README's demo tables: ``klppo demo`` run as a user runs it, once per seed, one after another.

    python benchmarks/demo_seeds.py                         # klppo demo, seeds 0-4
    python benchmarks/demo_seeds.py --full --seeds 0 1      # every weight instead of LoRA adapters
    python benchmarks/demo_seeds.py --offline-rankings --seeds 0 1 2
    python benchmarks/demo_seeds.py --reward-hacking --seeds 0

Each seed runs ``klppo demo`` in a process of its own (the command's wall time, SFT included, is
the process's), then its run folders are read back and one Markdown row is printed per seed and
kind of run, with a last row of means. Run it with nothing else using the CPU: the wall times are
the point. Arguments after ``--`` go to ``klppo demo`` as they are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from klppo.commands.demo_recipe import last_validated
from klppo.monitoring.logger import read_metrics

VAL = "val-core/openai/gsm8k/reward/mean@1"
KL = "val-aux/kl_to_ref"


def online_rows(out: Path, run: str) -> list[tuple[str, float, float, float]]:
    """(run, SFT accuracy, accuracy after, KL after) of one online demo run folder."""
    records = read_metrics(out / run)
    return [(run, records[0][VAL], last_validated(records)[VAL], last_validated(records).get(KL, 0.0))]


def rankings_rows(out: Path) -> list[tuple[str, float, float, float]]:
    recorded, rm = read_metrics(out / "ppo_rankings"), read_metrics(out / "ppo_rm_rankings")
    rm_val = read_metrics(out / "val_rm_rankings")[0]
    sft = recorded[0][VAL]
    return [("ppo_rankings", sft, last_validated(recorded)[VAL], last_validated(recorded).get(KL, 0.0)),
            ("ppo_rm_rankings", sft, rm_val[VAL], last_validated(rm).get(KL, 0.0))]


def reward_hacking_rows(out: Path) -> list[tuple[str, float, float, float]]:
    run = out / "ppo_reward_hacking"
    records = read_metrics(run)
    gold = [r for r in records if "val-gold/reward/mean" in r]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()] \
        if (run / "events.jsonl").exists() else []
    fired = [e["step"] for e in events if e["kind"] == "reward_divergence"]
    print(f"  gold reward by validation: {[(r['step'], round(r['val-gold/reward/mean'], 3)) for r in gold]}; "
          f"reward_divergence at steps {fired or 'none'}")
    return [("ppo_reward_hacking", gold[0]["val-gold/reward/mean"], gold[-1]["val-gold/reward/mean"],
             gold[-1].get(KL, 0.0))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", default="demo_runs/seeds", help="one folder per seed under it")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--offline-rankings", action="store_true")
    kind.add_argument("--reward-hacking", action="store_true")
    parser.add_argument("--full", action="store_true", help="every weight instead of LoRA adapters")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    flags = ["--offline-rankings"] * args.offline_rankings + ["--reward-hacking"] * args.reward_hacking
    flags += ["--full"] * args.full
    rows = []
    print("| seed | run | val accuracy, SFT model | val accuracy after PPO | gain | KL to SFT (per token) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        out = Path(args.out) / f"seed{seed}"
        command = [sys.executable, "-m", "klppo.cli", "demo", "--seed", str(seed), "--out", str(out), *flags, *extra]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"seed {seed}: klppo demo failed ({done.returncode})\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            return 1
        if args.offline_rankings:
            found = rankings_rows(out)
        elif args.reward_hacking:
            found = reward_hacking_rows(out)
        else:
            found = online_rows(out, "ppo_full" if args.full else "ppo")
        for run, before, after, kl in found:
            rows.append((before, after, kl, wall))
            print(f"| {seed} | {run} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {kl:.3f} | {wall:.0f} |",
                  flush=True)
    means = [statistics.mean(column) for column in zip(*rows)]
    print(f"| mean | | {means[0]:.3f} | {means[1]:.3f} | {means[1] - means[0]:+.3f} | {means[2]:.3f} | {means[3]:.0f} |")
    print(f"gains > 0: {sum(after > before for before, after, _, _ in rows)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
