"""Load the actor, reference, critic and tokenizer from local Hugging Face folders.

Nothing is fetched from a hub: a path that is not a folder holding a config is a
``UserError`` naming the config key. The critic is ``AutoModelForTokenClassification`` with
one label on the actor's backbone (verl's choice): the backbone weights come from the folder,
the one-output value head is freshly initialised, and the result saves and loads as an
ordinary Hugging Face model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from klppo.errors import UserError


def check_model_folder(path: str, key: str) -> Path:
    """Return ``path`` as a Path if it is a local model folder, else raise naming ``key``."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{key}: model folder '{path}' does not exist; point {key} at a local Hugging Face folder")
    if not (folder / "config.json").is_file():
        raise UserError(
            f"{key}: '{path}' has no config.json, so it is not a Hugging Face model folder; "
            "point it at the folder that save_pretrained wrote"
        )
    return folder


def load_tokenizer(path: str, key: str = "actor_rollout_ref.model.path") -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model, left-padding, with a pad token (EOS if it had none)."""
    folder = check_model_folder(path, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: cannot load a tokenizer from '{path}' ({exc}); save one next to the model") from exc
    if tokenizer.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer in '{path}' has no eos_token; set one and save it again")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise UserError(f"{key}: the tokenizer in '{path}' has no chat_template; prompts are chat messages")
    tokenizer.padding_side = "left"
    return tokenizer


def _causal_lm_config(folder: Path, key: str):
    config = AutoConfig.from_pretrained(folder)
    architectures = config.architectures or []
    if architectures and not any(name.endswith("ForCausalLM") for name in architectures):
        raise UserError(
            f"{key}: '{folder}' holds a {architectures[0]}, not a causal language model (...ForCausalLM)"
        )
    return config


def load_causal_lm(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False
) -> PreTrainedModel:
    """An ``AutoModelForCausalLM`` in fp32 on ``device`` (actor or reference)."""
    folder = check_model_folder(path, key)
    _causal_lm_config(folder, key)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.to(device)


def load_critic(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False, seed: int = 0
) -> PreTrainedModel:
    """A value model: the backbone of ``path`` with a one-output token head (initialised from ``seed``).

    A folder that already is a token-classification model with one label (a saved critic)
    loads as it is.
    """
    folder = check_model_folder(path, key)
    config = AutoConfig.from_pretrained(folder)
    config.num_labels = 1
    # The head must be deterministic: no dropout in front of the value projection.
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_pretrained(folder, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    critic.config.use_cache = False
    return critic.to(device)


def check_same_tokenizer(reference: PreTrainedTokenizerBase, path: str, key: str) -> None:
    """A model scoring the actor's token ids must share the actor's vocabulary."""
    if Path(path).resolve() == Path(reference.name_or_path).resolve():
        return
    other = load_tokenizer(path, key)
    if other.get_vocab() != reference.get_vocab():
        raise UserError(
            f"{key}: the tokenizer in '{path}' differs from the actor's ({len(other)} vs {len(reference)} tokens); "
            "it would read the actor's token ids as other words: use a model trained with the actor's tokenizer"
        )


def load_reward_model(
    path: str, *, key: str, device: torch.device, gradient_checkpointing: bool = False, seed: int = 0
) -> PreTrainedModel:
    """A one-output ``AutoModelForSequenceClassification``: a trained reward model, or (to train
    one) a causal LM's backbone with a fresh score head initialised from ``seed``."""
    folder = check_model_folder(path, key)
    config = AutoConfig.from_pretrained(folder)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(folder, config=config, dtype=torch.float32)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.to(device)
