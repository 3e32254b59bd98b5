"""``klppo sft`` / ``python -m klppo.commands.main_sft``: supervised warm start before PPO.

Trains a causal LM on prompt/response Parquet with the loss on response tokens only (token
mean over the whole batch, so micro-batching and the number of ranks do not change the
update) and writes the result to ``<trainer.default_local_dir>/hf``, the folder PPO's
``actor_rollout_ref.model.path`` points at. Runs under torchrun as PPO does
(``klppo.trainer.supervised``).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
import torch

from klppo.cli_support import loaded_with_notes, parse_config_args, run_cli
from klppo.config import SFTConfig, command_line_config, load_sft_config
from klppo.data.batching import row_chunks
from klppo.distributed import DistEnv, all_reduce_sum
from klppo.models.forward import HeadSettings, response_logprobs
from klppo.trainer.update import optimizer_step


def sft_loss(model, input_ids, attention_mask, loss_mask, total_tokens,
             head: HeadSettings = HeadSettings()) -> torch.Tensor:
    """Summed next-token NLL over ``loss_mask`` tokens, divided by the batch's ``total_tokens``.

    Shapes: input_ids, attention_mask, loss_mask (B, L), rows right-padded; the output at i
    predicts token i + 1. The log-probs come from the PPO forwards' ``response_logprobs``, each row
    read as a one-token "prompt" and an (L - 1)-token "response", so they go through the fused LM
    head wherever the model allows it (``head``): the (B, L, V) fp32 logits are never held whole,
    only slices of the vocabulary, in forward and backward alike.
    """
    log_probs, _ = response_logprobs(model, input_ids, attention_mask, input_ids.shape[1] - 1, head=head)  # (B, L-1)
    return -(log_probs * loss_mask[:, 1:]).sum() / total_tokens


def _evaluate(model, examples, pad_token_id, batch_rows: int, device: torch.device) -> float:
    from klppo.data.sft_dataset import collate_sft

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for idx in row_chunks(len(examples), batch_rows):
            batch = collate_sft([examples[i] for i in idx], pad_token_id)
            tokens += int(batch[2][:, 1:].sum())  # counted on the CPU copy
            ids, attn, loss_mask = (t.to(device) for t in batch)
            total += float(sft_loss(model, ids, attn, loss_mask, 1.0))  # host sync
    return total / max(tokens, 1)


def sft_step(model, optimizer, batch, micro_batch_rows: int, clip_grad: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate this rank's share of the batch loss over micro-batches, clip, step; returns
    (the global batch's loss, grad_norm). Normalised by the tokens of every rank's share."""
    model.train()
    ids, attn, loss_mask = batch
    total_tokens = all_reduce_sum(loss_mask[:, 1:].sum())
    loss_sum = torch.zeros((), device=ids.device)
    for idx in row_chunks(len(ids), micro_batch_rows):
        loss = sft_loss(model, ids[idx], attn[idx], loss_mask[idx], total_tokens)
        loss.backward()
        loss_sum += loss.detach()
    return all_reduce_sum(loss_sum), optimizer_step(model, optimizer, clip_grad)


def run_sft(cfg: SFTConfig, print_fn=print) -> Path:
    """Train and save (on every rank of a torchrun launch); returns the Hugging Face folder written."""
    from klppo.trainer.supervised import run_supervised

    return run_supervised(cfg, _prepare_sft, print_fn)


def _prepare_sft(cfg: SFTConfig, env: DistEnv, tokenizer, sharder, print_fn):
    """The SFT data, the causal LM (sharded), and the step that trains it on a share of a batch."""
    from klppo.data.multiturn_sft import load_multiturn_sft_dataset
    from klppo.data.parquet import RowSample
    from klppo.data.sft_dataset import collate_sft, load_sft_dataset
    from klppo.run.setup import load_model, lora_spec
    from klppo.trainer.supervised import SupervisedJob

    data, key, device = cfg.data, "model.partial_pretrain", env.device
    common = dict(max_length=data.max_length, truncation=data.truncation,
                  template_kwargs=data.apply_chat_template_kwargs, log=print_fn)
    if data.multiturn.enable:
        turns = data.multiturn
        load = partial(load_multiturn_sft_dataset, messages_key=turns.messages_key, tools_key=turns.tools_key,
                       enable_thinking_key=turns.enable_thinking_key, **common)
    else:
        load = partial(load_sft_dataset, prompt_key=data.prompt_key, response_key=data.response_key,
                       prompt_dict_keys=data.prompt_dict_keys or (), response_dict_keys=data.response_dict_keys or (),
                       **common)
    train = load(data.train_files, tokenizer, sample=RowSample.drawn(data.train_max_samples, data.shuffle, data.seed))
    val = (load(data.val_files, tokenizer, sample=RowSample.drawn(data.val_max_samples, data.shuffle, data.seed))
           if data.val_files else None)
    model = load_model("causal_lm", cfg.model.partial_pretrain, key=key, env=env, sharder=sharder,
                       fsdp=cfg.model.fsdp_config, gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                       seed=data.seed, lora=lora_spec(cfg.model, "model"))
    micro_rows = data.micro_batch_size_per_gpu or data.train_batch_size // env.world_size

    def train_step(run, indices: list[int]) -> dict:
        batch = collate_sft([train[i] for i in indices], tokenizer.pad_token_id)
        loss, grad_norm = sft_step(model, run.optimizer, [t.to(device) for t in batch], micro_rows,
                                   cfg.optim.clip_grad)
        return {"train/loss": loss, "train/grad_norm": grad_norm}

    def evaluate() -> dict:  # every rank the whole validation set, in step
        return {"val/loss": _evaluate(model, val, tokenizer.pad_token_id, micro_rows, device)}

    return SupervisedJob(model, len(train), ("train/loss", "val/loss", "train/lr", "train/grad_norm"), train_step,
                         evaluate if val is not None else None, "SFT model saved to {}", kind="sft")


def main(argv: list[str] | None = None) -> int:
    args = parse_config_args(argv, "klppo sft", "Supervised fine-tuning (warm start).")
    return run_cli(lambda: run_sft(loaded_with_notes(lambda notes: load_sft_config(*command_line_config(args),
                                                                                   notes=notes))))


if __name__ == "__main__":
    sys.exit(main())
