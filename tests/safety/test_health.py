"""Run-health detectors on hand-made streams: gradient spikes against a robust window, entropy
collapse and surge, and what the guard makes of them (skip, roll back, stop, certify)."""

import dataclasses
import math

import pytest
import torch

from klppo.config.checks import MIN_GUARD_WINDOW
from klppo.safety.guards import Action, GuardSettings, RunGuard, most_severe
from klppo.safety.health import (
    MIN_NORMS, RECENT_STEPS, EntropyTrend, GradSpikeDetector, SkippedStep, reference_level, relative_change,
    spike_log_ratio,
)
from klppo.trainer.update import OptimizerSteps, optimizer_step

# KL guards off: these tests are about the health detectors alone.
SETTINGS = GuardSettings(early_stop_kl=None, rollback_kl=None, rollback_lr=1e-6, max_rollbacks=1,
                         max_nonfinite_steps=2, entropy_floor=None, clipfrac_max=None, window=20, grad_spike=10.0,
                         max_grad_skips=1, entropy_collapse=0.5, entropy_surge=1.0, entropy_action="warn")


def test_the_reference_level_is_the_window_median_or_the_runs_first_where_higher():
    assert reference_level([1.0, 2.0, 3.0, 4.0], [], 20) is None  # fewer than MIN_NORMS = 5
    # the run's first 20 are not complete yet: the window's median, 3
    assert reference_level([1.0, 2.0, 3.0, 4.0, 10.0], [1.0, 2.0, 3.0, 4.0, 10.0], 20) == 3.0
    # a converged critic: recent norms 1e-4, the run's first 6 had median (1 + 2) / 2 = 1.5
    assert reference_level([1e-4] * 5, [1.0] * 3 + [2.0] * 3, 6) == 1.5
    assert reference_level([4.0, 5.0, 6.0, 7.0, 8.0], [1.0] * 6, 6) == 6.0  # grown past the start: the window's


def test_the_spike_statistic_is_the_log_ratio_to_the_level():
    assert spike_log_ratio(90.0, 3.0) == pytest.approx(math.log(30.0))  # 3.4012: the limit at grad_spike 30
    assert spike_log_ratio(100.0, 3.0) == pytest.approx(3.5066, abs=1e-4)  # ln(33.33)
    assert spike_log_ratio(1.5, 3.0) == pytest.approx(-0.6931, abs=1e-4)  # below the level: negative


def test_no_limit_until_the_window_holds_enough_norms_then_the_level_times_the_threshold():
    detector = GradSpikeDetector(window=20, threshold=30.0)
    detector.record(1, [1.0, 2.0, 3.0, 4.0], [True] * 4)
    assert MIN_NORMS == 5 and detector.limit() == math.inf
    detector.record(2, [10.0], [True])
    assert detector.limit() == 90.0  # median 3 x 30


def test_a_skipped_spike_is_reported_against_the_window_before_it_and_stays_out_of_it():
    detector = GradSpikeDetector(window=20, threshold=30.0)
    detector.record(1, [1.0, 2.0, 3.0, 4.0, 10.0], [True] * 5)
    skipped = detector.record(2, [100.0, 5.0], [False, True])  # 100 > 90: the update skipped it
    assert skipped == [SkippedStep(100.0, 3.0, pytest.approx(math.log(100.0 / 3.0)))]
    assert skipped[0].ratio == pytest.approx(33.333, abs=1e-3)
    assert detector.norms == [1.0, 2.0, 3.0, 4.0, 10.0, 5.0] and detector.skipped_at == [2]
    assert detector.early == detector.norms  # the run's first 20 applied norms: the skip stays out too


def test_a_converged_critic_waking_up_is_no_spike_but_a_blow_up_is():
    # A critic whose first 20 norms were 0.2 converges (1e-4), then a batch teaches it again (0.1):
    # 1000x its window's median, but half its run's first level. A blow-up to 10 is 50x that level.
    critic = GradSpikeDetector(window=20, threshold=30.0)
    critic.record(1, [0.2] * 20 + [1e-4] * 20, [True] * 40)
    assert critic.norms == [1e-4] * 20 and critic.early == [0.2] * 20
    assert critic.limit() == pytest.approx(6.0) and 0.1 < critic.limit() < 10.0


def test_non_finite_and_zero_norms_neither_enter_the_window_nor_count_as_spikes():
    detector = GradSpikeDetector(window=20, threshold=10.0)
    detector.record(1, [1.0] * 5, [True] * 5)
    assert detector.record(2, [math.nan, math.inf, 0.0], [False, False, True]) == []
    assert detector.norms == [1.0] * 5 and detector.skipped_at == []


