"""Generation time on sharded ranks: the sharded actor vs a whole copy gathered once per step.

Runs the demo's PPO config (``klppo demo``'s task and tiny Qwen2-shaped model, untrained
initialisation, HF generate rollouts) for a few steps, one process at a time, each with one
thread: as one process, and on 2 ranks with ``rollout.generation_weights=sharded`` (every layer
all-gathered for every generated token) and ``=gathered`` (one all-gather of the actor per step,
then decoding without collectives). Prints the mean ``timing_s/gen`` of each, side by side.

    python benchmarks/generation.py [--steps 4] [--repeats 2]
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
    from klppo.trainer.demo import ppo_overrides

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
    args = parser.parse_args(argv)
    from klppo.trainer.demo import prepare

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, model = prepare(work, seed=0, print_fn=lambda *_: None)
        seconds: dict[str, list[float]] = {name: [] for name, _, _ in RUNS}
        for repeat in range(args.repeats):
            for name, world, weights in RUNS:
                run_dir = work / f"run_{world}_{weights}_{repeat}"
                launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={world}"]
                run([sys.executable, *launcher, "-m", "klppo.trainer.main_ppo",
                     *overrides(data, model, run_dir, args.steps, world, weights)])
                seconds[name] += gen_seconds(run_dir)
    means = {name: sum(v) / len(v) for name, v in seconds.items()}
    print(f"mean timing_s/gen over {args.steps} steps x {args.repeats} runs (one thread per process):")
    for name, mean in means.items():
        print(f"  {name:20s} {mean:6.3f} s")
    print(f"gathered / sharded on 2 ranks: {means['2 ranks, gathered'] / means['2 ranks, sharded']:.2f}x")
    return means


if __name__ == "__main__":
    main()
