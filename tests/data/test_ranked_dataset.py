"""load_ranked_dataset: the four ranking forms, optional RL columns, and row-level errors."""

import re

import pytest

from klppo.data.ranked import load_ranked_dataset
from klppo.data.rollout_log_probs import LogProbsNeed
from klppo.errors import UserError

FORMS = ("ranking", "rankings", "scores", "chosen", "rejected")


def ranked_row(content="Tom has 7 apples and gets 5 more.", **columns):
    """One ranked row: a chat prompt plus ``columns``; every ranking column is present (null unless given).

    Keeping every column in every row gives all rows of a test file one Parquet schema, so rows
    using different ranking forms can share a file, as in real data.
    """
    row = {"prompt": [{"role": "user", "content": content}], "responses": None}
    row.update({form: None for form in FORMS})
    row.update(columns)
    return row


def good_row(**columns):
    return ranked_row(**{"responses": ["12", "11", "13"], "ranking": [0, 2, 1], **columns})


def load(path, tok, **kw):
    kw.setdefault("max_prompt_length", 256)
    kw.setdefault("log", lambda s: None)
    return load_ranked_dataset(path, tok, **kw)


def chat_ids(tok, content):
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text, add_special_tokens=False)["input_ids"]


def test_each_ranking_form_loads_in_one_file(tok, write_parquet):
    path = write_parquet([
        ranked_row("a", responses=["x", "y", "z"], ranking=[2, 0]),
        ranked_row("b", responses=["x", "y", "z"], rankings=[[0, 1, 2], [1, 0]]),
        ranked_row("c", responses=["x", "y", "z"], scores=[0.5, 2.0, -1.0]),
        ranked_row("d", chosen="good", rejected="bad"),
    ])
    logs = []
    a, b, c, d = load(path, tok, log=logs.append)
    assert [r.index for r in (a, b, c, d)] == [0, 1, 2, 3]
    assert a.responses == ["x", "y", "z"] and a.rankings == [[2, 0]] and a.scores is None  # partial ranking
    assert b.rankings == [[0, 1, 2], [1, 0]]  # several annotators, in order
    # scores 0.5, 2.0, -1.0 -> descending: response 1, then 0, then 2; scores kept
    assert c.rankings == [[1, 0, 2]] and c.scores == [0.5, 2.0, -1.0]
    assert d.responses == ["good", "bad"] and d.rankings == [[0, 1]] and d.scores is None
    assert logs == [f"loaded 4 ranked prompts from {path}"]


def test_prompt_is_tokenised_with_the_chat_template(tok, write_parquet):
    (record,) = load(write_parquet([good_row()]), tok)
    assert record.raw_prompt == [{"role": "user", "content": "Tom has 7 apples and gets 5 more."}]
    assert record.prompt_ids == chat_ids(tok, "Tom has 7 apples and gets 5 more.")


def test_plain_text_prompt_is_encoded_without_the_chat_template_even_by_a_base_model(base_tok, write_parquet):
    (record,) = load(write_parquet([good_row(prompt="Rate these.")]), base_tok)
    assert record.raw_prompt == "Rate these." and record.prompt_ids == base_tok("Rate these.")["input_ids"]
    path = write_parquet([good_row()], name="chat.parquet")
    with pytest.raises(UserError, match=re.escape(f"{path} row 0, column 'prompt': the prompt is chat messages")):
        load(path, base_tok)


def test_behaviour_log_probs_of_a_pair_follow_chosen_then_rejected(tok, write_parquet):
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in ("good", "bad")]
    log_probs = [[-0.5] * lengths[0], [-1.5] * lengths[1]]
    row = ranked_row("d", chosen="good", rejected="bad", rollout_log_probs=log_probs)
    (record,) = load(write_parquet([row]), tok, require_rollout_log_probs=LogProbsNeed("a setting", "no"))
    assert record.rollout_log_probs == log_probs


def test_optional_rl_columns_are_kept_when_present_and_defaulted_when_absent(tok, write_parquet):
    with_rl = good_row(data_source="openai/gsm8k", reward_model={"style": "rule", "ground_truth": "12"},
                       extra_info={"split": "train"})
    (record,) = load(write_parquet([with_rl]), tok)
    assert record.data_source == "openai/gsm8k" and record.ground_truth == "12"
    assert record.extra_info == {"split": "train"}
    (bare,) = load(write_parquet([good_row()], name="bare.parquet"), tok)
    assert bare.data_source is None and bare.ground_truth is None and bare.extra_info == {}


def test_equal_scores_keep_response_order(tok, write_parquet):
    (record,) = load(write_parquet([good_row(ranking=None, scores=[1.0, 3.0, 1.0])]), tok)
    assert record.rankings == [[1, 0, 2]]


def test_identical_chosen_and_rejected_are_allowed(tok, write_parquet):
    (record,) = load(write_parquet([ranked_row(chosen="same", rejected="same")]), tok)
    assert record.responses == ["same", "same"] and record.rankings == [[0, 1]]


def test_custom_prompt_key_is_used(tok, write_parquet):
    row = good_row()
    row["messages"] = row.pop("prompt")
    (record,) = load(write_parquet([row]), tok, prompt_key="messages")
    assert record.raw_prompt == row["messages"]


