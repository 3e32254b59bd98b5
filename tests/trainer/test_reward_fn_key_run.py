"""verl's data.reward_fn_key: the column it names picks each row's reward function (handed to it as
data_source), while validation's metrics stay grouped by the data_source column, as in verl."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.commands.main_ppo import run_ppo
from klppo.errors import UserError

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(data_source == 'A')\n"


def test_the_named_column_picks_the_reward_and_validation_groups_by_data_source(ppo_overrides, task_dir, tmp_path):
    rows = pq.read_table(task_dir / "train.parquet").to_pylist()
    for i, row in enumerate(rows):
        row["scorer"] = "AB"[i % 2]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text(REWARD)

    def run(name: str, **changes):
        return run_ppo(None, ppo_overrides(tmp_path / name, **{
            "data.train_files": tmp_path / "train.parquet", "data.val_files": tmp_path / "train.parquet",
            "data.val_max_samples": 8, "data.shuffle": "false", "actor_rollout_ref.rollout.name": "hf",
            "custom_reward_function.path": tmp_path / "reward.py", "trainer.total_training_steps": 1,
            "trainer.val_before_train": "true", "data.reward_fn_key": "scorer", **changes}), print_fn=lambda *a, **k: None)

    records = run("scorer")
    validation = next(r for r in records if any(k.startswith("val-core/") for k in r))
    assert validation["val-core/openai/gsm8k/reward/mean@1"] == 0.5  # rows A and B alternate; one data_source
    assert next(r for r in records if "critic/score/mean" in r)["critic/score/mean"] == 0.5
    with pytest.raises(UserError, match="column 'nope'"):
        run("missing", **{"data.reward_fn_key": "nope"})
