"""GSM8K as verl's multi-turn tool data (its examples/data_preprocess/gsm8k_multiturn_w_tool.py): a system
prompt that asks for the `calc_gsm8k_reward` tool, and each row's ground truth for the tool
(`extra_info.tools_kwargs`) and for the gsm8k interaction (`extra_info.interaction_kwargs`).

GSM8K is not downloaded here: pass the folder holding its `train-*.parquet` and `test-*.parquet`
(columns `question`, `answer`), e.g. a local copy of the `openai/gsm8k` dataset's `main` folder.

    python examples/gsm8k_tool/prepare.py --src /data/gsm8k/main --out data/gsm8k_tool
"""

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parents[1] / "gsm8k"))
from prepare import final_answer  # noqa: E402 (examples/gsm8k/prepare.py: the "#### <answer>" of a solution)

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by "
          "step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
          "question, before generate final answer at least once and refine your answer if necessary. Put your final "
          "answer in the format of `#### <answer>`.")


def convert(src: Path, split: str) -> list[dict]:
    files = sorted(src.glob(f"{split}-*.parquet"))
    if not files:
        raise SystemExit(f"no {split}-*.parquet under {src}")
    rows = []
    for table in (pq.read_table(f) for f in files):
        for question, answer in zip(table.column("question").to_pylist(), table.column("answer").to_pylist()):
            truth = final_answer(answer)
            rows.append({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": split, "index": len(rows), "answer": answer, "question": question,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                    "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": truth},
                },
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="folder with GSM8K's train-*/test-* Parquet")
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k_tool"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = convert(args.src, split)
        pq.write_table(pa.Table.from_pylist(rows), args.out / f"{split}.parquet")
        print(f"{split}: {len(rows)} prompts -> {args.out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
