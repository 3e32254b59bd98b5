"""The divergence of training and gold reward, and the length trend, on hand-made streams."""

import math

import pytest

from klppo.safety.guards import Action, GuardSettings, RunGuard
from klppo.safety.reward_hacking import Divergence, DivergenceDetector, Trend, in_spreads, least_squares_slope

SETTINGS = GuardSettings(early_stop_kl=None, rollback_kl=None, rollback_lr=1e-6, max_rollbacks=0,
                         max_nonfinite_steps=3, entropy_floor=None, clipfrac_max=None)


def feed(detector: DivergenceDetector, pairs, train_spread: float = 1.0, gold_spread: float = 1.0) -> list:
    """Each (train, gold) pair as one validation; spreads of 1 make a change in spreads a change in reward units."""
    return [detector.observe(train, gold, train_spread, gold_spread) for train, gold in pairs]


def test_training_reward_rising_over_flat_gold_fires_at_the_kth_validation():
    found = feed(DivergenceDetector(validations=3, margin=0.05), [(0.2, 0.3), (0.3, 0.3), (0.4, 0.3)])
    # window of 3: train 0.4 - 0.2 = 0.2 > 0.05, gold 0.3 - 0.3 = 0 < 0.05, gap 0.2 > 0.05
    assert found[:2] == [None, None]
    assert found[2] == Divergence(pytest.approx(0.2), 0.0, 3, 1.0, 1.0)


def test_each_reward_moves_in_units_of_its_own_spread():
    # A reward model in [-10, 10] (scores' std 4.0 over the held-out responses) rises by 0.5 while a
    # 0/1 gold reward at 10% right (std sqrt(0.1 * 0.9) = 0.3) rises by 0.04: both improved. In reward
    # units (the old rule, margin 0.05) that fired: 0.5 > 0.05, 0.04 < 0.05. In spreads: train
    # 0.5 / 4 = 0.125 > 0.1, but gold 0.04 / 0.3 = 0.133 is not below 0.1: no divergence.
    both_improved = [(0.0, 0.10), (0.3, 0.12), (0.5, 0.14)]
    assert feed(DivergenceDetector(3, 0.1), both_improved, train_spread=4.0, gold_spread=0.3) == [None] * 3
    # The same reward model with a gold reward that stays flat: 0.125 vs 0, gap 0.125 > 0.1
    found = feed(DivergenceDetector(3, 0.1), [(0.0, 0.1), (0.3, 0.1), (0.5, 0.1)], train_spread=4.0, gold_spread=0.3)
    assert found[2] == Divergence(0.5, 0.0, 3, 4.0, 0.3) and found[2].train_shift == 0.125


def test_the_spread_is_the_mean_over_the_window_and_a_reward_without_spread_moved_by_0_or_infinitely():
    detector = DivergenceDetector(2, 0.1)
    assert detector.observe(0.0, 0.5, 1.0, 0.0) is None
    found = detector.observe(0.4, 0.5, 3.0, 0.0)  # train spread (1 + 3) / 2 = 2: +0.4 is 0.2 spreads
    assert (found.train_spread, found.train_shift, found.gold_spread, found.gold_shift) == (2.0, 0.2, 0.0, 0.0)
    assert in_spreads(0.0, 0.0) == 0.0 and in_spreads(-0.1, 0.0) == -math.inf and in_spreads(0.3, 0.6) == 0.5


def test_rewards_that_rise_together_or_a_gold_that_falls_less_than_the_margin_do_not_fire():
    assert feed(DivergenceDetector(3, 0.05), [(0.2, 0.25), (0.3, 0.35), (0.4, 0.45)]) == [None] * 3
    # train +0.06, gold +0.04: both changes within one margin of each other (gap 0.02)
    assert feed(DivergenceDetector(3, 0.05), [(0.2, 0.2), (0.23, 0.22), (0.26, 0.24)]) == [None] * 3
    # a training reward that falls is no gaming, whatever gold does
    assert feed(DivergenceDetector(3, 0.05), [(0.4, 0.9), (0.3, 0.5), (0.2, 0.1)]) == [None] * 3


