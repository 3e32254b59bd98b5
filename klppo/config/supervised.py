"""The config trees of supervised training: ``klppo sft`` (verl's fsdp_sft_trainer key names) and
``klppo rm`` (reward-model training from ranked responses). The PPO tree is in ``schema``, whose
conventions these follow (a comment above each field, ``None`` = derived).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from klppo.config.schema import FSDPConfig, LoraKeys, OptimConfig


# ---- SFT (verl's fsdp_sft_trainer names) ----


@dataclass
class SFTMultiturnConfig:
    # Train on whole conversations instead of prompt and response columns: the loss on every
    # assistant turn (klppo.data.multiturn_sft, verl's multi-turn SFT dataset).
    enable: bool = False
    # Column of each row's conversation (a list of {role, content} messages).
    messages_key: str = "messages"
    # Column of a row's tool schemas, handed to the chat template (rows without it: no tools).
    tools_key: str = "tools"
    # Column of a row's enable_thinking flag, handed to the chat template (rows without it: none).
    enable_thinking_key: str = "enable_thinking"


@dataclass
class SFTDataConfig:
    # Parquet file(s) with a prompt and a response column.
    train_files: Union[str, list[str]] = ""
    # Parquet file(s) for validation loss; None disables it.
    val_files: Optional[Union[str, list[str]]] = None
    # Column of the prompt: chat messages or a plain string.
    prompt_key: str = "prompt"
    # Extra arguments to the chat template when it renders chat-message prompts (as verl passes
    # them), e.g. {enable_thinking: false} for Qwen3 or {reasoning_effort: medium} for gpt-oss.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Column of the response string.
    response_key: str = "response"
    # verl's keys into a dict-valued prompt / response column, in order: prompt_key=extra_info with
    # prompt_dict_keys=[question] reads each row's extra_info.question. null: the column itself.
    prompt_dict_keys: Optional[list[str]] = None
    response_dict_keys: Optional[list[str]] = None
    # Whole conversations instead of prompt and response columns.
    multiturn: SFTMultiturnConfig = field(default_factory=SFTMultiturnConfig)
    # Longest prompt + response in tokens.
    max_length: int = 1024
    # What to do with an over-long example: error, `left` cuts its start, `right` its end.
    truncation: Literal["error", "left", "right"] = "error"
    # Examples per optimiser step.
    train_batch_size: int = 256
    # Examples per forward/backward; None = the whole batch.
    micro_batch_size_per_gpu: Optional[int] = None
    # Shuffle each epoch.
    shuffle: bool = True
    # Seed of the data order.
    seed: int = 1
    # Train (validate) on at most this many rows of data.train_files (val_files); -1: every row.
    # The rows are drawn at random (seeded by `seed`) with `shuffle`, else the first ones, as in verl.
    train_max_samples: int = -1
    val_max_samples: int = -1


@dataclass
class SFTModelConfig(LoraKeys):  # LoRA: the adapter also goes to <default_local_dir>/adapter
    # Local Hugging Face folder to start from.
    partial_pretrain: str = ""
    # Recompute activations in the backward pass.
    enable_gradient_checkpointing: bool = False
    # FSDP2 options (as the PPO models'); used on torchrun ranks or, when set, on one process.
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class SFTOptimConfig(OptimConfig):
    # Max global gradient norm.
    clip_grad: float = 1.0


def _sft_optim() -> SFTOptimConfig:
    return SFTOptimConfig(lr=1e-5)


@dataclass
class SFTTrainerConfig:
    # Passes over the data.
    total_epochs: int = 1
    # Stop after this many optimiser steps; None = total_epochs worth.
    total_training_steps: Optional[int] = None
    # Project name.
    project_name: str = "klppo-sft"
    # Experiment name.
    experiment_name: str = "run"
    # Where metrics go besides <default_local_dir>/metrics.jsonl; a plain string is a list of one.
    logger: Union[str, list[str]] = field(default_factory=lambda: ["console"])
    # Output folder; the final Hugging Face folder is written to <default_local_dir>/hf.
    default_local_dir: Optional[str] = None
    # cpu, cuda, or auto.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Devices per node (checked against the actual world).
    n_gpus_per_node: int = 1
    # Nodes (checked against the actual world).
    nnodes: int = 1
    # Save a checkpoint every this many steps (and at the end); -1 = none, only the final export.
    save_freq: int = -1
    # auto: continue from the latest checkpoint if there is one; disable: start fresh;
    # resume_path: continue from resume_from_path.
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    # Checkpoint folder to resume from when resume_mode is resume_path.
    resume_from_path: Optional[str] = None
    # Keep only the newest N checkpoints; None keeps all.
    max_ckpt_to_keep: Optional[int] = None


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=_sft_optim)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


# ---- reward-model training (klppo rm) ----


@dataclass
class RMDataConfig:
    # Ranked-response Parquet file(s): prompt, responses and ranking / rankings / scores /
    # chosen+rejected (klppo.data.ranked).
    train_files: Union[str, list[str]] = ""
    # Ranked Parquet for pairwise accuracy; None disables validation.
    val_files: Optional[Union[str, list[str]]] = None
    # Column of the prompt's chat messages.
    prompt_key: str = "prompt"
    # Extra arguments to the chat template when it renders chat-message prompts (as verl passes
    # them), e.g. {enable_thinking: false} for Qwen3 or {reasoning_effort: medium} for gpt-oss.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Longest prompt in tokens.
    max_prompt_length: int = 512
    # Longest response in tokens (longer ones are cut).
    max_response_length: int = 512
    # Prompts per optimiser step (each with all its ranked responses).
    train_batch_size: int = 64
    # Prompts per forward/backward; None = the whole batch.
    micro_batch_size_per_gpu: Optional[int] = None
    # What to do with an over-long prompt: error, `left` cuts its start, `right` its end, `middle`
    # its middle (as data.truncation of PPO).
    truncation: Literal["error", "left", "right", "middle"] = "error"
    # Drop prompts longer than max_prompt_length instead of truncating them.
    filter_overlong_prompts: bool = False
    # Shuffle each epoch.
    shuffle: bool = True
    # Seed of the data order and of the new score head.
    seed: int = 1
    # Train (validate) on at most this many rows of data.train_files (val_files); -1: every row,
    # drawn as PPO's data.train_max_samples.
    train_max_samples: int = -1
    val_max_samples: int = -1


@dataclass
class RMModelConfig(LoraKeys):  # LoRA: the adapter also goes to <default_local_dir>/adapter
    # Local Hugging Face folder to start from (a causal LM: its backbone gets a score head).
    partial_pretrain: str = ""
    # Recompute activations in the backward pass.
    enable_gradient_checkpointing: bool = False
    # FSDP2 options (as the PPO models'); used on torchrun ranks or, when set, on one process.
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RMLossConfig:
    # bradley_terry: -log sigmoid(r_better - r_worse) over every pair a ranking implies;
    # plackett_luce: the listwise likelihood of each full ranking.
    type: Literal["bradley_terry", "plackett_luce"] = "bradley_terry"


def _rm_optim() -> SFTOptimConfig:
    return SFTOptimConfig(lr=1e-5)


@dataclass
class RMConfig:
    data: RMDataConfig = field(default_factory=RMDataConfig)
    model: RMModelConfig = field(default_factory=RMModelConfig)
    optim: SFTOptimConfig = field(default_factory=_rm_optim)
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    trainer: SFTTrainerConfig = field(default_factory=lambda: SFTTrainerConfig(project_name="klppo-rm"))
