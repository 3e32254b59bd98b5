"""verl's whole key list is understood: every key is a klppo field, another spelling of one, or
has a reason it has no effect (or is refused); the typed fields verl scripts set act."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from klppo.config import load_ppo_config
from klppo.config.parse import _field_kinds
from klppo.config.schema import PPOConfig
from klppo.config.verl import (
    ALIASES,
    GLOBAL_MICRO,
    VERL_KEYS_FILE,
    VERL_VERSION,
    reason_for,
    verl_defaults,
)
from klppo.errors import UserError

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
FIELDS = _field_kinds(PPOConfig)
LEAVES = {k: v for k, v in FIELDS.items() if v != "section"}


def load(*overrides: str, notes: list[str] | None = None) -> PPOConfig:
    return load_ppo_config(None, REQUIRED + list(overrides), notes=notes)


def error_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        load(*overrides)
    return str(info.value)


def not_acted_on() -> list[str]:
    return [k for k in verl_defaults() if k not in FIELDS and k not in ALIASES and k not in GLOBAL_MICRO]


# ---- the key list ----


def test_key_list_is_verl_0_9_1_generated_tree_of_about_nine_hundred_keys():
    data = yaml.safe_load(Path(VERL_KEYS_FILE).read_text())
    assert str(data["verl_version"]) == VERL_VERSION == "0.9.1"
    assert 850 <= len(data["keys"]) <= 1000
    assert data["keys"]["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.5
    assert data["keys"]["actor_rollout_ref.actor.use_remove_padding"].startswith("${oc.select:")


def test_every_verl_key_is_a_field_an_alias_or_has_a_reason():
    unexplained = [k for k in not_acted_on() if reason_for(k, LEAVES) is None]
    assert unexplained == []


def test_keys_of_older_releases_that_verl_scripts_set_are_known():
    for key in ("trainer.use_legacy_worker_impl", "reward_model.use_reward_loop", "reward_model.model.use_remove_padding",
                "reward_model.model.fsdp_config.param_offload", "critic.model.fsdp_config.param_offload",
                "reward_model.micro_batch_size_per_gpu", "actor_rollout_ref.rollout.mode",
                "actor_rollout_ref.rollout.multi_turn.format", "reward_model.num_workers", "reward_model.rollout.name"):
        assert key in verl_defaults(), key


def test_every_key_without_effect_set_to_another_value_is_listed_in_one_warning():
    keys = [k for k in not_acted_on() if not reason_for(k, LEAVES)[1]]
    keys = [k for k in keys if not any(other.startswith(k + ".") for other in verl_defaults())]  # leaves only
    notes: list[str] = []
    load(*[f"{k}=set{i}" for i, k in enumerate(keys)], notes=notes)  # unique values: no key copies another's
    assert len(notes) == 1 + len({reason_for(k, LEAVES)[0] for k in keys})  # the summary line, a line per reason
    listed = "\n".join(notes)
    assert [k for i, k in enumerate(keys) if f"{k}=set{i}," not in listed and f"{k}=set{i}: " not in listed] == []


def test_every_refused_key_set_to_another_value_is_an_error_naming_it():
    refused = [k for k in not_acted_on() if reason_for(k, LEAVES)[1]]
    assert "data.custom_cls.path" in refused and len(refused) > 10
    message = error_of(*[f"{k}=__set__" for k in refused])
    assert all(f"{k} = __set__: " in message and "remove the key" in message for k in refused)


def test_verl_default_tree_loads_without_a_warning(tmp_path):
    """verl's whole 0.9.1 default tree, as a user copying its ppo_trainer.yaml has it (interpolations included)."""
    tree: dict = {}
    for key, value in yaml.safe_load(Path(VERL_KEYS_FILE).read_text())["keys"].items():
        node = tree
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / "verl_ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(tree))
    notes: list[str] = []
    cfg = load_ppo_config(str(path), ["actor_rollout_ref.rollout.name=hf", "trainer.logger=console"], notes=notes)
    assert notes == []
    assert cfg.actor_rollout_ref.rollout.response_length == 512  # ${oc.select:data.max_response_length,512}
    assert cfg.critic.ppo_mini_batch_size == 256  # ${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}
    assert cfg.data.seed == 1  # verl's null: klppo's default
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


# ---- defaults that interpolate ----


def test_a_key_left_at_its_interpolated_verl_default_is_not_listed():
    notes: list[str] = []
    load("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_remove_padding=true",
         "actor_rollout_ref.rollout.prompt_length=512", "critic.forward_max_token_len_per_gpu=32768",
         "actor_rollout_ref.rollout.prompt_length=${data.max_prompt_length}", notes=notes)
    assert notes == []


def test_a_copy_that_differs_from_its_klppo_field_is_listed_with_the_field_klppo_reads():
    notes: list[str] = []
    load("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_remove_padding=false", notes=notes)
    assert "actor_rollout_ref.actor.use_remove_padding=false: no effect in klppo (klppo reads " \
           "actor_rollout_ref.model.use_remove_padding, which verl copies here by default)" in notes[1]


