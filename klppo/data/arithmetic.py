"""The built-in demo task: one-step arithmetic word problems in GSM8K's format.

Problems are short ("Tom has 7 apples and gets 5 more. How many apples does Tom have?")
with operands in [0, max_operand) and non-negative results, so a tiny model can learn them on
a CPU. The (a, op, b) triples are split once and for all into a training part and a held-out
part (``part``): problems drawn from the held-out part share no triple with any training
problem, so a validation set drawn there measures generalisation, not memory.
Solutions are written as GSM8K's are, ending in ``#### <answer>``, and the RL Parquet uses
``data_source="openai/gsm8k"`` so the GSM8K rule reward scores it, exactly as verl's
``examples/data_preprocess/gsm8k.py`` lays GSM8K out.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klppo.errors import UserError

# verl's gsm8k preprocessing appends this; the demo leaves it out by default (shorter prompts).
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# Where an SFT solution's planted error sits (``write_arithmetic_sft_parquet``).
SFT_ERRORS = ("result", "answer")

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe")
OBJECTS = (("apple", "apples"), ("book", "books"), ("coin", "coins"), ("pen", "pens"),
           ("cat", "cats"), ("ball", "balls"), ("cup", "cups"), ("card", "cards"))

# (op, template); {a} and {b} are the operands, {a_obj}/{b_obj}/{objs} the object noun.
TEMPLATES = (
    ("+", "{name} has {a} {a_obj} and gets {b} more. How many {objs} does {name} have?"),
    ("+", "{name} has {a} {a_obj} and buys {b} more. How many {objs} does {name} have now?"),
    ("+", "There are {a} {a_obj} in a box. {name} puts in {b} more. How many {objs} are in the box?"),
    ("-", "{name} has {a} {a_obj} and loses {b}. How many {objs} does {name} have left?"),
    ("-", "{name} has {a} {a_obj} and gives away {b}. How many {objs} does {name} have now?"),
    ("-", "There are {a} {a_obj} in a box. {name} takes out {b}. How many {objs} are in the box?"),
)
MAX_OPERAND = 20  # operands are drawn from [0, MAX_OPERAND)
HELD_OUT_EVERY = 5  # one (a, op, b) triple in 5 belongs to the held-out part
PARTS = ("all", "train", "held_out")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One word problem: ``a op b`` with op "+" or "-"."""

    question: str
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    def solution(self, result: int | None = None, answer: int | None = None) -> str:
        """GSM8K-style solution "7 + 5 = 12 #### 12". ``result`` overrides the (correct) result of the
        computation, and the final answer with it; ``answer`` overrides the final answer alone."""
        result = self.answer if result is None else result
        return f"{self.a} {self.op} {self.b} = {result} #### {result if answer is None else answer}"


