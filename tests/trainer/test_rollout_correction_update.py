"""Rollout correction in the actor update: where the weights multiply, what rejection removes."""

import copy
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.algo import masked_mean
from klppo.data.batching import MicroBatching
from klppo.models.forward import response_logprobs
from klppo.trainer.forwards import compute_log_prob
from klppo.run.settings import ActorUpdateSettings, RolloutCorrectionSettings
from klppo.trainer.update import update_actor


def _settings(correction=RolloutCorrectionSettings(), rows=6, micro_rows=2) -> ActorUpdateSettings:
    return ActorUpdateSettings(
        mini_batch_rows=rows, micro=MicroBatching(rows=micro_rows), ppo_epochs=1, clip_ratio_low=0.2,
        clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
        kl_loss_coef=0.1, kl_loss_type="low_var_kl", grad_clip=1e9, temperature=1.0, rollout_correction=correction)


@pytest.fixture
def actor_and_batch(tiny_model_dir, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = answer_batch()
    batch.old_log_prob = compute_log_prob(actor, batch, MicroBatching(), temperature=1.0) - 0.05
    batch.ref_log_prob = batch.old_log_prob + 0.1
    batch.has_rollout_log_probs = torch.ones(len(batch), dtype=torch.bool)
    return actor, batch


def _update(actor, batch, settings):
    model = copy.deepcopy(actor)
    metrics = update_actor(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, settings)
    return metrics, [p.detach().clone() for p in model.parameters()]


def test_weights_of_one_leave_the_update_bit_identical(actor_and_batch):
    actor, batch = actor_and_batch
    plain_metrics, plain = _update(actor, batch, _settings())
    batch.rollout_log_probs = batch.old_log_prob.clone()  # mu = pi_old: every weight exp(0) = 1
    metrics, corrected = _update(actor, batch, _settings(RolloutCorrectionSettings(rollout_is="token")))
    assert all(torch.equal(a, b) for a, b in zip(plain, corrected))
    assert metrics["actor/pg_loss"] == plain_metrics["actor/pg_loss"]
    assert float(metrics["rollout_corr/rollout_is_mean"]) == 1.0 and float(metrics["rollout_corr/kl"]) == 0.0


def test_token_weights_multiply_the_per_token_policy_loss(actor_and_batch):
    actor, batch = actor_and_batch
    plain_metrics, _ = _update(actor, batch, _settings())
    # mu = pi_old / 2 on every token: pi_old / mu = 2 under the bound 3, so each token loss doubles
    batch.rollout_log_probs = batch.old_log_prob - math.log(2.0)
    metrics, _ = _update(actor, batch, _settings(RolloutCorrectionSettings(rollout_is="token", is_threshold=3.0)))
    torch.testing.assert_close(metrics["actor/pg_loss"], 2 * plain_metrics["actor/pg_loss"])
    torch.testing.assert_close(metrics["actor/entropy"], plain_metrics["actor/entropy"])  # weights: policy loss only


def test_rejected_sequences_update_as_if_they_were_not_in_the_batch(actor_and_batch):
    actor, batch = actor_and_batch
    rejected = torch.tensor([False, True, False, False, True, False])
    # rows 1 and 4: log(pi_old / mu) = -3 per token, so seq_max_k2 = 9 / 2 > 1 rejects them whole
    batch.rollout_log_probs = batch.old_log_prob + 3.0 * rejected[:, None]
    correction = RolloutCorrectionSettings(rs=(("seq_max_k2", None, 1.0),))
    metrics, corrected = _update(actor, batch, _settings(correction))
    kept = batch.select([0, 2, 3, 5])
    kept.rollout_log_probs = kept.has_rollout_log_probs = None
    kept_metrics, dropped = _update(actor, kept, _settings(rows=4))
    for a, b in zip(corrected, dropped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        torch.testing.assert_close(metrics[key], kept_metrics[key], rtol=1e-5, atol=1e-6)
    assert float(metrics["rollout_corr/rollout_rs_seq_masked_fraction"]) == pytest.approx(2 / 6)


def test_diagnostics_alone_change_nothing_but_add_the_rollout_corr_metrics(actor_and_batch):
    actor, batch = actor_and_batch
    plain_metrics, plain = _update(actor, batch, _settings())
    batch.rollout_log_probs = batch.old_log_prob - 0.3
    metrics, same = _update(actor, batch, _settings())
    assert all(torch.equal(a, b) for a, b in zip(plain, same))
    assert {k for k in metrics if not k.startswith("rollout_corr/")} == set(plain_metrics)
    assert float(metrics["rollout_corr/kl"]) == pytest.approx(-0.3, abs=1e-6)  # E[log mu - log pi_old]


def test_bypass_reinforce_is_minus_advantage_times_log_prob(actor_and_batch):
    actor, batch = actor_and_batch
    batch.rollout_log_probs = batch.old_log_prob
    settings = dataclasses.replace(_settings(RolloutCorrectionSettings(bypass_mode=True, loss_type="reinforce"),
                                             micro_rows=6), entropy_coeff=0.0, use_kl_loss=False)
    metrics, _ = _update(actor, batch, settings)
    with torch.no_grad():
        log_prob, _ = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.response_length)
    expected = masked_mean(-batch.advantages * log_prob, batch.response_mask)
    torch.testing.assert_close(metrics["actor/pg_loss"], expected, rtol=1e-5, atol=1e-6)
    assert float(metrics["actor/pg_clipfrac"]) == 0.0 and "rollout_corr/kl" in metrics
