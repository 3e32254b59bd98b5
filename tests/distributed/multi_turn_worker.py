"""``klppo ppo`` under torchrun with conversations whose length differs between the ranks: each turn lasts
at most 6 sampled tokens (then EOS, which the random tiny model seldom writes itself), and the
conversations of rank 1 alone call the gsm8k tool after every turn, so rank 0 runs out of turns first.

argv: klppo ppo's overrides.
"""

import json
import os
import sys

from klppo.commands.main_ppo import main
from klppo.rollout import hf, multi_turn
from klppo.rollout.tools import ToolCall
from tests.trainer.test_multi_turn_run import shortened


def rank_one_calls(text):
    return [ToolCall("calc_gsm8k_reward", json.dumps({"answer": text[-3:]}))] if os.environ["RANK"] == "1" else []


hf._turn_generator = shortened(hf._turn_generator)
multi_turn.TOOL_CALL_PARSERS["hermes"] = rank_one_calls
sys.exit(main(sys.argv[1:]))
