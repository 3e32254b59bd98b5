"""load_rl_dataset, collate_prompts and tokenize_responses."""

import pytest
import torch

from klppo.data.rl_dataset import collate_prompts, load_rl_dataset, tokenize_responses
from klppo.data.rollout_log_probs import LogProbsNeed
from klppo.errors import UserError


def chat_ids(tok, content):
    """Expected prompt ids: ChatML user turn + opened assistant turn, encoded without extras."""
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text, add_special_tokens=False)["input_ids"]


def load(path, tok, **kw):
    kw.setdefault("max_prompt_length", 256)
    kw.setdefault("log", lambda s: None)
    return load_rl_dataset(path, tok, **kw)


def test_good_file_loads_with_chat_template_ids_and_fields(tok, write_parquet, rl_row):
    path = write_parquet([rl_row("Tom has 7 apples."), rl_row("Ann has 3 pens.", reward_model={"style": "rule",
                                                                                              "ground_truth": "3"})])
    logs = []
    records = load(path, tok, log=logs.append)
    assert [r.index for r in records] == [0, 1]
    assert records[0].prompt_ids == chat_ids(tok, "Tom has 7 apples.")
    assert records[0].prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert records[0].raw_prompt == [{"role": "user", "content": "Tom has 7 apples."}]
    assert records[1].ground_truth == "3" and records[0].data_source == "openai/gsm8k"
    assert records[0].extra_info == {"split": "train", "index": 0}
    assert records[0].responses is None and records[0].scores is None
    assert logs == [f"loaded 2 prompts from {path}"]


def test_optional_columns_may_be_absent(tok, write_parquet):
    path = write_parquet([{"data_source": "mine", "prompt": [{"role": "user", "content": "hi"}]}])
    (record,) = load(path, tok)
    assert record.ground_truth is None and record.extra_info == {}


def test_numeric_ground_truth_is_kept_as_given(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(reward_model={"style": "rule", "ground_truth": 12})])
    assert load(path, tok)[0].ground_truth == 12


def test_custom_prompt_key_is_used(tok, write_parquet, rl_row):
    row = rl_row()
    row["messages"] = row.pop("prompt")
    path = write_parquet([row])
    assert load(path, tok, prompt_key="messages")[0].raw_prompt == row["messages"]


def test_plain_text_prompt_is_encoded_as_text_without_the_chat_template(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(prompt="Tom has 7 apples.")])
    (record,) = load(path, tok)
    assert record.prompt_ids == tok("Tom has 7 apples.")["input_ids"]
    assert record.raw_prompt == "Tom has 7 apples."


def test_a_base_model_reads_plain_text_but_refuses_messages_naming_the_row(base_tok, write_parquet, rl_row):
    plain = write_parquet([rl_row(prompt="a"), rl_row(prompt="b")], "plain.parquet")
    assert [r.prompt_ids for r in load(plain, base_tok)] == [base_tok("a")["input_ids"], base_tok("b")["input_ids"]]
    chats = write_parquet([rl_row(), rl_row()], "chats.parquet")
    with pytest.raises(UserError) as err:
        load([plain, chats], base_tok)
    message = str(err.value)
    assert message.startswith(f"{chats} row 0, column 'prompt': the prompt is chat messages, but the model's")
    assert "has no chat template" in message and "plain text (a string)" in message


def test_files_may_mix_plain_text_and_chat_prompts_each_row_by_its_own_form(tok, write_parquet, rl_row):
    plain = write_parquet([rl_row(prompt="Tom has 7 apples.")], "plain.parquet")
    chats = write_parquet([rl_row("Tom has 7 apples.")], "chats.parquet")
    text, chat = load([plain, chats], tok)
    assert text.prompt_ids == tok("Tom has 7 apples.")["input_ids"]
    assert chat.prompt_ids == chat_ids(tok, "Tom has 7 apples.")


@pytest.mark.parametrize("prompt, problem", [("", "the prompt is an empty string"),
                                             (7, "expected plain text or a list of chat messages, got 7")])
def test_an_empty_or_non_text_prompt_names_file_row_and_column(tok, write_parquet, rl_row, prompt, problem):
    path = write_parquet([rl_row(prompt=prompt)])
    with pytest.raises(UserError) as err:
        load(path, tok)
    assert str(err.value).startswith(f"{path} row 0, column 'prompt': {problem}")


def test_message_without_content_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(), rl_row(prompt=[{"role": "user"}])])
    with pytest.raises(UserError, match=r"row 1, column 'prompt': message 0 has no string 'content'"):
        load(path, tok)


def test_unknown_role_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(prompt=[{"role": "robot", "content": "x"}])])
    with pytest.raises(UserError, match="role 'robot'; use one of system, user, assistant"):
        load(path, tok)


def test_empty_data_source_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(data_source="")])
    with pytest.raises(UserError, match="column 'data_source'"):
        load(path, tok)


