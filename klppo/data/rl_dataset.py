"""RL prompt datasets in verl's RLHFDataset format, tokenised and validated up front.

Columns (one row per prompt):
  data_source   str, picks the reward function (``klppo.rewards.score``)
  prompt        list of chat messages ``{"role", "content"}``, or plain text (a string); name set
                by ``data.prompt_key``; ``encode_prompts`` says how each form becomes tokens
  ability       str, optional, unused
  reward_model  ``{"style", "ground_truth"}``, optional; ``ground_truth`` is passed to the reward
  extra_info    dict, optional; passed to the reward function
  responses     list of str, optional: recorded responses for offline PPO
  scores        list of float, optional: one score per recorded response
  rollout_log_probs  list of lists of float, optional: the behaviour policy's per-token log-probs
                of each recorded response (``klppo.data.rollout_log_probs`` says how they align)

Shapes: ``B`` prompts in a batch, ``P`` longest prompt of the batch in tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from klppo.data import rollout_log_probs as behaviour
from klppo.data.chat_template import encode_chats
from klppo.data.parquet import (
    EVERY_ROW, RowSample, describe_files, read_parquet_rows, row_error, row_place, short_repr,
)
from klppo.errors import UserError

ROLES = ("system", "user", "assistant")
TRUNCATIONS = ("error", "left", "right", "middle")
MESSAGES_FIX = ("write the prompt as plain text (a string) or as a list of messages like "
                "[{'role': 'user', 'content': '...'}]")


@dataclass
class PromptRecord:
    """One validated, tokenised RL prompt (and its recorded responses, offline)."""

    # Position in the dataset after filtering; the sampler hands these out.
    index: int
    # Picks the reward function.
    data_source: str
    # The chat messages, each reduced to {"role", "content"}; or the plain-text prompt.
    raw_prompt: list[dict] | str
    # The prompt's tokens (``encode_prompts``), after truncation; at most max_prompt_length.
    prompt_ids: list[int]
    # reward_model["ground_truth"], or None when the row has none.
    ground_truth: Any
    # The row's extra_info ({} when absent).
    extra_info: dict
    # Recorded responses (offline PPO), or None.
    responses: list[str] | None = None
    # One score per recorded response, or None.
    scores: list[float] | None = None
    # Per response, the behaviour policy's log-prob of each of its tokens (closing EOS included), or None.
    rollout_log_probs: list[list[float]] | None = None
    # The file and row it came from ("x.parquet row 3"), for messages about it.
    where: str = ""
    # The column data.reward_fn_key names, where that is not data_source: what picks the reward function
    # (verl's reward managers read it; validation's metrics stay grouped by data_source).
    reward_source: str | None = None
    # verl's agent_name column: which agent loop the row runs (tool_agent, single_turn_agent), or None.
    agent_name: str | None = None

    @property
    def scored_as(self) -> str:
        """The data source the reward function is called with."""
        return self.data_source if self.reward_source is None else self.reward_source


def check_truncation(truncation: str, key: str = "data.truncation", allowed: Sequence[str] = TRUNCATIONS) -> None:
    """Raise a UserError unless ``truncation`` is one of ``allowed``."""
    if truncation not in allowed:
        raise UserError(f"{key} is {truncation!r}; set it to one of {', '.join(allowed)}")


def check_prompt(row: dict, column: str) -> list[dict] | str:
    """``row[column]`` as a prompt: plain text (a non-empty string, kept as it is) or chat messages
    (validated and reduced to {"role", "content"})."""
    value = row.get(column)
    if isinstance(value, str):
        if not value:
            raise row_error(row, column, "the prompt is an empty string", "give every row a prompt")
        if _is_json_messages(value):
            raise row_error(row, column, f"the prompt is a string of chat messages written as JSON "
                            f"({short_repr(value, 40)}), which the model would read as those characters",
                            "write the list of messages itself (json.loads it before writing the file)")
        return value
    if not isinstance(value, list):
        raise row_error(row, column, f"expected plain text or a list of chat messages, got {short_repr(value)}",
                        MESSAGES_FIX)
    return check_messages(row, column)


def _is_json_messages(text: str) -> bool:
    """Whether plain text is really chat messages serialised as JSON (a common export slip)."""
    if not text.lstrip().startswith("[{"):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)


def check_messages(row: dict, column: str) -> list[dict]:
    """Validate ``row[column]`` as chat messages; return them reduced to {"role", "content"}."""
    value = row.get(column)
    if not isinstance(value, list) or not value:
        raise row_error(row, column, f"expected a non-empty list of chat messages, got {short_repr(value)}",
                        MESSAGES_FIX)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise row_error(row, column, f"message {i} is {short_repr(message)}, not a dict", MESSAGES_FIX)
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise row_error(row, column, f"message {i} has no string '{key}' (got {short_repr(message)})",
                                MESSAGES_FIX)
        if message["role"] not in ROLES:
            raise row_error(row, column, f"message {i} has role {message['role']!r}",
                            f"use one of {', '.join(ROLES)}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def encode_prompts(tokenizer, prompts: Sequence[list[dict] | str], rows: Sequence[dict], column: str,
                   template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Each prompt's token ids, in order (``prompts`` from ``check_prompt``, ``rows`` their rows).

    Plain text is encoded as the tokenizer encodes text for its model, with the special tokens
    it adds itself (e.g. a BOS) and no chat template: a completion prompt, for base models or
    any model. Chat messages go through the chat template with the generation prompt and
    ``template_kwargs`` (``data.apply_chat_template_kwargs``); a tokenizer without a template (a
    base model) is an error naming the first such row.
    """
    chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    plain = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    ids: list[list[int]] = [[] for _ in prompts]
    chat_ids = encode_chats(tokenizer, [prompts[i] for i in chats], rows=[rows[i] for i in chats], column=column,
                            template_kwargs=template_kwargs)
    text_ids = tokenizer([prompts[i] for i in plain])["input_ids"] if plain else []
    for i, encoded in zip(chats + plain, chat_ids + [list(t) for t in text_ids]):
        ids[i] = encoded
    return ids


