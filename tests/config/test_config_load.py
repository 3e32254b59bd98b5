"""Loading: YAML files, overrides, interpolation, types, unknown keys, formatting."""

from pathlib import Path

import pytest

from klppo.config import PPOConfig, SFTConfig, config_to_dict, format_config, load_ppo_config, load_sft_config
from klppo.errors import UserError

DATA = Path(__file__).parent / "data"
# The two keys without a usable default.
REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]


def load(*overrides: str, notes: list[str] | None = None) -> PPOConfig:
    return load_ppo_config(None, REQUIRED + list(overrides), notes=notes)


def errors_of(*overrides: str, path: str | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_ppo_config(path, REQUIRED + list(overrides))
    return str(info.value)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


# ---- files and overrides ----


def test_defaults_load_when_the_required_keys_are_given():
    cfg = load()
    assert cfg.data.train_files == "train.parquet"
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.critic.optim.lr == 1e-5


def test_user_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_ppo_config(None)


def test_yaml_file_values_are_read_and_overrides_win_over_them(tmp_path):
    path = write(tmp_path, "data:\n  train_batch_size: 64\n  max_prompt_length: 128\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n")
    cfg = load_ppo_config(path, REQUIRED + ["data.max_prompt_length=256"])
    assert cfg.data.train_batch_size == 64
    assert cfg.data.max_prompt_length == 256
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 16


def test_override_of_a_list_replaces_the_list():
    cfg = load("trainer.logger=[console,jsonl]", "data.train_files=[a.parquet, b.parquet]")
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]


def test_override_null_sets_none_and_hydra_plus_prefix_is_accepted():
    cfg = load("data.val_files=val.parquet", "data.val_files=null", "+trainer.val_before_train=False")
    assert cfg.data.val_files is None
    assert cfg.trainer.val_before_train is False


def test_tilde_override_drops_a_key_so_its_default_applies(tmp_path):
    path = write(tmp_path, "data:\n  train_batch_size: 64\n")
    cfg = load_ppo_config(path, REQUIRED + ["~data.train_batch_size"])
    assert cfg.data.train_batch_size == 1024


def test_malformed_override_is_reported():
    assert "override 'data.train_batch_size' is not of the form key.path=value" in errors_of("data.train_batch_size")


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_ppo_config(str(tmp_path / "nope.yaml"))


def test_invalid_yaml_is_a_user_error_on_one_line(tmp_path):
    with pytest.raises(UserError, match="not valid YAML") as info:
        load_ppo_config(write(tmp_path, "data: [unclosed\n"))
    assert "\n" not in str(info.value)


def test_empty_section_in_yaml_means_defaults(tmp_path):
    cfg = load_ppo_config(write(tmp_path, "critic:\nreward_model:\n"), REQUIRED)
    assert cfg.critic.cliprange_value == 0.5


# ---- types ----


