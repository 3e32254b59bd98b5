"""load_sft_dataset and collate_sft: loss only on the response and its EOS."""

import pytest
import torch

from klppo.data.sft_dataset import collate_sft, load_sft_dataset
from klppo.errors import UserError


def load(path, tok, **kw):
    kw.setdefault("max_length", 256)
    kw.setdefault("log", lambda s: None)
    return load_sft_dataset(path, tok, **kw)


def parts(tok, question, answer):
    prompt = tok(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    response = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return prompt, response


def test_loss_mask_covers_only_the_response_and_eos(tok, write_parquet):
    path = write_parquet([{"prompt": [{"role": "user", "content": "1 + 2?"}], "response": "1 + 2 = 3 #### 3"}])
    (ex,) = load(path, tok)
    prompt, response = parts(tok, "1 + 2?", "1 + 2 = 3 #### 3")
    assert ex.input_ids == prompt + response
    assert ex.loss_mask == [False] * len(prompt) + [True] * len(response)
    assert ex.input_ids[-1] == tok.eos_token_id


def test_plain_text_prompt_is_encoded_as_text_without_the_chat_template(tok, write_parquet):
    plain = write_parquet([{"prompt": "1 + 2?", "response": "3"}], "plain.parquet")
    (ex,) = load(plain, tok)
    prompt = tok("1 + 2?")["input_ids"]
    assert ex.input_ids == prompt + tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.loss_mask == [False] * len(prompt) + [True] * (len(ex.input_ids) - len(prompt))


def test_plain_text_prompts_for_a_model_with_a_chat_template_are_warned_about(tok, base_tok, write_parquet):
    """verl's SFT renders a text prompt as a user message; klppo encodes it as written, and says so."""
    plain = write_parquet([{"prompt": "1 + 2?", "response": "3"}, {"prompt": "2 + 2?", "response": "4"}],
                          "plain.parquet")
    logs = []
    load(plain, tok, log=logs.append)
    assert logs[1].startswith(f"warning: 2 of the 2 prompts in {plain} are plain text, encoded as they are with no "
                              "chat template (verl's SFT would render each as a user message)")
    for tokenizer, rows in ((base_tok, [{"prompt": "1 + 2?", "response": "3"}]),  # a base model: text is all it reads
                            (tok, [{"prompt": [{"role": "user", "content": "1 + 2?"}], "response": "3"}])):
        logs = []
        load(write_parquet(rows, "other.parquet"), tokenizer, log=logs.append)
        assert len(logs) == 1 and not logs[0].startswith("warning")


def test_a_base_model_trains_on_plain_text_and_refuses_messages_naming_the_row(base_tok, write_parquet):
    plain = write_parquet([{"prompt": "1 + 2?", "response": "3"}], "plain.parquet")
    assert len(load(plain, base_tok)) == 1
    chat = write_parquet([{"prompt": [{"role": "user", "content": "1 + 2?"}], "response": "3"}], "chat.parquet")
    with pytest.raises(UserError, match=f"{chat} row 0, column 'prompt': the prompt is chat messages"):
        load(chat, base_tok)


def test_custom_keys_and_missing_response_column(tok, write_parquet):
    path = write_parquet([{"question": "1 + 2?", "answer": "3"}])
    assert len(load(path, tok, prompt_key="question", response_key="answer")) == 1
    with pytest.raises(UserError, match="no column 'response'"):
        load(path, tok, prompt_key="question")


def test_non_string_response_is_a_user_error(tok, write_parquet):
    path = write_parquet([{"prompt": "q", "response": None}])
    with pytest.raises(UserError, match=r"row 0, column 'response': expected a response string"):
        load(path, tok)


def test_overlong_example_error_right_and_left_truncation(tok, write_parquet):
    path = write_parquet([{"prompt": [{"role": "user", "content": "1 + 2 + 3 + 4?"}],
                           "response": "1 + 2 + 3 + 4 = 10 #### 10"}])
    prompt, response = parts(tok, "1 + 2 + 3 + 4?", "1 + 2 + 3 + 4 = 10 #### 10")
    full, limit = prompt + response, len(prompt) + len(response) - 5
    with pytest.raises(UserError, match=r"longer than data.max_length=.*set data.truncation=left\|right"):
        load(path, tok, max_length=limit)
    (right,) = load(path, tok, max_length=limit, truncation="right")
    assert right.input_ids == full[:limit] and right.input_ids[-1] != tok.eos_token_id
    (left,) = load(path, tok, max_length=limit, truncation="left")
    assert left.input_ids == full[-limit:] and left.input_ids[-1] == tok.eos_token_id
    assert sum(left.loss_mask) == len(response) and len(left.loss_mask) == limit
    with pytest.raises(UserError, match="data.truncation is 'middle'; set it to one of error, left, right$"):
        load(path, tok, max_length=limit, truncation="middle")  # verl's SFT has no middle cut either


def test_collate_sft_right_pads_with_false_masks(tok, write_parquet):
    path = write_parquet([{"prompt": "q", "response": "1"}, {"prompt": "a longer question", "response": "12 #### 12"}])
    examples = load(path, tok)
    input_ids, attention_mask, loss_mask = collate_sft(examples, pad_token_id=tok.pad_token_id)
    n0, width = len(examples[0].input_ids), len(examples[1].input_ids)
    assert input_ids.shape == attention_mask.shape == loss_mask.shape == (2, width)
    assert attention_mask.dtype == loss_mask.dtype == torch.bool
    assert input_ids[0, :n0].tolist() == examples[0].input_ids and input_ids[0, n0:].eq(tok.pad_token_id).all()
    assert attention_mask[0].tolist() == [True] * n0 + [False] * (width - n0)
    assert loss_mask[0].tolist() == examples[0].loss_mask + [False] * (width - n0)
    assert loss_mask[1].tolist() == examples[1].loss_mask


def test_verls_dict_keys_read_the_prompt_and_response_inside_a_column(tok, write_parquet):
    rows = [{"extra_info": {"question": "1 + 2?", "answer": "3", "meta": {"id": "a"}}}]
    path = write_parquet(rows)
    (nested,) = load(path, tok, prompt_key="extra_info", response_key="extra_info", prompt_dict_keys=["question"],
                     response_dict_keys=["answer"])
    (flat,) = load(write_parquet([{"prompt": "1 + 2?", "response": "3"}], "flat.parquet"), tok)
    assert nested == flat
    with pytest.raises(UserError, match=r"row 0, column 'extra_info': data.response_dict_keys reads "
                                        r"extra_info.meta.solution, but extra_info.meta has no 'solution' \(it holds "
                                        r"keys id\)"):
        load(path, tok, prompt_key="extra_info", response_key="extra_info", prompt_dict_keys=["question"],
             response_dict_keys=["meta", "solution"])
