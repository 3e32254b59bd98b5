"""SFT datasets (verl's fsdp_sft_trainer format): a prompt column and a response column.

The prompt is chat messages, rendered with the chat template and ``add_generation_prompt=True``,
or plain text, encoded as it is with no template (as RL prompts are: ``rl_dataset.encode_prompts``;
files may mix the two forms, each row encoded by its own); then the response tokens and EOS
follow. The loss is taken on the response tokens and the EOS only.

Shapes: ``B`` examples in a batch, ``L`` longest example of the batch in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from klppo.data.parquet import EVERY_ROW, RowSample, describe_files, read_parquet_rows, row_error, short_repr
from klppo.data.rl_dataset import check_prompt, check_truncation, encode_prompts
from klppo.errors import UserError


@dataclass
class SFTExample:
    """One tokenised prompt + response."""

    # Prompt tokens, then response tokens, then EOS (unless cut by right truncation).
    input_ids: list[int]
    # True on response tokens including the final EOS; same length as input_ids.
    loss_mask: list[bool]


def _response_text(row: dict, response_key: str) -> str:
    value = row.get(response_key)
    if not isinstance(value, str):
        raise row_error(row, response_key, f"expected a response string, got {short_repr(value)}",
                        "give every row a string response")
    return value


def _nested(rows: list[dict], column: str, keys: Sequence[str], setting: str) -> tuple[list[dict], str]:
    """Each row with the value at ``column`` then ``keys`` (verl's dict keys) under the dotted name
    ``column.key...``, which errors then name; ``rows`` as they are without keys."""
    if not keys:
        return rows, column
    name, out = ".".join([column, *keys]), []
    for row in rows:
        value = row.get(column)
        for depth, key in enumerate(keys):
            if not isinstance(value, dict) or key not in value:
                inside = ".".join([column, *keys[:depth]])
                found = f"keys {', '.join(map(str, value))}" if isinstance(value, dict) else short_repr(value)
                raise row_error(row, column, f"{setting} reads {name}, but {inside} has no '{key}' (it holds {found})",
                                f"give every row's {inside} a '{key}', or fix {setting}")
            value = value[key]
        out.append({**row, name: value})
    return out, name


def fit_example(ids: list[int], mask: list[bool], row: dict, key: str, max_length: int, truncation: str,
                what: str = "prompt + response") -> tuple[list[int], list[bool]]:
    """Cut an over-long example to ``max_length``: "right" drops the end, "left" the start."""
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    if truncation == "left":
        return ids[-max_length:], mask[-max_length:]
    raise row_error(row, key, f"{what} is {len(ids)} tokens, longer than data.max_length={max_length}",
                    "raise data.max_length or set data.truncation=left|right")


def load_sft_dataset(
    files: str | Sequence[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    max_length: int,
    truncation: str = "error",
    template_kwargs: Mapping[str, Any] | None = None,
    prompt_dict_keys: Sequence[str] = (),
    response_dict_keys: Sequence[str] = (),
    sample: RowSample = EVERY_ROW,
    log: Callable[[str], None] = print,
) -> list[SFTExample]:
    """Read, validate and tokenise SFT examples; one ``SFTExample`` per row.

    Examples longer than ``max_length`` tokens are rejected ("error") or cut: "right" drops
    the end (the response loses its EOS), "left" drops the start of the prompt.
    ``prompt_dict_keys`` / ``response_dict_keys`` (verl's): keys into a dict-valued column, in
    order (``prompt_key=extra_info`` with ``["question"]`` reads each row's extra_info.question).
    """
    check_truncation(truncation, allowed=("error", "left", "right"))
    if max_length <= 0:
        raise UserError(f"data.max_length is {max_length}; set it to a positive number of tokens")
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos_token; set eos_token in the model's tokenizer_config.json")
    rows = read_parquet_rows(files, [prompt_key, response_key], sample)
    rows, prompt_key = _nested(rows, prompt_key, prompt_dict_keys, "data.prompt_dict_keys")
    rows, response_key = _nested(rows, response_key, response_dict_keys, "data.response_dict_keys")
    prompts = [check_prompt(row, prompt_key) for row in rows]
    responses = [_response_text(row, response_key) for row in rows]
    prompt_ids = encode_prompts(tokenizer, prompts, rows, prompt_key, template_kwargs)
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    examples, n_truncated = [], 0
    for row, p_ids, r_ids in zip(rows, prompt_ids, response_ids):
        r_ids = list(r_ids) + [tokenizer.eos_token_id]
        ids = list(p_ids) + r_ids
        mask = [False] * len(p_ids) + [True] * len(r_ids)
        if len(ids) > max_length:
            ids, mask = fit_example(ids, mask, row, prompt_key, max_length, truncation)
            n_truncated += 1
        examples.append(SFTExample(ids, mask))
    note = f" ({n_truncated} truncated ({truncation}) to {max_length} tokens)" if n_truncated else ""
    log(f"loaded {len(examples)} SFT examples from {describe_files(files)}{note}")
    plain = sum(isinstance(p, str) for p in prompts)
    if plain and getattr(tokenizer, "chat_template", None) is not None:
        log(f"warning: {plain} of the {len(prompts)} prompts in {describe_files(files)} are plain text, encoded as "
            "they are with no chat template (verl's SFT would render each as a user message): the model learns to "
            "answer raw text, while prompts written as chat messages reach it through the template; write them as "
            f"chat messages ([{{'role': 'user', 'content': ...}}] in '{prompt_key}') to train the chat format")
    return examples


def collate_sft(
    examples: Sequence[SFTExample], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a batch to its longest example.

    Returns ``input_ids`` LongTensor (B, L), ``attention_mask`` BoolTensor (B, L) and
    ``loss_mask`` BoolTensor (B, L); both masks are False on padding.
    """
    assert examples, "collate_sft needs at least one example"
    width = max(len(e.input_ids) for e in examples)  # L
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[i, :n] = True
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.bool)
    return input_ids, attention_mask, loss_mask
