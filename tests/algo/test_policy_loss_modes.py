"""verl's policy loss modes beside vanilla PPO: GSPO (sequence-level ratios) and CISPO (clipped,
detached importance weights on REINFORCE), against verl's own functions on seeded tensors
(``data/verl_policy_losses.json``, written by ``data/make_verl_policy_losses.py``), against the
formulas worked by hand, and split over micro-batches as the update splits them."""

import json
import math
from pathlib import Path

import pytest
import torch

from klppo.algo import POLICY_LOSS_MODES, compute_policy_loss_of_mode
from klppo.config import load_ppo_config
from klppo.errors import UserError

VERL = json.loads((Path(__file__).parent / "data" / "verl_policy_losses.json").read_text())


def _loss(mode, old, new, advantages, mask, *, low=0.2, high=0.28, agg="token-mean", weights=None, **counts):
    return compute_policy_loss_of_mode(mode, old, new, advantages, mask, clip_ratio_low=low, clip_ratio_high=high,
                                       clip_ratio_c=3.0, loss_agg_mode=agg, rollout_is_weights=weights, **counts)


@pytest.mark.parametrize("name", sorted(VERL["cases"]))
def test_loss_gradient_and_metrics_equal_verls(name):
    case, x = VERL["cases"][name], {k: torch.tensor(v) for k, v in VERL["inputs"].items()}
    log_prob = x["log_prob"].clone().requires_grad_(True)
    loss, stats = _loss(case["mode"], x["old_log_prob"], log_prob, x["advantages"], x["response_mask"],
                        low=case["clip_ratio_low"], high=case["clip_ratio_high"], agg=case["loss_agg_mode"],
                        weights=x["rollout_is_weights"] if case["weighted"] else None,
                        global_seq_count=case["global_seq_count"])
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(log_prob.grad, torch.tensor(case["grad"]), rtol=1e-6, atol=1e-7)
    for key, value in case["metrics"].items():
        assert stats[key].item() == pytest.approx(value, abs=1e-7), key


def test_gspo_clips_a_sequence_by_the_geometric_mean_of_its_ratios_worked_by_hand():
    # sequence 0: token log-ratios 0.1 and 0.3 -> s = exp(0.2) = 1.221 (inside 1.28, though its second token's
    # own ratio exp(0.3) = 1.35 is not); sequence 1: one token, log-ratio -0.5, A > 0: the lower side never clips
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.1, 0.3], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = _loss("gspo", old, new, advantages, mask)
    loss.backward()
    # seq-mean-token-mean: each sequence's token mean of -A s, then their mean
    assert loss.item() == pytest.approx((-math.exp(0.2) - math.exp(-0.5)) / 2)
    torch.testing.assert_close(new.grad, torch.tensor([[-math.exp(0.2) / 4] * 2, [-math.exp(-0.5) / 2, 0.0]]))
    assert stats["actor/pg_clipfrac"].item() == 0.0
    new.grad = None
    clipped, stats = _loss("gspo", old, new, advantages, mask, high=0.1)  # s = 1.221 > 1.1: the whole sequence clips
    clipped.backward()
    assert new.grad[0].tolist() == [0.0, 0.0] and new.grad[1, 0] != 0
    assert stats["actor/pg_clipfrac"].item() == pytest.approx(2 / 3, abs=1e-6)


def test_cispo_keeps_a_clipped_tokens_gradient_at_the_clipped_weight_worked_by_hand():
    # token 0: ratio 2 (clipped to 1.28); token 1: ratio 1; A = 1, token-mean over 2 tokens
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = _loss("cispo", old, new, torch.ones(1, 2), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.28 * math.log(2.0) + 0.0) / 2)
    torch.testing.assert_close(new.grad, torch.tensor([[-1.28 / 2, -1.0 / 2]]))
    assert stats["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    new.grad = None
    vanilla, _ = _loss("vanilla", old, new, torch.ones(1, 2), mask)
    vanilla.backward()
    assert new.grad[0, 0] == 0  # PPO's clip drops the clipped token's gradient


@pytest.mark.parametrize("mode", ["gspo", "cispo"])
def test_on_policy_each_mode_gives_vanillas_gradient(mode):
    # pi_old = pi (one epoch over one mini-batch): every ratio is 1, so every loss is -A log pi's gradient
    g = torch.Generator().manual_seed(0)
    log_prob = (-3 * torch.rand(4, 5, generator=g)).requires_grad_(True)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]
    advantages = torch.randn(4, 1, generator=g).expand(4, 5)
    agg = "seq-mean-token-mean"  # GSPO's, whatever the run's
    grads = []
    for each in ("vanilla", mode):
        log_prob.grad = None
        loss, _ = _loss(each, log_prob.detach(), log_prob, advantages, mask, agg=agg)
        loss.backward()
        grads.append(log_prob.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("mode, agg", [("gspo", "token-mean"), ("cispo", "token-mean"), ("cispo", "seq-mean-token-sum")])
def test_micro_batches_with_global_counts_add_up_to_the_whole_batch(mode, agg):
    x = {k: torch.tensor(v) for k, v in VERL["inputs"].items()}
    whole = x["log_prob"].clone().requires_grad_(True)
    counts = dict(global_token_count=int(x["response_mask"].sum()), global_seq_count=6)
    loss, _ = _loss(mode, x["old_log_prob"], whole, x["advantages"], x["response_mask"], agg=agg,
                    weights=x["rollout_is_weights"], **counts)
    loss.backward()
    parts = x["log_prob"].clone().requires_grad_(True)
    total = 0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = _loss(mode, x["old_log_prob"][rows], parts[rows], x["advantages"][rows], x["response_mask"][rows],
                        agg=agg, weights=x["rollout_is_weights"][rows], **counts)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(parts.grad, whole.grad)


def test_an_unknown_mode_is_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="vanilla, gspo, cispo"):
        _loss("sapo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert POLICY_LOSS_MODES == ("vanilla", "gspo", "cispo")


BASE = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]


def test_the_loss_mode_is_verls_key_and_a_mode_klppo_lacks_is_refused_naming_the_ones_it_has():
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    with pytest.raises(UserError, match="'vanilla', 'gspo', 'cispo'"):
        load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"])


def test_bypass_mode_with_another_loss_mode_is_refused_naming_both_keys():
    bypass = [*BASE, "actor_rollout_ref.rollout.name=offline", "algorithm.rollout_correction.bypass_mode=true"]
    with pytest.raises(UserError, match="policy_loss.loss_mode = 'cispo' with algorithm.rollout_correction.bypass_mode"):
        load_ppo_config(None, [*bypass, "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"])
    load_ppo_config(None, bypass)  # vanilla: bypass mode's own loss
