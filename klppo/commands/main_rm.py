"""``klppo rm`` / ``python -m klppo.commands.main_rm``: train a reward model from ranked responses.

Each prompt's responses are scored by a sequence-classification model (a causal LM's backbone
with a one-output head), and the scores are fitted to the rankings with the Bradley-Terry loss
over every pair a ranking implies, or the Plackett-Luce loss over each whole ranking. Pairwise
accuracy (the better response scored higher) is reported on ``data.val_files``. The result is
written to ``<trainer.default_local_dir>/hf``, usable as PPO's ``reward_model.model.path``.
Runs under torchrun with FSDP2 and checkpoints as SFT does (``klppo.trainer.supervised``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from klppo.algo import bradley_terry_loss, plackett_luce_loss
from klppo.cli_support import loaded_with_notes, parse_config_args, run_cli
from klppo.config import RMConfig, command_line_config, load_rm_config
from klppo.data.batching import row_chunks
from klppo.data.ranked import RankedRecord, ranked_pairs, ranking_tiers
from klppo.distributed import DistEnv, all_reduce_sum
from klppo.models.forward import sequence_scores
from klppo.rollout.batch import right_pad
from klppo.trainer.update import optimizer_step


def score_records(model, records: list[RankedRecord], tokenizer, max_response_length: int,
                  device: torch.device) -> list[torch.Tensor]:
    """One (K_i,) score tensor per record: every recorded response after its prompt (run on ``device``)."""
    sequences, sizes = [], []
    for record in records:
        for text in record.responses:
            response = tokenizer(text, add_special_tokens=False)["input_ids"][: max_response_length - 1]
            sequences.append(record.prompt_ids + response + [tokenizer.eos_token_id])
        sizes.append(len(record.responses))
    ids, mask = right_pad(sequences, tokenizer.pad_token_id)
    return list(sequence_scores(model, ids.to(device), mask.to(device)).split(sizes))


def _flat_positions(scores: list[torch.Tensor], groups: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records' scores as one (sum K_i,) tensor, and a (n,) index into it of ``groups``
    (per record, lists of its response indices), flattened in order.

    The index is built on the host and copied once without waiting for the device (an index
    per pair or ranking would be one host-device sync each)."""
    flat = torch.cat(scores)
    positions, offset = [], 0
    for s, record_groups in zip(scores, groups):
        positions += [offset + i for group in record_groups for i in group]
        offset += len(s)
    return flat, torch.tensor(positions, dtype=torch.long).to(flat.device, non_blocking=True)


def ranking_loss(scores: list[torch.Tensor], records: list[RankedRecord], loss_type: str) -> tuple[torch.Tensor, int]:
    """Summed loss over the records' pairs (BT) or rankings (PL), and how many terms it holds.

    No host sync: pairs are picked by Python ints (views), each ranking's order goes to the
    device without waiting for it."""
    if loss_type == "bradley_terry":
        better, worse = [], []
        for s, record in zip(scores, records):
            for i, j in ranked_pairs(record.rankings):
                better.append(s[i])
                worse.append(s[j])
        if not better:
            return scores[0].sum() * 0.0, 0
        return bradley_terry_loss(torch.stack(better), torch.stack(worse)) * len(better), len(better)
    terms = []
    for s, record in zip(scores, records):
        for ranking in record.rankings:  # Plackett-Luce on the listed (strict) order of each ranking
            order = torch.tensor([i for tier in ranking_tiers(ranking) for i in tier]).to(s.device, non_blocking=True)
            terms.append(plackett_luce_loss(s[order].unsqueeze(0)))
    return torch.stack(terms).sum(), len(terms)


def pair_accuracy(scores: list[torch.Tensor], records: list[RankedRecord]) -> tuple[torch.Tensor, int]:
    """(pairs ordered right, as a 0-dim tensor on the scores' device; pairs) over every pair the
    rankings imply. The count stays on the device: no host sync until the step's metrics."""
    pairs = [[list(pair) for pair in ranked_pairs(record.rankings)] for record in records]
    n = sum(len(p) for p in pairs)
    if not n:
        return torch.zeros((), dtype=torch.long, device=scores[0].device), 0
    flat, index = _flat_positions(scores, pairs)
    better_worse = flat[index].view(n, 2)
    return (better_worse[:, 0] > better_worse[:, 1]).sum(), n


