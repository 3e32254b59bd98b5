"""Micro-batching must not change an update: accumulated micro-batches == one full mini-batch.

Whether the micro-batches are fixed rows, a token budget (use_dynamic_bsz) or packed rows
(use_remove_padding), and in every loss aggregation mode.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.data.batching import MicroBatching, micro_batch_plan
from klppo.models.load import load_critic
from klppo.rollout.batch import RolloutBatch
from klppo.trainer.forwards import compute_log_prob, compute_values
from klppo.run.settings import ActorUpdateSettings, CriticUpdateSettings
from klppo.trainer.update import update_actor, update_critic

WHOLE = MicroBatching()

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _budget(batch: RolloutBatch) -> int:
    """A token budget that splits the batch's 6 rows (32 to 44 tokens) into 3 micro-batches."""
    return 2 * int(batch.attention_mask.sum(-1).max()) + 2


def _plan(batch: RolloutBatch, split: MicroBatching) -> list[list[int]]:
    return micro_batch_plan(batch.attention_mask.sum(-1), split)


def _splits(batch: RolloutBatch) -> list[MicroBatching]:
    """Micro-batching set-ups to compare with the full mini-batch (fixed rows 6, padded)."""
    budget = _budget(batch)
    assert 2 < len(_plan(batch, MicroBatching(max_tokens=budget))) < len(batch)
    return [
        MicroBatching(rows=2), MicroBatching(rows=1),
        MicroBatching(rows=6, max_tokens=budget),
        MicroBatching(rows=3, packed=True),
        MicroBatching(rows=6, max_tokens=budget, packed=True),
    ]


def _actor_settings(mode: str, micro: MicroBatching) -> ActorUpdateSettings:
    return ActorUpdateSettings(
        mini_batch_rows=6, micro=micro, ppo_epochs=1, clip_ratio_low=0.2, clip_ratio_high=0.2,
        clip_ratio_c=3.0, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", grad_clip=1.0, temperature=1.0,
    )


def _assert_same_update(results, keys):
    (full_metrics, full_params), *others = results
    for metrics, params in others:
        for p_full, p_split in zip(full_params, params):
            torch.testing.assert_close(p_split, p_full, rtol=1e-5, atol=1e-6)
        for key in keys:
            torch.testing.assert_close(metrics[key], full_metrics[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_actor_update_is_the_same_for_any_micro_batching(tiny_model_dir, mode, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = answer_batch()
    batch.old_log_prob = compute_log_prob(actor, batch, WHOLE, temperature=1.0) - 0.05
    batch.ref_log_prob = batch.old_log_prob + 0.1
    results = []
    for split in [MicroBatching(rows=6)] + _splits(batch):
        model = copy.deepcopy(actor)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = update_actor(model, optimizer, batch, _actor_settings(mode, split))
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    _assert_same_update(results, ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss"))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_critic_update_is_the_same_for_any_micro_batching(tiny_model_dir, mode, answer_batch):
    critic = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"))
    batch = answer_batch()
    batch.values = compute_values(critic, batch, MicroBatching(rows=4))
    results = []
    for split in [MicroBatching(rows=6)] + _splits(batch):
        model = copy.deepcopy(critic)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        settings = CriticUpdateSettings(mini_batch_rows=6, micro=split, ppo_epochs=1, cliprange_value=0.5,
                                        loss_agg_mode=mode, grad_clip=1.0)
        metrics = update_critic(model, optimizer, batch, settings)
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    _assert_same_update(results, ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"))


def test_chunked_log_probs_equal_one_forward(tiny_model_dir, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = answer_batch()
    whole = compute_log_prob(actor, batch, WHOLE, temperature=0.7)
    torch.testing.assert_close(compute_log_prob(actor, batch, MicroBatching(rows=4), temperature=0.7), whole)


@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_forwards_restore_the_batch_order(tiny_model_dir, packed, answer_batch):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"))
    batch = answer_batch()
    split = MicroBatching(max_tokens=_budget(batch), packed=packed)
    plan = _plan(batch, split)
    assert [i for idx in plan for i in idx] != list(range(len(batch)))  # the micro-batches do reorder rows
    whole = compute_log_prob(actor, batch, WHOLE, temperature=0.7)
    torch.testing.assert_close(compute_log_prob(actor, batch, split, temperature=0.7), whole, atol=1e-5, rtol=1e-5)
    values = compute_values(critic, batch, WHOLE)
    torch.testing.assert_close(compute_values(critic, batch, split), values, atol=1e-5, rtol=1e-5)


def test_micro_batches_of_a_token_budget_are_balanced_and_fit(tiny_model_dir, answer_batch):
    batch = answer_batch()
    lens = batch.attention_mask.sum(-1).tolist()
    plan = _plan(batch, MicroBatching(max_tokens=_budget(batch)))
    assert all(sum(lens[i] for i in idx) <= _budget(batch) for idx in plan)
    assert sorted(i for idx in plan for i in idx) == list(range(len(batch)))
