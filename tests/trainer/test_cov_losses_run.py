"""Clip-Cov and KL-Cov in a run (actor.policy_loss.loss_mode clip_cov / kl_cov): the tokens are
picked over the whole mini-batch, so a run split into micro-batches picks what the unsplit run
picks, and Clip-Cov then trains the same."""

import pytest

import klppo.trainer.update as update
from klppo.commands.main_ppo import run_ppo

KEY = "actor_rollout_ref.actor.policy_loss"
MODES = {
    "clip_cov": {f"{KEY}.clip_cov_ratio": 0.2, f"{KEY}.clip_cov_lb": 0.0, f"{KEY}.clip_cov_ub": 100.0},
    "kl_cov": {f"{KEY}.kl_cov_ratio": 0.2, f"{KEY}.ppo_kl_coef": 1.0},
}
PICK = update.with_cov_tokens


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def _run(ppo_overrides, run_dir, mode, monkeypatch, **changes):
    """The run's records, and each mini-batch's picked tokens (mask of real tokens, picks), in order."""
    picks = []

    def recorded(actor, mini, spans, plan, s, seed):
        out = PICK(actor, mini, spans, plan, s, seed)
        picks.append((out.update_mask.clone(), out.cov_tokens.clone()))
        return out

    monkeypatch.setattr(update, "with_cov_tokens", recorded)
    records = run_ppo(None, ppo_overrides(run_dir, **{f"{KEY}.loss_mode": mode, "actor_rollout_ref.actor.ppo_epochs": 2,
                                                      **MODES[mode], **changes}), print_fn=quiet)
    return records, picks


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_pick_the_tokens_the_whole_mini_batch_picks(mode, ppo_overrides, tmp_path, monkeypatch):
    whole, whole_picks = _run(ppo_overrides, tmp_path / "whole", mode, monkeypatch)
    split, split_picks = _run(ppo_overrides, tmp_path / "split", mode, monkeypatch,
                              **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1})
    assert len(whole_picks) == len(split_picks) == 2 * 2 * 2  # steps x epochs x mini-batches
    for (mask, picked), (_, picked_split) in zip(whole_picks, split_picks):
        assert (picked <= mask).all() and picked.sum() == max(1, int(0.2 * int(mask.sum())))
    # both runs pick the same tokens at the same weights: the first mini-batch, and with Clip-Cov, which
    # then trains the same, every one (KL-Cov's penalty has no slope at pi = pi_old: the weights part)
    for (_, a), (_, b) in zip(whole_picks[:1] if mode == "kl_cov" else whole_picks, split_picks):
        assert (a == b).all()
    if mode == "clip_cov":
        for a, b in zip(whole, split):
            for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "critic/vf_loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert whole[0]["actor/pg_clipfrac"] == pytest.approx(0.2, abs=0.01)  # the share of tokens cut
    else:
        assert whole[0]["actor/pg_clipfrac"] == 0.0 and whole[0]["actor/ppo_kl"] > 0  # mean |log ratio|


def test_a_clip_cov_run_resumed_after_a_crash_repeats_the_uninterrupted_run(ppo_overrides, crashed_and_resumed):
    """Clip-Cov's random pick is seeded by data.seed, the step, the epoch and the mini-batch: a resumed
    run cuts the tokens the uninterrupted one cut."""
    changes = {f"{KEY}.loss_mode": "clip_cov", **MODES["clip_cov"], "trainer.total_training_steps": 4,
               "trainer.save_freq": 2}
    full, resumed = crashed_and_resumed(ppo_overrides, changes)
    assert [r["step"] for r in resumed] == [3, 4] and resumed == full[2:]
    assert all(r["actor/pg_clipfrac"] > 0 for r in full)
