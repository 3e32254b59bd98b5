"""Loss aggregation, PPO policy / value / KL losses, log-prob and entropy helpers."""

import math

import pytest
import torch

from klppo.algo import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    explained_variance,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_agg_loss_modes_on_a_hand_worked_example():
    # real tokens: row 0 [1, 2], row 1 [4]
    # token-mean: (1 + 2 + 4) / 3 = 7/3
    assert torch.allclose(agg_loss(LOSS, MASK, "token-mean"), torch.tensor(7.0 / 3.0))
    # seq-mean-token-sum: (3 + 4) / 2 = 3.5
    assert torch.allclose(agg_loss(LOSS, MASK, "seq-mean-token-sum"), torch.tensor(3.5))
    # seq-mean-token-mean: (1.5 + 4) / 2 = 2.75
    assert torch.allclose(agg_loss(LOSS, MASK, "seq-mean-token-mean"), torch.tensor(2.75))
    # seq-mean-token-sum-norm: (3 + 4) / T = 7 / 3; with loss_scale_factor 7: 1
    assert torch.allclose(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm"), torch.tensor(7.0 / 3.0))
    got = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7)
    assert torch.allclose(got, torch.tensor(1.0))


def test_agg_loss_does_not_count_all_padding_sequences():
    loss = torch.cat([LOSS, torch.full((1, 3), 100.0)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    # the third row has no real token: seq-mean-token-mean still (1.5 + 4) / 2
    assert torch.allclose(agg_loss(loss, mask, "seq-mean-token-mean"), torch.tensor(2.75))


def test_agg_loss_of_an_all_padding_batch_is_zero():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, mask, mode) == 0.0


def test_agg_loss_with_an_unknown_mode_raises():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "token-median")


def _split_batch(seed=0, b=7, t=5):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=gen)
    mask = torch.arange(t).expand(b, t) < torch.randint(0, t + 1, (b, 1), generator=gen)
    mask[0] = False  # one sequence without real tokens
    mask[1] = True
    return loss, mask, [slice(0, 2), slice(2, 5), slice(5, 7)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_losses_with_global_counts_sum_to_the_full_batch_loss(mode):
    loss, mask, parts = _split_batch()
    full = agg_loss(loss, mask, mode)
    n_tok, n_seq = mask.sum(), int(mask.any(dim=-1).sum())  # a tensor and a plain int
    summed = sum(agg_loss(loss[p], mask[p], mode, global_token_count=n_tok, global_seq_count=n_seq) for p in parts)
    assert torch.allclose(summed, full, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_policy_gradients_sum_to_the_full_batch_gradient(mode):
    # the same split, as two ranks x micro-batches would do it, through compute_policy_loss
    _, mask, parts = _split_batch(seed=3)
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(mask.shape, generator=gen) * 0.1
    adv = torch.randn(mask.shape, generator=gen)
    new = (old + torch.randn(mask.shape, generator=gen) * 0.3).requires_grad_(True)
    full, _ = compute_policy_loss(old, new, adv, mask, loss_agg_mode=mode)
    (full_grad,) = torch.autograd.grad(full, new)
    n_tok, n_seq = mask.sum(), mask.any(dim=-1).sum()
    total = 0.0
    for p in parts:
        part, _ = compute_policy_loss(
            old[p], new[p], adv[p], mask[p], loss_agg_mode=mode,
            global_token_count=n_tok, global_seq_count=n_seq,
        )
        total = total + part
    (split_grad,) = torch.autograd.grad(total, new)
    assert torch.allclose(total, full, atol=1e-6)
    assert torch.allclose(split_grad, full_grad, atol=1e-6)


def _policy_cases():
    # four tokens, old log-prob 0 everywhere:
    # 0: A = +1, ratio 2      -> -A * clip(2, 0.8, 1.2) = -1.2 (clipped above)
    # 1: A = -1, ratio e^2    -> max(7.389, 1.2) = 7.389, dual clip min(7.389, 3) = 3
    # 2: A = +1, ratio 1      -> -1 (no clip)
    # 3: A = -1, ratio 0.5    -> max(0.5, 0.8) = 0.8 (clipped below), min(0.8, 3) = 0.8
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(2.0), 2.0, 0.0, math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    return old, new, adv, torch.ones(1, 4, dtype=torch.bool)


def test_policy_loss_is_clipped_for_large_ratios_and_dual_clipped_for_negative_advantages():
    old, new, adv, mask = _policy_cases()
    loss, stats = compute_policy_loss(old, new, adv, mask)
    # token-mean (-1.2 + 3 - 1 + 0.8) / 4 = 0.4
    assert torch.allclose(loss, torch.tensor(0.4), atol=1e-6)
    assert torch.allclose(stats["actor/pg_loss"], torch.tensor(0.4), atol=1e-6)
    # clipped by the ratio clip: tokens 0 and 3 -> 2 / 4
    assert torch.allclose(stats["actor/pg_clipfrac"], torch.tensor(0.5))
    # bounded by clip_ratio_c: token 1 -> 1 / 4
    assert torch.allclose(stats["actor/pg_clipfrac_lower"], torch.tensor(0.25))
    # ppo_kl = mean(old - new) = (-log 2 - 2 - 0 + log 2) / 4 = -0.5
    assert torch.allclose(stats["actor/ppo_kl"], torch.tensor(-0.5))
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_policy_loss_has_no_gradient_through_clipped_tokens():
    old, new, adv, mask = _policy_cases()
    new = new.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(old, new, adv, mask)
    loss.backward()
    # only token 2 is unclipped: d(-A * exp(new - old)) / d new = -1 * 1, / 4 tokens
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0, -0.25, 0.0]]))