def check_data_source(row: dict, column: str = "data_source") -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value:
        raise row_error(row, column, f"expected a non-empty string, got {short_repr(value)}",
                        "set it to the dataset name that picks the reward, e.g. 'openai/gsm8k'")
    return value


AGENT_LOOPS = ("tool_agent", "single_turn_agent")  # verl's agent loops that klppo runs (rollout.multi_turn)


def check_agent_name(row: dict) -> str | None:
    """verl's ``agent_name`` column: one of ``AGENT_LOOPS``, or None where the row (or file) has none."""
    value = row.get("agent_name")
    if value is None:
        return None
    if value not in AGENT_LOOPS:
        raise row_error(row, "agent_name", f"names agent loop {short_repr(value)}", "klppo runs verl's "
                        f"{' and '.join(AGENT_LOOPS)} loops (actor_rollout_ref.rollout.multi_turn); use one of them, "
                        "or drop the column")
    return value


def check_ground_truth(row: dict) -> Any:
    value = row.get("reward_model")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise row_error(row, "reward_model", f"expected a dict like {{'style': 'rule', 'ground_truth': ...}}, "
                        f"got {short_repr(value)}", "write reward_model as a struct/dict column")
    return value.get("ground_truth")


def check_extra_info(row: dict) -> dict:
    value = row.get("extra_info")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise row_error(row, "extra_info", f"expected a dict, got {short_repr(value)}",
                        "write extra_info as a struct/dict column or drop it")
    return value