def test_the_window_keeps_the_newest_norms_and_skips_of_its_last_steps():
    detector = GradSpikeDetector(window=6, threshold=10.0)
    detector.record(1, [float(i) for i in range(1, 9)], [True] * 8)
    assert detector.norms == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    detector.record(3, [100.0], [False])
    detector.record(8, [100.0], [False])
    assert detector.skipped_at == [3, 8]
    detector.record(9, [5.0], [True])  # step 3 is 6 steps back: out of the window
    assert detector.skipped_at == [8]


def test_entropy_window_rules_match_the_config_check():
    assert MIN_GUARD_WINDOW == 2 * RECENT_STEPS


def test_entropy_change_compares_the_recent_mean_with_the_earlier_median():
    assert relative_change([2.0] * 5) is None  # too short: 3 recent need 3 earlier
    # earlier [2, 2, 4] -> median 2; recent [1, 1, 4] -> mean 2: no change
    assert relative_change([2.0, 2.0, 4.0, 1.0, 1.0, 4.0]) == (2.0, 2.0, 0.0)
    assert relative_change([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]) is None  # no level to be relative to


def test_an_entropy_collapse_is_reported_once_then_re_armed_after_recovery():
    trend = EntropyTrend(window=6, collapse=0.5, surge=None)
    seen = [trend.observe(v) for v in [2.0, 2.0, 2.0, 0.5, 0.5]]
    # the 5th: earlier [2, 2, 2], recent [2, 0.5, 0.5] -> mean 1.0, change -0.5: not beyond 0.5
    assert seen == [None] * 5
    shift = trend.observe(0.5)  # recent [0.5, 0.5, 0.5]: change -0.75 against the window's earlier 2.0
    # (against the run's first 6 steps, median 1.25: -0.6; the larger drop is reported)
    assert (shift.kind, shift.entropy, shift.reference, shift.change) == ("entropy_collapse", 0.5, 2.0, -0.75)
    assert (shift.steps, shift.horizon) == (6, "window")
    assert trend.observe(0.5) is None  # earlier [2, 2, 0.5] -> median 2: still collapsed, not reported again
    # window: earlier median 0.5, change 0; but 0.5 is still -0.6 below the run's start (1.25): the same episode
    assert trend.observe(0.5) is None and trend.active == "entropy_collapse"
    # back up to 1.25 (both changes 0 or above: recovered), then a new drop to 0.2 is a new episode
    assert [trend.observe(1.25) for _ in range(6)] == [None] * 6 and trend.active is None
    assert trend.observe(0.2) is None  # recent [1.25, 1.25, 0.2]: -0.28
    # recent [1.25, 0.2, 0.2] -> 0.55 against the window's 1.25 (the run's is 1.25 too): -0.56
    assert trend.observe(0.2).change == pytest.approx(0.55 / 1.25 - 1)


def test_a_collapse_spread_over_100_steps_is_caught_against_the_runs_first_steps():
    # Entropy falls linearly from 2.0 to 0.5 over 100 steps: 0.015 a step. Within a 20-step window
    # the recent 3 steps' mean lies 10 steps after the earlier 17's median: 0.15 below it, at most
    # -23% (the last window: 0.515 against 0.665), never beyond 50%. Against the median of the run's
    # first 20 steps (2.0 - 9.5 * 0.015 = 1.8575) the mean of steps 72-74 (2.0 - 72 * 0.015 = 0.92)
    # is -50.5%, the first beyond 50% (steps 71-73: 0.935, -49.7%).
    entropies = [2.0 - 0.015 * i for i in range(101)]
    windows = [relative_change(entropies[max(0, t - 20):t]) for t in range(6, 102)]
    assert min(w[2] for w in windows) == pytest.approx(0.515 / 0.665 - 1)
    trend = EntropyTrend(window=20, collapse=0.5, surge=1.0)
    found = [(step, s) for step, s in enumerate(map(trend.observe, entropies), start=1) if s is not None]
    assert len(found) == 1
    step, shift = found[0]
    assert step == 74 and (shift.kind, shift.horizon, shift.steps) == ("entropy_collapse", "run", 74)
    assert shift.reference == pytest.approx(1.8575) and shift.change == pytest.approx(0.92 / 1.8575 - 1)


def test_a_collapse_that_hovers_near_its_threshold_is_not_reported_twice():
    trend = EntropyTrend(window=20, collapse=0.5, surge=None)
    for v in [1.0] * 6 + [0.4] * 3:  # recent 0.4 against 1.0: -0.6, reported
        shift = trend.observe(v)
    assert shift is not None
    # back to 0.7 (-0.3: within the threshold, not within half of it), then down to 0.4 again
    assert [trend.observe(v) for v in [0.7] * 3 + [0.4] * 3] == [None] * 6 and trend.active == "entropy_collapse"


