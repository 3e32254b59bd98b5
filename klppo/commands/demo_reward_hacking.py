"""``klppo demo --reward-hacking``: a training reward that can be gamed, caught by a gold reward.

After the main demo's SFT warm start, PPO trains on ``biased_grader`` (the exact match, and more
for the answer one too many, the SFT labels' planted error: ``klppo/rewards/arithmetic_demo.py``)
while validation also scores the same held-out responses with the honest rule, ``exact_match``,
as the gold reward (``trainer.gold_reward``). The policy learns to make the mistake the grader
pays for, the training reward rises and the gold reward does not, and where the held-out
training reward rises by more than the detector's margin over a window of validations the
``reward_divergence`` event fires (README, "Reward hacking, measured": on 2 of 5 seeds). The
demo prints the run's validations as a table and writes ``klppo report``'s report of the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from klppo.cli_support import quiet_libraries
from klppo.commands.demo_recipe import LORA, ppo_overrides, warm_start, with_changes

RUN = "ppo_reward_hacking"


def reward_hacking_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int, steps: int) -> list[str]:
    """The main demo's PPO run with the gameable reward and the gold rule, as GRPO of LoRA adapters
    (they learn the training reward within the demo's steps; a critic would first have to learn it),
    validated every 10 steps."""
    from klppo.rewards import arithmetic_demo

    rewards = arithmetic_demo.__file__
    changes = {"custom_reward_function.path": rewards, "custom_reward_function.name": "biased_grader",
               "trainer.gold_reward.path": rewards, "trainer.gold_reward.name": "exact_match",
               "trainer.test_freq": "10", "algorithm.adv_estimator": "grpo", **LORA,
               "actor_rollout_ref.actor.optim.lr": "1e-3"}  # to game the grader within the demo's steps
    return with_changes(ppo_overrides(data_dir, sft_dir, out_dir, seed, steps), changes)


def validation_table(records: list[dict], events: list[dict]) -> str:
    """At each validation: the training reward of the step's sampled responses and its share of
    right answers, then the training and the gold reward of the same held-out (greedy) responses,
    and the step the divergence guard acted."""
    from klppo.rewards.arithmetic_demo import RIGHT_PAY

    fired = {e["step"] for e in events if e["kind"] == "reward_divergence"}
    lines = [f"{'step':>5s}{'train reward':>14s}{'right':>8s}{'val train reward':>18s}{'val gold reward':>17s}  event",
             f"{'':5s}{'(sampled)':>14s}{'':8s}{'(held-out)':>18s}{'(exact match)':>17s}"]
    for r in records:
        if "val-gold/reward/mean" in r:
            sampled = f"{r['critic/score/mean']:14.3f}{r['reward/right/mean'] / RIGHT_PAY:8.3f}" if r["step"] else f"{'':22s}"
            event = "reward_divergence" if r["step"] in fired else ""
            lines.append(f"{r['step']:5d}{sampled}{r['val-core/reward/mean']:18.3f}{r['val-gold/reward/mean']:17.3f}"
                         f"  {event}")
    return "\n".join(lines)


def run_reward_hacking_demo(out: Path, seed: int, ppo_steps: int, lora: bool = True, print_fn=print) -> list[dict]:
    """The demo (``lora`` is accepted for the CLI's sake: this demo always trains LoRA adapters)."""
    from klppo.monitoring.report import write_report
    from klppo.commands.main_ppo import run_ppo

    quiet_libraries()
    start = time.perf_counter()
    data_dir, sft_dir = warm_start(out, seed, print_fn)
    run_dir = out / RUN
    ppo = reward_hacking_overrides(data_dir, sft_dir, run_dir, seed, ppo_steps)
    print_fn("[demo] PPO on a biased grader (it pays more for one too many), exact match as the gold reward: "
             "klppo ppo " + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    events_file = run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    print_fn("\n" + validation_table(records, events))
    report = write_report(run_dir)
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s; events: {events_file}  report: {report}")
    return records
