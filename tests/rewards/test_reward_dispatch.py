"""default_compute_score dispatch, custom reward functions and score_responses."""

import math
import pickle

import pytest

from klppo.errors import UserError
from klppo.rewards.score import default_compute_score, load_custom_reward_function, make_reward_fn, score_responses


def write_module(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_gsm8k_data_sources_use_the_gsm8k_rule():
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_compute_score("gsm8k", "#### 13", "12", {}) == 0.0


def test_unknown_data_source_names_it_the_known_ones_and_the_fix():
    with pytest.raises(UserError) as err:
        default_compute_score("my/dataset", "#### 1", "1")
    msg = str(err.value)
    assert "'my/dataset'" in msg and "openai/gsm8k" in msg and "custom_reward_function.path" in msg


def test_gsm8k_without_ground_truth_is_a_user_error():
    with pytest.raises(UserError, match="reward_model.ground_truth"):
        default_compute_score("openai/gsm8k", "#### 1", None)


def test_custom_function_is_loaded_and_called_with_verls_keywords(tmp_path):
    path = write_module(tmp_path, (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str)) + extra_info.get('bonus', 0)\n"
        "def as_dict(extra_info, ground_truth, solution_str, data_source):\n"
        "    return {'score': 2, 'acc': True}\n"))
    fn = make_reward_fn(path, "compute_score")
    assert fn("anything", "abc", None, {"bonus": 1}) == 4.0
    assert fn("anything", "abc", None, None) == 3.0
    assert make_reward_fn(path, "as_dict")("d", "s", "g", {}) == 2.0
    assert pickle.loads(pickle.dumps(fn))("d", "ab", None, {}) == 2.0


def test_default_reward_fn_dispatches_by_data_source():
    fn = make_reward_fn(None, "compute_score")
    assert fn("openai/gsm8k", "7 + 5 = 12 #### 12", "12", {}) == 1.0


def test_missing_file_missing_function_and_non_callable_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"custom_reward_function.path '.*nope.py' not found"):
        load_custom_reward_function(str(tmp_path / "nope.py"), "compute_score")
    path = write_module(tmp_path, "THRESHOLD = 3\ndef reward(a, b, c, d):\n    return 1.0\n")
    with pytest.raises(UserError, match=r"custom_reward_function.name 'compute_score' is not defined.*reward"):
        load_custom_reward_function(path, "compute_score")
    with pytest.raises(UserError, match="'THRESHOLD' in .* is a int, not a function"):
        load_custom_reward_function(path, "THRESHOLD")


def test_file_that_fails_to_import_is_a_one_line_user_error(tmp_path):
    path = write_module(tmp_path, "def compute_score(:\n", name="broken.py")
    with pytest.raises(UserError, match=r"broken.py' failed to import \(SyntaxError"):
        load_custom_reward_function(path, "compute_score")


@pytest.mark.parametrize("value", ["'high'", "None", "{'acc': 1}", "[1.0, 2.0]"])
def test_non_numeric_return_values_are_user_errors_naming_the_function(tmp_path, value):
    body = f"def bad(data_source, solution_str, ground_truth, extra_info):\n    return {value}\n"
    path = write_module(tmp_path, body)
    with pytest.raises(UserError, match=r"reward function custom_reward_function bad in .* returned"):
        make_reward_fn(path, "bad")("d", "s", "g", {})


def test_nan_passes_through_as_a_float(tmp_path):
    path = write_module(tmp_path, "def f(data_source, solution_str, ground_truth, extra_info):\n"
                                  "    return float('nan')\n")
    assert math.isnan(make_reward_fn(path, "f")("d", "s", "g", {}))


def test_score_responses_gives_one_score_per_response():
    scores = score_responses(make_reward_fn(None), ["openai/gsm8k"] * 3,
                             ["#### 12", "#### 13", "no answer"], ["12", "12", "12"], [{}, None, {}])
    assert scores == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("header", ["def compute_score(solution, truth):",
                                    "def compute_score(data_source, solution_str, ground_truth):",
                                    "def compute_score(data_source, solution_str, ground_truth, extra_info, /):",
                                    "def compute_score(data_source, solution_str, ground_truth, extra_info, mode):"])
