"""Multi-turn SFT data (verl's ``data.multiturn``): a column of whole conversations, the loss on
every assistant turn.

Each row's ``messages`` (``data.multiturn.messages_key``) is a list of ``{"role", "content"}``
with at least one assistant turn. The conversation is rendered with the tokenizer's chat
template one prefix at a time, and each message becomes the text its prefix adds. An assistant
turn's text after its header (the generation prompt, what ``add_generation_prompt`` opens it
with) is trained on: its content and the template's end of turn, as the model writes them when
it answers. The headers and every other turn are context. A row may carry the template's
``tools`` (``data.multiturn.tools_key``) and ``enable_thinking`` (``enable_thinking_key``), as
in verl. A template that rewrites earlier turns as the conversation grows (so a prefix's text is
not the start of the next) cannot be cut into turns this way: the row is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from klppo.data.chat_template import TEMPLATE_FIX
from klppo.data.parquet import describe_files, read_parquet_rows, row_error, short_repr
from klppo.data.rl_dataset import check_messages, check_truncation
from klppo.data.sft_dataset import SFTExample, fit_example
from klppo.errors import UserError

MULTITURN_KEY = "data.multiturn"


def load_multiturn_sft_dataset(
    files: str | Sequence[str],
    tokenizer,
    *,
    messages_key: str = "messages",
    tools_key: str = "tools",
    enable_thinking_key: str = "enable_thinking",
    max_length: int,
    truncation: str = "error",
    template_kwargs: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> list[SFTExample]:
    """Read, validate and tokenise multi-turn SFT rows; one ``SFTExample`` per conversation."""
    check_truncation(truncation, allowed=("error", "left", "right"))
    if max_length <= 0:
        raise UserError(f"data.max_length is {max_length}; set it to a positive number of tokens")
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{MULTITURN_KEY}.enable renders conversations with the chat template, but the model's "
                        f"tokenizer has none (a base model); {TEMPLATE_FIX}")
    rows = read_parquet_rows(files, [messages_key])
    examples, n_truncated = [], 0
    for row in rows:
        messages = check_messages(row, messages_key)
        if not any(m["role"] == "assistant" for m in messages):
            raise row_error(row, messages_key, "the conversation has no assistant turn, so nothing would be trained",
                            "give every conversation at least one assistant message")
        if messages[0]["role"] == "assistant":
            raise row_error(row, messages_key, "the conversation opens with an assistant turn, which no prompt asked for",
                            "begin it with a user (or system) message")
        kwargs = {**(template_kwargs or {}), **_row_template_inputs(row, tools_key, enable_thinking_key)}
        ids, mask = _encode_conversation(tokenizer, messages, kwargs, row, messages_key)
        if len(ids) > max_length:
            ids, mask = fit_example(ids, mask, row, messages_key, max_length, truncation, "the conversation")
            n_truncated += 1
        examples.append(SFTExample(ids, mask))
    note = f" ({n_truncated} truncated ({truncation}) to {max_length} tokens)" if n_truncated else ""
    log(f"loaded {len(examples)} conversations from {describe_files(files)}{note}")
    return examples


def _row_template_inputs(row: dict, tools_key: str, enable_thinking_key: str) -> dict:
    """The row's own template inputs: its tools (a list of schemas) and its enable_thinking flag."""
    inputs = {}
    tools = row.get(tools_key)
    if tools is not None:
        if not isinstance(tools, list):
            raise row_error(row, tools_key, f"expected a list of tool schemas, got {short_repr(tools)}",
                            "write the tools as a list of dicts, or leave the column out")
        inputs["tools"] = tools
    thinking = row.get(enable_thinking_key)
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise row_error(row, enable_thinking_key, f"expected true or false, got {short_repr(thinking)}",
                            "write a boolean, or leave the column out")
        inputs["enable_thinking"] = thinking
    return inputs


def _encode_conversation(tokenizer, messages: list[dict], kwargs: dict, row: dict, column: str
                         ) -> tuple[list[int], list[bool]]:
    """The conversation's tokens, and True on each assistant turn's tokens after its header."""
    def render(prefix: list[dict], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(prefix, add_generation_prompt=generation_prompt, tokenize=False,
                                                 **kwargs)
        except Exception as exc:  # the model's Jinja template refused the messages (e.g. roles must alternate)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise row_error(row, column, f"the tokenizer's chat template cannot render its messages ({first})",
                            "fix the messages to the form the model's template expects") from None

    pieces: list[tuple[str, bool]] = []  # (text, trained)
    done = ""
    for i, message in enumerate(messages):
        text = render(messages[: i + 1])
        if message["role"] == "assistant":
            opened = render(messages[:i], generation_prompt=True)
            _check_prefix(done, opened, row, column, i)
            _check_prefix(opened, text, row, column, i, ANSWER_DIFFERS)
            pieces += [(opened[len(done):], False), (text[len(opened):], True)]
        else:
            _check_prefix(done, text, row, column, i)
            pieces.append((text[len(done):], False))
        done = text
    ids, mask = [], []
    for text, trained in pieces:
        if text:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [trained] * len(piece)
    return ids, mask


REWRITES = "so that the earlier turns' text changes (it rewrites past turns as the conversation grows)"
ANSWER_DIFFERS = ("not as its generation prompt opens it (e.g. a thinking block only the generation prompt "
                  "writes)")


def _check_prefix(before: str, after: str, row: dict, column: str, turn: int, problem: str = REWRITES) -> None:
    if not after.startswith(before):
        raise row_error(row, column, f"the chat template renders turn {turn} {problem}, so the turns cannot be cut "
                        "apart", "use a template that renders each turn the same however the conversation goes on "
                        "(most do), or train on prompt and response columns (data.multiturn.enable=false)")
