"""Keys whose single-string value is a regular expression (LoRA's ``target_modules`` and
``exclude_modules``, matched by peft with ``re.fullmatch``) must compile: one that does not is a
UserError naming the key, checked with the config, before any model loads."""

import pytest

from klppo.config import load_ppo_config, load_rm_config, load_sft_config
from klppo.errors import UserError

PPO = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
SUPERVISED = ["data.train_files=data.parquet", "model.partial_pretrain=models/tiny"]


@pytest.mark.parametrize("loader, required, key", [
    (load_ppo_config, PPO, "actor_rollout_ref.model.target_modules"),
    (load_ppo_config, PPO, "actor_rollout_ref.model.exclude_modules"),
    (load_ppo_config, PPO, "critic.model.target_modules"),
    (load_sft_config, SUPERVISED, "model.exclude_modules"),
    (load_rm_config, SUPERVISED, "model.target_modules"),
])
def test_a_module_regex_that_does_not_compile_names_its_key(loader, required, key):
    rank = key.rsplit(".", 1)[0] + ".lora_rank=8"
    with pytest.raises(UserError) as info:
        loader(None, required + [rank, f"{key}=.*(q|v_proj"])
    message = str(info.value)
    assert f"{key} = '.*(q|v_proj' is not a valid regular expression (missing ), unterminated subpattern" in message
    assert "give a list of module names" in message


def test_module_regexes_that_compile_and_lists_of_names_pass():
    cfg = load_ppo_config(None, PPO + ["actor_rollout_ref.model.lora_rank=8",
                                       r"actor_rollout_ref.model.target_modules=.*\.(q|v)_proj",
                                       "actor_rollout_ref.model.exclude_modules=[lm_head, (odd]"])
    assert cfg.actor_rollout_ref.model.exclude_modules == ["lm_head", "(odd"]  # names, not regexes: no compile


def test_a_bad_regex_is_ignored_while_lora_is_off():
    """Without a rank or an adapter the keys do nothing (verl's rule), as their other checks."""
    assert load_ppo_config(None, PPO + ["actor_rollout_ref.model.target_modules=(q"]).actor_rollout_ref.model