def test_a_function_that_cannot_take_verls_four_keywords_is_refused_when_it_loads(tmp_path, header):
    path = write_module(tmp_path, f"{header}\n    return 0.0\n")
    with pytest.raises(UserError) as err:
        make_reward_fn(path, "compute_score")
    message = str(err.value)
    assert "custom_reward_function.name 'compute_score'" in message and path in message
    assert "data_source=..., solution_str=..., ground_truth=..., extra_info=..." in message
    assert "\n" not in message


def test_a_class_without_those_parameters_is_refused_when_it_loads(tmp_path):
    path = write_module(tmp_path, "class compute_score:\n    pass\n")
    with pytest.raises(UserError, match=r"takes \(\), but klppo calls it as verl does"):
        make_reward_fn(path, "compute_score")


@pytest.mark.parametrize("header", ["def compute_score(**kwargs):",
                                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, "
                                    "*, scale=1.0):",
                                    "def compute_score(*args, **kwargs):"])
def test_functions_that_take_verls_keywords_in_any_form_load(tmp_path, header):
    path = write_module(tmp_path, f"{header}\n    return 0.5\n")
    assert make_reward_fn(path, "compute_score")("d", "s", "g", {}) == 0.5


def test_an_exception_in_the_function_is_one_user_error_naming_the_function_its_file_and_the_row(tmp_path):
    path = write_module(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                  "    if extra_info['index'] == 5:\n"
                                  "        raise KeyError('answer')\n"
                                  "    return 1.0\n")
    fn = make_reward_fn(path, "compute_score")
    infos = [{"index": 4}, {"index": 5}]
    with pytest.raises(UserError) as err:
        score_responses(fn, ["d", "d"], ["a", "b"], [None, None], infos, ["t.parquet row 4", "t.parquet row 5"])
    message = str(err.value)
    assert message.startswith("t.parquet row 5: reward function custom_reward_function compute_score in ")
    assert f"'{path}' raised KeyError: 'answer'" in message and "fix the function" in message
    assert isinstance(err.value.__cause__, KeyError)  # kept for a debugger


def test_a_wrong_return_value_names_the_row_it_was_scoring(tmp_path):
    path = write_module(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                  "    return extra_info['value']\n")
    with pytest.raises(UserError, match=r"^v.parquet row 2: reward function .* returned 'b' \(str\); return a number"):
        score_responses(make_reward_fn(path), ["d", "d"], ["x", "y"], [None, None], [{"value": 1.0}, {"value": "b"}],
                        ["v.parquet row 1", "v.parquet row 2"])


@pytest.mark.parametrize("body", ["def compute_score(**kw):\n    yield 1.0\n",
                                  "async def compute_score(**kw):\n    yield 1.0\n"])
def test_generator_functions_are_refused_when_they_load(tmp_path, body):
    with pytest.raises(UserError, match="is a generator function, but klppo calls it and uses what it returns"):
        make_reward_fn(write_module(tmp_path, body), "compute_score")


# ---- verl's reward_kwargs, and async reward functions ----


def test_reward_kwargs_reach_every_call_and_win_over_verls_four_keywords(tmp_path):
    path = write_module(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info, scale=1.0):\n"
                                  "    return scale * len(solution_str) + extra_info.get('bonus', 0)\n")
    assert make_reward_fn(path, reward_kwargs={"scale": 0.5})("d", "abcd", None, {}) == 2.0
    overriding = make_reward_fn(path, reward_kwargs={"extra_info": {"bonus": 10}})  # verl's merge: theirs win
    assert overriding("d", "ab", None, {"bonus": 1}) == 12.0
    assert pickle.loads(pickle.dumps(overriding))("d", "ab", None, {}) == 12.0


