"""Validation: derived defaults, required keys, sizes, ranges and the knobs of later work."""

import pytest

from klppo.config import PPOConfig, load_ppo_config, load_sft_config
from klppo.errors import UserError

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
SFT_REQUIRED = ["data.train_files=sft.parquet", "model.partial_pretrain=models/tiny"]
ACTOR = "actor_rollout_ref.actor"


def load(*overrides: str) -> PPOConfig:
    return load_ppo_config(None, REQUIRED + list(overrides))


def problems_of(*overrides: str, required: bool = True) -> list[str]:
    """The problem lines of the UserError (the summary line dropped)."""
    with pytest.raises(UserError) as info:
        load_ppo_config(None, (REQUIRED if required else []) + list(overrides))
    return _problem_lines(str(info.value), "config (defaults)")


def _problem_lines(message: str, where: str) -> list[str]:
    """One problem is one line ending in "(in <where>...)"; several follow a summary line."""
    summary, *lines = message.splitlines()
    if not lines:
        problem, _, suffix = summary.rpartition(" (in ")
        assert suffix.startswith(where), summary
        return [problem]
    assert summary.startswith(where) and summary.endswith(f"has {len(lines)} errors:"), summary
    return [line.removeprefix("  - ") for line in lines]


def sft_problems_of(*overrides: str) -> list[str]:
    with pytest.raises(UserError) as info:
        load_sft_config(None, SFT_REQUIRED + list(overrides))
    return _problem_lines(str(info.value), "config (defaults)")


# ---- derived defaults ----


def test_derived_defaults_are_resolved_from_their_sources():
    cfg = load(f"{ACTOR}.clip_ratio=0.1", "data.max_response_length=128", f"{ACTOR}.ppo_mini_batch_size=32",
               f"{ACTOR}.ppo_epochs=2", "trainer.project_name=p", "trainer.experiment_name=e")
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.1
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.1
    assert cfg.actor_rollout_ref.rollout.response_length == 128
    assert cfg.critic.ppo_mini_batch_size == 32
    assert cfg.critic.ppo_epochs == 2
    assert cfg.critic.model.path == "models/tiny"
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"


def test_explicit_values_are_kept_over_derived_defaults():
    cfg = load(f"{ACTOR}.clip_ratio_high=0.28", "critic.model.path=models/critic", "trainer.default_local_dir=out",
               "actor_rollout_ref.rollout.response_length=64")
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.critic.model.path == "models/critic"
    assert cfg.trainer.default_local_dir == "out"
    assert cfg.actor_rollout_ref.rollout.response_length == 64


def test_fsdp_strategy_is_kept_as_written():
    assert load(f"{ACTOR}.strategy=fsdp").actor_rollout_ref.actor.strategy == "fsdp"


# ---- required keys ----


def test_train_files_and_model_path_are_required():
    problems = problems_of(required=False)
    assert problems[0].startswith("data.train_files is required")
    assert problems[1].startswith("actor_rollout_ref.model.path is required")


def test_sft_needs_train_files_and_partial_pretrain():
    with pytest.raises(UserError) as info:
        load_sft_config(None)
    assert "data.train_files is required" in str(info.value)
    assert "model.partial_pretrain is required" in str(info.value)


# ---- batch sizes ----


def mini_batch_warnings(*overrides: str) -> list[str]:
    notes: list[str] = []
    load_ppo_config(None, REQUIRED + list(overrides), notes=notes)
    return [n for n in notes if "ppo_mini_batch_size" in n]


def test_mini_batch_not_dividing_the_batch_trains_as_verl_does_with_a_warning():
    # verl's split leaves a smaller last mini-batch: 96 prompts in 40s are 40, 40 and 16.
    assert mini_batch_warnings("data.train_batch_size=96", f"{ACTOR}.ppo_mini_batch_size=40") == [
        f"warning: {ACTOR}.ppo_mini_batch_size = 40 trains a step of 96 samples as 2 mini-batches of 40 samples "
        "and one of 16, as verl does; 48 would make them equal"
    ]  # the critic's copy of the actor's size is not reported twice


def test_mini_batch_samples_not_splitting_over_the_ranks_are_floored_as_verl_floors_them():
    # 64 prompts x 5 over 24 ranks: 13 samples each, 312 per mini-batch; 192 x 5 = 960 = 3 x 312 + 24.
    warnings = mini_batch_warnings("data.train_batch_size=192", f"{ACTOR}.ppo_mini_batch_size=64",
                                   "actor_rollout_ref.rollout.n=5", "trainer.n_gpus_per_node=8", "trainer.nnodes=3")
    assert warnings == [
        f"warning: {ACTOR}.ppo_mini_batch_size = 64 trains a step of 960 samples as 3 mini-batches of 312 samples "
        "and one of 24 (64 x actor_rollout_ref.rollout.n 5 = 320 samples do not split evenly over the 24 ranks: "
        "each takes 13, as verl's workers floor it), as verl does; 96 would make them equal"
    ]


