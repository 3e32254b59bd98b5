"""GSM8K rule reward, checked against verl's semantics (verl/utils/reward_score/gsm8k.py)."""

import pytest

from klppo.rewards.gsm8k import compute_score, extract_solution


def test_strict_takes_the_answer_after_the_last_hashes():
    assert extract_solution("48 / 2 = 24 #### 24 and then #### 72") == "72"
    assert extract_solution("#### -3") == "-3"
    assert extract_solution("the answer is 72") is None


def test_strict_removes_commas_and_flexible_takes_the_last_number():
    assert extract_solution("#### 1,000") == "1000"
    assert extract_solution("so 5 + 7 = 12 apples.", method="flexible") == "12"
    assert extract_solution("no digits here.", method="flexible") is None


def test_right_answer_scores_one_wrong_answer_format_score_missing_answer_zero():
    assert compute_score("Natalia sold 48 + 24 = 72 clips. #### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("the answer is 72", "72", format_score=0.1) == 0.0
    assert compute_score("the answer is 72", "72", method="flexible") == 1.0


def test_commas_in_the_answer_and_numeric_ground_truths_match():
    assert compute_score("#### 1,234", "1234") == 1.0
    assert compute_score("#### 72", 72) == 1.0
    assert compute_score("#### 72", 72.0) == 1.0


def test_only_the_last_300_characters_are_read():
    assert compute_score("#### 72" + "x" * 300, "72") == 0.0
    assert compute_score("#### 1 " + "x" * 300 + " #### 72", "72") == 1.0


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_solution("#### 1", method="loose")
