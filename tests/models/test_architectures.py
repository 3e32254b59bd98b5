"""Model types beyond Qwen2: a critic and a reward model for every causal LM type transformers ships a
backbone of, including the types it gives no token- or sequence-classification class (Gemma 3,
OLMo 2, Granite), and whole runs over them (packed rows with sliding windows, LoRA, bf16)."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from klppo.commands.main_ppo import run_ppo
from klppo.commands.main_rm import run_rm
from klppo.config import load_rm_config
from klppo.models.load import empty_model_for, load_critic, load_reward_model

CPU = torch.device("cpu")
# model type -> its config's keys; the comment says which heads transformers 5.25 lacks for it
TYPES = {
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=8),  # no token classification; sliding layers
    "olmo2": dict(),  # no token classification
    "granite": dict(),  # neither head
    "mistral": dict(sliding_window=8),  # both heads; every layer sliding
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A random-init tiny causal LM of each type, with the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer, out = AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path_factory.mktemp("types")
    folders = {}
    for kind, keys in TYPES.items():
        config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=tokenizer.eos_token_id, **keys)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out / kind)
        for name in TOKENIZER_FILES:
            shutil.copy(tiny_model_dir / name, out / kind / name)
        folders[kind] = out / kind
    return folders


@pytest.mark.parametrize("kind", list(TYPES))
def test_a_critic_and_a_reward_model_load_on_every_backbone_with_its_weights_and_a_fresh_head(model_dirs, kind):
    folder = model_dirs[kind]
    saved = load_file(folder / "model.safetensors")
    for model, head in ((load_critic(str(folder), key="critic.model.path", device=CPU, seed=3), "score"),
                        (load_reward_model(str(folder), key="reward_model.model.path", device=CPU, seed=3), "score")):
        weights = model.state_dict()
        backbone = {k: v for k, v in weights.items() if k.startswith(f"{model.base_model_prefix}.")}
        assert backbone and all(torch.equal(v, saved[k]) for k, v in backbone.items())
        assert getattr(model, head).out_features == 1 and f"{head}.weight" not in saved
        assert model._no_split_modules  # FSDP2 wraps its decoder blocks as it wraps the actor's
        ids = torch.randint(3, 50, (2, 7))
        assert model(input_ids=ids).logits.shape[-1] == 1
    # the sharded load builds the same classes on the meta device
    assert type(empty_model_for("critic", str(folder), key="critic.model.path")) is type(
        load_critic(str(folder), key="critic.model.path", device=CPU))


def test_the_heads_made_for_a_type_are_transformers_generic_heads_on_its_own_base():
    from transformers import GraniteConfig, LlamaConfig
    from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
    from transformers.models.granite.modeling_granite import GranitePreTrainedModel

    from klppo.models.heads import model_class

    critic = model_class(AutoModelForTokenClassification, GraniteConfig)
    scorer = model_class(AutoModelForSequenceClassification, GraniteConfig)
    assert critic.__name__ == "GraniteForTokenClassification" and scorer.__name__ == "GraniteForSequenceClassification"
    assert critic.__mro__[1:3] == (GenericForTokenClassification, GranitePreTrainedModel)
    assert scorer.__mro__[1:3] == (GenericForSequenceClassification, GranitePreTrainedModel)
    assert model_class(AutoModelForTokenClassification, GraniteConfig) is critic  # made once
    # a type with its own heads, and the causal LM, keep transformers' dispatch
    assert model_class(AutoModelForTokenClassification, LlamaConfig) is AutoModelForTokenClassification
    assert model_class(AutoModelForCausalLM, GraniteConfig) is AutoModelForCausalLM


@pytest.mark.parametrize("kind", ["gemma3_text", "granite"])
def test_ppo_with_a_critic_lora_bf16_and_packed_rows_runs_on_types_without_their_heads(
        model_dirs, kind, ppo_overrides, task_dir, tmp_path):
    overrides = ppo_overrides(**{
        "actor_rollout_ref.model.path": model_dirs[kind], "data.train_files": task_dir / "train.parquet",
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.hf_decoding": "static",
        "algorithm.adv_estimator": "gae", "trainer.total_training_steps": 1,
        "actor_rollout_ref.model.use_remove_padding": "true", "critic.model.use_remove_padding": "true",
        "actor_rollout_ref.actor.use_dynamic_bsz": "true", "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.target_modules": "all-linear",
        "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16", "actor_rollout_ref.ref.fsdp_config.dtype": "bfloat16",
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    assert len(records) == 1 and records[0]["critic/vf_loss"] > 0 and "actor/pg_loss" in records[0]
    assert (tmp_path / "run" / "actor_hf" / "config.json").is_file()


def test_a_reward_model_trained_on_a_type_without_the_head_scores_a_ppo_run(
        model_dirs, word_ranking_file, ppo_overrides, task_dir, tmp_path):
    words = word_ranking_file(tmp_path / "words.parquet", 16, 0)
    cfg = load_rm_config(None, [
        f"data.train_files={words}", "data.max_prompt_length=64", "data.max_response_length=16",
        "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", f"model.partial_pretrain={model_dirs['granite']}",
        "optim.lr=3e-3", "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'rm'}",
        "trainer.logger=[]", "trainer.device=cpu"])
    rm = run_rm(cfg, print_fn=quiet)
    overrides = ppo_overrides(**{
        "actor_rollout_ref.model.path": model_dirs["granite"], "data.train_files": task_dir / "train.parquet",
        "actor_rollout_ref.rollout.name": "hf", "trainer.total_training_steps": 1, "reward_model.enable": "true",
        "reward_model.model.path": rm, "reward_model.model.use_remove_padding": "true", "algorithm.adv_estimator": "grpo",
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    assert len(records) == 1 and records[0]["critic/score/mean"] != 0
