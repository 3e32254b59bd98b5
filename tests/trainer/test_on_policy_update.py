"""An on-policy actor update (one epoch over one mini-batch: ``update.OnPolicy``) is its own pi_old.

It replaces the scoring phase's no-grad forward of pi_old, so it must make the update that a
recomputed pi_old makes, give the step the same old log-probs (in the batch's row order, however
the micro-batches split it) and the same KL to the reference for the guard, and move nothing
when the guard refuses the step.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.algo import masked_mean
from klppo.data.batching import MicroBatching
from klppo.run.settings import ActorUpdateSettings
from klppo.safety.guards import Action
from klppo.trainer.forwards import compute_log_prob
from klppo.trainer.update import OnPolicy, update_actor

WHOLE = MicroBatching()
T = 0.7  # the rollout's temperature


def _settings(micro: MicroBatching, on_policy: bool) -> ActorUpdateSettings:
    return ActorUpdateSettings(
        mini_batch_rows=6, micro=micro, ppo_epochs=1, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
        grad_clip=1.0, temperature=T, on_policy=on_policy,
    )


def _scored(actor, answer_batch):
    """A batch with reference log-probs 0.05 to 0.3 nats off the actor's (so the KL is not 0), no pi_old."""
    batch = answer_batch()
    shift = torch.linspace(0.05, 0.3, batch.response_ids.shape[1])
    batch.ref_log_prob = (compute_log_prob(actor, batch, WHOLE, temperature=T) - shift) * batch.response_mask
    return batch


@pytest.mark.parametrize("micro", [MicroBatching(rows=6), MicroBatching(rows=2),
                                   MicroBatching(rows=6, max_tokens=90, packed=True)],
                         ids=["whole", "rows-2", "token-budget-packed"])
def test_an_on_policy_update_makes_the_update_a_recomputed_pi_old_makes(tiny_model_dir, answer_batch, micro):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _scored(actor, answer_batch)
    recomputed, measured = copy.deepcopy(actor), copy.deepcopy(actor)
    # the scoring phase's forward of pi_old, then the usual update
    with_old = copy.copy(batch)
    with_old.old_log_prob = compute_log_prob(recomputed, batch, WHOLE, temperature=T)
    expected = update_actor(recomputed, torch.optim.SGD(recomputed.parameters(), lr=0.1), with_old,
                            _settings(micro, on_policy=False))
    # no forward: the update is pi_old, and hands the guard the KL before its step
    kls = []
    on_policy = OnPolicy(decide=lambda kl: kls.append(kl) or Action.CONTINUE)
    got = update_actor(measured, torch.optim.SGD(measured.parameters(), lr=0.1), batch,
                       _settings(micro, on_policy=True), on_policy=on_policy)

    assert len(on_policy.rows) == (1 if micro.rows == 6 and micro.max_tokens is None else 3)
    for a, b in zip(measured.parameters(), recomputed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
    assert "actor/kl_to_ref_share" not in got
    torch.testing.assert_close(on_policy.log_prob, with_old.old_log_prob, rtol=1e-5, atol=1e-6)
    assert kls == [pytest.approx(float(masked_mean(with_old.old_log_prob - batch.ref_log_prob, batch.response_mask)),
                                 rel=1e-5)]
    assert kls[0] > 0.05


def test_a_step_the_guard_refuses_moves_no_weight_yet_gives_pi_old(tiny_model_dir, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _scored(actor, answer_batch)
    before = [p.detach().clone() for p in actor.parameters()]
    optimizer = torch.optim.AdamW(actor.parameters(), lr=0.1, fused=True)
    on_policy = OnPolicy(decide=lambda kl: Action.ROLLBACK)
    metrics = update_actor(actor, optimizer, batch, _settings(MicroBatching(rows=2), on_policy=True), on_policy=on_policy)
    assert metrics == {} and on_policy.action is Action.ROLLBACK
    assert all(torch.equal(p, b) for p, b in zip(actor.parameters(), before))
    assert not optimizer.state and all(p.grad is None for p in actor.parameters())
    expected = compute_log_prob(actor, batch, WHOLE, temperature=T)
    torch.testing.assert_close(on_policy.log_prob, expected, rtol=1e-5, atol=1e-6)


def test_without_a_hand_over_an_on_policy_update_steps_as_if_approved(tiny_model_dir, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _scored(actor, answer_batch)
    before = [p.detach().clone() for p in actor.parameters()]
    metrics = update_actor(actor, torch.optim.SGD(actor.parameters(), lr=0.1), batch,
                           _settings(MicroBatching(rows=3), on_policy=True))
    assert metrics["actor/pg_clipfrac"] == 0.0  # ratio 1: nothing to clip
    assert not all(torch.equal(p, b) for p, b in zip(actor.parameters(), before))