@torch.no_grad()
def evaluate(model, records, tokenizer, cfg: RMConfig, device: torch.device) -> dict[str, float]:
    model.eval()
    right, total = torch.zeros((), dtype=torch.long, device=device), 0
    for idx in row_chunks(len(records), cfg.data.micro_batch_size_per_gpu or cfg.data.train_batch_size):
        part = [records[i] for i in idx]
        r, t = pair_accuracy(score_records(model, part, tokenizer, cfg.data.max_response_length, device), part)
        right, total = right + r, total + t
    return {"val/pair_accuracy": int(right) / max(total, 1)}  # host sync


def rm_step(model, optimizer, records, tokenizer, cfg: RMConfig, device: torch.device) -> dict[str, torch.Tensor | float]:
    """One optimiser step over this rank's ``records``: micro-batch losses normalised by the
    term count of every rank's records; the metrics are the global batch's."""
    model.train()
    micro = cfg.data.micro_batch_size_per_gpu or len(records)
    parts = [[records[i] for i in idx] for idx in row_chunks(len(records), micro)]
    n_terms = int(all_reduce_sum(torch.tensor(sum(
        len(ranked_pairs(r.rankings)) if cfg.loss.type == "bradley_terry" else len(r.rankings) for r in records))))
    loss_sum, right, total = torch.zeros((), device=device), torch.zeros((), device=device), 0
    for part in parts:
        scores = score_records(model, part, tokenizer, cfg.data.max_response_length, device)
        loss, _ = ranking_loss(scores, part, cfg.loss.type)
        (loss / max(n_terms, 1)).backward()
        loss_sum += loss.detach() / max(n_terms, 1)
        r, t = pair_accuracy([s.detach() for s in scores], part)
        right, total = right + r, total + t
    grad_norm = optimizer_step(model, optimizer, cfg.optim.clip_grad)
    summed = all_reduce_sum(torch.stack([loss_sum, right.float(), torch.tensor(float(total), device=device)]))
    loss_sum, right, total = summed.cpu().tolist()  # one host sync per step
    return {"train/loss": loss_sum, "train/pair_accuracy": right / max(total, 1.0), "train/grad_norm": grad_norm}


def run_rm(cfg: RMConfig, print_fn=print) -> Path:
    """Train the reward model and save it (on every rank of a torchrun launch); returns the folder written."""
    from klppo.trainer.supervised import run_supervised

    return run_supervised(cfg, _prepare_rm, print_fn)


def _prepare_rm(cfg: RMConfig, env: DistEnv, tokenizer, sharder, print_fn):
    """The ranked data, the reward model (sharded), and the step that fits it to a share of a batch."""
    from klppo.data.parquet import RowSample
    from klppo.data.ranked import load_ranked_dataset
    from klppo.run.setup import load_model, lora_spec
    from klppo.trainer.supervised import SupervisedJob

    data, key = cfg.data, "model.partial_pretrain"
    common = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                  filter_overlong_prompts=data.filter_overlong_prompts,
                  template_kwargs=data.apply_chat_template_kwargs, log=print_fn)
    train = load_ranked_dataset(data.train_files, tokenizer,
                                sample=RowSample.drawn(data.train_max_samples, data.shuffle, data.seed), **common)
    val = (load_ranked_dataset(data.val_files, tokenizer,
                               sample=RowSample.drawn(data.val_max_samples, data.shuffle, data.seed), **common)
           if data.val_files else None)
    # The loss reads the score head at every position (sequence_scores), not the root's output.
    model = load_model("reward_model", cfg.model.partial_pretrain, key=key, env=env, sharder=sharder,
                       fsdp=cfg.model.fsdp_config, seed=data.seed,
                       gradient_checkpointing=cfg.model.enable_gradient_checkpointing, keep_root_gathered=True,
                       lora=lora_spec(cfg.model, "model"))

    def train_step(run, indices: list[int]) -> dict:
        return rm_step(model, run.optimizer, [train[i] for i in indices], tokenizer, cfg, env.device)

    def validate() -> dict:  # every rank, in step
        return evaluate(model, val, tokenizer, cfg, env.device)

    return SupervisedJob(model, len(train), ("train/loss", "train/pair_accuracy", "val/pair_accuracy"), train_step,
                         validate if val is not None else None,
                         "reward model saved to {} (use it as reward_model.model.path)", kind="rm")


def main(argv: list[str] | None = None) -> int:
    args = parse_config_args(argv, "klppo rm", "Train a reward model from ranked responses.")
    return run_cli(lambda: run_rm(loaded_with_notes(lambda notes: load_rm_config(*command_line_config(args),
                                                                                 notes=notes))))


if __name__ == "__main__":
    sys.exit(main())