def is_held_out(a: int, op: str, b: int) -> bool:
    """Whether triple (a, op, b) belongs to the held-out part (a fixed hash: the same on every run)."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % HELD_OUT_EVERY == 0


def make_arithmetic_problem(rng: random.Random, max_operand: int = MAX_OPERAND, part: str = "all") -> ArithmeticProblem:
    """Draw one problem from ``rng`` with operands in [0, max_operand); subtraction stays >= 0.

    ``part``: "all" triples, only the "train" part, or only the "held_out" part (problems of
    the other part are drawn again).
    """
    if part not in PARTS:
        raise UserError(f"part is {part!r}; use one of {', '.join(PARTS)}")
    for _ in range(10_000):
        op, template = rng.choice(TEMPLATES)
        name = rng.choice(NAMES)
        singular, plural = rng.choice(OBJECTS)
        a = rng.randrange(max_operand)
        b = rng.randrange(max_operand) if op == "+" else rng.randrange(a + 1)
        if part == "all" or is_held_out(a, op, b) == (part == "held_out"):
            question = template.format(name=name, a=a, b=b, a_obj=singular if a == 1 else plural, objs=plural)
            return ArithmeticProblem(question, a, op, b)
    raise UserError(f"no arithmetic problem with operands below {max_operand} falls in the {part} part; "
                    "raise max_operand")


def make_problems(n: int, seed: int, max_operand: int = MAX_OPERAND, part: str = "all") -> list[ArithmeticProblem]:
    """``n`` problems drawn from ``random.Random(seed)`` (from ``part``); the same seed gives the same list."""
    if n <= 0:
        raise UserError(f"number of arithmetic problems is {n}; ask for at least 1")
    rng = random.Random(seed)
    return [make_arithmetic_problem(rng, max_operand, part) for _ in range(n)]


def _prompt(problem: ArithmeticProblem, instruction: str) -> list[dict]:
    content = f"{problem.question} {instruction}" if instruction else problem.question
    return [{"role": "user", "content": content}]


def write_arithmetic_parquet(
    path: str | Path, n: int, seed: int, *, instruction: str = "", split: str = "train",
    max_operand: int = MAX_OPERAND, part: str = "all",
) -> Path:
    """Write ``n`` RL prompts in verl's RLHFDataset format (as verl's gsm8k preprocessing does)."""
    rows = []
    for i, p in enumerate(make_problems(n, seed, max_operand, part)):
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": _prompt(p, instruction),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "answer": p.solution(), "question": p.question},
        })
    return _write(path, rows)


def write_arithmetic_sft_parquet(
    path: str | Path, n: int, seed: int, *, wrong_fraction: float, error: str = "result", instruction: str = "",
    max_operand: int = MAX_OPERAND, part: str = "all",
) -> Path:
    """Write ``n`` prompt/response rows; ``round(n * wrong_fraction)`` of them answer one too many.

    The wrong responses carry a systematic error, which a warm-started policy learns and PPO with
    the GSM8K reward then has to unlearn. ``error``: where it sits, in the ``result`` ("7 + 5 = 13
    #### 13": the computation itself is off) or only in the final ``answer`` ("7 + 5 = 12 #### 13":
    the computation is right and the answer does not copy it).
    """
    if not 0.0 <= wrong_fraction <= 1.0:
        raise UserError(f"wrong_fraction is {wrong_fraction}; set it between 0 and 1")
    if error not in SFT_ERRORS:
        raise UserError(f"error is {error!r}; set it to one of {', '.join(SFT_ERRORS)}")
    problems = make_problems(n, seed, max_operand, part)
    wrong = set(random.Random(seed + 1).sample(range(n), round(n * wrong_fraction)))
    rows = [{"prompt": _prompt(p, instruction),
             "response": p.solution(**({error: p.answer + 1} if i in wrong else {}))} for i, p in enumerate(problems)]
    return _write(path, rows)


def write_arithmetic_offline_parquet(
    path: str | Path, n: int, seed: int, *, n_responses: int = 2, instruction: str = "", split: str = "train",
    max_operand: int = MAX_OPERAND,
) -> Path:
    """RL prompts with recorded ``responses`` for offline runs: one correct, the rest off by 1, 2, ...

    The order of the responses is shuffled per row, so position carries no information.
    """
    if n_responses < 1:
        raise UserError(f"n_responses is {n_responses}; ask for at least 1")
    rng = random.Random(seed + 7)
    rows = []
    for i, p in enumerate(make_problems(n, seed, max_operand)):
        responses = [p.solution(p.answer + k) for k in range(n_responses)]
        rng.shuffle(responses)
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": _prompt(p, instruction),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i},
            "responses": responses,
        })
    return _write(path, rows)


def write_arithmetic_ranked_parquet(
    path: str | Path, n: int, seed: int, *, n_responses: int = 4, instruction: str = "",
    max_operand: int = MAX_OPERAND, part: str = "all",
) -> Path:
    """Ranked-response rows: ``n_responses`` answers off by 0, 1, 2, ... ranked by closeness.

    The responses are shuffled per row and ``ranking`` lists their indices best first, the
    format of ``klppo.data.ranked`` (and of the demo of learning from rankings).
    """
    if n_responses < 2:
        raise UserError(f"n_responses is {n_responses}; a ranking needs at least 2")
    rng = random.Random(seed + 11)
    rows = []
    for i, p in enumerate(make_problems(n, seed, max_operand, part)):
        offsets = list(range(n_responses))  # closeness to the right answer: 0 is best
        rng.shuffle(offsets)
        responses = [p.solution(p.answer + k) for k in offsets]
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": _prompt(p, instruction),
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"index": i},
            "responses": responses,
            "ranking": sorted(range(n_responses), key=lambda j: offsets[j]),
        })
    return _write(path, rows)


def arithmetic_corpus(n: int, seed: int, *, instruction: str = "", max_operand: int = MAX_OPERAND,
                      part: str = "all") -> list[str]:
    """Texts for training the demo tokenizer: questions, solutions and the ChatML role lines.

    The ChatML special tokens themselves are left out (the tokenizer adds them as specials).
    """
    texts = [GSM8K_INSTRUCTION, instruction, "system\n", "user\n", "assistant\n"]
    for p in make_problems(n, seed, max_operand, part):
        texts.append(f"user\n{p.question}\nassistant\n{p.solution()}\n")
        texts.append(p.solution(p.answer + 1))
    return [t for t in texts if t]


def _write(path: str | Path, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out
