"""Four ranks in two tensor-parallel groups of two run one conversation each, as a vLLM engine's ranks
would: every rank's tool and interaction answer with their own rank, so the groups agree only where
the first rank of each computes the answers for all its members (and holds the one instance of the
interaction each conversation has).

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


class RankUser:
    """A user who asks once more, naming its rank, then ends the chat; counts what it was asked to do."""

    def __init__(self):
        self.started, self.finished, self.turns = [], [], 0

    def start_interaction(self, instance_id, **kwargs):
        self.started.append(instance_id)
        return instance_id

    def generate_response(self, instance_id, messages, **kwargs):
        assert instance_id in self.started  # asked only about an instance it started
        self.turns += 1
        return self.turns > 1, f"rank {os.environ['RANK']} asks again", 1.0, {}

    def finalize_interaction(self, instance_id):
        self.finished.append(instance_id)


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
    user = RankUser()
    chat = PromptRecord(index=1, data_source="x", raw_prompt="hi", prompt_ids=tokenizer.encode("hi"), ground_truth=None,
                        extra_info={"interaction_kwargs": {"name": "user"}})
    script += ["one", "two", "three"]
    talk = multi_turn_rollout([chat], 1, tokenizer, policy, MultiTurn(interactions={"user": user}), 100, share=share)
    user_turns = talk.response_ids[0][talk.response_attention[0] & ~talk.response_mask[0]].tolist()
    failure = None
    try:
        share(lambda: 1 / 0)
    except Exception as error:  # noqa: BLE001
        failure = str(error)
    report = {"reply": tokenizer.decode(replies), "tokens": batch.response_ids[0].tolist(), "calls": len(CALLS),
              "failure": failure, "user_turns": tokenizer.decode(user_turns), "chat": talk.response_ids[0].tolist(),
              "interactions": [len(user.started), user.turns, len(user.finished)]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
