"""Write the prompts of the SmolLM2 online example: training problems and held-out problems.

    python examples/smollm2/prepare_online.py outputs/smollm2

writes ``online_train.parquet`` (problems from the training part of klppo's arithmetic word
problems) and ``online_val.parquet`` (problems from the held-out part), in verl's RLHFDataset
format, as chat messages that ask for a single number. Operands go up to 19, as in
``klppo demo``: of the 610 (a, op, b) triples one in five is held out, so no validation problem
shares its operands and operator with any training problem and a gain on validation is not
memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klppo.cli_support import run_cli
from klppo.data.arithmetic import write_arithmetic_parquet

INSTRUCTION = "Answer with a single number."
MAX_OPERAND = 20


def write_online_parquets(out_dir: str | Path, n_train: int = 2000, n_val: int = 100, seed: int = 0,
                          max_operand: int = MAX_OPERAND) -> tuple[Path, Path]:
    """``n_train`` training prompts and ``n_val`` held-out prompts under ``out_dir``."""
    out_dir = Path(out_dir)
    train = write_arithmetic_parquet(out_dir / "online_train.parquet", n_train, seed, instruction=INSTRUCTION,
                                     max_operand=max_operand, part="train")
    val = write_arithmetic_parquet(out_dir / "online_val.parquet", n_val, seed + 1, instruction=INSTRUCTION,
                                   split="test", max_operand=max_operand, part="held_out")
    return train, val


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("out_dir", help="folder to write online_train.parquet and online_val.parquet to")
    parser.add_argument("--n-train", type=int, default=2000, help="training prompts (default: %(default)s)")
    parser.add_argument("--n-val", type=int, default=100, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems (default: %(default)s)")
    args = parser.parse_args(argv)

    def action() -> None:
        train, val = write_online_parquets(args.out_dir, args.n_train, args.n_val, args.seed)
        print(f"wrote {args.n_train} training prompts to {train} and {args.n_val} held-out prompts to {val}")

    return run_cli(action)


if __name__ == "__main__":
    sys.exit(main())
