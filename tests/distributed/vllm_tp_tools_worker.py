"""``klppo ppo`` with vLLM conversations whose tool answers with the rank that ran it: ``torchrun ...
vllm_tp_tools_worker.py key=value ...``. The random tiny model writes no calls, so every turn calls
the tool (``hello``) and lasts at most 6 tokens. Each call is logged to ``$KLPPO_TEST_CALLS/rank<r>.txt``.
"""

import os
import sys
from pathlib import Path

from klppo.commands.main_ppo import main
from klppo.rollout import multi_turn
from klppo.rollout.tools import ToolCall
from klppo.rollout.vllm import VLLMEngine


class RankTool:
    """verl's tool interface; answers every call with the rank that ran it."""

    def __init__(self, config, tool_schema):
        pass

    def create(self, create_kwargs=None):
        return "id", None

    def execute(self, instance_id, parameters):
        rank = os.environ["RANK"]
        with open(Path(os.environ["KLPPO_TEST_CALLS"]) / f"rank{rank}.txt", "a") as log:
            log.write("call\n")
        return f"rank {rank} says hello", 0.0, {}

    def release(self, instance_id):
        pass


def short_turns(real_turns):
    def turns(self, params, seeds, eos):
        generate = real_turns(self, params, seeds, eos)
        return lambda rows, contexts, budgets: generate(rows, contexts, [min(b, 6) for b in budgets])
    return turns


if __name__ == "__main__":
    multi_turn.TOOL_CALL_PARSERS["hermes"] = lambda text: [ToolCall("hello", "{}")]
    VLLMEngine._turns = short_turns(VLLMEngine._turns)
    sys.exit(main(sys.argv[1:]))
