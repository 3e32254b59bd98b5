"""The demo's task: validation problems share no (a, op, b) triple with any problem a model trains on."""

import re

import pyarrow.parquet as pq

from klppo.data.arithmetic import is_held_out
from klppo.commands.demo_rankings import prepare_rankings
from klppo.commands.demo_recipe import MAX_OPERAND, prepare, with_changes

SOLUTION = re.compile(r"^(\d+) ([+-]) (\d+) = ")


def _triples(texts) -> set[tuple[int, str, int]]:
    out = set()
    for text in texts:
        a, op, b = SOLUTION.match(text).groups()
        out.add((int(a), op, int(b)))
    return out


def test_demo_validation_problems_are_disjoint_from_every_training_problem(tmp_path):
    data_dir, _ = prepare(tmp_path, seed=3, print_fn=lambda *_: None)
    prepare_rankings(data_dir, seed=3)
    rows = {name: pq.read_table(data_dir / f"{name}.parquet").to_pylist()
            for name in ("train", "val", "sft", "ranked", "rm_train", "ranked_val", "responses")}
    seen = {
        "train": _triples(r["extra_info"]["answer"] for r in rows["train"]),
        "sft": _triples(r["response"] for r in rows["sft"]),
        **{name: _triples(text for r in rows[name] for text in r["responses"])
           for name in ("ranked", "rm_train", "responses")},
    }
    val = _triples(r["extra_info"]["answer"] for r in rows["val"])
    ranked_val = _triples(text for r in rows["ranked_val"] for text in r["responses"])
    for name, triples in seen.items():
        assert triples and not triples & (val | ranked_val), name
    # Many distinct problems on both sides (610 triples with operands below 20, 122 held out).
    assert len(val) > 100 and len(seen["train"]) > 400
    assert all(is_held_out(*t) for t in val | ranked_val) and max(t[0] for t in val) == MAX_OPERAND - 1
    assert "ranking" not in rows["responses"][0] and rows["responses"][0]["responses"] == rows["ranked"][0]["responses"]


def test_with_changes_replaces_keys_in_place_and_appends_new_ones():
    assert with_changes(["a=1", "b=2"], {"b": "3", "c": "4"}) == ["a=1", "b=3", "c=4"]
