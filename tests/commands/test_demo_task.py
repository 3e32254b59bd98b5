"""The demo's task (validation problems share no (a, op, b) triple with any problem a model trains on) and its
recipe (LoRA adapters unless ``--full``)."""

import re

import pyarrow.parquet as pq
import pytest

from klppo.commands import demo
from klppo.commands.demo_rankings import prepare_rankings
from klppo.commands.demo_recipe import LORA, MAX_OPERAND, demo_overrides, prepare, with_changes
from klppo.config import load_ppo_config
from klppo.data.arithmetic import is_held_out

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


@pytest.mark.parametrize("argv, lora", [([], True), (["--lora"], True), (["--full"], False),
                                        (["--offline-rankings"], True), (["--offline-rankings", "--full"], False)])
def test_the_demo_trains_lora_adapters_unless_told_full(monkeypatch, tmp_path, argv, lora):
    called = {}
    record = lambda out, seed, steps, use_lora: called.update(lora=use_lora) or []  # noqa: E731
    monkeypatch.setattr(demo, "run_demo", record)
    monkeypatch.setattr(demo, "run_rankings_demo", record)
    assert demo.main([*argv, "--out", str(tmp_path)]) == 0
    assert called == {"lora": lora}


def test_full_and_lora_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--full", "--lora"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_demo_run_is_the_recipe_of_lora_adapters_and_full_is_the_recipe_without_them(tmp_path):
    lora = load_ppo_config(None, demo_overrides(tmp_path, tmp_path / "sft", tmp_path / "run", 0, 40))
    full = load_ppo_config(None, demo_overrides(tmp_path, tmp_path / "sft", tmp_path / "run", 0, 40, lora=False))
    assert lora.actor_rollout_ref.model.lora_rank == int(LORA["actor_rollout_ref.model.lora_rank"]) > 0
    assert lora.actor_rollout_ref.actor.optim.lr == float(LORA["actor_rollout_ref.actor.optim.lr"])
    assert full.actor_rollout_ref.model.lora_rank == 0 and full.actor_rollout_ref.actor.optim.lr == 2e-4
