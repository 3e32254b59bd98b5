"""verl's policy loss modes beside vanilla PPO: GSPO (sequence-level ratios), CISPO (clipped,
detached importance weights on REINFORCE), SAPO (a smooth gate on the ratio), GPG (the plain
policy gradient) and GMPO (geo_mean: the geometric mean of a sequence's clipped ratios), against
verl's own functions on seeded tensors
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


def _loss(mode, old, new, advantages, mask, *, low=0.2, high=0.28, agg="token-mean", weights=None, taus=(1.0, 1.05),
          **counts):
    return compute_policy_loss_of_mode(mode, old, new, advantages, mask, clip_ratio_low=low, clip_ratio_high=high,
                                       clip_ratio_c=3.0, loss_agg_mode=agg, tau_pos=taus[0], tau_neg=taus[1],
                                       rollout_is_weights=weights, **counts)


@pytest.mark.parametrize("name", sorted(VERL["cases"]))
def test_loss_gradient_and_metrics_equal_verls(name):  # verl's gpg logs no metrics; the others compare
    case, x = VERL["cases"][name], {k: torch.tensor(v) for k, v in VERL["inputs"].items()}
    log_prob = x["log_prob"].clone().requires_grad_(True)
    loss, stats = _loss(case["mode"], x["old_log_prob"], log_prob, x["advantages"], x["response_mask"],
                        low=case["clip_ratio_low"], high=case["clip_ratio_high"], agg=case["loss_agg_mode"],
                        weights=x["rollout_is_weights"] if case["weighted"] else None,
                        taus=(case["tau_pos"], case["tau_neg"]), global_seq_count=case["global_seq_count"])
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


def test_sapo_gates_the_ratio_smoothly_worked_by_hand():
    # one token, ratio 1.5, A = +1 (tau_pos 2) and A = -1 (tau_neg 4): loss -A sigmoid(tau (r - 1)) 4 / tau, and
    # d loss / d log pi = -A r sigmoid'(tau (r - 1)) 4, which is -A at r = 1 and fades as r leaves 1
    old = torch.zeros(2, 1)
    new = torch.full((2, 1), math.log(1.5), requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.bool)
    advantages = torch.tensor([[1.0], [-1.0]])
    loss, stats = _loss("sapo", old, new, advantages, mask, taus=(2.0, 4.0))
    loss.backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert loss.item() == pytest.approx((-sig(1.0) * 2 + sig(2.0) * 1) / 2)
    want = [-1.5 * sig(1.0) * (1 - sig(1.0)) * 4 / 2, 1.5 * sig(2.0) * (1 - sig(2.0)) * 4 / 2]
    torch.testing.assert_close(new.grad[:, 0], torch.tensor(want))
    assert abs(want[0]) < 1.5 / 2  # below PPO's unclipped -A r / 2: the gate has begun to close
    assert stats["actor/pg_clipfrac"].item() == stats["actor/pg_clipfrac_lower"].item() == 0.0


def test_gpg_is_the_plain_policy_gradient_whatever_the_ratio():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(5.0), -1.0]], requires_grad=True)  # a ratio of 5 is neither clipped nor weighted
    loss, stats = _loss("gpg", old, new, torch.tensor([[2.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * (math.log(5.0) - 1.0) / 2)
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, -1.0]]))
    assert stats["actor/ppo_kl"].item() == pytest.approx(-(math.log(5.0) - 1.0) / 2)


def test_geo_mean_clips_each_token_in_log_space_then_takes_the_geometric_mean_worked_by_hand():
    # sequence 0 (A = +1): log-ratios 0.5 (clipped to high 0.2) and -0.1 -> ratio exp((0.2 - 0.1) / 2);
    # sequence 1 (A = -1): log-ratios -0.5 (clipped to -low = -0.3) and 0.1 -> ratio exp((-0.3 + 0.1) / 2)
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.5, -0.1], [-0.5, 0.1]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = _loss("geo_mean", old, new, advantages, mask, low=0.3, high=0.2)
    loss.backward()
    r0, r1 = math.exp(0.05), math.exp(-0.1)
    assert loss.item() == pytest.approx((-r0 + r1) / 2)
    # a clipped token passes no gradient; the others d/d log pi of -A_seq exp(mean) / 2 sequences
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -r0 / 4], [0.0, r1 / 4]]))
    assert stats["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    assert stats["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    new.grad = None  # a log-ratio past the bound on the side that helps the sequence is not clipped (pessimism)
    _loss("geo_mean", old, new, -advantages, mask, low=0.3, high=0.2)[0].backward()
    assert new.grad[0, 0] != 0 and new.grad[1, 0] != 0


@pytest.mark.parametrize("mode", ["gspo", "cispo", "sapo", "gpg", "geo_mean"])
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


@pytest.mark.parametrize("mode, agg", [("gspo", "token-mean"), ("cispo", "token-mean"), ("cispo", "seq-mean-token-sum"),
                                       ("sapo", "token-mean"), ("gpg", "seq-mean-token-mean"), ("geo_mean", "token-mean")])
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
    with pytest.raises(ValueError, match="vanilla, gspo, cispo, sapo, gpg, geo_mean"):
        _loss("clip_cov", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert POLICY_LOSS_MODES == ("vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean")


BASE = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]


def test_the_loss_mode_is_verls_key_and_a_mode_klppo_lacks_is_refused_naming_the_ones_it_has():
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    with pytest.raises(UserError, match="'vanilla', 'gspo', 'cispo', 'sapo', 'gpg', 'geo_mean', 'clip_cov', 'kl_cov'"):
        load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=dro"])
    with pytest.raises(UserError, match="did you mean 'gspo'"):
        load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=gpso"])


def test_sapos_temperatures_are_verls_actor_keys_and_must_be_positive():
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                                 "actor_rollout_ref.actor.tau_pos=2.0"])
    assert (cfg.actor_rollout_ref.actor.tau_pos, cfg.actor_rollout_ref.actor.tau_neg) == (2.0, 1.05)
    with pytest.raises(UserError, match="actor_rollout_ref.actor.tau_neg = 0.0 must be > 0"):
        load_ppo_config(None, [*BASE, "actor_rollout_ref.actor.tau_neg=0"])


def test_bypass_mode_with_another_loss_mode_is_refused_naming_both_keys():
    bypass = [*BASE, "actor_rollout_ref.rollout.name=offline", "algorithm.rollout_correction.bypass_mode=true"]
    with pytest.raises(UserError, match="policy_loss.loss_mode = 'cispo' with algorithm.rollout_correction.bypass_mode"):
        load_ppo_config(None, [*bypass, "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"])
    load_ppo_config(None, bypass)  # vanilla: bypass mode's own loss