def check_responses(row: dict, required: bool) -> tuple[list[str] | None, list[float] | None]:
    """Validate the ``responses`` and ``scores`` columns of one row; None where absent."""
    responses = row.get("responses")
    if responses is None and not required:
        if row.get("scores") is not None:
            raise row_error(row, "scores", "scores given without responses", "add a 'responses' column")
        return None, None
    fix = "write responses as a non-empty list of strings, one per recorded response"
    if not isinstance(responses, list) or not responses:
        raise row_error(row, "responses", f"expected a non-empty list of strings, got {short_repr(responses)}", fix)
    for i, text in enumerate(responses):
        if not isinstance(text, str):
            raise row_error(row, "responses", f"response {i} is {short_repr(text)}, not a string", fix)
    scores = row.get("scores")
    if scores is None:
        return responses, None
    fix = "give one finite number per response in 'scores', or drop the column"
    if not isinstance(scores, list) or len(scores) != len(responses):
        raise row_error(row, "scores", f"expected a list of {len(responses)} numbers (one per response), "
                        f"got {short_repr(scores)}", fix)
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise row_error(row, "scores", f"score {i} is {short_repr(s)}, not a finite number", fix)
    return responses, [float(s) for s in scores]


def _fit_prompt(ids: list[int], row: dict, prompt_key: str, max_len: int, truncation: str) -> list[int]:
    """Cut an over-long prompt to ``max_len`` tokens: "left" drops the start, "right" the end,
    "middle" the middle (verl's: the first max_len // 2 tokens and the last max_len - max_len // 2
    stay, so a chat prompt keeps its opening and its generation prompt)."""
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise row_error(row, prompt_key, f"prompt is {len(ids)} tokens, longer than data.max_prompt_length={max_len}",
                    "raise data.max_prompt_length, set data.filter_overlong_prompts=true to drop such prompts, "
                    "or set data.truncation=left|right|middle to cut them")


