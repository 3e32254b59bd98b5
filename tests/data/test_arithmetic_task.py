"""The built-in arithmetic task: deterministic problems, correct answers, loadable Parquet."""

import random

import pyarrow.parquet as pq
import pytest

from klppo.data.arithmetic import (
    ArithmeticProblem,
    arithmetic_corpus,
    make_arithmetic_problem,
    make_problems,
    write_arithmetic_parquet,
    write_arithmetic_sft_parquet,
)
from klppo.data.rl_dataset import load_rl_dataset
from klppo.data.sft_dataset import load_sft_dataset
from klppo.errors import UserError
from klppo.rewards.score import make_reward_fn


def test_problems_are_deterministic_per_seed():
    assert make_problems(50, seed=1) == make_problems(50, seed=1)
    assert make_problems(50, seed=1) != make_problems(50, seed=2)
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert make_arithmetic_problem(rng_a) == make_arithmetic_problem(rng_b)


def test_answers_are_correct_small_and_non_negative():
    problems = make_problems(300, seed=0)
    assert {p.op for p in problems} == {"+", "-"}
    assert len({p.question.split(" ")[0] for p in problems}) > 3  # several names / templates
    for p in problems:
        assert 0 <= p.a < 20 and 0 <= p.b < 20 and p.answer >= 0
        assert p.answer == eval(f"{p.a} {p.op} {p.b}")
        assert f" {p.a} " in p.question and f" {p.b}" in p.question


def test_solution_is_gsm8k_style_with_an_optional_wrong_answer():
    p = ArithmeticProblem("Tom has 7 apples and gets 5 more. How many apples does Tom have?", 7, "+", 5)
    assert p.answer == 12
    assert p.solution() == "7 + 5 = 12 #### 12"
    assert p.solution(13) == "7 + 5 = 13 #### 13"
    assert p.solution(answer=13) == "7 + 5 = 12 #### 13"
    assert ArithmeticProblem("q", 9, "-", 4).solution() == "9 - 4 = 5 #### 5"


def test_arithmetic_parquet_loads_and_scores_its_own_solutions(tok, tmp_path):
    path = write_arithmetic_parquet(tmp_path / "train.parquet", 20, seed=3)
    row = pq.read_table(path).to_pylist()[0]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"]["style"] == "rule" and row["extra_info"]["index"] == 0
    records = load_rl_dataset(str(path), tok, max_prompt_length=128, log=lambda s: None)
    assert len(records) == 20
    reward = make_reward_fn(None)
    for r in records:
        solution = r.extra_info["answer"]
        assert solution.endswith(f"#### {r.ground_truth}")
        assert reward(r.data_source, solution, r.ground_truth, r.extra_info) == 1.0


def test_instruction_is_appended_to_the_question(tmp_path):
    path = write_arithmetic_parquet(tmp_path / "t.parquet", 2, seed=0, instruction="Answer after ####.")
    assert pq.read_table(path).to_pylist()[0]["prompt"][0]["content"].endswith("? Answer after ####.")


def test_sft_parquet_has_the_requested_fraction_of_off_by_one_answers(tok, tmp_path):
    path = write_arithmetic_sft_parquet(tmp_path / "sft.parquet", 40, seed=2, wrong_fraction=0.25)
    rows = pq.read_table(path).to_pylist()
    problems = make_problems(40, seed=2)
    wrong = [r["response"] == p.solution(p.answer + 1) for r, p in zip(rows, problems)]
    right = [r["response"] == p.solution() for r, p in zip(rows, problems)]
    assert sum(wrong) == 10 and sum(right) == 30
    assert len(load_sft_dataset(str(path), tok, max_length=128, log=lambda s: None)) == 40
    with pytest.raises(UserError, match="wrong_fraction"):
        write_arithmetic_sft_parquet(tmp_path / "bad.parquet", 4, seed=0, wrong_fraction=1.5)


def test_sft_parquet_plants_its_error_in_the_final_answer_alone_when_asked(tmp_path):
    path = write_arithmetic_sft_parquet(tmp_path / "sft.parquet", 40, seed=2, wrong_fraction=0.25, error="answer")
    rows, problems = pq.read_table(path).to_pylist(), make_problems(40, seed=2)
    wrong = [r["response"] == f"{p.a} {p.op} {p.b} = {p.answer} #### {p.answer + 1}" for r, p in zip(rows, problems)]
    assert sum(wrong) == 10 and sum(r["response"] == p.solution() for r, p in zip(rows, problems)) == 30
    with pytest.raises(UserError, match="error is 'both'"):
        write_arithmetic_sft_parquet(tmp_path / "bad.parquet", 4, seed=0, wrong_fraction=0.5, error="both")


def test_corpus_round_trips_through_the_tiny_tokenizer(tok):
    texts = arithmetic_corpus(20, seed=0)
    assert any("####" in t for t in texts) and not any("<|im_start|>" in t for t in texts)
    for text in texts[:10]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_held_out_problems_share_no_triple_with_training_problems():
    from klppo.data.arithmetic import is_held_out

    train = {(p.a, p.op, p.b) for p in make_problems(2000, seed=3, max_operand=100, part="train")}
    held_out = {(p.a, p.op, p.b) for p in make_problems(500, seed=4, max_operand=100, part="held_out")}
    assert train and held_out and not train & held_out
    everything = [(p.a, p.op, p.b) for p in make_problems(5000, seed=5, max_operand=100)]
    share = sum(is_held_out(*t) for t in everything) / len(everything)
    assert 0.15 < share < 0.25  # one triple in five