def test_oc_select_interpolations_resolve_in_klppo_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("critic:\n  ppo_micro_batch_size_per_gpu: ${oc.select:.ppo_micro_batch_size_per_gpu_x,4}\n"
                    "  loss_agg_mode: ${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}\n"
                    "actor_rollout_ref:\n  actor:\n    loss_agg_mode: seq-mean-token-mean\n")
    cfg = load_ppo_config(str(path), REQUIRED)
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean"


# ---- verl's second spellings and global sizes ----


def test_verl_0_9_1_reward_section_sets_klppo_reward_fields():
    cfg = load("reward.reward_model.enable=true", "reward.reward_model.model_path=rm", "reward.custom_reward_function.path=r.py",
               "reward.reward_model.rollout.response_length=300")
    rm = cfg.reward_model
    assert (rm.enable, rm.model.path, rm.rollout.response_length) == (True, "rm", 300)
    assert cfg.custom_reward_function.path == "r.py"


def test_both_spellings_of_one_knob_with_different_values_is_an_error():
    message = error_of("actor_rollout_ref.actor.optim.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip=2.0")
    assert "actor_rollout_ref.actor.optim.clip_grad = 0.5 and actor_rollout_ref.actor.grad_clip = 2.0 set the same knob" in message


def test_a_second_spelling_left_at_verl_default_leaves_the_klppo_field_alone():
    cfg = load("actor_rollout_ref.actor.optim.clip_grad=1.0", "actor_rollout_ref.actor.grad_clip=0.3")
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.3


# ---- typed fields verl scripts set ----


def test_verl_typed_fields_default_to_verl_defaults():
    cfg = load()
    model, actor = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    assert (model.lora_rank, model.lora_alpha, model.target_modules, model.exclude_modules) == (0, 16, "all-linear", None)
    # klppo's one deliberate difference: the fused head is on wherever the model's head allows it.
    assert (model.use_fused_kernels, model.fused_kernel_options.impl_backend) == (None, "torch")
    assert (actor.entropy_from_logits_with_chunking, actor.entropy_from_logits_chunk_size, actor.entropy_checkpointing) == (False, 2048, False)
    assert cfg.trainer.critic_warmup == 0
    assert dataclasses.asdict(cfg.reward_model.model.fsdp_config) == dataclasses.asdict(cfg.actor_rollout_ref.actor.fsdp_config)


def test_reward_model_lengths_default_to_the_data_lengths():
    cfg = load("data.max_prompt_length=300", "data.max_response_length=200")
    assert (cfg.reward_model.rollout.prompt_length, cfg.reward_model.rollout.response_length) == (300, 200)


def test_critic_warmup_is_kept_and_needs_a_critic():
    assert load("trainer.critic_warmup=3").trainer.critic_warmup == 3
    message = error_of("trainer.critic_warmup=3", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
    assert "trainer.critic_warmup = 3 holds back the actor" in message and "set trainer.critic_warmup=0" in message


def test_lora_keys_are_typed_for_actor_and_critic():
    cfg = load("actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
               "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "critic.model.lora_rank=8")
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (64, 32, ["q_proj", "v_proj"])
    assert cfg.critic.model.lora_rank == 8


def test_fused_kernels_take_the_torch_backend_and_triton_is_a_warning_that_it_changes_nothing():
    assert load("actor_rollout_ref.model.use_fused_kernels=true").actor_rollout_ref.model.use_fused_kernels
    notes = []  # verl's fused-kernel example asks for triton: the same log-probs and entropies, so it runs
    load("actor_rollout_ref.model.fused_kernel_options.impl_backend=triton", notes=notes)
    assert [n for n in notes if "impl_backend = 'triton' has no effect" in n and "torch backend only" in n], notes


# ---- unknown keys ----


def test_unknown_key_in_a_verl_only_section_gets_a_suggestion_from_that_section():
    assert "did you mean 'global_profiler.tool'?" in error_of("global_profiler.toool=nsys")


def test_misplaced_key_names_where_it_lives():
    message = error_of("critic.use_fused_kernels=true")
    assert "did you mean 'critic.model.use_fused_kernels'? 'use_fused_kernels' lives there, not under 'critic'" in message


def test_misplaced_section_is_matched_by_the_keys_it_holds():
    assert "did you mean 'actor_rollout_ref.rollout'?" in error_of("rollout.temperature=0.3")


def test_reward_model_rollout_typo_is_suggested_from_reward_model_rollout():
    assert "did you mean 'reward_model.rollout.name'?" in error_of("reward_model.rollout.nmae=vllm")


def test_a_value_where_verl_has_a_section_is_an_error_and_an_empty_one_is_nothing():
    message = error_of("global_profiler=5", "actor_rollout_ref.rollout.multi_turn=null")
    assert message.startswith("global_profiler: is a section of verl's config, not a value; write its keys under it "
                              "(e.g. global_profiler.tool=...), got 5")


def test_critic_nested_under_actor_rollout_ref_is_an_error_naming_critic_as_a_top_level_section(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    path: m\n  critic:\n    optim:\n      lr: 1e-5\n")
    with pytest.raises(UserError) as info:
        load_ppo_config(str(path), ["data.train_files=t.parquet"])
    assert "unknown key 'actor_rollout_ref.critic': 'critic' is a top-level section, not part of 'actor_rollout_ref'" \
        in str(info.value)
