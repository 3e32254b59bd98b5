"""examples/smollm2's online run, its parts on their own: the reward, the held-out split, and the
YAML run end to end with the tiny test model in place of SmolLM2 (fast; no optional package)."""

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from klppo.data.arithmetic import is_held_out
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"
REPO = EXAMPLE.parents[1]


@pytest.mark.parametrize(("response", "truth", "score"), [
    ("Ben has 6 pens and gets 10 more, so Ben has 6 + 10 = 16 pens.", "16", 1.0),
    ("16", "16", 1.0),
    ("The answer is 16.", 16, 1.0),                       # a full stop is not a decimal point
    ("There are 1,200 cups in the box.", "1200", 1.0),      # thousands separators
    ("16 - 3 = 13 balls are left. In total 16 + 13 = 29.", "13", 0.0),  # the last number counts
    ("She has -4 coins.", "-4", 1.0),
    ("Sam has no balls left.", "0", 0.0),                  # no number: no answer
    ("17 #### 17", "16", 0.0),
])
def test_reward_reads_the_last_integer_of_the_response(response, truth, score, smollm2_script):
    reward = smollm2_script("reward")
    assert reward.compute_score("openai/gsm8k", response, truth, {}) == score


def triple(row: dict) -> tuple[int, str, int]:
    """(a, op, b) of a row, read from its recorded solution "a op b = r #### r"."""
    a, op, b = re.match(r"(\d+) ([+-]) (\d+) =", row["extra_info"]["answer"]).groups()
    return int(a), op, int(b)


def test_validation_problems_share_no_operands_and_operator_with_training_problems(tmp_path, smollm2_script):
    prepare = smollm2_script("prepare_online")
    train_file, val_file = prepare.write_online_parquets(tmp_path, n_train=500, n_val=100, seed=3)
    train = pq.read_table(train_file).to_pylist()
    val = pq.read_table(val_file).to_pylist()
    assert (len(train), len(val)) == (500, 100)
    train_triples, val_triples = {triple(r) for r in train}, {triple(r) for r in val}
    assert not train_triples & val_triples
    assert all(is_held_out(*t) for t in val_triples) and not any(is_held_out(*t) for t in train_triples)
    assert all(r["prompt"][-1]["content"].endswith(prepare.INSTRUCTION) for r in train + val)


def test_the_online_yaml_runs_a_validated_grpo_step_with_the_example_reward(tmp_path, tiny_model_dir, monkeypatch,
                                                                           smollm2_script):
    monkeypatch.chdir(REPO)  # the YAML names its reward file relative to the repository root
    prepare = smollm2_script("prepare_online")
    train_file, val_file = prepare.write_online_parquets(tmp_path / "data", n_train=16, n_val=4, seed=0)
    run_dir = tmp_path / "run"
    run_ppo(str(EXAMPLE / "ppo_online.yaml"), [
        f"data.train_files={train_file}", f"data.val_files={val_file}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.response_length=8",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.logger=[]",
        f"trainer.default_local_dir={run_dir}",
    ])
    records = read_metrics(run_dir)
    validated = [r["step"] for r in records if any(k.startswith("val-core/") for k in r)]
    assert validated == [0, 1]  # before the first step and after the last
    step = next(r for r in records if r["step"] == 1)
    assert step["critic/score/mean"] in {0.0, 0.25, 0.5, 0.75, 1.0}  # 4 samples scored 0 or 1 each
    assert "actor/kl_loss" in step
