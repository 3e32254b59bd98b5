"""Multi-turn SFT rows (data.multiturn): a whole conversation per row, the loss on each assistant
turn's content and end of turn, never on a header or another role's turn."""

import copy

import pytest

from klppo.data.multiturn_sft import load_multiturn_sft_dataset
from klppo.data.sft_dataset import load_sft_dataset
from klppo.errors import UserError
from tests.conftest import THINKING_TEMPLATE

TWO_TURNS = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"},
             {"role": "user", "content": "and 3 + 4?"}, {"role": "assistant", "content": "7"}]


def load(path, tok, **kw):
    kw.setdefault("max_length", 256)
    kw.setdefault("log", lambda s: None)
    return load_multiturn_sft_dataset(path, tok, **kw)


def encoded(tok, pieces):
    """(ids, mask) of ChatML pieces (text, trained), each encoded on its own."""
    ids, mask = [], []
    for text, trained in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + piece, mask + [trained] * len(piece)
    return ids, mask


def test_every_assistant_turn_is_trained_and_nothing_else(tok, write_parquet):
    (example,) = load(write_parquet([{"messages": TWO_TURNS}]), tok)
    ids, mask = encoded(tok, [("<|im_start|>user\n1 + 2?<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
                              ("3<|im_end|>\n", True), ("<|im_start|>user\nand 3 + 4?<|im_end|>\n", False),
                              ("<|im_start|>assistant\n", False), ("7<|im_end|>\n", True)])
    assert example.input_ids == ids and example.loss_mask == mask
    whole = tok.apply_chat_template(TWO_TURNS, tokenize=False)
    assert tok.decode(example.input_ids) == whole  # the pieces make up the template's own text


def test_one_turn_trains_what_the_prompt_and_response_reader_trains(tok, write_parquet):
    one = TWO_TURNS[:2]
    (turns,) = load(write_parquet([{"messages": one}], "turns.parquet"), tok)
    (single,) = load_sft_dataset(write_parquet([{"prompt": one[:1], "response": "3"}], "single.parquet"), tok,
                                 max_length=256, log=lambda s: None)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert turns.input_ids == single.input_ids + newline  # ChatML's newline after the end of turn, trained too
    assert turns.loss_mask == single.loss_mask + [True] * len(newline)


def test_a_rows_enable_thinking_and_tools_and_the_runs_kwargs_reach_the_template(tok, write_parquet):
    switched = copy.deepcopy(tok)  # enable_thinking=false: a note of two special tokens opens the conversation
    switched.chat_template = ("{% if enable_thinking is defined and enable_thinking is false %}"
                              "{{ '<|im_start|><|im_end|>' }}{% endif %}{% if tools %}{{ tools | length }}{% endif %}"
                              + tok.chat_template)
    rows = [{"messages": TWO_TURNS, "enable_thinking": False, "tools": None},
            {"messages": TWO_TURNS, "enable_thinking": None, "tools": [{"name": "calc"}, {"name": "search"}]},
            {"messages": TWO_TURNS, "enable_thinking": None, "tools": None}]
    off, with_tools, default = load(write_parquet(rows), switched)
    note = switched.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert off.input_ids == note + default.input_ids and off.loss_mask == [False] * 2 + default.loss_mask
    # The two tools' count, then the tiny template's own rendering of their schemas.
    assert switched.decode(with_tools.input_ids).startswith('2<|im_start|>system\n# Tools\n<tools>\n{"name": "calc"}')
    (by_kwargs,) = load(write_parquet([{"messages": TWO_TURNS}], "k.parquet"), switched,
                        template_kwargs={"enable_thinking": False})
    assert by_kwargs.input_ids == off.input_ids


def test_a_template_whose_generation_prompt_differs_from_its_answers_is_refused(tok, write_parquet):
    thinking = copy.deepcopy(tok)  # the empty thought opens the generation prompt but no rendered answer
    thinking.chat_template = THINKING_TEMPLATE
    with pytest.raises(UserError, match="the chat template renders turn 1 not as its generation prompt opens it"):
        load(write_parquet([{"messages": TWO_TURNS}]), thinking, template_kwargs={"enable_thinking": False})
    (one_turn,) = load(write_parquet([{"messages": TWO_TURNS[:2]}], "one.parquet"), thinking)  # thinking on: fine
    assert sum(one_turn.loss_mask) > 0


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user", "content": "hi"}], "has no assistant turn, so nothing would be trained"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}], "opens with an assistant turn"),
    (None, "expected a non-empty list of chat messages"),
])
def test_rows_that_cannot_train_name_their_file_row_and_column(tok, write_parquet, messages, problem):
    path = write_parquet([{"messages": TWO_TURNS}, {"messages": messages}])
    with pytest.raises(UserError, match=rf"{path} row 1, column 'messages': .*{problem}"):
        load(path, tok)


# Qwen3's shape: the answer after the last question carries a (here empty) thought, earlier answers
# lose theirs, and the generation prompt opens the thought (enable_thinking=false).
DROPS_PAST_THOUGHTS = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<|im_start|><|im_end|>' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<|im_start|><|im_end|>' }}{%- endif %}")


def test_a_template_that_drops_past_thoughts_trains_each_answer_as_the_model_sees_it(tok, write_parquet):
    qwen3_like = copy.deepcopy(tok)
    qwen3_like.chat_template = DROPS_PAST_THOUGHTS
    logs, path = [], write_parquet([{"messages": TWO_TURNS}])
    first, second = load(path, qwen3_like, log=logs.append)
    thought = "<|im_start|><|im_end|>"
    assert (first.input_ids, first.loss_mask) == encoded(qwen3_like, [
        (f"<|im_start|>user\n1 + 2?<|im_end|>\n<|im_start|>assistant\n{thought}", False), ("3<|im_end|>\n", True)])
    assert (second.input_ids, second.loss_mask) == encoded(qwen3_like, [
        ("<|im_start|>user\n1 + 2?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"  # the first answer, thought dropped
         f"<|im_start|>user\nand 3 + 4?<|im_end|>\n<|im_start|>assistant\n{thought}", False), ("7<|im_end|>\n", True)])
    assert logs == [f"loaded 1 conversations from {path} as 2 examples (1 as one example per assistant turn, "
                    "since the chat template renders past turns differently as a conversation goes on)"]


def test_a_template_whose_answer_does_not_follow_its_generation_prompt_is_refused_by_row(tok, write_parquet):
    rewriting = copy.deepcopy(tok)  # writes how many messages there are first: no prompt starts its answer
    rewriting.chat_template = "{{ messages | length }}" + tok.chat_template
    with pytest.raises(UserError, match=r"row 0, column 'messages': the chat template renders turn 1 not as its "
                                        r"generation prompt opens it"):
        load(write_parquet([{"messages": TWO_TURNS}]), rewriting)


def test_a_base_model_and_over_long_conversations(tok, base_tok, write_parquet):
    path = write_parquet([{"messages": TWO_TURNS}])
    with pytest.raises(UserError, match="data.multiturn.enable renders conversations with the chat template, but "
                                        "the model's tokenizer has none"):
        load(path, base_tok)
    (whole,) = load(path, tok)
    with pytest.raises(UserError, match=r"the conversation is \d+ tokens, longer than data.max_length=10"):
        load(path, tok, max_length=10)
    (right,) = load(path, tok, max_length=10, truncation="right")
    assert right.input_ids == whole.input_ids[:10] and right.loss_mask == whole.loss_mask[:10]
