"""Turn GSM8K's own Parquet files into verl's RL format (as verl's examples/data_preprocess/gsm8k.py).

GSM8K is not downloaded here: pass the folder holding its `train-*.parquet` and `test-*.parquet`
(columns `question`, `answer`), e.g. a local copy of the `openai/gsm8k` dataset's `main` folder.

    python examples/gsm8k/prepare.py --src /data/gsm8k/main --out data/gsm8k
"""

import argparse
import re
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def final_answer(solution: str) -> str:
    match = re.search(r"#### (\-?[0-9\.\,]+)", solution)
    if match is None:
        raise ValueError(f"GSM8K solution without '#### <answer>': {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def questions(src: Path, split: str) -> Iterator[tuple[str, str]]:
    """(question, solution) of every GSM8K row of ``split`` under ``src``."""
    files = sorted(src.glob(f"{split}-*.parquet"))
    if not files:
        raise SystemExit(f"no {split}-*.parquet under {src}")
    for table in (pq.read_table(f) for f in files):
        yield from zip(table.column("question").to_pylist(), table.column("answer").to_pylist())


def convert(src: Path, split: str) -> list[dict]:
    rows = []
    for question, answer in questions(src, split):
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(answer)},
            "extra_info": {"split": split, "index": len(rows), "answer": answer, "question": question},
        })
    return rows


def write_splits(convert: Callable[[Path, str], list[dict]], description: str, default_out: str) -> None:
    """The command line: ``convert`` each split of ``--src`` into ``--out``/{train,test}.parquet."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--src", type=Path, required=True, help="folder with GSM8K's train-*/test-* Parquet")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = convert(args.src, split)
        pq.write_table(pa.Table.from_pylist(rows), args.out / f"{split}.parquet")
        print(f"{split}: {len(rows)} prompts -> {args.out / f'{split}.parquet'}")


if __name__ == "__main__":
    write_splits(convert, __doc__.split("\n")[0], "data/gsm8k")
