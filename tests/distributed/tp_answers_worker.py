"""Four ranks in two tensor-parallel groups of two run one conversation each, as a vLLM engine's ranks
would: every rank's tool answers with its own rank, so the groups agree only where the first rank
of each computes the answers for all its members.

argv: the tiny model's folder, a folder for each rank's report (rank<r>.json).
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

from klppo.data.rl_dataset import PromptRecord
from klppo.distributed.env import computed_by_first_rank, consecutive_group
from klppo.rollout.multi_turn import MultiTurn, Turn, multi_turn_rollout
from klppo.rollout.tools import Tools

CALLS = []


class RankTool:
    """Answers every call with the rank that ran it."""

    def create(self, create_kwargs=None):
        return "id", None

    def execute(self, instance_id, arguments):
        CALLS.append(arguments)
        return f"rank {os.environ['RANK']} says hello", 0.0, {}

    def release(self, instance_id):
        pass


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    share = computed_by_first_rank(consecutive_group(2))
    script = ['<tool_call>{"name": "hello", "arguments": {}}</tool_call>', "done"]

    def policy(rows, contexts, budgets):
        return [Turn(tokenizer.encode(script.pop(0)) + [tokenizer.eos_token_id]) for _ in rows]

    record = PromptRecord(index=0, data_source="x", raw_prompt="hi", prompt_ids=tokenizer.encode("hi"),
                          ground_truth=None, extra_info={})
    batch = multi_turn_rollout([record], 1, tokenizer, policy, MultiTurn(Tools({"hello": RankTool()}, [])), 100,
                               share=share)
    replies = batch.response_ids[0][batch.response_attention[0] & ~batch.response_mask[0]].tolist()
    failure = None
    try:
        share(lambda: 1 / 0)
    except Exception as error:  # noqa: BLE001
        failure = str(error)
    report = {"reply": tokenizer.decode(replies), "tokens": batch.response_ids[0].tolist(), "calls": len(CALLS),
              "failure": failure}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
