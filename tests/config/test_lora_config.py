"""The LoRA keys (verl's ``lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``,
``lora_adapter_path``) of the actor, the critic, SFT and reward-model training are checked before
any model loads, each problem naming its key and the fix."""

import json

import pytest

from klppo.config import load_ppo_config, load_rm_config, load_sft_config
from klppo.config.lora import lora_enabled
from klppo.errors import UserError

PPO = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
SUPERVISED = ["data.train_files=data.parquet", "model.partial_pretrain=models/tiny"]
MODEL = "actor_rollout_ref.model"


def error_of(loader, required, *overrides: str) -> str:
    with pytest.raises(UserError) as info:
        loader(None, required + list(overrides))
    return str(info.value)


def saved_adapter(folder, **config):
    """A folder shaped like PeftModel.save_pretrained's (the weights file is only looked for)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_a_rank_or_an_adapter_turns_lora_on_for_every_trained_model(tmp_path):
    ppo = load_ppo_config(None, PPO + [f"{MODEL}.lora_rank=16", "critic.model.lora_rank=8"])
    assert lora_enabled(ppo.actor_rollout_ref.model) and lora_enabled(ppo.critic.model)
    adapter = saved_adapter(tmp_path / "adapter")
    assert lora_enabled(load_ppo_config(None, PPO + [f"{MODEL}.lora_adapter_path={adapter}"]).actor_rollout_ref.model)
    sft = load_sft_config(None, SUPERVISED + ["model.lora_rank=8", "model.target_modules=[q_proj,v_proj]"])
    assert (sft.model.lora_rank, sft.model.target_modules) == (8, ["q_proj", "v_proj"])
    assert load_rm_config(None, SUPERVISED + ["model.lora_rank=4"]).model.lora_rank == 4
    assert not lora_enabled(load_ppo_config(None, PPO).actor_rollout_ref.model)


def test_a_negative_rank_and_a_non_positive_alpha_are_refused_with_the_fix():
    message = error_of(load_ppo_config, PPO, f"{MODEL}.lora_rank=-1", "critic.model.lora_rank=8",
                       "critic.model.lora_alpha=0")
    assert f"{MODEL}.lora_rank = -1 must be >= 0: 0 trains every parameter" in message
    assert "critic.model.lora_alpha = 0 must be > 0" in message
    assert "model.lora_alpha = 0 must be > 0" in error_of(load_sft_config, SUPERVISED, "model.lora_rank=8",
                                                          "model.lora_alpha=0")
    assert "model.target_modules is empty" in error_of(load_rm_config, SUPERVISED, "model.lora_rank=8",
                                                       "model.target_modules=[]")


def test_the_critic_lora_keys_are_checked_only_when_a_critic_trains():
    cfg = load_ppo_config(None, PPO + ["critic.model.lora_rank=-1", "algorithm.adv_estimator=grpo",
                                       "actor_rollout_ref.rollout.n=2"])
    assert cfg.critic.model.lora_rank == -1


def test_an_adapter_folder_that_peft_did_not_write_is_refused_naming_the_key(tmp_path):
    key = f"{MODEL}.lora_adapter_path"
    assert f"{key} = '{tmp_path / 'none'}' does not exist" in error_of(load_ppo_config, PPO, f"{key}={tmp_path / 'none'}")
    (tmp_path / "empty").mkdir()
    assert "has no adapter_config.json" in error_of(load_ppo_config, PPO, f"{key}={tmp_path / 'empty'}")
    no_weights = saved_adapter(tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    assert "holds no adapter weights" in error_of(load_ppo_config, PPO, f"{key}={no_weights}")
    prefix = saved_adapter(tmp_path / "prefix", peft_type="PREFIX_TUNING")
    assert "holds a PREFIX_TUNING adapter, not LoRA" in error_of(load_ppo_config, PPO, f"{key}={prefix}")
    dora = saved_adapter(tmp_path / "dora", use_dora=True)
    assert "sets use_dora = True (DoRA), which klppo does not support" in error_of(
        load_sft_config, SUPERVISED, f"model.lora_adapter_path={dora}")


def test_a_rank_that_differs_from_the_saved_adapters_is_refused_and_zero_takes_the_adapters(tmp_path):
    adapter = saved_adapter(tmp_path / "adapter")
    message = error_of(load_ppo_config, PPO, f"{MODEL}.lora_rank=16", f"{MODEL}.lora_adapter_path={adapter}")
    assert f"{MODEL}.lora_rank = 16, but the adapter in {MODEL}.lora_adapter_path has rank 8" in message
    assert f"set {MODEL}.lora_rank=8" in message
    for rank in (0, 8):
        load_ppo_config(None, PPO + [f"{MODEL}.lora_rank={rank}", f"{MODEL}.lora_adapter_path={adapter}"])


def test_a_saved_adapter_whose_options_klppo_would_ignore_is_refused_naming_the_file_and_each_option(tmp_path):
    key = f"{MODEL}.lora_adapter_path"
    options = {"bias": "lora_only", "lora_bias": True, "trainable_token_indices": [3, 4],
               "init_lora_weights": "pissa", "use_frobnication": 2}
    for option, value in options.items():
        adapter = saved_adapter(tmp_path / option, **{option: value})
        message = error_of(load_ppo_config, PPO, f"{key}={adapter}")
        assert f"{key}: '{adapter / 'adapter_config.json'}' sets {option} = {value!r} (" in message, option
        assert "which klppo does not support; train a plain LoRA adapter" in message
    both = saved_adapter(tmp_path / "both", bias="all", layers_pattern="layers", layers_to_transform=[0])
    message = error_of(load_ppo_config, PPO, f"{key}={both}")
    assert "sets bias = 'all' (trained biases); layers_pattern = 'layers' (a subset of layers); " \
           "layers_to_transform = [0] (a subset of layers), which" in message


def test_every_option_peft_writes_with_its_default_value_is_accepted(tmp_path):
    from peft import LoraConfig

    adapter = tmp_path / "peft"
    LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj"], fan_in_fan_out=True,
               init_lora_weights="gaussian", task_type="CAUSAL_LM").save_pretrained(str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    load_ppo_config(None, PPO + [f"{MODEL}.lora_adapter_path={adapter}"])


def test_a_regex_of_modules_that_does_not_compile_is_refused_naming_the_key():
    message = error_of(load_ppo_config, PPO, f"{MODEL}.lora_rank=8", f"{MODEL}.exclude_modules=layers\\.(0")
    assert f"{MODEL}.exclude_modules = 'layers\\\\.(0' is not a regular expression" in message
