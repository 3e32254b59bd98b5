"""Responses sampled from the actor with Hugging Face ``generate``."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import GenerationConfig

from klppo.data.rl_dataset import PromptRecord, collate_prompts
from klppo.rollout.batch import RolloutBatch, assemble_batch, eos_token_ids, mask_after_eos


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k, as in verl
    do_sample: bool = True


@torch.no_grad()
def hf_rollout(model, records: list[PromptRecord], tokenizer, params: SamplingParams, *,
               synced_gpus: bool = False, device: torch.device | None = None) -> RolloutBatch:
    """Sample ``params.n`` responses per prompt; rows grouped by prompt as in ``offline_rollout``.

    ``synced_gpus`` (sharded models): every rank keeps running forwards until all ranks have
    finished, so FSDP2's per-forward collectives line up.

    Sampling is from exactly softmax(logits / temperature), with ``params.top_p`` / ``top_k``
    and nothing else: ``generate`` would start from the model folder's generation_config and
    apply its other processors too (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``;
    others set ``no_repeat_ngram_size``, ``min_p``, ``suppress_tokens``, ...), so the responses
    would not come from the policy whose log-probs PPO uses (``neutral_generation_config``).

    Tokens after a response's first EOS (any of ``eos_token_ids``: the tokenizer's and those the
    model's generation config lists) are replaced by padding and masked out. Sampling
    draws from torch's global RNG, which checkpoints save and restore, so a resumed run
    samples the same responses as an uninterrupted one.

    ``device``: where the model computes (the rank's device; by default its parameters'). Say
    it for models whose parameters live elsewhere (FSDP2's ``offload_policy`` keeps them on
    CPU). The batch comes back on CPU; callers move it to their device once.
    """
    device = device if device is not None else next(model.parameters()).device
    prompt_ids, prompt_mask = collate_prompts(records, tokenizer.pad_token_id)
    prompt_ids = prompt_ids.repeat_interleave(params.n, dim=0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(params.n, dim=0).to(device)
    was_training = model.training
    model.eval()
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    with generating_with(model, neutral_generation_config(params, tokenizer, eos)):
        output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), synced_gpus=synced_gpus)
    model.train(was_training)
    response_ids = output[:, prompt_ids.shape[1] :].cpu()  # (B, T) with T <= max_new_tokens
    if response_ids.shape[1] == 0:
        response_ids = torch.full((len(response_ids), 1), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = mask_after_eos(response_ids, eos)
    response_ids = response_ids.masked_fill(~response_mask, tokenizer.pad_token_id)
    return assemble_batch(records, params.n, tokenizer.pad_token_id, response_ids, response_mask)


def neutral_generation_config(params: SamplingParams, tokenizer, eos: tuple[int, ...] = ()) -> GenerationConfig:
    """The generation config of sampling from softmax(z / T) with ``params``' top_p / top_k alone,
    stopping at each id of ``eos`` (default: the tokenizer's EOS).

    Every field left unset falls back to transformers' neutral global defaults (no repetition
    penalty, no n-gram blocking, no minimum length, no suppressed tokens, ...).
    """
    sampling = {}
    if params.do_sample:  # top_k 0 switches top-k off (transformers' own default is 50)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0)}
    return GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=list(eos or [tokenizer.eos_token_id]),
                            use_cache=True, **sampling)


@contextmanager
def generating_with(model, config: GenerationConfig) -> Iterator[None]:
    """``model.generation_config`` is ``config`` inside the block.

    ``generate(generation_config=...)`` alone is not enough: transformers fills every field the
    given config leaves unset from the model's own generation_config (``_prepare_generation_config``),
    which is how the folder's processors come back.
    """
    own = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = own
