"""``klppo score-logprobs``: fill the ``rollout_log_probs`` column of recorded responses with a model.

Offline rollout correction weighs each recorded token by pi_old / mu, so it needs mu: the
per-token log-probs of the policy that wrote the responses. When the data did not record
them, this command computes them with a model standing for that policy (e.g. the SFT model
that sampled them): it reads a Parquet file of prompts with recorded responses (an RL file's
``responses``, or a ranked file's ``responses`` or ``chosen``/``rejected``), scores every
response token under the model, prompt as context, and writes a copy of the file with the
column added (or replaced). The input is never written to.

Each prompt is encoded as training encodes it (chat template, or plain text), whole: no
truncation, so the column does not depend on a run's ``data.max_prompt_length``. Each
response is its tokens without special tokens, then EOS (``klppo.data.rollout_log_probs``);
all of it is scored, and training cuts the list with the response. Use the tokenizer of the
model you will train (the column's lengths are checked against it) and the temperature of the
distribution the responses were sampled from (``actor_rollout_ref.rollout.temperature``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from klppo.cli_support import quiet_libraries, run_cli
from klppo.config.checks import template_kwargs_problems
from klppo.data.chat_template import template_kwargs_notes
from klppo.data.batching import MicroBatching
from klppo.data.parquet import read_parquet_rows, row_error
from klppo.data.ranked import check_pair
from klppo.data.rl_dataset import check_prompt, check_responses, encode_prompts
from klppo.data.rollout_log_probs import COLUMN, encode_responses
from klppo.distributed import resolve_device
from klppo.errors import UserError
from klppo.models.load import load_causal_lm, load_tokenizer
from klppo.monitoring.progress import Progress
from klppo.rollout.batch import RolloutBatch, right_pad
from klppo.trainer.forwards import compute_log_prob

MODEL_KEY = "--model"
TEMPLATE_KWARGS_FLAG = "--chat-template-kwargs"


def check_paths(input_path: str, output_path: str, force: bool) -> tuple[Path, Path]:
    """The input must be a file; the output must not be the input, a folder, or (without --force) a file."""
    src, dst = Path(input_path), Path(output_path)
    if not src.is_file():
        raise UserError(f"--input '{input_path}' is not a file; point it at the Parquet file of recorded responses")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UserError(f"--output '{output_path}' is the input file; write the scored copy to another path "
                        "(score-logprobs never overwrites its input)")
    if dst.is_dir():
        raise UserError(f"--output '{output_path}' is a folder; give a file path such as {dst / src.name}")
    if dst.exists() and not force:
        raise UserError(f"--output '{output_path}' exists; choose another path, or pass --force to replace it")
    if not dst.parent.is_dir():
        raise UserError(f"--output '{output_path}': the folder '{dst.parent}' does not exist; create it first")
    return src, dst


def recorded_responses(row: dict) -> list[str]:
    """The row's responses: ``responses``, or [chosen, rejected] for a preference pair."""
    if row.get("responses") is None and (row.get("chosen") is not None or row.get("rejected") is not None):
        return check_pair(row)
    if row.get("responses") is None:
        raise row_error(row, "responses", "no recorded responses to score",
                        "give the row 'responses' (or 'chosen' and 'rejected'), or drop it")
    return check_responses(row, required=True)[0]


def _batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> RolloutBatch:
    """(prompt ids, response ids) pairs as a batch: prompts left-padded, responses right-padded."""
    flipped, flipped_mask = right_pad([p[::-1] for p, _ in items], pad_id)
    response_ids, response_mask = right_pad([r for _, r in items], pad_id)
    n = len(items)
    return RolloutBatch(prompt_ids=flipped.flip(1), prompt_mask=flipped_mask.flip(1), response_ids=response_ids,
                        response_mask=response_mask, group_index=torch.arange(n), data_sources=[""] * n,
                        ground_truths=[None] * n, extra_infos=[{}] * n)


def score(model, items: list[tuple[list[int], list[int]]], *, pad_id: int, batch_size: int, temperature: float,
          progress: Progress) -> list[list[float]]:
    """Each response's per-token log-probs under ``model``, ``batch_size`` responses per forward."""
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in items]
    # Similar lengths together: less padding, fewer wasted tokens per forward.
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = _batch([items[i] for i in chunk], pad_id).to(device)
        log_prob = compute_log_prob(model, batch, MicroBatching(rows=batch_size), temperature=temperature)
        for row, i in enumerate(chunk):
            out[i] = log_prob[row, : len(items[i][1])].float().cpu().tolist()  # host sync
        progress.advance()
    return out


