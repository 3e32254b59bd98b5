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