def test_even_mini_batches_bring_no_warning():
    assert mini_batch_warnings("data.train_batch_size=96", f"{ACTOR}.ppo_mini_batch_size=32",
                               "trainer.n_gpus_per_node=4") == []


def test_a_mini_batch_larger_than_the_step_is_an_error():
    assert problems_of("data.train_batch_size=32", f"{ACTOR}.ppo_mini_batch_size=64") == [
        f"{ACTOR}.ppo_mini_batch_size = 64 is larger than data.train_batch_size = 32 (prompts per step); "
        "set it to 32 or less"
    ]


def test_micro_batch_must_divide_the_mini_batch_times_n():
    problems = problems_of("data.train_batch_size=64", f"{ACTOR}.ppo_mini_batch_size=16",
                           "actor_rollout_ref.rollout.n=3", f"{ACTOR}.ppo_micro_batch_size_per_gpu=5",
                           "critic.ppo_micro_batch_size_per_gpu=12")
    assert problems == [
        f"{ACTOR}.ppo_micro_batch_size_per_gpu = 5 must divide a rank's share of the mini-batch "
        f"({ACTOR}.ppo_mini_batch_size 16 x actor_rollout_ref.rollout.n 3 / 1 rank = 48 samples); "
        "set it to a divisor such as 4"
    ]


def test_micro_batch_dividing_mini_batch_times_n_is_accepted():
    cfg = load("data.train_batch_size=64", f"{ACTOR}.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=3",
               f"{ACTOR}.ppo_micro_batch_size_per_gpu=6")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 6


def test_critic_batch_sizes_are_checked_with_gae_only():
    bad = ["critic.ppo_mini_batch_size=2000", "critic.ppo_micro_batch_size_per_gpu=0"]
    problems = problems_of(*bad)
    assert any(p.startswith("critic.ppo_mini_batch_size = 2000 is larger than data.train_batch_size = 1024")
               for p in problems)
    assert any(p.startswith("critic.ppo_micro_batch_size_per_gpu = 0 must be > 0") for p in problems)
    load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", *bad)


def test_log_prob_micro_batches_must_be_positive():
    problems = problems_of("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-2")
    assert [p.split(" =")[0] for p in problems] == [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ]


def test_sft_micro_batch_must_divide_the_batch():
    problems = sft_problems_of("data.train_batch_size=10", "data.micro_batch_size_per_gpu=4")
    assert problems == ["data.micro_batch_size_per_gpu = 4 must divide data.train_batch_size = 10; set it to a divisor such as 2"]


# ---- ranges ----


