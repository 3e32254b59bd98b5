"""An update whose forward ran first (``update.forward_first``) makes the update a second forward makes.

The forward's detached outputs are the step's pi_old log-probs and values, in the batch's row
order whatever order the micro-batch's plan gave its rows; the update that takes the forward's
graphs must move the weights and report the metrics that an update running its own forward does.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.data.batching import MicroBatching
from klppo.models.load import load_critic
from klppo.run.settings import ActorUpdateSettings, CriticUpdateSettings
from klppo.trainer import update
from klppo.trainer.forwards import compute_log_prob, compute_values
from klppo.trainer.update import forward_first, update_actor, update_critic

T = 0.7  # the rollout's temperature
ROWS = 6


@pytest.fixture
def reversed_plan(monkeypatch):
    """Every update plans its one micro-batch with the rows in reverse, as a token budget's plan may order them."""
    monkeypatch.setattr(update, "micro_plans", lambda batch, spans, mini_rows, micro: [
        (list(range(len(batch))), [list(reversed(range(len(batch))))])])


def _assert_same_updates(updates: list[dict], first, second) -> None:
    """The two updates' metrics and the two models' weights after them agree to float rounding."""
    assert updates[0].keys() == updates[1].keys()
    for key, value in updates[0].items():
        torch.testing.assert_close(value, updates[1][key], rtol=1e-4, atol=1e-6, msg=key)
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("micro", [MicroBatching(), MicroBatching(max_tokens=4096, packed=True)],
                         ids=["padded", "packed"])
def test_an_actor_update_on_its_forward_run_first_is_the_update_with_its_own(tiny_model_dir, answer_batch,
                                                                              reversed_plan, micro):
    s = ActorUpdateSettings(
        mini_batch_rows=ROWS, micro=micro, ppo_epochs=1, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", grad_clip=1.0, temperature=T)
    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    second = copy.deepcopy(first)
    batch = answer_batch(ROWS)
    batch.ref_log_prob = compute_log_prob(second, batch, MicroBatching(), temperature=T) - 0.1 * batch.response_mask

    forwarded = forward_first(first, batch, s)
    assert forwarded.rows == list(reversed(range(ROWS)))
    old = compute_log_prob(second, batch, MicroBatching(), temperature=T)
    torch.testing.assert_close(forwarded.detached(), old, rtol=1e-5, atol=1e-6)  # pi_old, in the batch's order

    updates = []
    for model, given, old_log_prob in ((first, forwarded, forwarded.detached()), (second, None, old)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would magnify ~0 gradients
        scored = copy.copy(batch)
        scored.old_log_prob = old_log_prob
        updates.append(update_actor(model, optimizer, scored, s, forwarded=given))
    _assert_same_updates(updates, first, second)


def test_a_critic_update_on_its_forward_run_first_is_the_update_with_its_own(tiny_model_dir, answer_batch,
                                                                              reversed_plan):
    s = CriticUpdateSettings(mini_batch_rows=ROWS, micro=MicroBatching(), ppo_epochs=1, cliprange_value=0.2,
                             loss_agg_mode="token-mean", grad_clip=1.0)
    first = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"))
    second = copy.deepcopy(first)
    batch = answer_batch(ROWS)

    forwarded = forward_first(first, batch, s)
    values = compute_values(second, batch, MicroBatching())
    torch.testing.assert_close(forwarded.detached(), values, rtol=1e-5, atol=1e-6)  # in the batch's order

    updates = []
    for model, given, own_values in ((first, forwarded, forwarded.detached()), (second, None, values)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would magnify ~0 gradients
        scored = copy.copy(batch)
        scored.values = own_values
        updates.append(update_critic(model, optimizer, scored, s, forwarded=given))
    _assert_same_updates(updates, first, second)
