"""Multi-turn SFT data (verl's ``data.multiturn``): a column of whole conversations, the loss on
every assistant turn.

Each row's ``messages`` (``data.multiturn.messages_key``) is a list of ``{"role", "content"}``
with at least one assistant turn. The conversation is rendered with the tokenizer's chat
template one prefix at a time, and each message becomes the text its prefix adds. An assistant
turn's text after its header (the generation prompt, what ``add_generation_prompt`` opens it
with) is trained on: its content and the template's end of turn, as the model writes them when
it answers. The headers and every other turn are context. A template that renders a past turn
differently as the conversation goes on (Qwen3's drops the thinking of earlier answers) gives no
one sequence for the whole conversation: such a row becomes one example per assistant turn, the
turn after the conversation before it, as the model sees it when it answers. A row may carry the
template's ``tools`` (``data.multiturn.tools_key``) and ``enable_thinking``
(``enable_thinking_key``), as in verl.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from klppo.data.chat_template import TEMPLATE_FIX
from klppo.data.parquet import EVERY_ROW, RowSample, describe_files, read_parquet_rows, row_error, short_repr
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
    sample: RowSample = EVERY_ROW,
    log: Callable[[str], None] = print,
) -> list[SFTExample]:
    """Read, validate and tokenise multi-turn SFT rows; one ``SFTExample`` per conversation."""
    check_truncation(truncation, allowed=("error", "left", "right"))
    if max_length <= 0:
        raise UserError(f"data.max_length is {max_length}; set it to a positive number of tokens")
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{MULTITURN_KEY}.enable renders conversations with the chat template, but the model's "
                        f"tokenizer has none (a base model); {TEMPLATE_FIX}")
    rows = read_parquet_rows(files, [messages_key], sample)
    examples, n_truncated, n_split = [], 0, 0
    for row in rows:
        messages = check_messages(row, messages_key)
        if not any(m["role"] == "assistant" for m in messages):
            raise row_error(row, messages_key, "the conversation has no assistant turn, so nothing would be trained",
                            "give every conversation at least one assistant message")
        if messages[0]["role"] == "assistant":
            raise row_error(row, messages_key, "the conversation opens with an assistant turn, which no prompt asked for",
                            "begin it with a user (or system) message")
        kwargs = {**(template_kwargs or {}), **_row_template_inputs(row, tools_key, enable_thinking_key)}
        encoded = _encode_conversation(tokenizer, messages, kwargs, row, messages_key)
        n_split += len(encoded) > 1
        for ids, mask in encoded:
            if len(ids) > max_length:
                ids, mask = fit_example(ids, mask, row, messages_key, max_length, truncation, "the conversation")
                n_truncated += 1
            examples.append(SFTExample(ids, mask))
    notes = [f"{n_truncated} truncated ({truncation}) to {max_length} tokens"] if n_truncated else []
    if n_split:
        notes.append(f"{n_split} as one example per assistant turn, since the chat template renders past turns "
                     "differently as a conversation goes on")
    log(f"loaded {len(rows)} conversations from {describe_files(files)} as {len(examples)} examples"
        + (f" ({'; '.join(notes)})" if notes else ""))
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


class _PastTurnsChange(Exception):
    """The template renders an earlier turn differently once the conversation goes on."""


def _renderer(tokenizer, kwargs: dict, row: dict, column: str) -> Callable[..., str]:
    def render(prefix: list[dict], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(prefix, add_generation_prompt=generation_prompt, tokenize=False,
                                                 **kwargs)
        except Exception as exc:  # the model's Jinja template refused the messages (e.g. roles must alternate)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise row_error(row, column, f"the tokenizer's chat template cannot render its messages ({first})",
                            "fix the messages to the form the model's template expects") from None

    return render


def _encode_conversation(tokenizer, messages: list[dict], kwargs: dict, row: dict, column: str
                         ) -> list[tuple[list[int], list[bool]]]:
    """The conversation's examples: (tokens, True on each answer's tokens after its header).

    One example where each prefix's text starts the next; otherwise (a template such as Qwen3's,
    which drops the thinking of answers before the last question) one example per assistant
    turn: the turn as the last message after its context, as the model sees it when it answers.
    """
    render = _renderer(tokenizer, kwargs, row, column)
    try:
        return [_tokens(tokenizer, _whole_conversation(render, messages))]
    except _PastTurnsChange:
        return [_tokens(tokenizer, _one_turn(render, messages, i, row, column))
                for i, message in enumerate(messages) if message["role"] == "assistant"]


def _whole_conversation(render: Callable[..., str], messages: list[dict]) -> list[tuple[str, bool]]:
    """(text, trained) pieces of the whole conversation, or ``_PastTurnsChange``."""
    pieces, done = [], ""
    for i, message in enumerate(messages):
        text = render(messages[: i + 1])
        opened = render(messages[:i], generation_prompt=True) if message["role"] == "assistant" else done
        if not (opened.startswith(done) and text.startswith(opened)):
            raise _PastTurnsChange
        pieces += [(opened[len(done):], False), (text[len(opened):], message["role"] == "assistant")]
        done = text
    return pieces


def _one_turn(render: Callable[..., str], messages: list[dict], turn: int, row: dict, column: str
              ) -> list[tuple[str, bool]]:
    """(context, False), (answer, True): assistant turn ``turn`` after the conversation before it."""
    context = render(messages[:turn], generation_prompt=True)
    text = render(messages[: turn + 1])
    if not text.startswith(context):
        raise row_error(row, column, f"the chat template renders turn {turn} not as its generation prompt opens it "
                        "(e.g. a thinking block only the generation prompt writes), so the answer cannot be cut from "
                        "its context", "use a template whose generation prompt starts the answer it renders, or train "
                        "on prompt and response columns (data.multiturn.enable=false)")
    return [(context, False), (text[len(context):], True)]


def _tokens(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Each piece encoded on its own (a template's special tokens sit at the joins), and which are trained."""
    ids, mask = [], []
    for text, trained in pieces:
        if text:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [trained] * len(piece)
    return ids, mask