def load_rl_dataset(
    files: str | Sequence[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int,
    truncation: str = "error",
    filter_overlong_prompts: bool = False,
    require_responses: bool = False,
    require_rollout_log_probs: behaviour.LogProbsNeed | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    sample: RowSample = EVERY_ROW,
    reward_fn_key: str = "data_source",
    log: Callable[[str], None] = print,
) -> list[PromptRecord]:
    """Read, validate and tokenise RL prompts; returns one ``PromptRecord`` per kept row.

    A prompt is chat messages (rendered with the chat template) or plain text (encoded as it
    is; ``encode_prompts``). Files may mix the two forms (a Parquet column has one type, so
    one file holds one form, but several files may differ): each row is encoded by its own.
    Over-long prompts (more than ``max_prompt_length`` tokens after the chat template) are
    dropped when ``filter_overlong_prompts`` (as verl does), else cut per ``truncation``
    ("left" keeps the end, "right" keeps the start) or rejected ("error").
    ``require_rollout_log_probs``: every row must carry its responses' behaviour log-probs, for this need.
    ``sample``: the rows read (``RowSample``: verl's ``data.train_max_samples``), drawn before any check.
    ``reward_fn_key``: the column that picks each row's reward function (verl's ``data.reward_fn_key``).
    """
    check_truncation(truncation)
    if max_prompt_length <= 0:
        raise UserError(f"data.max_prompt_length is {max_prompt_length}; set it to a positive number of tokens")
    own_key = reward_fn_key != "data_source"
    required = ["data_source", prompt_key] + (["responses"] if require_responses else []) + ([reward_fn_key] if own_key else [])
    rows = read_parquet_rows(files, required, sample)
    checked = []
    for row in rows:
        prompt = check_prompt(row, prompt_key)
        responses, scores = check_responses(row, require_responses)
        log_probs = behaviour.check_rollout_log_probs(row, responses, require_rollout_log_probs)
        checked.append((row, prompt, check_data_source(row), check_ground_truth(row),
                        check_extra_info(row), responses, scores, log_probs,
                        check_data_source(row, reward_fn_key) if own_key else None, check_agent_name(row)))
    behaviour.check_lengths([(c[0], c[5], c[7]) for c in checked], tokenizer)
    all_ids = encode_prompts(tokenizer, [c[1] for c in checked], rows, prompt_key, template_kwargs)
    kept = fit_prompts([c[0] for c in checked], all_ids, prompt_key=prompt_key, max_prompt_length=max_prompt_length,
                       truncation=truncation, filter_overlong_prompts=filter_overlong_prompts, files=files, log=log)
    records = []
    for position, ids in kept:
        row, prompt, source, truth, extra, responses, scores, log_probs, reward_source, agent = checked[position]
        records.append(PromptRecord(len(records), source, prompt, ids, truth, extra, responses, scores, log_probs,
                                    where=row_place(row), reward_source=reward_source, agent_name=agent))
    return records


def fit_prompts(
    rows: Sequence[dict],
    prompt_ids: Sequence[list[int]],
    *,
    prompt_key: str,
    max_prompt_length: int,
    truncation: str,
    filter_overlong_prompts: bool,
    files: str | Sequence[str],
    log: Callable[[str], None],
    what: str = "prompts",
) -> list[tuple[int, list[int]]]:
    """Apply the over-long-prompt policy; returns ``(position, ids)`` of the kept rows, logs counts.

    Over-long prompts are dropped when ``filter_overlong_prompts`` (as verl does), else cut per
    ``truncation`` ("left" keeps the end, "right" keeps the start, "middle" both ends) or rejected
    ("error"). A prompt that encodes to no token at all is refused: generation and the forwards need at least
    one token to continue from.
    """
    kept, n_filtered, n_truncated = [], 0, 0
    for position, (row, ids) in enumerate(zip(rows, prompt_ids)):
        if not ids:
            raise row_error(row, prompt_key, "the prompt encodes to no tokens (empty text, and a tokenizer or chat "
                            "template that adds nothing)", "give the row a non-empty prompt, or use a model whose "
                            "tokenizer encodes this text")
        if len(ids) > max_prompt_length:
            if filter_overlong_prompts:
                n_filtered += 1
                continue
            ids = _fit_prompt(ids, row, prompt_key, max_prompt_length, truncation)
            n_truncated += 1
        kept.append((position, ids))
    where = describe_files(files)
    if not kept:
        raise UserError(f"all {len(rows)} prompts in {where} are longer than data.max_prompt_length="
                        f"{max_prompt_length} tokens and were filtered; raise data.max_prompt_length "
                        "or set data.filter_overlong_prompts=false and data.truncation=left|right|middle")
    notes = []
    if n_filtered:
        notes.append(f"{n_filtered} filtered as over {max_prompt_length} tokens")
    if n_truncated:
        notes.append(f"{n_truncated} truncated ({truncation}) to {max_prompt_length} tokens")
    log(f"loaded {len(kept)} {what} from {where}" + (f" ({', '.join(notes)})" if notes else ""))
    return kept


def collate_prompts(records: Sequence[PromptRecord], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad the prompts of a batch to the longest one (generation continues at the right edge).

    Returns ``input_ids`` LongTensor (B, P) and ``attention_mask`` BoolTensor (B, P), True on
    real tokens.
    """
    assert records, "collate_prompts needs at least one record"
    return left_pad([r.prompt_ids for r in records], pad_token_id)


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists left-padded to the longest: ids (B, P) long and mask (B, P) bool."""
    width = max(len(s) for s in sequences)  # P
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, seq in enumerate(sequences):
        n = len(seq)
        if n:
            input_ids[i, width - n:] = torch.tensor(list(seq), dtype=torch.long)
            attention_mask[i, width - n:] = True
    return input_ids, attention_mask


def tokenize_responses(texts: Sequence[str], tokenizer, max_response_length: int) -> tuple[list[list[int]], int]:
    """Encode recorded responses (no special tokens) and close each with EOS, as generation would.

    A response whose tokens plus EOS exceed ``max_response_length`` is cut to its first
    ``max_response_length`` tokens without the EOS (it did not end within the budget).
    Returns ``(ids_list, n_truncated)``.
    """
    if max_response_length <= 0:
        raise UserError(f"data.max_response_length is {max_response_length}; set it to a positive number")
    out, n_truncated = [], 0
    for ids in behaviour.encode_responses(texts, tokenizer):
        if len(ids) > max_response_length:
            ids = ids[:max_response_length]
            n_truncated += 1
        out.append(ids)
    return out, n_truncated
