"""actor_rollout_ref.rollout: vLLM is an engine of its own (no fallback), verl's engine keys act
with it and are named as having no effect with hf, SGLang falls back to hf with one warning, and
sampling that is not from the policy's softmax is warned about."""

import pytest

from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.run.settings import compile_ppo, engine_load_format

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
ROLLOUT = "actor_rollout_ref.rollout"


def load(*overrides: str) -> tuple[object, list[str]]:
    notes: list[str] = []
    return load_ppo_config(None, REQUIRED + list(overrides), notes=notes), notes


def test_vllm_stays_vllm_and_its_engine_keys_reach_the_settings():
    cfg, notes = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.tensor_model_parallel_size=2",
                      f"{ROLLOUT}.gpu_memory_utilization=0.6", f"{ROLLOUT}.max_num_seqs=64", f"{ROLLOUT}.enforce_eager=true",
                      f"{ROLLOUT}.free_cache_engine=false", f"{ROLLOUT}.load_format=dummy_dtensor", f"{ROLLOUT}.seed=7",
                      "data.max_prompt_length=100", "data.max_response_length=28")
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and notes == []
    engine = compile_ppo(cfg, world_size=4).engine
    assert (engine.tensor_parallel_size, engine.gpu_memory_utilization, engine.max_num_seqs) == (2, 0.6, 64)
    assert (engine.enforce_eager, engine.sleep_between_generations, engine.load_format, engine.seed) == (True, False, "dummy", 7)
    assert engine.max_model_len == 128  # prompt + response, when not set
    assert engine.rows_per_generation == 1024 * 1 * 2 // 4  # a TP group's share of the step's rows


def test_the_engine_dtype_follows_the_actors_compute_dtype_unless_set():
    import torch

    cfg, _ = load(f"{ROLLOUT}.name=vllm", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16")
    assert compile_ppo(cfg, 1).engine.dtype == torch.bfloat16
    cfg, _ = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.dtype=float32", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16")
    assert compile_ppo(cfg, 1).engine.dtype == torch.float32
    assert compile_ppo(load(f"{ROLLOUT}.name=hf")[0], 1).engine is None


def test_a_lora_actor_computing_in_bf16_gets_an_fp32_engine_and_a_warning_where_bf16_is_asked_for():
    import torch

    lora = (f"{ROLLOUT}.name=vllm", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
            "actor_rollout_ref.model.lora_rank=8")
    cfg, notes = load(*lora)
    assert compile_ppo(cfg, 1).engine.dtype == torch.float32 and notes == []  # bf16 would round the merge's update away
    cfg, notes = load(*lora, f"{ROLLOUT}.dtype=bfloat16")
    assert compile_ppo(cfg, 1).engine.dtype == torch.bfloat16
    assert len(notes) == 1 and "loses every update below its resolution" in notes[0]
    cfg, _ = load(f"{ROLLOUT}.name=vllm", "actor_rollout_ref.model.lora_rank=8")
    assert compile_ppo(cfg, 1).engine.dtype == torch.float32  # an fp32 actor: its own dtype


def test_a_tensor_parallel_size_that_does_not_divide_the_ranks_is_an_error_naming_the_key():
    cfg, _ = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.tensor_model_parallel_size=3")
    with pytest.raises(UserError, match="tensor_model_parallel_size=3 does not divide the 2 ranks"):
        compile_ppo(cfg, world_size=2)


@pytest.mark.parametrize("value, expected", [("dummy", "dummy"), ("dummy_dtensor", "dummy"), ("dummy_hf", "dummy"),
                                             ("hf", "auto"), ("dtensor", "auto"), ("safetensors", "safetensors")])
def test_verls_load_formats_map_to_vllms(value, expected):
    assert engine_load_format(value) == expected


@pytest.mark.parametrize("override, words", [
    (f"{ROLLOUT}.tensor_model_parallel_size=0", "must be >= 1"),
    (f"{ROLLOUT}.gpu_memory_utilization=1.5", "must lie in (0, 1]"),
    (f"{ROLLOUT}.max_num_seqs=0", "max_num_seqs = 0 must be >= 1"),
    (f"{ROLLOUT}.max_model_len=64", "shorter than data.max_prompt_length + rollout.response_length = 1024"),
    (f"{ROLLOUT}.logprobs_mode=raw_logits", "logprobs_mode"),
])
def test_engine_keys_that_cannot_work_are_errors_naming_the_key(override, words):
    with pytest.raises(UserError) as info:
        load(f"{ROLLOUT}.name=vllm", override)
    assert words in str(info.value)


def test_rollout_correction_with_vllm_needs_the_engines_log_probs():
    with pytest.raises(UserError, match="calculate_log_probs=true"):
        load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.calculate_log_probs=false", "algorithm.rollout_correction.rollout_is=token")
    _, notes = load(f"{ROLLOUT}.name=vllm", "algorithm.rollout_correction.rollout_is=token")
    assert notes == []  # it acts: the engine is the behaviour policy