def test_policy_loss_uses_separate_low_and_high_clip_ranges():
    old, new, adv, mask = _policy_cases()
    loss, _ = compute_policy_loss(old[:, :1], new[:, :1], adv[:, :1], mask[:, :1], clip_ratio_high=0.28)
    # A = +1, ratio 2 clipped at 1 + 0.28 -> -1.28
    assert torch.allclose(loss, torch.tensor(-1.28))


def test_policy_loss_rejects_a_dual_clip_bound_not_above_one():
    old, new, adv, mask = _policy_cases()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    vpreds = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.zeros(1, 3)
    returns = torch.tensor([[0.5, 1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # clipped preds [0.2, 0.0, 0.2]
    # unclipped (V - R)^2 = [0.25, 1.0, 1.0]; clipped = [0.09, 1.0, 3.24]; max = [0.25, 1, 3.24]
    # loss = 0.5 * (0.25 + 1 + 3.24) / 3 = 0.748333; clipped is larger only for token 2
    assert torch.allclose(loss, torch.tensor(0.5 * 4.49 / 3.0))
    assert torch.allclose(stats["critic/vf_loss"], loss)
    assert torch.allclose(stats["critic/vf_clipfrac"], torch.tensor(1.0 / 3.0))
    assert torch.allclose(stats["critic/vpred_mean"], torch.tensor(2.0 / 3.0))


def test_kl_loss_aggregates_the_chosen_estimator():
    log_prob = torch.tensor([[0.0, -1.0, 5.0]])
    ref = torch.tensor([[-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # k3 on the real tokens: [e^-1, e - 2] -> token-mean
    expected = (math.exp(-1.0) + math.e - 2.0) / 2.0
    assert torch.allclose(kl_loss(log_prob, ref, mask, "low_var_kl", "token-mean"), torch.tensor(expected))
    direct = agg_loss(kl_penalty(log_prob, ref, "k1"), mask, "seq-mean-token-sum")
    assert torch.allclose(kl_loss(log_prob, ref, mask, "k1", "seq-mean-token-sum"), direct)


def test_entropy_of_uniform_logits_is_log_vocab_size():
    logits = torch.zeros(2, 3, 4)
    assert torch.allclose(entropy_from_logits(logits), torch.full((2, 3), math.log(4.0)))


def test_entropy_from_logits_matches_torch_categorical():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-5)


def test_logprobs_from_logits_matches_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 9, generator=gen) * 4
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels), expected, atol=1e-5)
    low = logprobs_from_logits(logits.bfloat16(), labels)
    assert low.dtype == torch.float32
    assert torch.allclose(low, expected, atol=0.1)


def test_explained_variance_on_a_hand_worked_example():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, -50.0]])  # last token is padding
    mask = torch.tensor([[True, True, True, False]])
    # returns - values = [0, 0, 1]: mean 1/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    # var(returns) = 1 -> 1 - (1/3) / 1 = 2/3
    assert torch.allclose(explained_variance(values, returns, mask), torch.tensor(2.0 / 3.0))


def test_explained_variance_is_zero_when_returns_are_constant():
    returns = torch.full((1, 3), 2.0)
    values = torch.tensor([[0.0, 1.0, 5.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert torch.equal(explained_variance(values, returns, mask), torch.tensor(0.0))