def test_float_field_accepts_yaml_string_1e_minus_6(tmp_path):
    path = write(tmp_path, "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n")
    cfg = load_ppo_config(path, REQUIRED + ["critic.optim.lr=2E-5"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.critic.optim.lr == 2e-5


def test_float_field_accepts_an_int_as_a_float():
    cfg = load("actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.optim.betas=[0, 1e-1]")
    assert cfg.actor_rollout_ref.actor.entropy_coeff == 0.0
    assert isinstance(cfg.actor_rollout_ref.actor.entropy_coeff, float)
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.0, 0.1]


def test_string_for_int_is_an_error_that_names_the_key():
    message = errors_of("data.train_batch_size='64'")
    assert "data.train_batch_size: expected an integer, got '64' (a string)" in message


def test_bool_for_int_and_for_float_is_an_error():
    message = errors_of("data.train_batch_size=true", "actor_rollout_ref.actor.clip_ratio=false")
    assert "data.train_batch_size: expected an integer, got true (a boolean)" in message
    assert "actor_rollout_ref.actor.clip_ratio: expected a number, got false (a boolean)" in message


def test_non_numeric_string_for_float_is_an_error():
    assert "actor_rollout_ref.actor.optim.lr: expected a number, got 'fast'" in errors_of("actor_rollout_ref.actor.optim.lr=fast")


def test_wrong_list_element_names_its_index():
    message = errors_of("actor_rollout_ref.actor.optim.betas=[0.9, x]")
    assert "actor_rollout_ref.actor.optim.betas[1]: expected a number" in message


def test_scalar_for_a_list_field_is_an_error_that_shows_a_list():
    message = errors_of("actor_rollout_ref.actor.optim.betas=0.9")
    assert "actor_rollout_ref.actor.optim.betas: expected a list of numbers, got 0.9 (a number)" in message


def test_logger_written_as_one_string_is_a_list_of_one_as_in_verl():
    assert load("trainer.logger=console").trainer.logger == ["console"]


def test_literal_violation_lists_the_choices_and_the_nearest_one():
    message = errors_of("algorithm.adv_estimator=grop")
    assert "algorithm.adv_estimator = 'grop' is not one of 'gae', 'grpo', 'rloo'" in message
    assert "did you mean 'grpo'?" in message


def test_mapping_for_a_value_and_value_for_a_section_are_errors(tmp_path):
    path = write(tmp_path, "trainer:\n  project_name:\n    name: x\ncritic: 3\n")
    message = errors_of(path=path)
    assert "trainer.project_name: expected a string, got a mapping (keys: name)" in message
    assert "critic: is a section, not a value" in message


# ---- unknown keys ----


def test_unknown_key_suggests_the_nearest_key_at_its_level():
    message = errors_of("actor_rollout_ref.actor.clip_ration=0.3")
    assert "unknown key 'actor_rollout_ref.actor.clip_ration'; did you mean 'actor_rollout_ref.actor.clip_ratio'?" in message


def test_misspelled_nested_key_in_a_file_is_reported(tmp_path):
    path = write(tmp_path, "algorithm:\n  kl_ctrl:\n    target_kll: 0.05\n")
    message = errors_of(path=path)
    assert "unknown key 'algorithm.kl_ctrl.target_kll'; did you mean 'algorithm.kl_ctrl.target_kl'?" in message


def test_misspelled_section_is_reported_with_the_section_name():
    message = errors_of("actor_rollout_ref.actr.ppo_epochs=2")
    assert "unknown key 'actor_rollout_ref.actr'; did you mean 'actor_rollout_ref.actor'?" in message


def test_misplaced_key_suggests_its_full_path():
    message = errors_of("actor_rollout_ref.clip_ratio=0.1", "actor_rollout_ref.actor.temperature=0.7")
    assert "unknown key 'actor_rollout_ref.clip_ratio'; did you mean 'actor_rollout_ref.actor.clip_ratio'?" in message
    assert "did you mean 'actor_rollout_ref.rollout.temperature'?" in message


def test_unknown_key_without_a_near_one_lists_the_valid_keys():
    message = errors_of("reward_model.zzzzzzzz=1")
    assert ("unknown key 'reward_model.zzzzzzzz'; valid keys under 'reward_model' are: enable, rank_responses, ranking, "
            "model, micro_batch_size_per_gpu, rollout") in message


# ---- interpolation ----


def test_verl_interpolations_take_the_value_and_type_of_their_target(tmp_path):
    text = (
        "data:\n  max_response_length: 300\n"
        "actor_rollout_ref:\n  rollout:\n    response_length: ${data.max_response_length}\n"
        "trainer:\n  project_name: p\n  default_local_dir: out/${trainer.project_name}/${trainer.experiment_name}\n"
    )
    cfg = load_ppo_config(write(tmp_path, text), REQUIRED + ["data.max_response_length=400"])
    assert cfg.actor_rollout_ref.rollout.response_length == 400
    assert cfg.trainer.default_local_dir == "out/p/run"


def test_interpolation_to_an_unknown_key_or_a_resolver_is_an_error():
    message = errors_of("critic.model.path=${actor_rollout_ref.model.pth}", "data.val_files=${oc.env:HOME}")
    assert "critic.model.path: cannot resolve '${actor_rollout_ref.model.pth}'" in message
    assert "data.val_files: cannot resolve '${oc.env:HOME}'" in message


def test_interpolation_cycle_is_an_error():
    message = errors_of("trainer.project_name=${trainer.experiment_name}", "trainer.experiment_name=${trainer.project_name}")
    assert "interpolation cycle" in message


# ---- whole files and formatting ----


def test_verl_style_gsm8k_config_loads():
    cfg = load_ppo_config(str(DATA / "gsm8k_ppo_verl_style.yaml"))
    arf = cfg.actor_rollout_ref
    assert arf.actor.strategy == "fsdp"
    assert arf.actor.optim.lr == 1e-6
    assert arf.rollout.response_length == 256
    assert cfg.critic.model.path == "~/models/Qwen2.5-0.5B-Instruct"
    assert cfg.critic.ppo_mini_batch_size == 64
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"


def test_sft_config_loads_and_resolves_its_output_folder():
    cfg = load_sft_config(str(DATA / "gsm8k_sft.yaml"))
    assert isinstance(cfg, SFTConfig)
    assert cfg.optim.lr == 1e-5
    assert cfg.optim.betas == [0.9, 0.95]
    assert cfg.trainer.default_local_dir == "checkpoints/gsm8k-sft/qwen-0.5b"


def test_sft_config_reports_unknown_keys_against_the_sft_tree():
    with pytest.raises(UserError, match=r"unknown key 'data.micro_batchsize_per_gpu'; did you mean "
                                        r"'data.micro_batch_size_per_gpu'\?"):
        load_sft_config(str(DATA / "gsm8k_sft.yaml"), ["data.micro_batchsize_per_gpu=4"])
    notes = []  # verl's own SFT trainer never reads data.micro_batch_size: neither does klppo, and says so
    load_sft_config(str(DATA / "gsm8k_sft.yaml"), ["data.micro_batch_size=4"], notes=notes)
    assert "data.micro_batch_size=4: no effect in klppo" in "\n".join(notes)


def test_format_config_round_trips_ppo(tmp_path):
    cfg = load_ppo_config(str(DATA / "gsm8k_ppo_verl_style.yaml"), ["trainer.logger=[console,jsonl]"])
    assert load_ppo_config(write(tmp_path, format_config(cfg))) == cfg


def test_format_config_round_trips_sft(tmp_path):
    cfg = load_sft_config(str(DATA / "gsm8k_sft.yaml"))
    assert load_sft_config(write(tmp_path, format_config(cfg))) == cfg


def test_config_to_dict_is_plain_nested_dicts():
    d = config_to_dict(load())
    assert d["actor_rollout_ref"]["actor"]["optim"]["betas"] == [0.9, 0.999]
    assert type(d["trainer"]) is dict


def test_verl_global_micro_batch_is_divided_over_the_devices_as_verl_does():
    cfg = load("actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.rollout.log_prob_micro_batch_size=32",
               "trainer.n_gpus_per_node=4", "trainer.nnodes=2")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4


def test_verl_global_micro_batch_with_the_per_gpu_one_or_not_dividing_is_an_error():
    message = errors_of("actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                        "critic.ppo_micro_batch_size=6", "trainer.n_gpus_per_node=4")
    assert "keep actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu only" in message
    assert "critic.ppo_micro_batch_size = 6 is verl's global micro-batch, split over" in message
    assert "set critic.ppo_micro_batch_size_per_gpu (samples per device) instead" in message


def test_verl_micro_batches_of_ulysses_groups_become_whole_sequence_ones_with_the_same_tokens_per_device():
    # verl's examples/ppo_trainer/run_deepseek7b_llm_sp2.sh: groups of 2 devices, each holding half of every
    # sequence of a micro-batch; klppo keeps whole sequences, so half as many fill a device as much.
    notes = []
    cfg = load("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64", "critic.model.path=models/tiny",
               "critic.ulysses_sequence_parallel_size=2", "critic.ppo_micro_batch_size_per_gpu=64",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
               "data.train_batch_size=1024", "trainer.n_gpus_per_node=8", notes=notes)
    arf = cfg.actor_rollout_ref
    assert (arf.actor.ppo_micro_batch_size_per_gpu, arf.rollout.log_prob_micro_batch_size_per_gpu) == (16, 32)
    assert (arf.ref.log_prob_micro_batch_size_per_gpu, cfg.critic.ppo_micro_batch_size_per_gpu) == (1, 32)  # ref: the actor's size
    text = "\n".join(notes)
    assert ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: no effect in klppo (Ulysses sequence parallelism: "
            "klppo keeps whole sequences on each device, so its micro-batches hold 1/2 as many") in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu 32 -> 16" in text
    assert "critic.ppo_micro_batch_size_per_gpu 64 -> 32" in text


def test_ulysses_sizes_of_each_role_and_spelling_size_only_that_roles_micro_batches():
    cfg = load("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
               "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
               "critic.model.path=models/tiny", "critic.ppo_micro_batch_size_per_gpu=8")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2  # verl 0.9.1's spelling
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 8  # the reference runs without groups
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 8  # the critic has its own size, unset


def test_a_global_micro_batch_under_ulysses_is_divided_over_every_device_once():
    # verl: 16 // (8 devices / 2) = 4 sequences per group of 2 = 2 per device, which klppo's division gives
    cfg = load("actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
               "trainer.n_gpus_per_node=8")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2


def test_verl_sft_micro_batch_of_a_ulysses_group_becomes_a_whole_sequence_one():
    notes = []
    cfg = load_sft_config(str(DATA / "gsm8k_sft.yaml"), ["data.micro_batch_size_per_gpu=8", "ulysses_sequence_parallel_size=2"],
                          notes=notes)
    assert cfg.data.micro_batch_size_per_gpu == 4
    assert "ulysses_sequence_parallel_size=2: no effect in klppo (Ulysses sequence parallelism" in "\n".join(notes)
    assert "data.micro_batch_size_per_gpu 8 -> 4" in "\n".join(notes)


def test_numbers_with_an_exponent_and_no_point_are_floats_as_in_verl_in_files_and_overrides(tmp_path):
    # YAML 1.1 reads 1e-6 as a string; OmegaConf and Hydra, so verl, read a float. Typed fields coerced it
    # anyway; the open mappings handed a string on (to the optimiser, to the user's reward function).
    path = write(tmp_path, "custom_reward_function:\n  reward_kwargs: {threshold: 1e-3, scale: -2E+1, tag: 1e-3x}\n")
    cfg = load_ppo_config(path, REQUIRED + ["+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-6",
                                            "actor_rollout_ref.actor.optim.lr=5e-7"])
    assert cfg.custom_reward_function.reward_kwargs == {"threshold": 1e-3, "scale": -20.0, "tag": "1e-3x"}
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config == {"eps": 1e-6}
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-7


def test_an_optimizer_argument_the_optimizer_does_not_take_is_an_error_naming_what_it_takes():
    message = errors_of("+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1.",
                        "+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-6")
    assert ("actor_rollout_ref.actor.optim.override_optimizer_config: torch.optim.AdamW takes no argument "
            "'optimizer_offload_fraction'; remove it (it takes lr, betas, eps, weight_decay, amsgrad") in message
    assert "'eps'" not in message


def test_megatrons_optimizer_settings_have_no_effect_when_megatron_trains_with_fsdp2():
    # verl's deepseek671b/qwen3-235b megatron scripts: these go to Megatron's optimizer, which klppo does not have
    notes = []
    cfg = load("actor_rollout_ref.actor.strategy=megatron",
               "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1.",
               "+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=True",
               "+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-6", notes=notes)
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config == {"eps": 1e-6}  # AdamW's own acts
    (warning,) = [n for n in notes if "'megatron': training with FSDP2" in n]
    assert warning.endswith("nor do its optimizer's settings actor_rollout_ref.actor.optim.override_optimizer_config."
                            "optimizer_offload_fraction, actor_rollout_ref.actor.optim.override_optimizer_config."
                            "use_precision_aware_optimizer")


# ---- an open mapping: data.apply_chat_template_kwargs ----


def test_chat_template_kwargs_take_verl_s_plus_form_a_mapping_or_a_yaml_section(tmp_path):
    assert load().data.apply_chat_template_kwargs == {}
    assert load("+data.apply_chat_template_kwargs.enable_thinking=False").data.apply_chat_template_kwargs == {
        "enable_thinking": False}
    both = load("data.apply_chat_template_kwargs={reasoning_effort: medium, tools: [a, b]}",
                "+data.apply_chat_template_kwargs.enable_thinking=false")
    assert both.data.apply_chat_template_kwargs == {"reasoning_effort": "medium", "tools": ["a", "b"],
                                                     "enable_thinking": False}
    path = write(tmp_path, "data:\n  apply_chat_template_kwargs:\n    enable_thinking: false\n")
    assert load_ppo_config(path, REQUIRED).data.apply_chat_template_kwargs == {"enable_thinking": False}
    empty = write(tmp_path, "data:\n  apply_chat_template_kwargs:\n")
    assert load_ppo_config(empty, REQUIRED).data.apply_chat_template_kwargs == {}
    cfg = load("+data.apply_chat_template_kwargs.enable_thinking=False")
    assert load_ppo_config(write(tmp_path, format_config(cfg))) == cfg  # the resolved config round-trips


def test_chat_template_kwargs_that_are_not_a_mapping_or_that_klppo_sets_itself_are_errors():
    assert ("data.apply_chat_template_kwargs: expected a mapping of names to values, got 3 (an integer); write a "
            "YAML mapping, e.g. {name: value}, or set one entry with data.apply_chat_template_kwargs.<name>=value"
            in errors_of("data.apply_chat_template_kwargs=3"))
    message = errors_of("+data.apply_chat_template_kwargs.tokenize=true",
                        "+data.apply_chat_template_kwargs.chat_template=x")
    assert "data.apply_chat_template_kwargs.tokenize: klppo sets this argument of apply_chat_template itself" in message
    assert "data.apply_chat_template_kwargs.chat_template: klppo renders prompts with the chat template saved" in message


def test_sft_and_reward_model_training_take_chat_template_kwargs_too():
    from klppo.config import load_rm_config

    sft = load_sft_config(str(DATA / "gsm8k_sft.yaml"), ["+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert sft.data.apply_chat_template_kwargs == {"enable_thinking": False}
    rm = load_rm_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m",
                               "+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert rm.data.apply_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(UserError, match="data.apply_chat_template_kwargs.add_generation_prompt: klppo sets"):
        load_sft_config(str(DATA / "gsm8k_sft.yaml"), ["+data.apply_chat_template_kwargs.add_generation_prompt=true"])