def test_an_entropy_surge_is_reported_and_non_finite_entropies_are_ignored():
    trend = EntropyTrend(window=6, collapse=0.5, surge=1.0)
    assert [trend.observe(v) for v in [1.0, 1.0, 1.0, 3.0, 3.0, math.nan]] == [None] * 6
    shift = trend.observe(3.0)  # recent mean 3 against 1: +2.0
    assert (shift.kind, shift.change) == ("entropy_surge", 2.0)


def test_detectors_resume_from_their_state_dicts_exactly():
    detector, trend = GradSpikeDetector(window=6, threshold=3.0), EntropyTrend(window=6, collapse=0.2, surge=0.2)
    detector.record(4, [1.0, 1.5, 1.2, 0.9, 1.1, 1.3, 0.8], [True] * 7)
    detector.record(5, [9.0], [False])
    for v in [3.0, 3.0, 3.0, 1.0, 1.0, 1.0]:
        trend.observe(v)
    detector2, trend2 = GradSpikeDetector(window=6, threshold=3.0), EntropyTrend(window=6, collapse=0.2, surge=0.2)
    detector2.load_state_dict(detector.state_dict())
    trend2.load_state_dict(trend.state_dict())
    assert detector2.state_dict() == detector.state_dict() and trend2.state_dict() == trend.state_dict()
    assert detector2.limit() == detector.limit()
    assert detector2.record(6, [20.0], [False]) == detector.record(6, [20.0], [False])
    assert [trend2.observe(v) for v in (3.0, 3.0, 3.0)] == [trend.observe(v) for v in (3.0, 3.0, 3.0)]


# ---- what the guard makes of them ----


def _update(guard: RunGuard, step: int, norms: list[float], entropy=None, existing=None):
    """One PPO step's actor optimiser steps, applied the way ``update.optimizer_step`` decides."""
    limit = guard.grad_limit("actor")
    applied = [math.isfinite(n) and n <= limit for n in norms]
    return guard.check_update(step, {"actor": (norms, applied)}, entropy, existing)


def test_a_spike_is_an_event_with_its_numbers_and_the_window_metrics_are_logged():
    guard = RunGuard(SETTINGS)
    assert _update(guard, 1, [1.0, 2.0, 3.0, 4.0, 10.0]) == (Action.CONTINUE, {"actor/grad_norm_skipped": 0.0})
    action, metrics = _update(guard, 2, [40.0, 5.0])  # grad_spike 10: the limit is 3 x 10
    assert action is Action.CONTINUE
    assert metrics == {"actor/grad_norm_skipped": 1.0, "actor/grad_norm_median": 3.0}
    [event] = guard.drain_events()
    assert (event.step, event.kind, event.values["model"], event.values["grad_norm"]) == (2, "skip_grad_spike", "actor", 40.0)
    assert event.values["ratio"] == pytest.approx(40.0 / 3.0) and event.values["log_ratio"] == pytest.approx(2.5903, abs=1e-4)
    assert "actor gradient norm 40 is 13.3x its reference level 3 (the median of its last 5 optimiser" in event.message


def test_too_many_skips_in_the_window_roll_back_to_the_last_good_checkpoint_then_stop():
    guard = RunGuard(SETTINGS)
    _update(guard, 1, [1.0] * 5)
    guard.checkpoint_saved(1)
    _update(guard, 2, [1.0])  # no skip in the step after checkpoint 1: it is good (KL guards off)
    guard.checkpoint_saved(2)
    assert _update(guard, 3, [50.0])[0] is Action.CONTINUE  # one skip: max_grad_skips = 1 allows it
    guard.checkpoint_saved(3)  # a checkpoint of a step that skipped a spike is never good
    assert _update(guard, 4, [60.0])[0] is Action.ROLLBACK  # two skips in 20 steps
    assert guard.good_checkpoints == [1] and guard.rollbacks == 1 and guard.lr_override == 1e-6
    kinds = [(e.kind, e.values.get("to_step"), e.values.get("skips")) for e in guard.drain_events()]
    assert kinds == [("skip_grad_spike", None, None), ("skip_grad_spike", None, None), ("rollback_grad_spike", 1, 2)]
    # The rollback forgot the skips; two more with no rollback left stop the run.
    assert _update(guard, 5, [70.0])[0] is Action.CONTINUE
    assert _update(guard, 6, [70.0])[0] is Action.STOP
    assert guard.drain_events()[-1].kind == "stop_grad_spike"


