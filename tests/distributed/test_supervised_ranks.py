"""SFT and reward-model training on several ranks: the same updates as one process, exact resume."""

import pytest
from launch import RM, SFT, assert_same_metrics, assert_same_weights, launch, run_ok
from transformers import AutoModelForSequenceClassification

from klppo.monitoring.logger import read_metrics

def _common(run_dir, world: int) -> list[str]:
    return [f"trainer.default_local_dir={run_dir}", "trainer.logger=[]", "trainer.device=cpu",
            f"trainer.n_gpus_per_node={world}"]


def test_sft_on_two_ranks_trains_exactly_as_one_process(tiny_model_dir, task_dir, tmp_path):
    def overrides(name: str, world: int) -> list[str]:
        return [f"data.train_files={task_dir / 'sft.parquet'}", f"data.val_files={task_dir / 'sft.parquet'}",
                "data.max_length=96", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=4",
                f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3", "trainer.total_training_steps=3",
                *_common(tmp_path / name, world)]

    run_ok(overrides("one", 1), None, module=SFT)
    run_ok(overrides("two", 2), 2, module=SFT)
    one = read_metrics(tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3] and "val/loss" in one[-1]
    assert_same_metrics(one, read_metrics(tmp_path / "two"))
    assert_same_weights(tmp_path / "one" / "hf", tmp_path / "two" / "hf")


@pytest.fixture(scope="module")
def rm_runs(tiny_model_dir, tmp_path_factory, word_ranking_file):
    """Reward models: one process, two ranks with checkpoints, and two ranks stopped at step 2 and resumed."""
    out = tmp_path_factory.mktemp("rm_ranks")
    train, val = word_ranking_file(out / "train.parquet", 32, 0), word_ranking_file(out / "val.parquet", 8, 1)

    def overrides(name: str, world: int, steps: int, loss: str = "bradley_terry") -> list[str]:
        return [f"data.train_files={train}", f"data.val_files={val}", "data.max_prompt_length=64",
                "data.max_response_length=16", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
                f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3", f"trainer.total_training_steps={steps}",
                "trainer.save_freq=2", f"loss.type={loss}", *_common(out / name, world)]

    run_ok(overrides("one", 1, 4), None, module=RM)
    run_ok(overrides("two", 2, 4), 2, module=RM)
    run_ok(overrides("resumed", 2, 2), 2, module=RM)
    run_ok(overrides("resumed", 2, 4), 2, module=RM)
    run_ok(overrides("pl_one", 1, 2, "plackett_luce"), None, module=RM)
    run_ok(overrides("pl_two", 2, 2, "plackett_luce"), 2, module=RM)
    return out


@pytest.mark.parametrize("loss", ["bradley_terry", "plackett_luce"])
def test_reward_model_training_on_two_ranks_is_exactly_one_process(rm_runs, loss):
    one, two = ("one", "two") if loss == "bradley_terry" else ("pl_one", "pl_two")
    records = read_metrics(rm_runs / one)
    assert "val/pair_accuracy" in records[-1] and "train/pair_accuracy" in records[-1]
    assert_same_metrics(records, read_metrics(rm_runs / two))
    assert_same_weights(rm_runs / one / "hf", rm_runs / two / "hf", AutoModelForSequenceClassification)


def test_reward_model_training_resumed_in_new_processes_repeats_the_uninterrupted_run(rm_runs):
    resumed = read_metrics(rm_runs / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_same_metrics(read_metrics(rm_runs / "two"), resumed)
    assert_same_weights(rm_runs / "two" / "hf", rm_runs / "resumed" / "hf", AutoModelForSequenceClassification)
    assert sorted(p.name for p in rm_runs.joinpath("resumed").glob("global_step_*")) == ["global_step_2",
                                                                                          "global_step_4"]


def test_a_damaged_rank_file_stops_every_rank_with_its_error_and_changes_nothing(tiny_model_dir, task_dir, tmp_path):
    """Each rank checks its own rank_R.pt; the ranks agree on what they found before any of them
    restores (a collective the refusing rank would leave the others waiting in) or writes."""
    def overrides(steps: int) -> list[str]:
        return [f"data.train_files={task_dir / 'sft.parquet'}", "data.max_length=96", "data.train_batch_size=8",
                "data.micro_batch_size_per_gpu=4", f"model.partial_pretrain={tiny_model_dir}",
                f"trainer.total_training_steps={steps}", "trainer.save_freq=1", *_common(tmp_path / "run", 2)]

    run_ok(overrides(1), 2, module=SFT)
    rank_1 = tmp_path / "run" / "global_step_1" / "rank_1.pt"
    rank_1.write_bytes(rank_1.read_bytes()[:200])
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    done = launch(overrides(2), 2, timeout=120, module=SFT)
    assert done.returncode != 0
    errors = {line for line in done.stderr.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1 and "rank_1.pt" in errors.pop(), done.stderr[-3000:]
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr, done.stderr[-3000:]
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
