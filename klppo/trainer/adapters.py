"""What a run does with a model's LoRA adapters (``klppo.models.lora``) beyond training them:
export, the merged weights an inference engine takes, and going back to their starting values.

A model with adapters is exported twice by rank 0 from one streaming of its whole tensors:
``<name>_adapter/`` (or ``adapter/``), the adapter alone in peft's layout, loadable with
``PeftModel.from_pretrained`` on the base model; and the usual Hugging Face folder with the
adapters merged into the weights (W + alpha / r * B @ A), a plain model that
``AutoModelForCausalLM`` (or the reward model's or critic's class) loads without peft.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from klppo.checkpoint.export import export_hf
from klppo.distributed import DistEnv, barrier, whole_tensor_groups
from klppo.models.lora import has_adapters, is_adapter, lora_merges, merged_state, save_adapter, trained_heads


def export_model(model: torch.nn.Module, tokenizer, hf_dir: Path, adapter_dir: Path, env: DistEnv) -> list[Path]:
    """Export ``model`` to ``hf_dir`` (merged, if it has adapters) and its adapter to ``adapter_dir``;
    every rank calls this. Returns the folders written.

    The export streams the whole tensors a decoder block at a time; each block's adapters are
    merged into its weights on the way, and kept (they are small) for the adapter folder.
    """
    if not has_adapters(model):
        return [export_hf(model, tokenizer, hf_dir, env)]
    merges, heads, kept = lora_merges(model), set(trained_heads(model)), {}

    def keep_adapters_then_merge(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept.update({name: t for name, t in group.items() if is_adapter(name) or name in heads})
        return merged_state(group, merges)

    export_hf(model, tokenizer, hf_dir, env, transform=keep_adapters_then_merge)
    if env.rank == 0:
        tmp = adapter_dir.with_name(adapter_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(tmp, model, kept, model.name_or_path)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(adapter_dir, ignore_errors=True)
        os.replace(tmp, adapter_dir)
    barrier()
    return [hf_dir, adapter_dir]


@torch.no_grad()
def merged_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter and persistent buffer of the plain model that
    ``model`` computes, for an inference engine that takes weights by name (the fp32 generation
    copy, ``trainer.responses``): each adapted weight merged, W + alpha / r * B @ A, in fp32 from
    the fp32 masters and only then cast to ``dtype`` (merging in bf16 would round most of a small
    update away); every other parameter cast to ``dtype``, buffers in their own dtype. A model
    without adapters gives its own weights, cast.

    On every rank, on ``device``, each a tensor of its own; collective (every rank iterates to the
    end); one decoder block's whole tensors at a time besides those already yielded.
    """
    merges = lora_merges(model) if has_adapters(model) else {}
    buffers = set(model.state_dict()) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for group in whole_tensor_groups(model, device):  # collective
        for name, tensor in merged_state(group, merges).items():
            yield name, tensor if name in buffers else tensor.to(dtype)  # buffers keep their own dtype


@torch.no_grad()
def trained_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of the parameters that train (LoRA: the adapters, small)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def restore_values(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put ``trained_values`` back into ``model`` (each rank its own shards)."""
    for name, param in model.named_parameters():
        if name in values:
            param.copy_(values[name])