@pytest.mark.parametrize(
    "responses, problem",
    [("one string", "expected a non-empty list of strings"), ([], "expected a non-empty list of strings"),
     ([1, 2], "response 0 is 1, not a string")],
)
def test_responses_of_the_wrong_shape_are_user_errors(tok, write_parquet, rl_row, responses, problem):
    path = write_parquet([rl_row(responses=responses)])
    with pytest.raises(UserError, match=rf"row 0, column 'responses': {problem}"):
        load(path, tok, require_responses=True)


def test_missing_responses_column_is_an_error_when_required(tok, write_parquet, rl_row):
    path = write_parquet([rl_row()])
    with pytest.raises(UserError, match="no column 'responses'"):
        load(path, tok, require_responses=True)


def test_responses_and_scores_are_loaded(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(responses=["a", "b"], scores=[1, 0.5])])
    (record,) = load(path, tok, require_responses=True)
    assert record.responses == ["a", "b"] and record.scores == [1.0, 0.5]


def test_scores_length_mismatch_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(responses=["a", "b"], scores=[1.0])])
    with pytest.raises(UserError, match=r"column 'scores': expected a list of 2 numbers"):
        load(path, tok, require_responses=True)


def test_non_finite_score_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row(responses=["a"], scores=[float("nan")])])
    with pytest.raises(UserError, match="score 0 is nan, not a finite number"):
        load(path, tok)


def overlong_file(write_parquet, rl_row):
    return write_parquet([rl_row("1 2 3 4 5 6 7 8 9 " * 4), rl_row("hi"), rl_row("7 + 5 = 12 " * 5)])


def _token_counts(tok, texts):
    """Tokens of each response as klppo trains on it: the text without special tokens, then EOS."""
    return [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]


def test_behaviour_log_probs_load_one_list_per_response_of_its_token_count(tok, write_parquet, rl_row):
    responses = ["7 + 5 = 12 #### 12", "12"]
    log_probs = [[-0.25] * n for n in _token_counts(tok, responses)]
    path = write_parquet([rl_row(responses=responses, rollout_log_probs=log_probs),
                          rl_row(responses=responses, rollout_log_probs=None)])
    with_them, without = load(path, tok, require_responses=True)
    assert with_them.rollout_log_probs == log_probs and without.rollout_log_probs is None


BAD_LOG_PROBS = [
    ("one list short", lambda counts: [[-1.0] * counts[0]], "expected a list of 2 lists (one per response)"),
    ("a positive value", lambda counts: [[-1.0] * counts[0], [0.5] * counts[1]], "response 1, token 0: 0.5 is not "
     "a log-prob"),
    ("EOS left out", lambda counts: [[-1.0] * counts[0], [-1.0] * (counts[1] - 1)], "response 1 has {n} log-probs "
     "but {m} tokens"),
]


@pytest.mark.parametrize("make, problem", [c[1:] for c in BAD_LOG_PROBS], ids=[c[0] for c in BAD_LOG_PROBS])
def test_bad_behaviour_log_probs_name_file_row_column_and_the_command_that_fills_them(tok, write_parquet, rl_row,
                                                                                      make, problem):
    responses = ["7 + 5 = 12 #### 12", "12"]
    counts = _token_counts(tok, responses)
    good = [[-1.0] * n for n in counts]
    path = write_parquet([rl_row(responses=responses, rollout_log_probs=good),
                          rl_row(responses=responses, rollout_log_probs=make(counts))])
    with pytest.raises(UserError) as err:
        load(path, tok)
    message = str(err.value)
    assert message.startswith(f"{path} row 1, column 'rollout_log_probs': "), message
    assert problem.format(n=counts[1] - 1, m=counts[1]) in message and "klppo score-logprobs" in message


def test_rows_without_behaviour_log_probs_are_refused_when_the_correction_needs_them(tok, write_parquet, rl_row):
    responses = ["12"]
    path = write_parquet([rl_row(responses=responses, rollout_log_probs=[[-1.0] * _token_counts(tok, responses)[0]]),
                          rl_row(responses=responses, rollout_log_probs=None)])
    need = LogProbsNeed("algorithm.rollout_correction", "switch the correction off")
    with pytest.raises(UserError, match=f"{path} row 1, column 'rollout_log_probs': no behaviour log-probs for this "
                                        "row's responses, which algorithm.rollout_correction needs for every row; "
                                        ".*klppo score-logprobs.*, or switch the correction off"):
        load(path, tok, require_responses=True, require_rollout_log_probs=need)


def test_overlong_prompt_is_an_error_that_suggests_the_fixes(tok, write_parquet, rl_row):
    path = overlong_file(write_parquet, rl_row)
    with pytest.raises(UserError) as err:
        load(path, tok, max_prompt_length=20)
    msg = str(err.value)
    assert f"{path} row 0, column 'prompt'" in msg and "data.max_prompt_length=20" in msg
    assert "data.filter_overlong_prompts" in msg and "data.truncation" in msg


