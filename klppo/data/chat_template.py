"""Chat messages to tokens: the tokenizer's chat template, with the caller's template arguments.

verl hands ``data.apply_chat_template_kwargs`` to every ``apply_chat_template`` call that renders
a prompt (Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``, ``tools``); klppo does
the same, so a prompt has the same tokens in both. A template reads only the names it was
written for and ignores the rest, so a misspelt name would change no prompt without a word:
``template_kwargs_notes`` says so at the start of a run.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from klppo.data.parquet import row_error
from klppo.errors import UserError

TEMPLATE_KWARGS_KEY = "data.apply_chat_template_kwargs"
TEMPLATE_FIX = ("write the prompt as plain text (a string), which needs no template, or use an instruct model's "
                "tokenizer (its tokenizer_config.json has 'chat_template')")
# What every template is given by apply_chat_template itself, or by the tokenizer's special tokens.
_SUPPLIED = {"messages", "add_generation_prompt", "tools", "documents", "raise_exception", "strftime_now",
             "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"}


def encode_chats(tokenizer, conversations: Sequence[list[dict]], add_generation_prompt: bool = True,
                 rows: Sequence[dict] | None = None, column: str = "prompt",
                 template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Render each conversation with the tokenizer's chat template and encode it (no extra specials).

    ``rows`` (the conversations' rows from ``read_parquet_rows``) name the row in errors;
    ``template_kwargs`` go to the template as they are (``data.apply_chat_template_kwargs``).
    """
    template_kwargs = dict(template_kwargs or {})

    def fail(i: int, problem: str, fix: str) -> UserError:
        if rows is None:
            return UserError(f"prompt {i}: {problem}; {fix}")
        return row_error(rows[i], column, problem, fix)

    if conversations and getattr(tokenizer, "chat_template", None) is None:
        raise fail(0, "the prompt is chat messages, but the model's tokenizer has no chat template (a base model) "
                   "to render them with", TEMPLATE_FIX)
    # transformers 5 returns a dict for tokenize=True; render to text, then encode in one batch.
    texts = []
    for i, conversation in enumerate(conversations):
        try:
            texts.append(tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False, **template_kwargs))
        except Exception as exc:  # the model's Jinja template refused the messages (e.g. roles must alternate)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            given = f" or {TEMPLATE_KWARGS_KEY} ({', '.join(template_kwargs)})" if template_kwargs else ""
            raise fail(i, f"the tokenizer's chat template cannot render its messages ({first})",
                       f"fix the messages{given} to the form the model's template expects") from None
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def template_variables(tokenizer) -> set[str] | None:
    """The names the tokenizer's chat template(s) read from their caller, or None when there is no
    template or its Jinja code cannot be parsed here (then nothing is said about the names)."""
    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]  # named templates
    if not all(isinstance(source, str) for source in sources):
        return None
    try:
        from jinja2 import meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(sources[0]).environment  # transformers' own extensions and globals
        return set().union(*(meta.find_undeclared_variables(environment.parse(source)) for source in sources))
    except Exception:  # another transformers, or a template only its own renderer accepts
        return None


def template_kwargs_notes(tokenizer, template_kwargs: Mapping[str, Any]) -> list[str]:
    """One warning per entry of ``template_kwargs`` the tokenizer's chat template never reads."""
    if not template_kwargs:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        return [f"warning: {TEMPLATE_KWARGS_KEY} is set, but the model's tokenizer has no chat template: "
                "plain-text prompts are encoded as they are, so it changes no prompt"]
    names = template_variables(tokenizer)
    if names is None:
        return []
    own = sorted(names - _SUPPLIED)
    notes = []
    for name in template_kwargs:
        if name in names:
            continue
        near = difflib.get_close_matches(name, own, n=1)
        hint = (f"did you mean '{near[0]}'?" if near else
                f"it reads {', '.join(own)}" if own else "it reads no argument of its own")
        notes.append(f"warning: {TEMPLATE_KWARGS_KEY}.{name}: the model's chat template never reads '{name}', "
                     f"so it changes no prompt; {hint}")
    return notes
