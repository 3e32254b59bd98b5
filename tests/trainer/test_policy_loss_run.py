"""Runs with verl's ``actor.policy_loss.loss_mode``: gspo, cispo, sapo, gpg and geo_mean train
through the whole update.

One epoch over one mini-batch is on-policy (pi_old = pi at the update), where every ratio is 1
and each mode's gradient is vanilla PPO's: GSPO's with its own seq-mean-token-mean reduction
(whatever loss_agg_mode says), CISPO's with the run's; SAPO's gate has slope 1 at ratio 1, GPG is
-A log pi, and GMPO's geometric mean of ratios 1 is 1. So such runs end with vanilla's weights,
while what they log shows which loss ran (CISPO's and GPG's loss is -A log pi, not -A x ratio).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.commands.main_ppo import run_ppo

quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def on_policy(ppo_overrides, task_dir):
    # no KL loss: it is reduced by loss_agg_mode in every mode, GSPO's too (as verl)
    changes = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
               "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "false"}
    return lambda run_dir, **more: ppo_overrides(run_dir, **{**changes, **more})


def _weights(run_dir):
    return AutoModelForCausalLM.from_pretrained(run_dir / "actor_hf").state_dict()


def _assert_same_weights(a, b):
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], rtol=1e-4, atol=1e-6, msg=key)


def test_gspo_and_cispo_runs_on_policy_end_with_vanillas_weights_and_log_their_own_losses(on_policy, tmp_path):
    mode = "actor_rollout_ref.actor.policy_loss.loss_mode"
    agg = "actor_rollout_ref.actor.loss_agg_mode"
    vanilla = run_ppo(None, on_policy(tmp_path / "vanilla", **{agg: "seq-mean-token-mean"}), print_fn=quiet)
    # GSPO reduces its loss seq-mean-token-mean whatever loss_agg_mode says (as verl)
    gspo = run_ppo(None, on_policy(tmp_path / "gspo", **{mode: "gspo", agg: "token-mean"}), print_fn=quiet)
    cispo = run_ppo(None, on_policy(tmp_path / "cispo", **{mode: "cispo", agg: "seq-mean-token-mean"}), print_fn=quiet)
    token_mean = run_ppo(None, on_policy(tmp_path / "token_mean", **{agg: "token-mean"}), print_fn=quiet)

    _assert_same_weights(_weights(tmp_path / "vanilla"), _weights(tmp_path / "gspo"))
    _assert_same_weights(_weights(tmp_path / "vanilla"), _weights(tmp_path / "cispo"))
    with pytest.raises(AssertionError):  # the reductions differ: GSPO did not follow loss_agg_mode
        _assert_same_weights(_weights(tmp_path / "token_mean"), _weights(tmp_path / "gspo"))
    for v, g, c in zip(vanilla, gspo, cispo):
        assert g["actor/pg_loss"] == pytest.approx(v["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert abs(c["actor/pg_loss"] - v["actor/pg_loss"]) > 1e-5  # -A log pi, not -A x 1 (GRPO: mean 0)
        assert g["actor/pg_clipfrac"] == c["actor/pg_clipfrac"] == 0.0 == g["actor/pg_clipfrac_lower"]
    assert len(token_mean) == len(vanilla) == 2


def test_an_off_policy_gspo_run_clips_whole_sequences(ppo_overrides, tmp_path):
    # two epochs: the second moves pi away from pi_old, and GSPO's paper ranges (3e-4, 4e-4) clip sequences
    records = run_ppo(None, ppo_overrides(tmp_path / "run", **{
        "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.clip_ratio_low": 3e-4, "actor_rollout_ref.actor.clip_ratio_high": 4e-4}),
        print_fn=quiet)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/pg_clipfrac"] > 0 for r in records)


def test_sapo_gpg_and_geo_mean_runs_on_policy_train_as_vanilla(on_policy, tmp_path):
    # Their gradients equal vanilla's to float rounding (the gradient norms to 1e-6); Adam's m / sqrt(v) turns the
    # rounding of a near-zero gradient element into up to a few 1e-5 of weight, so the weights are compared to a
    # tenth of one step (lr 1e-3), which a run reduced otherwise (token-mean) exceeds.
    mode = "actor_rollout_ref.actor.policy_loss.loss_mode"
    agg = "actor_rollout_ref.actor.loss_agg_mode"  # seq-mean-token-mean: SAPO's and GMPO's own reduction
    vanilla = run_ppo(None, on_policy(tmp_path / "vanilla", **{agg: "seq-mean-token-mean"}), print_fn=quiet)
    runs = {name: run_ppo(None, on_policy(tmp_path / name, **{agg: "seq-mean-token-mean", mode: name, **more}),
                          print_fn=quiet)
            for name, more in [("sapo", {"actor_rollout_ref.actor.tau_pos": 3.0}), ("gpg", {}), ("geo_mean", {})]}
    run_ppo(None, on_policy(tmp_path / "token_mean", **{agg: "token-mean"}), print_fn=quiet)

    def same_weights(name):
        a, b = _weights(tmp_path / "vanilla"), _weights(tmp_path / name)
        return all(torch.allclose(a[key], b[key], rtol=0, atol=1e-4) for key in a)

    assert not same_weights("token_mean")
    for name, records in runs.items():
        assert same_weights(name), name
        for v, r in zip(vanilla, records, strict=True):
            assert r["actor/grad_norm"] == pytest.approx(v["actor/grad_norm"], rel=1e-5), name
            assert r["actor/pg_clipfrac"] == r["actor/pg_clipfrac_lower"] == 0.0
            if name == "geo_mean":  # -A_seq x exp(0): vanilla's loss (GRPO's advantage is the sequence's)
                assert r["actor/pg_loss"] == pytest.approx(v["actor/pg_loss"], rel=1e-4, abs=1e-6)
            else:  # SAPO: -A x 2 / tau (tau_pos 3 where A > 0, tau_neg 1.05 elsewhere); GPG: -A log pi
                assert abs(r["actor/pg_loss"] - v["actor/pg_loss"]) > 1e-5, name

def test_an_off_policy_geo_mean_run_clips_tokens_on_both_sides(ppo_overrides, tmp_path):
    # four epochs with a narrow range: the later epochs move pi away from pi_old past 0.01 in log space
    records = run_ppo(None, ppo_overrides(tmp_path / "run", **{
        "actor_rollout_ref.actor.policy_loss.loss_mode": "geo_mean", "actor_rollout_ref.actor.ppo_epochs": 4,
        "actor_rollout_ref.actor.clip_ratio": 0.01}), print_fn=quiet)
    assert all(r["actor/pg_clipfrac"] > 0 and r["actor/pg_clipfrac_lower"] > 0 for r in records)