def test_engine_keys_set_for_an_hf_rollout_are_named_in_one_warning():
    _, notes = load(f"{ROLLOUT}.name=hf", f"{ROLLOUT}.tensor_model_parallel_size=4", f"{ROLLOUT}.gpu_memory_utilization=0.4")
    assert len(notes) == 1
    assert notes[0].startswith(f"warning: {ROLLOUT}.{{tensor_model_parallel_size, gpu_memory_utilization}} configure "
                               "the vLLM engine and have no effect")
    assert load(f"{ROLLOUT}.name=hf")[1] == []
    assert load(f"{ROLLOUT}.name=hf", f"{ROLLOUT}.tensor_model_parallel_size=2")[1] == []  # verl's default


def test_hf_decoding_reaches_the_settings_sized_for_the_longest_prompt_and_is_named_where_it_decodes_nothing():
    cfg, notes = load(f"{ROLLOUT}.name=hf", f"{ROLLOUT}.hf_decoding=compiled", "data.max_prompt_length=100",
                      "data.max_response_length=28")
    assert notes == []
    decoding = compile_ppo(cfg, world_size=1).hf_decoding
    assert (decoding.mode, decoding.cache_length) == ("compiled", 128)
    _, notes = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.hf_decoding=static")
    assert len(notes) == 1 and "has no effect with actor_rollout_ref.rollout.name = 'vllm'" in notes[0]
    _, notes = load(f"{ROLLOUT}.name=hf", f"{ROLLOUT}.hf_decoding=compiled", f"{ROLLOUT}.generation_weights=sharded")
    assert len(notes) == 1 and "the sharded actor decodes with the dynamic cache" in notes[0]
    assert load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.hf_decoding=auto")[1] == []


@pytest.mark.parametrize("name, engine", [("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")])
def test_sglang_and_trtllm_generate_with_hf_and_one_warning_says_why(name, engine):
    cfg, notes = load(f"{ROLLOUT}.name={name}", f"{ROLLOUT}.temperature=0.7")
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.rollout.temperature == 0.7
    assert len(notes) == 1 and notes[0].startswith(f"warning: {ROLLOUT}.name = '{name}': generating with 'hf'")
    assert f"klppo has no {engine} backend" in notes[0]


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_truncated_or_greedy_online_sampling_is_warned_about_as_a_biased_kl(name):
    for override in (f"{ROLLOUT}.top_p=0.9", f"{ROLLOUT}.top_k=50", f"{ROLLOUT}.do_sample=false"):
        _, notes = load(f"{ROLLOUT}.name={name}", override)
        assert len(notes) == 1 and "not sampled from softmax(logits / T)" in notes[0] and "biased" in notes[0], notes


def test_truncated_sampling_with_rollout_correction_on_vllm_says_why_the_weights_are_biased():
    _, notes = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.top_p=0.9", "algorithm.rollout_correction.rollout_is=token")
    assert len(notes) == 2 and "renormalised over the tokens top_p / top_k keep" in notes[1]


def test_an_offline_run_warns_about_truncated_sampling_only_where_its_kl_probe_samples():
    _, notes = load(f"{ROLLOUT}.name=offline", f"{ROLLOUT}.top_p=0.9", "algorithm.use_kl_in_reward=true")
    assert len(notes) == 1 and "offline KL probe" in notes[0]
    assert load(f"{ROLLOUT}.name=offline", f"{ROLLOUT}.top_p=0.9")[1] == []  # no reference: nothing samples


def test_raw_log_probs_off_temperature_one_are_refused_with_rollout_correction_and_warned_about_otherwise():
    raw = (f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.logprobs_mode=raw_logprobs")
    with pytest.raises(UserError, match="logprobs_mode=processed_logprobs") as info:
        load(*raw, f"{ROLLOUT}.temperature=0.7", "algorithm.rollout_correction.rollout_is=token")
    assert "log softmax(z / T)" in str(info.value)
    with pytest.raises(UserError, match="raw_logprobs"):
        load(*raw, f"{ROLLOUT}.temperature=1.3", "algorithm.rollout_correction.bypass_mode=true")
    _, notes = load(*raw, f"{ROLLOUT}.temperature=0.7")
    assert len(notes) == 1 and "training/rollout_probs_diff_* measure the temperature" in notes[0]
    assert load(*raw, "algorithm.rollout_correction.rollout_is=token")[1] == []  # T = 1: raw is what the trainer scores
    assert load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.temperature=0.7", "algorithm.rollout_correction.rollout_is=token")[1] == []


def test_ignore_eos_acts_on_hf_with_a_warning_that_eos_is_not_sampled():
    cfg, notes = load(f"{ROLLOUT}.name=hf", f"{ROLLOUT}.ignore_eos=true")
    assert len(notes) == 1 and "ignore_eos = true (hf: EOS is not sampled)" in notes[0], notes
    assert compile_ppo(cfg, 1).sampling.ignore_eos
    cfg, _ = load(f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.ignore_eos=true")  # the engine takes it from its settings
    assert not compile_ppo(cfg, 1).sampling.ignore_eos and compile_ppo(cfg, 1).engine.ignore_eos
