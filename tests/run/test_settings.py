"""The PPO config is compiled once into frozen settings; the loop and what it calls read only those."""

import ast
import dataclasses
from pathlib import Path

import pytest

from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.run.settings import compile_ppo

KLPPO = Path(__file__).parents[2] / "klppo"
# The loop and the code under it: they read PPOSettings, never the config.
READS_SETTINGS_ONLY = ["trainer/ppo_trainer.py", "trainer/dynamic_sampling.py", "trainer/forwards.py", "trainer/update.py",
                       "trainer/evaluate.py", "trainer/step_metrics.py", "run/state.py", "safety/guards.py"]


def _config(**changes):
    overrides = {
        "data.train_files": "t.parquet", "actor_rollout_ref.model.path": "m", "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    }
    overrides.update(changes)
    return load_ppo_config(None, [f"{k}={v}" for k, v in overrides.items()])


def test_mini_batches_are_per_rank_and_the_shard_chunk_covers_actor_and_critic():
    s = compile_ppo(_config(**{"critic.ppo_mini_batch_size": 2}), world_size=2)
    assert s.actor.mini_batch_rows == 4 * 4 // 2  # prompts x responses / ranks
    assert s.critic.mini_batch_rows == 2 * 4 // 2
    assert s.shard_chunk_rows == 8  # gcd of the global mini-batches: 16 (actor) and 8 (critic) rows


def test_token_budgets_apply_only_where_dynamic_batch_sizes_are_on():
    s = compile_ppo(_config(**{"actor_rollout_ref.actor.use_dynamic_bsz": "true",
                               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
                               "critic.use_dynamic_bsz": "false"}), world_size=1)
    assert s.actor.micro.max_tokens == 4096
    assert s.actor.micro.budget_key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    assert s.critic.micro.max_tokens is None and s.forwards.values.max_tokens is None
    off = compile_ppo(_config(), world_size=1)
    assert off.actor.micro.max_tokens is None and off.forwards.old_log_prob.max_tokens is None


def test_forwards_and_critic_follow_the_actors_dynamic_batch_sizes_as_in_verl():
    s = compile_ppo(_config(**{"actor_rollout_ref.actor.use_dynamic_bsz": "true",
                               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
                               "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
                               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 8192}), world_size=1)
    assert s.forwards.old_log_prob.max_tokens == 4096  # verl: ${actor.ppo_max_token_len_per_gpu}
    assert s.forwards.ref.max_tokens == 8192  # set by the user
    assert s.critic.micro.max_tokens == 32768 and s.forwards.values.max_tokens == 32768  # critic's own budget
    assert s.critic.loss_agg_mode == "seq-mean-token-mean"


def test_critic_free_runs_have_no_critic_settings_and_kl_guards_need_a_reference():
    s = compile_ppo(_config(**{"algorithm.adv_estimator": "grpo"}), world_size=1)
    assert s.critic is None and not s.uses_reference
    assert s.guard.rollback_kl is None and s.guard.early_stop_kl is None
    with_ref = compile_ppo(_config(**{"actor_rollout_ref.actor.use_kl_loss": "true"}), world_size=1)
    assert with_ref.uses_reference and with_ref.guard.rollback_kl == 0.15


def test_sampling_and_validation_sampling_come_from_their_sections():
    s = compile_ppo(_config(**{"actor_rollout_ref.rollout.temperature": 0.7, "data.max_response_length": 33}), 1)
    assert (s.sampling.n, s.sampling.temperature, s.sampling.max_new_tokens, s.sampling.do_sample) == (4, 0.7, 33, True)
    assert (s.val_sampling.n, s.val_sampling.do_sample, s.val_sampling.max_new_tokens) == (1, False, 33)
    assert s.forwards.temperature == s.actor.temperature == 0.7


def test_settings_are_frozen():
    s = compile_ppo(_config(), world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.actor.ppo_epochs = 3


def test_a_mini_batch_that_leaves_a_rank_no_sample_is_refused_with_the_key():
    with pytest.raises(UserError, match=r"actor_rollout_ref.actor.ppo_mini_batch_size = 2 x actor_rollout_ref.rollout.n 1 = 2 samples per "
                       r"mini-batch leave each of the 4 ranks less than one sample .* a multiple of 4 such as 4"):
        compile_ppo(_config(**{"actor_rollout_ref.rollout.n": 1, "data.train_batch_size": 12,
                               "actor_rollout_ref.actor.ppo_mini_batch_size": 2}), world_size=4)


def test_uneven_mini_batches_are_floored_per_rank_and_dealt_in_whole_global_mini_batches():
    # 4 samples per mini-batch over 3 ranks: 1 each (verl floors 4 / 3), so 3 per global mini-batch.
    s = compile_ppo(_config(**{"actor_rollout_ref.rollout.n": 1, "data.train_batch_size": 12,
                               "actor_rollout_ref.actor.ppo_mini_batch_size": 4}), world_size=3)
    assert (s.actor.mini_batch_rows, s.shard_chunk_rows) == (1, 3)


@pytest.mark.parametrize("name", READS_SETTINGS_ONLY)
def test_the_loop_and_its_helpers_never_read_the_config(name):
    tree = ast.parse((KLPPO / name).read_text())
    imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in imports if m.startswith("klppo.config")], name
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"cfg", "actor_rollout_ref", "algorithm", "trainer"} & attributes, name


