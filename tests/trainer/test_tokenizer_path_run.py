"""verl's actor_rollout_ref.model.tokenizer_path: a model folder without a tokenizer trains with the one
saved elsewhere (checked against the model's embeddings as ever), the critic at the actor's folder reads
the same token ids, and the exported actor carries that tokenizer."""

import shutil

import pytest
from transformers import AutoTokenizer

from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.models.load import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def split_folder(tiny_model_dir, tmp_path):
    """The tiny model's weights in one folder, its tokenizer in another."""
    model, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir, model)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.move(model / name, tokenizer / name)
    return model, tokenizer


def test_a_model_folder_without_a_tokenizer_trains_with_tokenizer_path(ppo_overrides, tiny_model_dir, task_dir,
                                                                        tmp_path):
    model, tokenizer = split_folder(tiny_model_dir, tmp_path)
    with pytest.raises(UserError, match="the tokenizer in"):
        load_tokenizer(str(model))
    records = run_ppo(None, ppo_overrides(tmp_path / "run", **{
        "actor_rollout_ref.model.path": model, "actor_rollout_ref.model.tokenizer_path": tokenizer,
        "critic.model.tokenizer_path": tokenizer, "data.train_files": task_dir / "train.parquet",
        "actor_rollout_ref.rollout.name": "hf", "trainer.total_training_steps": 1}), print_fn=lambda *a, **k: None)
    assert len([r for r in records if "actor/pg_loss" in r]) == 1
    exported = AutoTokenizer.from_pretrained(tmp_path / "run" / "actor_hf")
    assert exported.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_a_tokenizer_path_that_is_no_folder_or_another_critic_tokenizer_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="actor_rollout_ref.model.tokenizer_path = '/nowhere' is not a folder"):
        load_tokenizer(str(tiny_model_dir), tokenizer_path="/nowhere")
    with pytest.raises(UserError, match="critic.model.tokenizer_path = /other: every model of a klppo run reads"):
        load_ppo_config(None, ["data.train_files=t.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}",
                               "actor_rollout_ref.model.tokenizer_path=/tok", "critic.model.tokenizer_path=/other"])
    load_ppo_config(None, ["data.train_files=t.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}",
                           "actor_rollout_ref.model.tokenizer_path=/tok", "critic.model.tokenizer_path=/tok"])
