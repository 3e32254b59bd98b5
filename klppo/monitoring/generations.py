"""Sample generations, where a user reads them: verl's ``trainer.rollout_data_dir`` and
``trainer.validation_data_dir`` (one JSON-lines file per step) and ``trainer.log_val_generations``
(a few validation responses at each validation: the console, TensorBoard's text tab, a W&B table).

A file ``<dir>/<step>.jsonl`` holds one line per response, with verl's fields: ``input`` and
``output`` (the prompt and the response, decoded without special tokens), ``gts`` (the ground
truth), ``score`` (the reward before any KL penalty), ``step``, and each number the reward function
returned beside its score. A step that runs again (a resumed run, a rollback) writes its file
again; a file is replaced whole (written beside it, then renamed), so a crash never leaves half
of one. Validation before training is step 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from klppo.rollout.batch import RolloutBatch

# verl's W&B key. A step's metrics carry the chosen validation responses under it to the loggers,
# which show them as text; metrics.jsonl never holds them.
GENERATIONS_KEY = "val/generations"
_SHOWN_CHARS = 400  # of a prompt or response on the console (files and TensorBoard hold all of it)


@dataclass(frozen=True)
class Generation:
    """One response, as text, with its score."""

    input: str
    output: str
    gts: Any
    score: float
    extra: dict[str, float] = field(default_factory=dict)  # the reward function's other numbers

    def record(self, step: int) -> dict:
        """The JSON line verl writes (its field names), the reward's other numbers after them."""
        return {"input": self.input, "output": self.output, "gts": self.gts, "score": self.score, "step": step,
                **{k: v for k, v in self.extra.items() if k not in _FIELDS}}


_FIELDS = ("input", "output", "gts", "score", "step")


def batch_generations(batch: RolloutBatch, tokenizer, scores: Sequence[float]) -> list[Generation]:
    """Each response of ``batch`` as text (a multi-turn response with the tools' replies), in batch
    order, with ``scores`` (one per row)."""
    prompt_mask, response_mask = batch.prompt_mask.cpu(), batch.response_attention.cpu()
    prompts = [ids[mask].tolist() for ids, mask in zip(batch.prompt_ids.cpu(), prompt_mask)]
    responses = [ids[mask].tolist() for ids, mask in zip(batch.response_ids.cpu(), response_mask)]
    inputs = tokenizer.batch_decode(prompts, skip_special_tokens=True)
    outputs = tokenizer.batch_decode(responses, skip_special_tokens=True)
    extras = batch.reward_components or [{}] * len(batch)
    return [Generation(i, o, truth, float(score), dict(extra))
            for i, o, truth, score, extra in zip(inputs, outputs, batch.ground_truths, scores, extras)]


def write_generations(folder: Path, step: int, generations: Sequence[Generation]) -> Path:
    """``folder/<step>.jsonl``, one line per generation, replacing the file whole."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    partial = folder / f".{step}.jsonl.partial"
    with partial.open("w", encoding="utf-8") as f:
        for generation in generations:
            f.write(json.dumps(generation.record(step), ensure_ascii=False, default=_plain) + "\n")
    os.replace(partial, path)
    return path


def _plain(value: Any) -> Any:
    """A ground truth JSON cannot hold as it is (a NumPy array or number, ...): a list, a number or its text."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def pick_generations(generations: Sequence[Generation], n: int) -> list[Generation]:
    """The ``n`` responses verl's ``log_val_generations`` shows: sorted by prompt, shuffled with a
    fixed seed (42), the first ``n``; the same responses at every validation of a run."""
    chosen = sorted(generations, key=lambda g: g.input)
    np.random.RandomState(42).shuffle(chosen)
    return chosen[:n]


def generations_text(step: int, generations: Sequence[Generation], limit: int | None = _SHOWN_CHARS) -> str:
    """A readable block of the responses (each text cut to ``limit`` characters; None keeps all)."""
    lines = [f"validation samples at step {step}:"]
    for i, g in enumerate(generations, 1):
        lines += [f"[{i}] score {g.score:g}" + (f"  (ground truth: {_cut(str(g.gts), limit)})" if g.gts is not None
                                                  else ""),
                  f"  input:  {_indent(_cut(g.input, limit))}", f"  output: {_indent(_cut(g.output, limit))}"]
    return "\n".join(lines)


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _indent(text: str) -> str:
    return text.replace("\n", "\n          ")