def test_the_lm_head_settings_reach_the_actor_update_and_the_forwards():
    s = compile_ppo(_config(**{"actor_rollout_ref.model.use_fused_kernels": "false",
                               "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "true",
                               "actor_rollout_ref.actor.entropy_from_logits_chunk_size": 512}), world_size=1)
    assert s.actor.head == s.forwards.head
    assert (s.actor.head.fused, s.actor.head.entropy_chunking, s.actor.head.entropy_chunk_rows) == (False, True, 512)
    assert compile_ppo(_config(), world_size=1).actor.head.fused is None  # on wherever the head allows it


@pytest.mark.parametrize("changes, source", [
    ({}, "on_policy"),  # GRPO-like: one epoch over one mini-batch of the whole step, sampled by the actor
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 4}, "forward"),  # two mini-batches: two optimiser steps
    ({"actor_rollout_ref.actor.ppo_epochs": 2}, "forward"),  # the second epoch's pi_old is not its forward
    # the rewards read pi_old before the update: from the update's forward, run first (one micro-batch)
    ({"algorithm.use_kl_in_reward": "true"}, "update_first"),
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32}, "update_first"),
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16}, "forward"),
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.actor.use_dynamic_bsz": "true",  # 32 x 96 tokens
      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 32 * 96}, "update_first"),
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.actor.use_dynamic_bsz": "true",
      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 32 * 96 - 1}, "forward"),  # may need two
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.actor.fsdp_config.param_offload": "true"}, "forward"),
    ({"algorithm.use_kl_in_reward": "true", "actor_rollout_ref.rollout.name": "vllm"}, "forward"),
    ({"actor_rollout_ref.rollout.name": "offline"}, "forward"),  # recorded responses: their log-probs are compared
    ({"actor_rollout_ref.rollout.name": "offline", "algorithm.use_kl_in_reward": "true"}, "update_first"),
    ({"actor_rollout_ref.rollout.name": "offline", "algorithm.use_kl_in_reward": "true",
      "algorithm.rollout_correction.rollout_is": "token"}, "forward"),
    ({"algorithm.adv_estimator": "gae", "trainer.critic_warmup": 1}, "forward"),  # the actor skips its first update
    ({"algorithm.adv_estimator": "gae"}, "update_first"),  # the values come from the critic's update forward
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 4}, "on_policy"),  # two critic steps
    ({"algorithm.adv_estimator": "gae", "critic.ppo_micro_batch_size_per_gpu": 16}, "on_policy"),  # two critic micros
])
def test_pi_old_comes_from_the_update_only_where_its_one_optimiser_step_is_on_the_sampling_weights(changes, source):
    base = {"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
            "actor_rollout_ref.rollout.name": "hf", "algorithm.use_kl_in_reward": "false",
            "actor_rollout_ref.actor.use_kl_loss": "true", "data.max_prompt_length": 64,
            "data.max_response_length": 32, "algorithm.adv_estimator": "grpo"}
    s = compile_ppo(_config(**{**base, **changes}), world_size=1)
    assert s.actor.on_policy is (source == "on_policy")
    assert s.forwards.update_forwards_first is (source == "update_first")
    assert s.forwards.old_log_prob_from_update is (source != "forward")


def test_ranks_share_the_rows_one_micro_batch_must_hold():
    changes = {"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
               "actor_rollout_ref.rollout.name": "hf", "algorithm.use_kl_in_reward": "true",
               "data.max_prompt_length": 64, "data.max_response_length": 32,
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16}  # a rank's 32 samples, or 16 on 2 ranks
    assert not compile_ppo(_config(**changes), world_size=1).forwards.update_forwards_first
    assert compile_ppo(_config(**changes), world_size=2).forwards.update_forwards_first
