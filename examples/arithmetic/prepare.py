"""Write the arithmetic task and a tiny model, as `klppo demo` does, for running the phases by hand.

    python examples/arithmetic/prepare.py --out runs/arith
    klppo sft --config examples/arithmetic/sft.yaml
    klppo ppo --config examples/arithmetic/ppo.yaml

The YAML files expect the default --out.
"""

import argparse
from pathlib import Path

from klppo.commands.demo import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/arith", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prepare(Path(args.out), args.seed)


if __name__ == "__main__":
    main()