def score_file(model_path: str, input_path: str, output_path: str, *, prompt_key: str = "prompt",
               template_kwargs: dict | None = None, chat_template: str | None = None, batch_size: int = 8,
               temperature: float = 1.0, device: str = "auto", force: bool = False, print_fn=print) -> Path:
    """Write ``output_path``: ``input_path`` with ``rollout_log_probs`` scored by ``model_path``;
    ``template_kwargs`` and ``chat_template``: the chat-template arguments and the template training
    uses (``data.apply_chat_template_kwargs``, ``actor_rollout_ref.model.custom_chat_template``)."""
    src, dst = check_paths(input_path, output_path, force)
    if batch_size < 1 or not temperature > 0:
        raise UserError(f"--batch-size must be >= 1 and --temperature > 0 (got {batch_size}, {temperature})")
    template_kwargs = template_kwargs or {}
    problems = template_kwargs_problems(template_kwargs, TEMPLATE_KWARGS_FLAG)
    if problems:
        raise UserError("; ".join(p.message for p in problems))
    dev = resolve_device(device, key="--device")
    tokenizer = load_tokenizer(model_path, MODEL_KEY, chat_template, "--chat-template")
    for note in template_kwargs_notes(tokenizer, template_kwargs):
        print_fn(note)
    rows = read_parquet_rows(str(src), [prompt_key])
    prompt_ids = encode_prompts(tokenizer, [check_prompt(row, prompt_key) for row in rows], rows, prompt_key,
                                template_kwargs)
    responses = [encode_responses(recorded_responses(row), tokenizer) for row in rows]
    items = [(ids, r) for ids, rs in zip(prompt_ids, responses) for r in rs]
    model = load_causal_lm(model_path, key=MODEL_KEY, device=dev)
    print_fn(f"scoring {len(items)} responses of {len(rows)} rows of {src} with {model_path} on {dev}")
    started = time.perf_counter()
    with Progress(total=-(-len(items) // batch_size), desc="score-logprobs") as progress:
        flat = score(model, items, pad_id=tokenizer.pad_token_id, batch_size=batch_size, temperature=temperature,
                     progress=progress)
    per_row, at = [], 0
    for rs in responses:
        per_row.append(flat[at : at + len(rs)])
        at += len(rs)
    _write(src, dst, per_row)
    print_fn(f"wrote {dst} ({COLUMN} for {len(items)} responses, {time.perf_counter() - started:.1f} s)")
    return dst


def _mapping(text: str) -> dict:
    """A command-line YAML/JSON mapping of names to values, e.g. '{enable_thinking: false}'."""
    try:
        value = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mapping of names to values; write e.g. "
                                         "'{enable_thinking: false}'")
    return value


def _template_text(value: str | None) -> str | None:
    """``--chat-template``: the template itself, or ``@FILE``: the file's text."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:])
    if not path.is_file():
        raise UserError(f"--chat-template {value}: '{path}' is not a file; give @ and the path of a Jinja template")
    return path.read_text(encoding="utf-8")



def _write(src: Path, dst: Path, per_row: list[list[list[float]]]) -> None:
    """The input table plus the column, written next to ``dst`` and renamed into place."""
    table = pq.read_table(src)
    if COLUMN in table.column_names:
        table = table.drop_columns([COLUMN])
    table = table.append_column(COLUMN, pa.array(per_row, type=pa.list_(pa.list_(pa.float32()))))
    partial = dst.with_name(f".{dst.name}.partial")
    pq.write_table(table, partial)
    os.replace(partial, dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo score-logprobs", description="Fill the rollout_log_probs column "
                                     "(behaviour log-probs for rollout correction) of recorded responses by scoring "
                                     "them with a model; writes a copy of the input with the column.")
    parser.add_argument("--model", required=True, help="local model folder: the policy that wrote the responses")
    parser.add_argument("--input", required=True, help="Parquet file of prompts with recorded responses")
    parser.add_argument("--output", required=True, help="where to write the copy with rollout_log_probs")
    parser.add_argument("--prompt-key", default="prompt", help="the prompt column (data.prompt_key)")
    parser.add_argument(TEMPLATE_KWARGS_FLAG, type=_mapping, default={}, metavar="MAPPING",
                        help="chat-template arguments as training passes them (data.apply_chat_template_kwargs), "
                        "as YAML or JSON, e.g. '{enable_thinking: false}'")
    parser.add_argument("--chat-template", metavar="JINJA", help="a chat template replacing the model's, as "
                        "training renders prompts (actor_rollout_ref.model.custom_chat_template); @FILE reads a file")
    parser.add_argument("--batch-size", type=int, default=8, help="responses per forward")
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampling temperature of the responses")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--force", action="store_true", help="replace an existing --output (never the input)")
    args = parser.parse_args(argv)
    quiet_libraries()
    return run_cli(lambda: score_file(args.model, args.input, args.output, prompt_key=args.prompt_key,
                                      template_kwargs=args.chat_template_kwargs,
                                      chat_template=_template_text(args.chat_template), batch_size=args.batch_size, temperature=args.temperature, device=args.device,
                                      force=args.force))


if __name__ == "__main__":
    sys.exit(main())