def test_one_bad_batch_is_one_step_with_skips_however_many_optimiser_steps_it_spiked():
    guard = RunGuard(SETTINGS)  # max_grad_skips = 1
    _update(guard, 1, [1.0] * 5)
    assert _update(guard, 2, [50.0, 60.0, 70.0, 80.0])[0] is Action.CONTINUE  # 4 skips, 1 step
    assert [e.kind for e in guard.drain_events()] == ["skip_grad_spike"] * 4
    assert _update(guard, 3, [50.0, 1.0])[0] is Action.ROLLBACK  # a second step with a skip
    assert guard.drain_events()[-1].values["skips"] == 2


def test_a_rollback_without_a_good_checkpoint_or_initial_weights_stops_instead():
    guard = RunGuard(dataclasses.replace(SETTINGS, initial_weights=False))
    _update(guard, 1, [1.0] * 5)
    _update(guard, 2, [50.0])
    _update(guard, 3, [50.0])
    assert guard.rollbacks == 0 and guard.drain_events()[-1].kind == "stop_grad_spike"


def test_the_kl_guard_certifies_checkpoints_when_it_is_on():
    guard = RunGuard(dataclasses.replace(SETTINGS, rollback_kl=0.1, early_stop_kl=0.2))
    _update(guard, 1, [1.0] * 5)
    guard.checkpoint_saved(1)
    assert guard.check_kl(2, 0.5) is Action.ROLLBACK  # the KL decides, and it says no
    guard.checkpoint_saved(3)
    guard.check_kl(4, 0.01)
    assert guard.good_checkpoints == [3]


@pytest.mark.parametrize("choice, expected", [("warn", Action.CONTINUE), ("stop", Action.STOP),
                                              ("rollback", Action.ROLLBACK)])
def test_an_entropy_collapse_takes_the_configured_action(choice, expected):
    guard = RunGuard(dataclasses.replace(SETTINGS, entropy_action=choice))
    actions = [_update(guard, step, [1.0], entropy=e)[0] for step, e in enumerate([2.0] * 3 + [0.5] * 3, start=1)]
    assert actions == [Action.CONTINUE] * 5 + [expected]
    [event] = guard.drain_events()
    assert event.kind == "entropy_collapse"
    # the window is 20 steps but 6 were seen: the event says 6 (trainer.guard.window is no measurement)
    assert {k: event.values[k] for k in ("entropy", "reference", "change", "window", "action")} == {
        "entropy": 0.5, "reference": 2.0, "change": -0.75, "window": 6, "action": choice}
    assert "fell by 75% (more than 50%) to 0.5 over the last 6 steps (earlier 2)" in event.message
    # A rollback's weights are earlier ones: the trend starts again rather than report a surge back.
    assert guard.entropy.values == ([] if choice == "rollback" else [2.0] * 3 + [0.5] * 3)


def test_the_guard_record_with_its_detectors_round_trips_and_old_records_load():
    guard = RunGuard(SETTINGS)
    _update(guard, 1, [1.0, 1.2, 0.8, 1.1, 0.9], entropy=2.0)
    _update(guard, 2, [40.0], entropy=2.1)
    restored = RunGuard(SETTINGS)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict() and restored.grad_limit("actor") == guard.grad_limit("actor")
    old = {k: v for k, v in guard.state_dict().items() if k != "health"}  # saved before the detectors existed
    fresh = RunGuard(SETTINGS)
    fresh.load_state_dict(old)
    assert fresh.grad_limit("actor") == math.inf and fresh.rollbacks == guard.rollbacks


def test_the_most_severe_action_wins():
    assert most_severe(Action.SKIP, Action.CONTINUE) is Action.SKIP
    assert most_severe(Action.ROLLBACK, Action.SKIP, Action.STOP) is Action.STOP


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimiser_step_above_the_limit_leaves_the_weights_and_is_recorded(fused):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=fused)
    steps = OptimizerSteps(limit=1.0)
    for scale in (0.1, 100.0):  # a norm below the limit, then one far above it
        before = [p.detach().clone() for p in net.parameters()]
        (scale * net(torch.ones(1, 3)).sum()).backward()
        optimizer_step(net, opt, grad_clip=1.0, max_norm=steps.limit, steps=steps)
        changed = [not torch.equal(p, b) for p, b in zip(net.parameters(), before)]
        assert changed == [scale < 1.0] * 2
    norms, applied = steps.on_host()
    assert applied == [True, False] and norms[1] > 1.0 > norms[0]