# Bad values in row 1 (row 0 is good), each with the column and words the error must name.
BAD_VALUES = [
    ("ranking index out of range", dict(ranking=[0, 3]), "ranking", "index 3, out of range for 3 responses"),
    ("duplicate index", dict(ranking=[1, 1]), "ranking", "lists response 1 twice"),
    ("ranking longer than responses", dict(ranking=[0, 1, 2, 0]), "ranking", "4 entries but the row has 3"),
    ("ranking of one response", dict(ranking=[2]), "ranking", "needs at least 2"),
    ("fewer than 2 responses", dict(responses=["12"], ranking=[0, 1]), "responses", "at least 2"),
    ("no ranking column", dict(ranking=None), "ranking", "none of the columns 'ranking', 'rankings', 'scores'"),
    ("two ranking columns", dict(scores=[1.0, 2.0, 3.0]), "scores", "'ranking' and 'scores' are given together"),
    ("scores length mismatch", dict(ranking=None, scores=[1.0, 2.0]), "scores", "expected a list of 3 numbers"),
    ("non-finite score", dict(ranking=None, scores=[1.0, float("inf"), 0.0]), "scores", "not a finite number"),
    ("bad annotator ranking", dict(ranking=None, rankings=[[0, 1], [0, 5]]), "rankings",
     "ranking 1 has index 5, out of range"),
    ("empty rankings", dict(ranking=None, rankings=[]), "rankings", "non-empty list of rankings"),
    ("chosen without rejected", dict(ranking=None, responses=None, chosen="a"), "rejected",
     "expected the rejected response as a string"),
    ("pair with responses", dict(ranking=None, chosen="a", rejected="b"), "responses",
     "given together with 'chosen'/'rejected'"),
    ("pair with a ranking", dict(responses=None, chosen="a", rejected="b"), "chosen",
     "'ranking' and 'chosen/rejected' are given together"),
    ("missing responses", dict(responses=None), "responses", "expected a non-empty list of strings"),
]


@pytest.mark.parametrize("overrides, column, problem", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_bad_value_is_a_user_error_naming_file_row_and_column(tok, write_parquet, overrides, column, problem):
    path = write_parquet([good_row(), good_row(**overrides)])
    with pytest.raises(UserError) as err:
        load(path, tok)
    message = str(err.value)
    assert message.startswith(f"{path} row 1, column '{column}': "), message
    assert problem in message and "\n" not in message


# Values of the wrong type; the file has only this row, since Parquet needs one type per column.
BAD_TYPES = [
    ("ranking as a string", dict(ranking="0,1"), "ranking", "not a list of response indices"),
    ("float indices", dict(ranking=[0.0, 1.0]), "ranking", "has entry 0.0, not an integer index"),
    ("rankings not nested", dict(ranking=None, rankings=[0, 1]), "rankings", "ranking 0 is 0, not a list"),
    ("responses not strings", dict(responses=[1, 2, 3]), "responses", "response 0 is 1, not a string"),
    ("scores as strings", dict(ranking=None, scores=["a", "b", "c"]), "scores", "score 0 is 'a'"),
    ("chosen not a string", dict(ranking=None, responses=None, chosen=1, rejected=2), "chosen",
     "expected the chosen response as a string"),
    ("prompt as a number", dict(prompt=5), "prompt", "expected plain text or a list of chat messages"),
]


@pytest.mark.parametrize("overrides, column, problem", [c[1:] for c in BAD_TYPES], ids=[c[0] for c in BAD_TYPES])
def test_wrong_type_is_a_user_error_naming_the_column(tok, write_parquet, overrides, column, problem):
    path = write_parquet([good_row(**overrides)])
    with pytest.raises(UserError, match=re.escape(f"{path} row 0, column '{column}': ")) as err:
        load(path, tok)
    assert problem in str(err.value)


def test_missing_prompt_column_names_the_file(tok, write_parquet):
    row = good_row()
    del row["prompt"]
    path = write_parquet([row])
    with pytest.raises(UserError, match=re.escape(f"data file '{path}' has no column 'prompt'")):
        load(path, tok)


def test_overlong_prompts_are_filtered_cut_or_rejected(tok, write_parquet):
    path = write_parquet([good_row(content="1 2 3 4 5 6 7 8 9 " * 4), good_row(content="hi")])
    logs = []
    (kept,) = load(path, tok, max_prompt_length=20, filter_overlong_prompts=True, log=logs.append)
    assert kept.index == 0 and kept.raw_prompt[0]["content"] == "hi"
    assert logs == [f"loaded 1 ranked prompts from {path} (1 filtered as over 20 tokens)"]
    cut = load(path, tok, max_prompt_length=20, truncation="left")
    assert len(cut[0].prompt_ids) == 20 and cut[0].prompt_ids == chat_ids(tok, "1 2 3 4 5 6 7 8 9 " * 4)[-20:]
    with pytest.raises(UserError, match=r"row 0, column 'prompt': prompt is \d+ tokens, longer than"):
        load(path, tok, max_prompt_length=20)
