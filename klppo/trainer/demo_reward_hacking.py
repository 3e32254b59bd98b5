"""``klppo demo --reward-hacking``: a training reward that can be gamed, caught by a gold reward.

After the main demo's SFT warm start, PPO trains on ``paid_for_length`` (the exact match plus a
bonus per character: ``klppo/rewards/arithmetic_demo.py``) while validation also scores the same
held-out responses with the honest rule, ``exact_match``, as the gold reward
(``trainer.gold_reward``). The policy learns to write longer answers, the training reward rises
and the gold reward does not: the ``reward_divergence`` event fires. The demo prints the run's
validations as a table and writes ``klppo report``'s report of the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from klppo.cli_support import quiet_libraries
from klppo.trainer.demo import LORA, ppo_overrides, warm_start, with_changes

RUN = "ppo_reward_hacking"


def reward_hacking_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int, steps: int) -> list[str]:
    """The main demo's PPO run with the gameable reward, the gold rule, and a validation every 5 steps."""
    from klppo.rewards import arithmetic_demo

    rewards = arithmetic_demo.__file__
    changes = {"custom_reward_function.path": rewards, "custom_reward_function.name": "paid_for_length",
               "trainer.gold_reward.path": rewards, "trainer.gold_reward.name": "exact_match",
               "trainer.test_freq": "5"}
    return with_changes(ppo_overrides(data_dir, sft_dir, out_dir, seed, steps), changes)


def validation_table(records: list[dict], events: list[dict]) -> str:
    """Each validation's training and gold reward of the same held-out responses, their length, and
    the step the divergence guard acted."""
    fired = {e["step"]: e for e in events if e["kind"] == "reward_divergence"}
    lines = [f"{'step':>5s}{'train reward':>14s}{'gold reward':>13s}{'length':>8s}  event"]
    for r in records:
        if "val-gold/reward/mean" in r:
            event = "reward_divergence" if r["step"] in fired else ""
            lines.append(f"{r['step']:5d}{r['val-core/reward/mean']:14.3f}{r['val-gold/reward/mean']:13.3f}"
                         f"{r['val-aux/response_length/mean']:8.1f}  {event}")
    return "\n".join(lines)


def run_reward_hacking_demo(out: Path, seed: int, ppo_steps: int, lora: bool = False, print_fn=print) -> list[dict]:
    from klppo.monitoring.report import write_report
    from klppo.trainer.main_ppo import run_ppo

    quiet_libraries()
    start = time.perf_counter()
    data_dir, sft_dir = warm_start(out, seed, print_fn)
    run_dir = out / RUN
    ppo = reward_hacking_overrides(data_dir, sft_dir, run_dir, seed, ppo_steps)
    if lora:
        ppo = with_changes(ppo, LORA)
    print_fn("[demo] PPO on a reward that pays for length, exact match as the gold reward: klppo ppo " + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    events_file = run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    print_fn("\n" + validation_table(records, events))
    report = write_report(run_dir)
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s; events: {events_file}  report: {report}")
    return records