@pytest.mark.parametrize("override, key", [
    (f"{ACTOR}.clip_ratio=1.0", f"{ACTOR}.clip_ratio"),
    (f"{ACTOR}.clip_ratio_low=-0.1", f"{ACTOR}.clip_ratio_low"),
    (f"{ACTOR}.clip_ratio_c=0.5", f"{ACTOR}.clip_ratio_c"),
    ("algorithm.gamma=1.01", "algorithm.gamma"),
    ("algorithm.lam=-0.5", "algorithm.lam"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.rollout.top_k"),
    (f"{ACTOR}.optim.lr=0", f"{ACTOR}.optim.lr"),
    ("critic.optim.lr=-1e-5", "critic.optim.lr"),
    (f"{ACTOR}.ppo_epochs=0", f"{ACTOR}.ppo_epochs"),
    (f"{ACTOR}.grad_clip=0", f"{ACTOR}.grad_clip"),
    ("data.max_prompt_length=0", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length=-1", "actor_rollout_ref.rollout.response_length"),
    ("trainer.save_freq=0", "trainer.save_freq"),
    ("trainer.test_freq=-2", "trainer.test_freq"),
])
def test_out_of_range_value_is_an_error_naming_its_key(override, key):
    problems = problems_of(override)
    assert len(problems) == 1 and problems[0].startswith(f"{key} = ")


def test_greedy_decoding_allows_zero_temperature():
    cfg = load("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.temperature=0")
    assert cfg.actor_rollout_ref.rollout.temperature == 0.0


def test_adaptive_kl_needs_positive_horizon_and_target():
    problems = problems_of("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.target_kl=0")
    assert [p.split(" =")[0] for p in problems] == ["algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl"]
    load("algorithm.kl_ctrl.horizon=0")  # the fixed controller ignores them


def test_resume_path_mode_needs_a_path():
    problems = problems_of("trainer.resume_mode=resume_path")
    assert problems[0].startswith("trainer.resume_mode = 'resume_path' needs trainer.resume_from_path")
    load("trainer.resume_mode=resume_path", "trainer.resume_from_path=checkpoints/x/global_step_10")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized", "opo", "gpg"])
def test_group_estimators_on_one_response_per_prompt_run_as_verl_with_a_warning(estimator):
    # verl's own rollout-correction and LoRA examples run GRPO with n = 1: each response is its own group,
    # its baseline 0, its advantage its score
    notes = []
    load_ppo_config(None, REQUIRED + [f"algorithm.adv_estimator={estimator}"], notes=notes)
    assert [n for n in notes if f"'{estimator}' with actor_rollout_ref.rollout.n = 1" in n and "no baseline" in n]
    notes = []
    load_ppo_config(None, REQUIRED + [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2"],
                    notes=notes)
    assert not [n for n in notes if "rollout.n = 1" in n]


@pytest.mark.parametrize("estimator, why", [("grpo_passk", "margin over the second best"),
                                            ("rloo_vectorized", "nothing would train")])
def test_group_estimators_that_cannot_run_on_one_response_per_prompt_are_refused(estimator, why):
    problems = problems_of(f"algorithm.adv_estimator={estimator}")
    assert len(problems) == 1
    assert "needs actor_rollout_ref.rollout.n >= 2" in problems[0] and why in problems[0]
    load(f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2")


# ---- not supported yet ----


@pytest.mark.parametrize("key", [
    f"{ACTOR}.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.model.use_remove_padding",
    "critic.use_dynamic_bsz",
    "critic.model.use_remove_padding",
    "trainer.balance_batch",
])
def test_packing_and_balancing_knobs_are_accepted(key):
    assert getattr_dotted(load(f"{key}=true"), key) is True


@pytest.mark.parametrize("switch, budget", [
    (f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"),
])
def test_a_token_budget_must_hold_the_longest_sequence(switch, budget):
    lengths = ["data.max_prompt_length=100", "data.max_response_length=200"]
    problems = problems_of(f"{switch}=true", f"{budget}=299", *lengths)
    assert problems == [
        f"{budget} = 299 is smaller than the longest sequence {switch} may meet: data.max_prompt_length + "
        "actor_rollout_ref.rollout.response_length = 300 tokens; raise it to at least 300 (a few times that "
        "packs more sequences per micro-batch)"
    ]
    load(f"{switch}=true", f"{budget}=300", *lengths)
    load(f"{switch}=false", f"{budget}=299", *lengths)  # an unused budget is not checked


def getattr_dotted(obj, key: str):
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


def test_fsdp_options_and_multi_process_worlds_are_accepted():
    load(f"{ACTOR}.fsdp_config.dtype=bfloat16", "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=false",
         "critic.model.fsdp_config.fsdp_size=2", f"{ACTOR}.fsdp_config.offload_policy=true",
         f"{ACTOR}.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true",
         "trainer.n_gpus_per_node=8", "trainer.nnodes=2")


def test_an_fsdp_size_of_the_world_or_more_shards_over_every_rank_as_in_verl_and_one_not_dividing_it_is_refused():
    load(f"{ACTOR}.fsdp_config.fsdp_size=32", "trainer.n_gpus_per_node=8")  # an example's 4 nodes, run on 8 GPUs
    assert problems_of("critic.model.fsdp_config.fsdp_size=3", "trainer.n_gpus_per_node=8") == [
        "critic.model.fsdp_config.fsdp_size = 3 does not divide the 8 ranks (trainer.n_gpus_per_node x trainer.nnodes): "
        "shard groups of 3 cannot cover them; use a divisor such as 2, or -1 to shard over every rank"
    ]


def test_a_reward_model_needs_its_path_and_ranking_needs_groups():
    problems = problems_of("reward_model.enable=true")
    assert len(problems) == 1 and "reward_model.model.path" in problems[0]
    problems = problems_of("reward_model.rank_responses=true", "actor_rollout_ref.rollout.n=1")
    assert len(problems) == 2 and "reward_model.enable" in problems[0] and "rollout.n >= 2" in problems[1]
    cfg = load("reward_model.enable=true", "reward_model.model.path=rm", "reward_model.rank_responses=true")
    assert cfg.actor_rollout_ref.rollout.n == 4  # ranking's default: 4 responses per prompt
    assert load().actor_rollout_ref.rollout.n == 1  # verl's default otherwise


def test_unknown_loggers_are_refused_with_the_nearest_one():
    load("trainer.logger=[console,jsonl,tensorboard,wandb]")
    problems = problems_of("trainer.logger=[console,wandb,tensorbord]")
    assert len(problems) == 1
    assert problems[0].startswith("trainer.logger entry 'tensorbord': unknown logger (did you mean 'tensorboard'?)")


def test_verls_loggers_klppo_lacks_are_dropped_with_one_warning_and_its_old_tracking_is_wandb():
    notes = []  # verl's MLflow example script logs to [console, mlflow]: klppo has that one
    cfg = load_ppo_config(None, REQUIRED + ["trainer.logger=[console,mlflow,swanlab,clearml]"], notes=notes)
    assert cfg.trainer.logger == ["console", "mlflow"]
    assert [n for n in notes if "trainer.logger 'swanlab', 'clearml' has no effect" in n and "metrics.jsonl" in n]
    assert load("trainer.logger=tracking").trainer.logger == ["wandb"]  # verl's deprecated name of its wandb logger
    sft = load_sft_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "trainer.logger=[clearml]"])
    assert sft.trainer.logger == []


def test_sft_refuses_unknown_loggers_and_a_bad_checkpoint_frequency():
    problems = sft_problems_of("trainer.nnodes=2", "trainer.logger=[wandbb]", "trainer.save_freq=0")
    assert len(problems) == 2 and "trainer.save_freq" in problems[0] and "'wandbb'" in problems[1]


# ---- reporting ----


def test_several_errors_are_reported_together_with_a_summary():
    with pytest.raises(UserError) as info:
        load_ppo_config(None, ["actor_rollout_ref.actor.clip_ration=0.3", "data.train_batch_size=abc",
                               "actor_rollout_ref.rollout.top_p=2", "trainer.nnodes=0"])
    lines = str(info.value).splitlines()
    assert lines[0] == "config (defaults) + 4 overrides has 6 errors:"
    text = "\n".join(lines)
    for fragment in ["clip_ration", "data.train_batch_size: expected an integer", "top_p", "trainer.nnodes",
                     "data.train_files is required", "actor_rollout_ref.model.path is required"]:
        assert fragment in text


def test_checks_reading_a_mistyped_key_stay_quiet():
    # The mistyped values keep their defaults (256, 1024), which do not divide 100 and 1000;
    # those checks would only repeat the type errors.
    problems = problems_of("data.train_batch_size=100", f"{ACTOR}.ppo_mini_batch_size=lots")
    assert problems == [f"{ACTOR}.ppo_mini_batch_size: expected an integer, got 'lots' (a string); write a whole number without quotes, e.g. 8"]
    problems = problems_of("data.train_batch_size=many", f"{ACTOR}.ppo_mini_batch_size=1000")
    assert problems == ["data.train_batch_size: expected an integer, got 'many' (a string); write a whole number without quotes, e.g. 8"]


def test_empty_val_files_is_an_error_that_suggests_null():
    problems = problems_of("data.val_files=[]")
    assert problems == ["data.val_files = [] names no file: set it to a Parquet file or a list of them, or to null to turn validation off"]


def test_training_in_float16_is_refused_naming_bfloat16_but_frozen_models_may_use_it():
    lines = problems_of(f"{ACTOR}.fsdp_config.dtype=float16", "critic.model.fsdp_config.dtype=float16")
    assert len(lines) == 2
    assert lines[0].startswith(f"{ACTOR}.fsdp_config.dtype = float16 trains without a gradient scaler")
    assert lines[1].startswith("critic.model.fsdp_config.dtype = float16") and all("bfloat16" in line for line in lines)
    cfg = load("actor_rollout_ref.ref.fsdp_config.dtype=float16", "critic.model.fsdp_config.dtype=float16",
               "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2")  # no critic trains
    assert cfg.actor_rollout_ref.ref.fsdp_config.dtype == "float16"
    assert "model.fsdp_config.dtype = float16" in sft_problems_of("model.fsdp_config.dtype=float16")[0]


def test_the_process_group_timeout_is_verls_nccl_timeout_and_must_be_positive():
    assert load().actor_rollout_ref.nccl_timeout == 600
    assert load("actor_rollout_ref.nccl_timeout=1800").actor_rollout_ref.nccl_timeout == 1800
    assert problems_of("actor_rollout_ref.nccl_timeout=0")[0].startswith("actor_rollout_ref.nccl_timeout = 0 must be > 0")


@pytest.mark.parametrize("override, fix", [
    ("trainer.guard.window=5", "set it to 6 or more"),
    ("trainer.guard.grad_spike=1", "or to null to switch this detector off"),
    ("trainer.guard.grad_spike=.nan", "must be > 1"),  # YAML's NaN: every comparison with it is False
    ("trainer.guard.entropy_collapse=-0.5", "must be > 0"),
    ("trainer.guard.entropy_surge=0", "must be > 0"),
    ("trainer.guard.max_grad_skips=-1", "must be >= 0"),
])
def test_bad_run_health_settings_are_refused_naming_the_key_and_the_fix(override, fix):
    [problem] = problems_of(override)
    key = override.split("=")[0]
    assert problem.startswith(f"{key} = ") and fix in problem


def test_run_health_detectors_are_on_by_default_and_can_be_switched_off():
    guard = load().trainer.guard
    assert (guard.window, guard.grad_spike, guard.max_grad_skips) == (20, 30.0, 3)
    assert (guard.entropy_collapse, guard.entropy_surge, guard.entropy_action) == (0.5, 1.0, "warn")
    off = load("trainer.guard.grad_spike=null", "trainer.guard.entropy_collapse=null",
               "trainer.guard.entropy_surge=null", "trainer.guard.entropy_action=rollback").trainer.guard
    assert (off.grad_spike, off.entropy_collapse, off.entropy_surge, off.entropy_action) == (None, None, None, "rollback")
    assert problems_of("trainer.guard.entropy_action=pause")[0].startswith("trainer.guard.entropy_action")


# ---- sample generations (trainer.rollout_data_dir, validation_data_dir, log_val_generations) ----


def test_generation_folders_and_the_number_shown_are_checked(tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert problems_of("trainer.log_val_generations=-1", f"trainer.rollout_data_dir={a_file}",
                       "trainer.validation_data_dir=' '") == [
        "trainer.log_val_generations = -1 must be >= 0; set it to 0 or more",
        f"trainer.rollout_data_dir = '{a_file}' is a file: set it to the folder that gets a <step>.jsonl file of "
        "responses per step, or to null to write none",
        "trainer.validation_data_dir = ' ' names no folder: set it to the folder that gets a <step>.jsonl file of "
        "responses per step, or to null to write none",
    ]
    cfg = load(f"trainer.rollout_data_dir={tmp_path / 'new'}", "trainer.log_val_generations=3")
    assert (cfg.trainer.rollout_data_dir, cfg.trainer.log_val_generations) == (str(tmp_path / "new"), 3)


def test_verl_0_3_s_name_of_log_val_generations_acts():
    assert load("+trainer.val_generations_to_log_to_wandb=5").trainer.log_val_generations == 5
    assert "set the same knob" in problems_of("+trainer.val_generations_to_log_to_wandb=5",
                                              "trainer.log_val_generations=4")[0]


def test_validation_samples_asked_for_without_validation_data_are_warned_about():
    notes = []
    load_ppo_config(None, REQUIRED + ["trainer.validation_data_dir=val_samples", "trainer.log_val_generations=2"],
                    notes=notes)
    assert notes == ["warning: trainer.validation_data_dir and trainer.log_val_generations show validation's "
                     "responses, but data.val_files is not set, so nothing is validated; set data.val_files (and "
                     "trainer.test_freq) to see them"]
    notes = []
    load_ppo_config(None, REQUIRED + ["trainer.validation_data_dir=v", "data.val_files=val.parquet"], notes=notes)
    assert notes == []


def test_reward_kwargs_load_as_a_mapping_and_without_their_function_are_warned_about():
    cfg = load("custom_reward_function.path=r.py", "+custom_reward_function.reward_kwargs.scale=0.5",
               "+trainer.gold_reward.reward_kwargs.mode=strict")
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 0.5}
    assert cfg.trainer.gold_reward.reward_kwargs == {"mode": "strict"}
    notes = []
    load_ppo_config(None, REQUIRED + ["+custom_reward_function.reward_kwargs.scale=0.5"], notes=notes)
    assert notes == ["warning: custom_reward_function.reward_kwargs has no effect: they are passed to the function "
                     "in custom_reward_function.path, which is not set (the built-in rules take none)"]


def test_the_actors_custom_chat_template_acts_and_the_critics_has_no_effect(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    custom_chat_template: |-\n"
                    "      {% for m in messages %}{{ m.content }}{% endfor %}\n")
    cfg = load_ppo_config(str(path), REQUIRED)
    assert cfg.actor_rollout_ref.model.custom_chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    notes = []
    load_ppo_config(None, REQUIRED + ["critic.model.custom_chat_template=x"], notes=notes)
    assert "critic.model.custom_chat_template=x: no effect in klppo (the critic reads the actor's prompt tokens" in (
        "\n".join(notes))