def test_a_divergence_fires_once_per_episode_and_re_arms_when_the_rewards_agree_again():
    detector = DivergenceDetector(3, 0.05)
    stream = [(0.2, 0.3), (0.3, 0.3), (0.4, 0.3),  # fires at the 3rd
              (0.5, 0.28),  # still diverging (window 0.3 -> 0.5 vs 0.3 -> 0.28): same episode, silent
              (0.5, 0.28), (0.5, 0.28),  # window 0.5, 0.5, 0.5 vs flat gold: they agree, re-armed
              (0.6, 0.28),  # window 0.5 -> 0.6 (+0.1), gold flat: a new episode
              (0.7, 0.28)]  # window 0.5 -> 0.7: the same episode
    found = feed(detector, stream)
    assert [i for i, f in enumerate(found) if f is not None] == [2, 6]
    assert found[6].train_change == pytest.approx(0.1) and found[6].gold_change == 0.0


def test_the_detector_continues_from_its_state_dict_as_if_never_stopped():
    stream = [(0.2, 0.3), (0.3, 0.3), (0.4, 0.3), (0.5, 0.3), (0.5, 0.3), (0.5, 0.3), (0.6, 0.3), (0.7, 0.3)]
    whole = feed(DivergenceDetector(3, 0.05), stream)
    first = DivergenceDetector(3, 0.05)
    feed(first, stream[:4])
    second = DivergenceDetector(3, 0.05)
    second.load_state_dict(first.state_dict())
    assert feed(second, stream[4:]) == whole[4:] and whole[6] is not None
    # a record saved before the spreads holds (train, gold) pairs: the window starts afresh
    legacy = DivergenceDetector(3, 0.05)
    legacy.load_state_dict({"history": [[0.2, 0.3], [0.3, 0.3]], "armed": False})
    assert list(legacy.history) == [] and legacy.armed is False


def test_least_squares_slope_of_hand_worked_series():
    assert least_squares_slope([]) == 0.0 and least_squares_slope([5.0]) == 0.0
    assert least_squares_slope([1.0, 2.0, 3.0]) == 1.0
    # x mean 1, y mean 3: ((-1)(-1) + 0 + (1)(0)) / ((-1)^2 + 0 + 1^2) = 1 / 2
    assert least_squares_slope([2.0, 4.0, 3.0]) == 0.5


def test_the_trend_is_the_slope_over_the_last_window_steps_and_resumes_from_its_state():
    trend = Trend(window=3)
    assert [trend.observe(v) for v in (1.0, 2.0, 3.0)] == [0.0, 1.0, 1.0]
    resumed = Trend(window=3)
    resumed.load_state_dict(trend.state_dict())
    # window 2, 3, 10: y mean 5, ((-1)(-3) + 0 + (1)(5)) / 2 = 4
    assert trend.observe(10.0) == resumed.observe(10.0) == 4.0


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_the_guard_reports_a_divergence_as_an_event_and_stops_only_when_told(action):
    import dataclasses

    guard = RunGuard(dataclasses.replace(SETTINGS, divergence_validations=2, divergence_action=action))
    assert guard.check_validation(0, (0.1, 0.5), (0.5, 0.5)) is Action.CONTINUE
    expected = Action.STOP if action == "stop" else Action.CONTINUE
    # train +0.3 over spread (0.5 + 0.1) / 2 = 0.3: +1 spread; gold -0.1 over 0.5: -0.2 spreads
    assert guard.check_validation(10, (0.4, 0.1), (0.4, 0.5)) is expected
    (event,) = guard.drain_events()
    assert (event.step, event.kind) == (10, "reward_divergence")
    assert event.values == {"train_change": pytest.approx(0.3), "gold_change": pytest.approx(-0.1),
                            "train_spread": pytest.approx(0.3), "gold_spread": 0.5,
                            "train_shift": pytest.approx(1.0), "gold_shift": pytest.approx(-0.2),
                            "validations": 2, "action": action}
    assert "training reward +0.3 (+1 of its spread 0.3) but gold reward -0.1 (-0.2 of its spread 0.5)" in event.message


def test_the_guard_record_carries_the_detectors_windows():
    guard = RunGuard(SETTINGS)
    guard.check_validation(0, (0.1, 0.2), (0.5, 0.3))
    guard.observe_response_length(4.0)
    guard.observe_response_length(6.0)
    restored = RunGuard(SETTINGS)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert restored.observe_response_length(8.0) == 2.0  # 4, 6, 8: the window came back
    old_checkpoint = {k: v for k, v in guard.state_dict().items() if k != "health"}
    RunGuard(SETTINGS).load_state_dict(old_checkpoint)  # written before the detectors: they start empty
