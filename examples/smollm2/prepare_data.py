"""Write a small offline RL Parquet for the SmolLM2 example:

    python examples/smollm2/prepare_data.py outputs/smollm2/train.parquet

Each row is one of klppo's arithmetic word problems in verl's RLHFDataset format
(``data_source="openai/gsm8k"``, so the GSM8K rule reward scores it) with two recorded
responses in the ``responses`` column: the correct solution ("7 + 5 = 12 #### 12", reward 1)
and one off by one ("7 + 5 = 13 #### 13", reward 0). With ``rollout.n=2`` a PPO step sees both,
and a group estimator (GRPO) pushes the policy towards the first and away from the second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klppo.cli_support import run_cli
from klppo.data.arithmetic import GSM8K_INSTRUCTION, make_problems, write_arithmetic_parquet


def write_offline_parquet(path: str | Path, n: int = 16, seed: int = 0) -> Path:
    """``n`` prompts, each with [correct solution, off-by-one solution] as recorded responses."""
    out = write_arithmetic_parquet(path, n, seed, instruction=GSM8K_INSTRUCTION)
    # make_problems(n, seed) is the list write_arithmetic_parquet wrote, in the same order.
    responses = [[p.solution(), p.solution(p.answer + 1)] for p in make_problems(n, seed)]
    table = pq.read_table(out).append_column("responses", pa.array(responses, type=pa.list_(pa.string())))
    pq.write_table(table, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("out", help="Parquet file to write")
    parser.add_argument("--n", type=int, default=16, help="number of prompts (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems (default: %(default)s)")
    args = parser.parse_args(argv)

    def action() -> None:
        out = write_offline_parquet(args.out, args.n, args.seed)
        print(f"wrote {args.n} prompts with 2 recorded responses each to {out}")

    return run_cli(action)


if __name__ == "__main__":
    sys.exit(main())
