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
from klppo.rollout.multi_turn import Turn
from klppo.rollout.tools import ToolCall

real_turns = hf._turn_generator


def short_turns(model, tokenizer, params, device, synced_gpus):
    generate = real_turns(model, tokenizer, params, device, synced_gpus)
    eos = tokenizer.eos_token_id

    def turn(rows, contexts, budgets):
        said = generate(rows, contexts, [min(b, 6) for b in budgets])
        return [Turn((t.tokens if t.tokens[-1:] == [eos] else t.tokens + [eos])[:b]) for t, b in zip(said, budgets)]
    return turn


def rank_one_calls(text):
    return [ToolCall("calc_gsm8k_reward", json.dumps({"answer": text[-3:]}))] if os.environ["RANK"] == "1" else []


hf._turn_generator = short_turns
multi_turn.parse_hermes_tool_calls = rank_one_calls
sys.exit(main(sys.argv[1:]))
