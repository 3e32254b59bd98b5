"""verl's data.train_max_samples / val_max_samples in a run: the run trains and validates on that
many rows of its files, drawn by data.seed with data.shuffle (else the first ones)."""

import json

from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def _validated_prompts(run_dir) -> list[str]:
    return [json.loads(line)["input"] for line in (run_dir / "val" / "2.jsonl").read_text().splitlines()]


def test_a_run_trains_and_validates_on_the_capped_rows(ppo_overrides, task_dir, tmp_path):
    def run(name: str, **changes):
        return run_ppo(None, ppo_overrides(tmp_path / name, **{
            "trainer.total_training_steps": 2, "data.val_files": task_dir / "offline.parquet", "trainer.test_freq": 2,
            "trainer.validation_data_dir": tmp_path / name / "val", **changes}), print_fn=quiet)

    capped = run("capped", **{"data.train_max_samples": 8, "data.val_max_samples": 3})
    # one batch of 8 prompts is the whole epoch: each step is an epoch of its own
    assert [r["training/epoch"] for r in capped if "training/epoch" in r] == [0.0, 1.0]
    drawn = _validated_prompts(tmp_path / "capped")
    assert len(drawn) == 3
    first = run("first", **{"data.val_max_samples": 3, "data.shuffle": "false"})
    assert [r["training/epoch"] for r in first if "training/epoch" in r] == [0.0, 0.0]
    in_order = _validated_prompts(tmp_path / "first")
    assert len(in_order) == 3 and in_order != drawn  # the file's first three, not the seeded draw
