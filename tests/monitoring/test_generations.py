"""Sample generations as text: verl's <step>.jsonl files and the validation samples the loggers show."""

import json
import random

import numpy as np
import pytest
import torch

from klppo.data.arithmetic import arithmetic_corpus
from klppo.data.rl_dataset import PromptRecord
from klppo.monitoring.generations import (
    GENERATIONS_KEY, Generation, batch_generations, generations_text, pick_generations, write_generations,
)
from klppo.monitoring.logger import MetricsLogger, read_metrics
from klppo.models.tiny import train_tiny_tokenizer
from klppo.rollout.batch import assemble_batch, right_pad


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(arithmetic_corpus(200, seed=0))


def test_a_batch_decodes_to_its_prompts_and_responses_without_padding_or_special_tokens(tok):
    def prompt(text):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok(chat, add_special_tokens=False)["input_ids"]

    records = [PromptRecord(0, "arith", [], prompt("What is 2+3?"), "5", {}),
               PromptRecord(1, "arith", [], prompt("What is 10+20?"), 30, {})]
    answers = ["5", "The answer is 30", "31", "30"]
    ids, mask = right_pad([tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers],
                          tok.pad_token_id)
    batch = assemble_batch(records, 2, tok.pad_token_id, ids, mask)  # left-padded prompts, right-padded responses
    batch.reward_components = [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}, {"acc": 1.0}]
    generations = batch_generations(batch, tok, [1.0, 0.0, 0.0, 1.0])
    assert [g.output for g in generations] == answers  # the EOS and the padding dropped
    assert [g.input for g in generations] == ["user\nWhat is 2+3?\nassistant\n"] * 2 + ["user\nWhat is 10+20?\nassistant\n"] * 2
    assert [g.gts for g in generations] == ["5", "5", 30, 30]
    assert generations[1] == Generation(generations[1].input, "The answer is 30", "5", 0.0, {"acc": 0.0})


def test_a_step_file_has_one_verl_line_per_response_and_is_replaced_whole(tmp_path):
    folder = tmp_path / "rollouts"
    first = [Generation("q1", "a1 é", np.array([1, 2]), 1.0, {"acc": 1.0, "score": 5.0}),
             Generation("q2", "a2", np.int64(7), 0.5)]
    path = write_generations(folder, 3, first)
    assert path == folder / "3.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines == [{"input": "q1", "output": "a1 é", "gts": [1, 2], "score": 1.0, "step": 3, "acc": 1.0},
                     {"input": "q2", "output": "a2", "gts": 7, "score": 0.5, "step": 3}]
    assert "é" in path.read_text(encoding="utf-8")  # as verl writes it: ensure_ascii=False
    write_generations(folder, 3, first[1:])  # the step ran again (a resumed run, a rollback)
    assert len(path.read_text().splitlines()) == 1
    assert sorted(p.name for p in folder.iterdir()) == ["3.jsonl"]  # no partial file left behind


def test_the_validation_samples_shown_do_not_depend_on_the_order_they_came_in():
    generations = [Generation(f"prompt {i:02d}", f"answer {i}", None, float(i)) for i in range(20)]
    picked = pick_generations(generations, 4)
    assert len(picked) == 4 and len({g.input for g in picked}) == 4
    shuffled = generations[:]
    random.Random(0).shuffle(shuffled)
    assert pick_generations(shuffled, 4) == picked  # sorted by prompt first, then a fixed shuffle
    assert pick_generations(generations, 4) == picked
    assert pick_generations(generations, 100) == pick_generations(generations, 20)
    assert sorted(g.input for g in pick_generations(generations, 20)) == [g.input for g in generations]
    assert picked != generations[:4]  # shuffled, not the first prompts


def test_the_loggers_show_validation_samples_as_text_and_metrics_jsonl_never_holds_them(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    shown = [Generation("user\nWhat is 2+3?", "5", "5", 1.0), Generation("q2", "x" * 500, None, 0.0)]
    printed = []
    with MetricsLogger(tmp_path, ["console", "tensorboard", "wandb"], print_fn=printed.append) as logger:
        for step in (0, 2):
            record = logger.log(step, {"val-core/reward/mean": 0.5, GENERATIONS_KEY: shown})
            assert record == {"step": step, "val-core/reward/mean": 0.5}
    assert read_metrics(tmp_path) == [{"step": 0, "val-core/reward/mean": 0.5}, {"step": 2, "val-core/reward/mean": 0.5}]
    assert printed[-1] == generations_text(2, shown)
    assert printed[-1].splitlines()[:4] == ["validation samples at step 2:", "[1] score 1  (ground truth: 5)",
                                            "  input:  user", "          What is 2+3?"]
    assert printed[-1].endswith("x" * 400 + "... (100 more characters)")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors(f"{GENERATIONS_KEY}/text_summary")
    assert [t.step for t in texts] == [0, 2]
    assert "**Input:** user\nWhat is 2+3?\n\n**Output:** 5\n\n**Score:** 1.0" in texts[1].tensor_proto.string_val[0].decode()
    (table,) = (tmp_path / "wandb").glob("offline-run-*/files/media/table/val/generations_2_*.table.json")
    content = json.loads(table.read_text())
    assert content["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert [row[0] for row in content["data"]] == [0, 2]  # one row per validation, the earlier ones kept
    assert content["data"][1][1:4] == ["user\nWhat is 2+3?", "5", 1.0]


def test_a_step_without_samples_shows_none():
    printed = []
    logger = MetricsLogger("/nonexistent-never-written", [], print_fn=printed.append, rank=1)  # rank 1 writes nothing
    assert logger.log(1, {"x": torch.tensor(2.0), GENERATIONS_KEY: [Generation("q", "a", None, 1.0)]}) == {
        "step": 1, "x": 2.0}
    assert printed == []
