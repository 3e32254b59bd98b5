"""The guard's decisions, step by step, from hand-made numbers."""

import math

from klppo.safety.guards import Action, GuardSettings, RunGuard

SETTINGS = GuardSettings(early_stop_kl=0.2, rollback_kl=0.15, rollback_lr=1e-6, max_rollbacks=1,
                         max_nonfinite_steps=2, entropy_floor=0.01, clipfrac_max=0.3)


def test_a_checkpoint_is_certified_by_the_kl_of_the_step_after_it():
    guard = RunGuard(SETTINGS)
    guard.checkpoint_saved(2)
    assert guard.check_kl(3, 0.05) is Action.CONTINUE  # weights of step 2 sampled with KL 0.05: good
    guard.checkpoint_saved(4)
    assert guard.check_kl(5, 0.16) is Action.ROLLBACK  # weights of step 4 gave KL 0.16: not good
    assert guard.good_checkpoints == [2]
    assert guard.rollback_target() == 2 and guard.lr_override == 1e-6
    event = guard.drain_events()[0]
    assert (event.kind, event.step, event.values["to_step"]) == ("rollback", 5, 2)


def test_rollback_goes_to_the_initial_weights_when_no_checkpoint_is_good_or_on_disk():
    guard = RunGuard(SETTINGS)
    guard.checkpoint_saved(1)
    guard.check_kl(2, 0.01)
    assert guard.check_kl(3, 0.5, existing=set()) is Action.ROLLBACK
    assert guard.drain_events()[0].values["to_step"] == 0


def test_with_rollbacks_used_up_kl_above_early_stop_stops_and_between_thresholds_goes_on():
    guard = RunGuard(SETTINGS)
    assert guard.check_kl(1, 0.3) is Action.ROLLBACK  # the one rollback allowed
    assert guard.check_kl(2, 0.17) is Action.CONTINUE  # above rollback_kl, below early_stop_kl
    assert guard.check_kl(3, 0.25) is Action.STOP
    assert [e.kind for e in guard.drain_events()] == ["rollback", "early_stop"]


def test_non_finite_numbers_skip_then_stop_after_max_in_a_row_and_reset_when_finite():
    guard = RunGuard(SETTINGS)
    assert guard.check_finite(1, {"critic/score": math.nan}) is Action.SKIP
    assert guard.check_finite(2, {"actor/grad_norm": 1.0}) is Action.CONTINUE
    assert guard.check_finite(3, {"actor/pg_loss": math.inf}) is Action.SKIP
    assert guard.check_finite(4, {"actor/pg_loss": math.nan}) is Action.STOP
    assert [e.kind for e in guard.drain_events()] == ["skip_nonfinite", "skip_nonfinite", "stop_nonfinite"]


def test_health_warnings_name_the_numbers():
    guard = RunGuard(SETTINGS)
    guard.check_health(7, entropy=0.001, clipfrac=0.5)
    guard.check_health(8, entropy=0.5, clipfrac=0.1)
    events = guard.drain_events()
    assert [(e.step, e.kind) for e in events] == [(7, "warn_entropy"), (7, "warn_clipfrac")]
    assert events[0].values == {"entropy": 0.001}


def test_guard_record_round_trips_through_its_state_dict():
    guard = RunGuard(SETTINGS)
    guard.checkpoint_saved(2)
    guard.check_kl(3, 0.01)
    guard.check_kl(4, 0.9)
    guard.check_finite(4, {"x": math.nan})
    restored = RunGuard(SETTINGS)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()



def test_entropy_messages_give_small_fractions_their_digits():
    from klppo.safety.guards import percent

    assert (percent(0.5), percent(1.0), percent(2e-6)) == ("50%", "100%", "0.0002%")
