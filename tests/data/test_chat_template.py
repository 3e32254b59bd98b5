"""data.apply_chat_template_kwargs: the chat template's own arguments reach every prompt encoder
(RL, ranked, SFT), as verl passes them; names the template never reads are warned about."""

import copy

import pytest

from klppo.data.chat_template import encode_chats, template_kwargs_notes, template_variables
from klppo.data.ranked import load_ranked_dataset
from klppo.data.rl_dataset import load_rl_dataset
from klppo.data.sft_dataset import load_sft_dataset
from klppo.errors import UserError
from klppo.models.tiny import CHAT_TEMPLATE
from tests.conftest import THINKING_TEMPLATE

NO_THINKING = {"enable_thinking": False}
CHAT = [{"role": "user", "content": "Tom has 7 apples."}]


@pytest.fixture
def thinking_tok(tok):
    tokenizer = copy.deepcopy(tok)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def test_the_kwargs_reach_the_template_as_apply_chat_template_takes_them(thinking_tok):
    (plain,) = encode_chats(thinking_tok, [CHAT])
    (ids,) = encode_chats(thinking_tok, [CHAT], template_kwargs=NO_THINKING)
    text = thinking_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert ids == thinking_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == plain + thinking_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert encode_chats(thinking_tok, [CHAT], template_kwargs={"enable_thinking": True}) == [plain]


def _ranked_row(content):
    return {"prompt": [{"role": "user", "content": content}], "responses": ["a", "b"], "ranking": [0, 1]}


@pytest.mark.parametrize("reader", ["rl", "ranked", "sft"])
def test_every_prompt_reader_renders_with_the_kwargs(thinking_tok, write_parquet, rl_row, reader):
    contents = ["Tom has 7 apples.", "Ann has 3 pens and 4 cups."]
    if reader == "rl":
        path = write_parquet([rl_row(c) for c in contents])
        read = lambda **kw: [r.prompt_ids for r in load_rl_dataset(path, thinking_tok, max_prompt_length=256, **kw)]
    elif reader == "ranked":
        path = write_parquet([_ranked_row(c) for c in contents])
        read = lambda **kw: [r.prompt_ids for r in load_ranked_dataset(path, thinking_tok, max_prompt_length=256, **kw)]
    else:
        path = write_parquet([{"prompt": [{"role": "user", "content": c}], "response": "12"} for c in contents])
        read = lambda **kw: [[t for t, is_response in zip(e.input_ids, e.loss_mask) if not is_response]
                             for e in load_sft_dataset(path, thinking_tok, max_length=256, **kw)]  # the prompt
    quiet = dict(log=lambda s: None)
    plain, no_thinking = read(**quiet), read(template_kwargs=NO_THINKING, **quiet)
    thought = thinking_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert no_thinking == [ids + thought for ids in plain]


def test_plain_text_prompts_are_not_rendered_so_the_kwargs_leave_them_alone(thinking_tok, write_parquet, rl_row):
    path = write_parquet([rl_row(prompt="Tom has 7 apples.")])
    load = lambda **kw: load_rl_dataset(path, thinking_tok, max_prompt_length=256, log=lambda s: None, **kw)
    assert load(template_kwargs=NO_THINKING)[0].prompt_ids == load()[0].prompt_ids


def test_a_template_that_refuses_a_value_names_the_row_and_the_kwargs(tok, write_parquet, rl_row):
    tokenizer = copy.deepcopy(tok)
    tokenizer.chat_template = ("{% if reasoning_effort not in ['low', 'medium', 'high'] %}"
                               "{{ raise_exception('reasoning_effort must be low, medium or high') }}{% endif %}"
                               + CHAT_TEMPLATE)
    path = write_parquet([rl_row()])
    with pytest.raises(UserError, match=r"row 0.*reasoning_effort must be low, medium or high.*fix the messages or "
                                        r"data.apply_chat_template_kwargs \(reasoning_effort\)"):
        load_rl_dataset(path, tokenizer, max_prompt_length=256, log=lambda s: None,
                        template_kwargs={"reasoning_effort": "extreme"})


def test_the_names_a_template_reads_are_found_in_its_jinja_code(tok, thinking_tok):
    assert template_variables(tok) == {"tools", "messages", "add_generation_prompt"}
    assert template_variables(thinking_tok) == {"tools", "messages", "add_generation_prompt", "enable_thinking"}
    named = copy.deepcopy(tok)
    named.chat_template = {"default": CHAT_TEMPLATE, "tool_use": "{{ tools }}{{ builtin_tools }}"}
    assert {"tools", "builtin_tools", "messages"} <= template_variables(named)


def test_names_the_template_never_reads_are_warned_about_with_the_nearest_one(thinking_tok, tok, base_tok):
    assert template_kwargs_notes(thinking_tok, NO_THINKING) == []
    assert template_kwargs_notes(thinking_tok, {}) == []
    (typo, other) = template_kwargs_notes(thinking_tok, {"enable_thinkng": False, "reasoning_effort": "low",
                                                         "enable_thinking": False})
    assert typo == ("warning: data.apply_chat_template_kwargs.enable_thinkng: the model's chat template never reads "
                    "'enable_thinkng', so it changes no prompt; did you mean 'enable_thinking'?")
    assert other.endswith("never reads 'reasoning_effort', so it changes no prompt; it reads enable_thinking")
    assert template_kwargs_notes(tok, NO_THINKING)[0].endswith("it reads no argument of its own")
    (note,) = template_kwargs_notes(base_tok, NO_THINKING)
    assert "the model's tokenizer has no chat template" in note
