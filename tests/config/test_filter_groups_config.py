"""algorithm.filter_groups and data.gen_batch_size: verl's keys and defaults, compiled, and the combinations refused."""

import pytest

from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.run.settings import FilterGroupsSettings, compile_ppo

FG = "algorithm.filter_groups"
REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4"]
DAPO = ["algorithm.adv_estimator=grpo", f"{FG}.enable=true"]


def load(*overrides, notes=None):
    return load_ppo_config(None, REQUIRED + list(overrides), notes=notes)


def problems_of(*overrides) -> str:
    with pytest.raises(UserError) as caught:
        load(*overrides)
    return str(caught.value)


def test_keys_and_defaults_are_verls_and_the_generation_batch_is_the_step_batch():
    cfg = load()
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches, fg.max_inflight_gen_batches) == (False, "reward", 0, 1)
    assert cfg.data.gen_batch_size == 8  # null: data.train_batch_size
    assert compile_ppo(cfg, 1).filter_groups is None


@pytest.mark.parametrize("metric", ["reward", "score", "seq_reward", "seq_final_reward"])
def test_dynamic_sampling_compiles_into_its_sizes(metric):
    s = compile_ppo(load(*DAPO, f"{FG}.metric={metric}", "data.gen_batch_size=12", f"{FG}.max_num_gen_batches=3"), 1)
    assert s.filter_groups == FilterGroupsSettings(prompts=8, gen_batch_prompts=12, max_gen_batches=3)
    assert s.advantage.grouped
    assert compile_ppo(load(*DAPO, f"{FG}.max_num_gen_batches=0"), 1).filter_groups.max_gen_batches is None
    assert compile_ppo(load(*DAPO, f"{FG}.max_num_gen_batches=-1"), 1).filter_groups.max_gen_batches is None


def test_dynamic_sampling_needs_a_group_estimator():
    message = problems_of(f"{FG}.enable=true")  # adv_estimator: gae
    assert f"{FG}.enable needs a group estimator (grpo, rloo, reinforce_plus_plus_baseline, grpo_vectorized, " \
           "rloo_vectorized, opo, grpo_passk, gpg, optimal_token_baseline, tir_optimal_token_baseline), not " \
           "algorithm.adv_estimator = 'gae'" in message and "set algorithm.adv_estimator=grpo" in message


def test_a_reward_component_is_a_metric_as_verls_acc_and_the_score_is_none():
    assert compile_ppo(load(*DAPO, f"{FG}.metric=acc"), 1).filter_groups.component == "acc"
    assert compile_ppo(load(*DAPO, f"{FG}.metric=exact_match"), 1).filter_groups.component == "exact_match"
    assert compile_ppo(load(*DAPO, f"{FG}.metric=seq_reward"), 1).filter_groups.component is None


def test_the_metrics_klppo_cannot_compute_are_refused_with_the_one_to_use():
    assert f"{FG}.metric = null" in problems_of(*DAPO, f"{FG}.metric=null")
    message = problems_of(*DAPO, f"{FG}.metric=seq_final_reward", "algorithm.use_kl_in_reward=true")
    assert "'seq_final_reward' with algorithm.use_kl_in_reward" in message and f"{FG}.metric=score" in message
    load(*DAPO, f"{FG}.metric=seq_final_reward")  # without the KL penalty it is the score
    message = problems_of(*DAPO, f"{FG}.metric=acc", "reward_model.enable=true", "reward_model.model.path=models/rm")
    assert f"{FG}.metric = 'acc' names an entry of the dict a reward function returns, but reward_model.enable" in message


def test_a_generation_batch_of_its_own_needs_dynamic_sampling_and_prompts():
    message = problems_of("data.gen_batch_size=16")
    assert "data.gen_batch_size = 16 differs from data.train_batch_size = 8 but algorithm.filter_groups.enable " \
           "is false" in message
    assert "data.gen_batch_size = 0 must be > 0" in problems_of(*DAPO, "data.gen_batch_size=0")
    assert f"{FG}.max_inflight_gen_batches = 0 must be >= 1" in problems_of(*DAPO, f"{FG}.max_inflight_gen_batches=0")
    load("data.gen_batch_size=8")  # the step's batch: nothing to object to
    load(*DAPO, "data.gen_batch_size=4")  # smaller than the step's: verl draws on too


def test_inflight_generation_batches_are_accepted_with_a_note_that_they_change_nothing():
    notes: list[str] = []
    load(*DAPO, f"{FG}.max_inflight_gen_batches=4", notes=notes)
    assert any(f"{FG}.max_inflight_gen_batches = 4 has no effect" in note for note in notes), notes
    quiet: list[str] = []
    load(*DAPO, notes=quiet)
    assert not any("filter_groups" in note for note in quiet)


def test_a_generation_batch_must_split_over_the_ranks():
    with pytest.raises(UserError, match="data.gen_batch_size = 6 prompts do not split evenly over the 4 ranks .* multiple of 4"):
        compile_ppo(load(*DAPO, "data.gen_batch_size=6"), world_size=4)


def test_dynamic_sampling_on_one_response_per_prompt_is_refused():
    message = problems_of(*[d for d in DAPO if not d.startswith("actor_rollout_ref.rollout.n=")],
                          "actor_rollout_ref.rollout.n=1")
    assert f"{FG}.enable with actor_rollout_ref.rollout.n = 1: a group of one response never has spread" in message
