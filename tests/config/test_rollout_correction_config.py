"""algorithm.rollout_correction: verl's keys and defaults, its threshold strings, and where it acts."""

import pytest

from klppo.config import load_ppo_config
from klppo.run.settings import RolloutCorrectionSettings, compile_ppo
from klppo.errors import UserError

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny",
            "actor_rollout_ref.rollout.name=offline"]
KEY = "algorithm.rollout_correction"


def load(*overrides, notes=None):
    return load_ppo_config(None, REQUIRED + list(overrides), notes=notes)


def test_keys_and_defaults_are_verls():
    rc = load().algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize) == (None, 2.0, False)
    assert (rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode, rc.loss_type) == (None, None, False, "ppo_clip")
    assert compile_ppo(load(), 1).actor.rollout_correction == RolloutCorrectionSettings()


def test_thresholds_are_parsed_as_verl_reads_them():
    cfg = load(f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_is_threshold='0.5_5.0'",
               f"{KEY}.rollout_rs=token_k1,seq_mean_k3,token_k1", f"{KEY}.rollout_rs_threshold='2.0,0.1'")
    s = compile_ppo(cfg, 1).actor.rollout_correction
    assert (s.rollout_is, s.is_threshold, s.is_threshold_lower) == ("sequence", 5.0, 0.5)
    # a k1 bound alone bounds mu / pi_old within [1/2, 2]; the repeated criterion counts once
    assert s.rs == (("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.1))
    assert load(f"{KEY}.rollout_is_threshold='3'").algorithm.rollout_correction.rollout_is_threshold == 3.0


@pytest.mark.parametrize("overrides, problem", [
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold='5_0.5'"], "the lower bound is above the upper one"),
    ([f"{KEY}.rollout_is=token", f"{KEY}.rollout_is_threshold=-1"], "must be > 0"),
    ([f"{KEY}.rollout_rs=token_k9", f"{KEY}.rollout_rs_threshold=2"], "unknown criterion 'token_k9'"),
    ([f"{KEY}.rollout_rs=token_k2"], "rollout_rs_threshold is null but"),
    ([f"{KEY}.rollout_rs=token_k2", f"{KEY}.rollout_rs_threshold='0.1_2'"], "takes one upper bound"),
    ([f"{KEY}.rollout_rs=token_k2,seq_max_k3", f"{KEY}.rollout_rs_threshold='1,2,3'"], "3 thresholds for 2"),
    ([f"{KEY}.rollout_is=tokens"], "did you mean 'token'"),
    ([f"{KEY}.loss_type=ppo"], "'ppo_clip'"),
])
def test_bad_settings_are_errors_naming_the_key(overrides, problem):
    with pytest.raises(UserError) as err:
        load(*overrides)
    assert problem in str(err.value) and KEY in str(err.value)


def test_online_the_correction_is_off_and_a_warning_says_why():
    notes: list[str] = []
    cfg = load("actor_rollout_ref.rollout.name=hf", f"{KEY}.rollout_is=token", notes=notes)
    assert any(f"{KEY} has no effect" in n and "pi_old" in n for n in notes), notes
    settings = compile_ppo(cfg, 1)
    assert settings.actor.rollout_correction == RolloutCorrectionSettings()
    assert not settings.forwards.old_log_prob_from_rollout


def test_reinforce_outside_bypass_mode_is_ignored_with_a_warning():
    notes: list[str] = []
    load(f"{KEY}.loss_type=reinforce", notes=notes)
    assert any("applies in bypass mode only" in n for n in notes), notes


def test_bypass_mode_offline_takes_the_old_log_probs_from_the_data():
    settings = compile_ppo(load(f"{KEY}.bypass_mode=true", f"{KEY}.loss_type=reinforce"), 1)
    assert settings.forwards.old_log_prob_from_rollout
    assert settings.actor.rollout_correction.bypass_mode and settings.actor.rollout_correction.loss_type == "reinforce"


@pytest.mark.parametrize("key, fix", [("rollout_token_veto_threshold", "rollout_rs=token_k1"),
                                      ("rollout_rs_threshold_lower", "'lower_upper'"),
                                      ("use_policy_gradient", "loss_type=reinforce")])
def test_keys_of_older_verl_releases_are_refused_with_their_0_9_1_spelling(key, fix):
    with pytest.raises(UserError) as err:
        load(f"{KEY}.{key}=0.5")
    assert f"{KEY}.{key}" in str(err.value) and fix in str(err.value)
