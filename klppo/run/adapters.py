"""What a run does with a model's LoRA adapters (``klppo.models.lora``) beyond training them:
export, the merged weights an inference engine takes, the reference policy, and going back to
their starting values.

A model with adapters is exported twice by rank 0 from one streaming of its whole tensors:
``<name>_adapter/`` (or ``adapter/``), the adapter alone in peft's layout, loadable with
``PeftModel.from_pretrained`` on the base model; and the usual Hugging Face folder with the
adapters merged into the weights (W + alpha / r * B @ A), a plain model that
``AutoModelForCausalLM`` (or the reward model's or critic's class) loads without peft.

A LoRA actor's reference policy is the actor with its adapters at their starting values (those
of ``lora_adapter_path``, or for new adapters the base model, lora_B being zero), or with
``actor_rollout_ref.ref.lora_reference: base`` the base model: the reference forward swaps
those values into the adapters and back, at the memory of one copy of the adapters.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from klppo.checkpoint.export import export_hf
from klppo.distributed import DistEnv, barrier, reshard, whole_tensor_groups
from klppo.models.load import as_saved
from klppo.models.lora import has_adapters, is_adapter, lora_merges, merged_state, save_adapter, trained_heads


def export_model(model: torch.nn.Module, tokenizer, hf_dir: Path, adapter_dir: Path, env: DistEnv) -> list[Path]:
    """Export ``model`` to ``hf_dir`` (merged, if it has adapters) and its adapter to ``adapter_dir``;
    every rank calls this. Returns the folders written.

    The export streams the whole tensors a decoder block at a time; each block's adapters are
    merged into its weights on the way, and kept (they are small) for the adapter folder.
    """
    if not has_adapters(model):
        return [export_hf(model, tokenizer, hf_dir, env, transform=lambda group: as_saved(model, group))]
    merges, heads, kept = lora_merges(model), set(trained_heads(model)), {}

    def keep_adapters_then_merge(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept.update({name: t for name, t in group.items() if is_adapter(name) or name in heads})
        return as_saved(model, merged_state(group, merges))

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
def merged_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, *, copies: bool = True,
                   saved: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter and persistent buffer of the plain model that
    ``model`` computes, for an inference engine that takes weights by name (the fp32 generation
    copy, ``trainer.responses``): each adapted weight merged, W + alpha / r * B @ A, in fp32 from
    the fp32 masters and only then cast to ``dtype`` (merging in bf16 would round most of a small
    update away); every other parameter cast to ``dtype``, buffers in their own dtype. A model
    without adapters gives its own weights, cast.

    On every rank, on ``device``, each a tensor of its own (``copies=False``: the model's own
    where nothing changes it, for a consumer that copies them itself); collective (every rank
    iterates to the end); one decoder block's whole tensors at a time besides those already yielded.
    ``saved``: under the names and in the layout of the model's saved folders (``load.as_saved``:
    MoE experts one by one), as an engine that loads such folders takes them.
    """
    merges = lora_merges(model) if has_adapters(model) else {}
    buffers = set(model.state_dict()) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for group in whole_tensor_groups(model, device, copies=copies):  # collective
        state = merged_state(group, merges)
        for name, tensor in (as_saved(model, state) if saved else state).items():
            yield name, tensor if name in buffers else tensor.to(dtype)  # buffers keep their own dtype


@torch.no_grad()
def trained_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of the parameters that train (LoRA: the adapters, small)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def restore_values(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put ``trained_values`` back into ``model`` (each rank its own shards). Whole parameters FSDP2
    kept from a forward are freed first, so the next forward gathers the values put back."""
    reshard(model)
    for name, param in model.named_parameters():
        if name in values:
            param.copy_(values[name])


def base_values(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter ``values`` with every lora_B zero: the adapters add nothing, the model is its base."""
    return {name: torch.zeros_like(v) if ".lora_B." in name else v for name, v in values.items()}


@contextmanager
def adapters_at(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
    """Inside the block ``model``'s adapters hold ``values`` (this rank's shards, as ``trained_values``
    gives them), for forwards without gradients; afterwards their own values again, bit for bit.

    No ``requires_grad`` flag changes: FSDP2 fixes each parameter group's mixed-precision dtypes
    from those flags at the model's first forward, which may be this one (a reference forward
    first, as in rollout correction's bypass mode); switching adapters off with peft's
    ``enable_adapters(False)`` clears them, and a bf16 run then failed at its first backward.
    """
    own = {name: p.detach().clone() for name, p in model.named_parameters() if name in values}
    restore_values(model, values)
    try:
        yield model
    finally:
        restore_values(model, own)