@pytest.mark.parametrize("header, named", [
    ("def compute_score(data_source, solution_str, ground_truth, extra_info):", "'scale', 'mode'"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info, scale):", "'mode'")])
def test_reward_kwargs_the_function_cannot_take_are_refused_when_it_loads(tmp_path, header, named):
    path = write_module(tmp_path, f"{header}\n    return 0.0\n")
    with pytest.raises(UserError) as err:
        make_reward_fn(path, reward_kwargs={"scale": 2, "mode": "strict"})
    message = str(err.value)
    assert f"which has no parameter {named} that custom_reward_function.reward_kwargs passes on every call" in message
    with pytest.raises(UserError, match="that trainer.gold_reward.reward_kwargs passes"):
        make_reward_fn(path, key="trainer.gold_reward", reward_kwargs={"mode": "strict"})
    assert make_reward_fn(write_module(tmp_path, "def f(**kw):\n    return kw['mode'] == 'strict'\n", "kw.py"), "f",
                          reward_kwargs={"mode": "strict"})("d", "s", None, {}) == 1.0


ASYNC_JUDGE = """
import asyncio

started = []

async def compute_score(data_source, solution_str, ground_truth, extra_info, expected=4):
    started.append(solution_str)
    # every call of the batch must be under way before any returns: awaited one by one, this times out
    await asyncio.wait_for(_all_started(expected), timeout=10)
    if solution_str == "boom":
        raise ValueError("judge unreachable")
    return {"score": float(len(solution_str)), "judged": 1.0}

async def _all_started(expected):
    while len(started) < expected:
        await asyncio.sleep(0.001)
"""


def test_an_async_function_scores_a_batch_with_its_calls_awaited_together(tmp_path):
    from klppo.rewards.score import score_responses_with_components

    fn = make_reward_fn(write_module(tmp_path, ASYNC_JUDGE, "judge.py"))
    scores, parts = score_responses_with_components(fn, ["d"] * 4, ["a", "bb", "ccc", "dddd"], [None] * 4, [{}] * 4)
    assert scores == [1.0, 2.0, 3.0, 4.0] and parts == [{"judged": 1.0}] * 4
    alone = make_reward_fn(write_module(tmp_path, ASYNC_JUDGE, "judge_alone.py"), reward_kwargs={"expected": 1})
    assert alone("d", "xyz", None, {}) == 3.0  # one call, awaited on its own


def test_an_async_functions_failure_names_the_row_it_was_scoring(tmp_path):
    fn = make_reward_fn(write_module(tmp_path, ASYNC_JUDGE, "judge_fails.py"), reward_kwargs={"expected": 2})
    with pytest.raises(UserError) as err:
        score_responses(fn, ["d", "d"], ["ok", "boom"], [None, None], [{}, {}], ["t.parquet row 0", "t.parquet row 1"])
    assert str(err.value).startswith("t.parquet row 1: reward function custom_reward_function compute_score in ")
    assert "raised ValueError: judge unreachable (data_source 'd')" in str(err.value)
    assert isinstance(err.value.__cause__, ValueError)


def test_an_exit_in_the_file_or_the_function_is_a_user_error_not_an_exit(tmp_path):
    with pytest.raises(UserError, match=r"failed to import \(SystemExit: no GPU\)"):
        make_reward_fn(write_module(tmp_path, "raise SystemExit('no GPU')\n", name="exits.py"))
    path = write_module(tmp_path, "def compute_score(**kw):\n    raise SystemExit(0)\n")
    with pytest.raises(UserError, match=r"raised SystemExit: 0"):
        make_reward_fn(path)("d", "s", "g", {})


@pytest.mark.parametrize("truth", ["Natalia sold 48 clips in April. #### 72", "seventy-two", "1/2", ""])
def test_a_gsm8k_ground_truth_no_answer_can_equal_is_refused_up_front_naming_the_row(truth):
    from klppo.rewards.score import check_scorable

    rows = [("openai/gsm8k", "72"), ("openai/gsm8k", truth)]
    with pytest.raises(UserError, match=r"^data.train_files, t.parquet row 1: .*which no answer can equal; give the "
                                        r"final number alone"):
        check_scorable(make_reward_fn(None), rows, "data.train_files", ["t.parquet row 0", "t.parquet row 1"])


@pytest.mark.parametrize("truth", ["72", 72, 72.0, "1,000", "$5", "-3", "0.25"])
def test_gsm8k_ground_truths_that_an_answer_can_equal_pass(truth):
    from klppo.rewards.score import check_scorable

    check_scorable(make_reward_fn(None), [("openai/gsm8k", truth)], "data.train_files", ["t.parquet row 0"])


def test_a_bool_entry_is_a_component_of_1_or_0_and_text_is_none():
    from klppo.rewards.score import reward_components

    # verl's math_dapo returns {"score": ..., "acc": <bool>, "pred": <str>}: its DAPO recipe filters groups by acc
    assert reward_components({"score": 1.0, "acc": True, "pred": "12", "bonus": 2}) == {"acc": 1.0, "bonus": 2.0}
    assert reward_components({"score": 0.0, "acc": False}) == {"acc": 0.0} and reward_components(0.5) == {}
