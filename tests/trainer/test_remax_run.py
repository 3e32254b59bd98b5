"""ReMax (algorithm.adv_estimator=remax) online: each step also decodes one greedy response per
prompt from the weights that sampled, scores it as the samples are scored, and takes that score as
the baseline of the prompt's samples."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.errors import UserError

quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def remax(ppo_overrides, task_dir):
    changes = {"data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
               "algorithm.adv_estimator": "remax", "algorithm.use_kl_in_reward": "false"}
    return lambda run_dir, **more: ppo_overrides(run_dir, **{**changes, **more})


def test_remax_logs_its_greedy_baseline_and_trains(remax, tmp_path, tiny_model_dir):
    records = run_ppo(None, remax(tmp_path / "run"), print_fn=quiet)
    assert [r["step"] for r in records if "critic/reward_baseline/mean" in r] == [1, 2]
    assert all(r["timing_s/gen_max"] > 0 for r in records)
    assert not any(k.startswith("critic/vf_") for k in records[-1])  # no critic
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor_hf").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_greedy_samples_are_their_own_baseline_so_nothing_trains(remax, tmp_path, tiny_model_dir):
    # with rollout.do_sample=false every sample is the greedy response: advantage = score - the same score = 0
    records = run_ppo(None, remax(tmp_path / "run", **{"actor_rollout_ref.rollout.do_sample": "false"}), print_fn=quiet)
    for r in records:
        assert r["critic/reward_baseline/mean"] == pytest.approx(r["critic/score/mean"], abs=1e-6)
        assert r["critic/advantages/max"] == r["critic/advantages/min"] == 0.0
        assert r["actor/pg_loss"] == 0.0


def test_remax_needs_responses_it_can_generate():
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "algorithm.adv_estimator=remax"]
    with pytest.raises(UserError, match="'offline' generates nothing"):
        load_ppo_config(None, base)
    with pytest.raises(UserError, match="cannot rank against the others"):
        load_ppo_config(None, [*base, "actor_rollout_ref.rollout.name=hf", "reward_model.enable=true",
                               "reward_model.model.path=rm", "reward_model.rank_responses=true"])
    load_ppo_config(None, [*base, "actor_rollout_ref.rollout.name=hf"])