def test_overlong_prompts_are_filtered_and_counted(tok, write_parquet, rl_row):
    path = overlong_file(write_parquet, rl_row)
    logs = []
    records = load(path, tok, max_prompt_length=20, filter_overlong_prompts=True, log=logs.append)
    assert [r.index for r in records] == [0] and records[0].raw_prompt[0]["content"] == "hi"
    assert logs == [f"loaded 1 prompts from {path} (2 filtered as over 20 tokens)"]


def test_left_truncation_keeps_the_end_and_right_keeps_the_start(tok, write_parquet, rl_row):
    path = overlong_file(write_parquet, rl_row)
    full = chat_ids(tok, "1 2 3 4 5 6 7 8 9 " * 4)
    left = load(path, tok, max_prompt_length=20, truncation="left")
    right = load(path, tok, max_prompt_length=20, truncation="right")
    assert left[0].prompt_ids == full[-20:] and right[0].prompt_ids == full[:20]
    assert left[1].prompt_ids == right[1].prompt_ids == chat_ids(tok, "hi")


@pytest.mark.parametrize("limit", [20, 21])
def test_middle_truncation_keeps_both_ends_as_verl_cuts_them(tok, write_parquet, rl_row, limit):
    path = overlong_file(write_parquet, rl_row)
    full = chat_ids(tok, "1 2 3 4 5 6 7 8 9 " * 4)
    cut, short, _ = load(path, tok, max_prompt_length=limit, truncation="middle")
    head = limit // 2  # verl's postprocess_data: the first max // 2 tokens, then the last max - max // 2
    assert cut.prompt_ids == full[:head] + full[-(limit - head):] and len(cut.prompt_ids) == limit
    assert cut.prompt_ids[:3] == full[:3] and cut.prompt_ids[-3:] == full[-3:]  # the turn's opening and the generation prompt
    assert short.prompt_ids == chat_ids(tok, "hi")


def test_all_prompts_filtered_is_a_user_error(tok, write_parquet, rl_row):
    path = write_parquet([rl_row("long " * 20)])
    with pytest.raises(UserError, match="all 1 prompts"):
        load(path, tok, max_prompt_length=5, filter_overlong_prompts=True)


def test_unknown_truncation_is_a_user_error(tok, write_parquet, rl_row):
    with pytest.raises(UserError, match="data.truncation is 'center'; set it to one of error, left, right, middle"):
        load(write_parquet([rl_row()]), tok, truncation="center")


def test_collate_left_pads_to_the_longest_prompt(tok, write_parquet, rl_row):
    records = load(write_parquet([rl_row("hi"), rl_row("Tom has 7 apples and gets 5 more.")]), tok)
    input_ids, mask = collate_prompts(records, pad_token_id=tok.pad_token_id)
    short, long = len(records[0].prompt_ids), len(records[1].prompt_ids)
    assert input_ids.shape == mask.shape == (2, long) and mask.dtype == torch.bool
    assert input_ids.dtype == torch.long
    assert input_ids[0, long - short:].tolist() == records[0].prompt_ids
    assert input_ids[0, : long - short].eq(tok.pad_token_id).all()
    assert mask[0].tolist() == [False] * (long - short) + [True] * short
    assert mask[1].all() and input_ids[1].tolist() == records[1].prompt_ids


def test_tokenize_responses_appends_eos_and_truncates(tok):
    text_ids = tok("7 + 5 = 12 #### 12", add_special_tokens=False)["input_ids"]
    n = len(text_ids)
    (ids,), cut = tokenize_responses(["7 + 5 = 12 #### 12"], tok, max_response_length=n + 1)
    assert ids == text_ids + [tok.eos_token_id] and cut == 0
    (ids,), cut = tokenize_responses(["7 + 5 = 12 #### 12"], tok, max_response_length=n)
    assert ids == text_ids and cut == 1  # no room for EOS: the response did not end
    (ids, empty), cut = tokenize_responses(["7 + 5 = 12 #### 12", ""], tok, max_response_length=3)
    assert ids == text_ids[:3] and empty == [tok.eos_token_id] and cut == 1


@pytest.mark.parametrize("text", ['[{"role": "user", "content": "What is 2 + 3?"}]',
                                  ' [{"content": "Hi", "role": "system"}, {"role": "user", "content": "2+3?"}]'])
def test_chat_messages_written_as_json_text_are_refused_naming_the_row(text):
    from klppo.data.rl_dataset import check_prompt

    with pytest.raises(UserError, match=r"x.parquet row 4, column 'prompt': the prompt is a string of chat messages "
                                        r"written as JSON .*json.loads it"):
        check_prompt({"_file": "x.parquet", "_row": 4, "prompt": text}, "prompt")


@pytest.mark.parametrize("text", ["[1, 2, 3] sorted is", '[{"a": 1}] as a table', "[{ not json", "[]"])
def test_plain_text_that_only_looks_like_a_list_stays_plain_text(text):
    from klppo.data.rl_dataset import check_prompt

    assert check_prompt({"_file": "x.parquet", "_row": 4, "prompt": text}, "prompt") == text
