"""The gradient-spike detector, replayed offline on gradient norms recorded from real runs.

``data/grad_norms.json`` holds every optimiser step's norm of the demos (full fine-tuning and
LoRA, GAE and GRPO, offline rankings, the reward-hacking run, the demo's PPO stage for 200 steps)
and of the test suite's learning runs, and of runs with one step's advantages planted 100x or
1000x too large. The detector is a pure function of that series, so the default window and
threshold are chosen here, once, instead of over many runs: every healthy run stays quiet with a
margin, every planted step is skipped.
"""

import json
import math
from pathlib import Path

import pytest

from klppo.config.health import GuardConfig
from klppo.safety.health import GradSpikeDetector, spike_log_ratio

DATA = json.loads((Path(__file__).parent / "data" / "grad_norms.json").read_text())
DEFAULT = GuardConfig()


def replay(steps: list, window: int, threshold: float) -> tuple[dict[int, int], float]:
    """Feed one model's recorded norms as the update and the guard do: each PPO step's optimiser
    steps applied against the limit taken before it. Returns ({step: optimiser steps skipped},
    the largest log ratio of a norm to its reference level)."""
    detector, skipped, worst = GradSpikeDetector(window, threshold), {}, -math.inf
    for step, norms in steps:
        level, limit = detector.level(), detector.limit()
        if level is not None:
            worst = max([worst] + [spike_log_ratio(g, level) for g in norms if g > 0])
        found = detector.record(step, norms, [g <= limit for g in norms])
        if found:
            skipped[step] = len(found)
    return skipped, worst


def healthy_series() -> list[tuple[str, str]]:
    return [(name, model) for name, run in sorted(DATA["healthy"].items()) for model in sorted(run["norms"])]


@pytest.mark.parametrize("name, model", healthy_series())
def test_healthy_runs_are_quiet_with_the_default_window_and_threshold(name, model):
    skipped, worst = replay(DATA["healthy"][name]["norms"][model], DEFAULT.window, DEFAULT.grad_spike)
    assert skipped == {} and worst < math.log(DEFAULT.grad_spike) - 1.0, (DATA["healthy"][name]["what"], worst)


def test_the_largest_healthy_ratio_is_the_one_the_threshold_was_chosen_by():
    # 10.3x (ln 2.33): the learning run's critic at the step its policy first earned reward; the
    # default 30 (ln 3.40) lies e^1.07 = 2.9x above it, and a step with 100x its advantages e^1.26
    # above the default (the next test). Without the run's first window as a floor the 200-step
    # learning run's converged critic reads 470x (ln 6.16) when a batch teaches it again.
    worst = max(replay(DATA["healthy"][n]["norms"][m], DEFAULT.window, DEFAULT.grad_spike)[1]
                for n, m in healthy_series())
    assert worst == pytest.approx(2.33, abs=0.005)


@pytest.mark.parametrize("name", sorted(DATA["planted"]))
def test_a_step_with_planted_huge_advantages_is_skipped_and_no_other(name):
    run = DATA["planted"][name]
    steps = run["norms"]["actor"]
    planted = next(norms for step, norms in steps if step == run["step"])
    before = [s for s in steps if s[0] < run["step"]]  # after it, the runs recorded without the guard differ
    skipped, _ = replay(before + [[run["step"], planted]], DEFAULT.window, DEFAULT.grad_spike)
    assert skipped == {run["step"]: len(planted)}, run["what"]
