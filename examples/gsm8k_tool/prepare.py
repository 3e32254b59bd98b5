"""GSM8K as verl's multi-turn tool data (its examples/data_preprocess/gsm8k_multiturn_w_tool.py): a system
prompt that asks for the `calc_gsm8k_reward` tool, and each row's ground truth for the tool
(`extra_info.tools_kwargs`) and for the gsm8k interaction (`extra_info.interaction_kwargs`).

GSM8K is not downloaded here: pass the folder holding its `train-*.parquet` and `test-*.parquet`
(columns `question`, `answer`), e.g. a local copy of the `openai/gsm8k` dataset's `main` folder.

    python examples/gsm8k_tool/prepare.py --src /data/gsm8k/main --out data/gsm8k_tool
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "gsm8k"))
from prepare import final_answer, questions, write_splits  # noqa: E402 (examples/gsm8k/prepare.py)

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by "
          "step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
          "question, before generate final answer at least once and refine your answer if necessary. Put your final "
          "answer in the format of `#### <answer>`.")


def convert(src: Path, split: str) -> list[dict]:
    rows = []
    for question, answer in questions(src, split):
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


if __name__ == "__main__":
    write_splits(convert, __doc__.split("\n")[0], "data/gsm8k_tool")
