"""DAPO's soft overlong punishment (verl's dapo reward manager's ``overlong_buffer_cfg``): by hand,
and in a run, where it is added to the reward function's scores (and logged with ``log``)."""

import pytest
import torch

from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.rewards.overlong import OverlongPenalty, overlong_rewards

quiet = lambda *a, **k: None  # noqa: E731
KWARGS = "+reward_model.reward_kwargs"


def test_the_penalty_grows_linearly_through_the_buffer_worked_by_hand():
    # buffer of 4 before 10 tokens: none up to 6 tokens, then -1/4 per token, -factor at 10
    penalty = OverlongPenalty(max_length=10, buffer=4, factor=1.0)
    assert overlong_rewards(torch.tensor([5, 6, 7, 10]), penalty).tolist() == [0.0, 0.0, -0.25, -1.0]
    half = OverlongPenalty(max_length=10, buffer=4, factor=0.5)
    assert overlong_rewards(torch.tensor([8]), half).tolist() == [-0.25]


def test_a_run_adds_the_penalty_to_the_reward_functions_scores_and_logs_it(ppo_overrides, tmp_path):
    plain = run_ppo(None, ppo_overrides(tmp_path / "plain"), print_fn=quiet)
    # data.max_response_length 16: the buffer is the last 12 tokens, so the recorded responses reach into it
    punished = run_ppo(None, ppo_overrides(tmp_path / "punished", **{
        f"{KWARGS}.overlong_buffer_cfg.enable": "true", f"{KWARGS}.overlong_buffer_cfg.len": 12,
        f"{KWARGS}.overlong_buffer_cfg.penalty_factor": 2.0, f"{KWARGS}.overlong_buffer_cfg.log": "true"}),
        print_fn=quiet)
    first, mine = plain[0], punished[0]  # the same rows and scores before any update
    assert mine["reward/overlong_reward/mean"] < 0 < mine["reward/overlong/mean"] <= 1
    assert mine["critic/score/mean"] == pytest.approx(first["critic/score/mean"] + mine["reward/overlong_reward/mean"],
                                                      abs=1e-6)
    assert "reward/overlong_reward/mean" not in first


def test_the_buffer_must_fit_the_length_it_ends_at_and_punishes_only_a_reward_functions_scores():
    from klppo.run.settings import overlong_penalty

    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "data.max_response_length=512",
            f"{KWARGS}.overlong_buffer_cfg.enable=true"]
    with pytest.raises(UserError, match="len = 4096 is longer than data.max_response_length = 512"):
        load_ppo_config(None, base)
    with pytest.raises(UserError, match="len = 1024 is longer than reward_model.reward_kwargs.max_resp_len = 1000"):
        load_ppo_config(None, [*base, f"{KWARGS}.overlong_buffer_cfg.len=1024", f"{KWARGS}.max_resp_len=1000"])
    cfg = load_ppo_config(None, [*base, f"{KWARGS}.overlong_buffer_cfg.len=64"])
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 64
    assert overlong_penalty(cfg) == OverlongPenalty(max_length=512, buffer=64, factor=1.0)
    # beside a reward model it acts as in verl, whose dapo manager hands the model's scores on as they are
    # (verl's FAPO recipe sets both): not at all, with one warning
    notes = []
    cfg = load_ppo_config(None, [*base, f"{KWARGS}.overlong_buffer_cfg.len=64", "reward_model.enable=true",
                                 "reward_model.model.path=rm"], notes=notes)
    assert overlong_penalty(cfg) is None
    assert [n for n in notes if "overlong_buffer_cfg has no effect with reward_model.enable" in n], notes
