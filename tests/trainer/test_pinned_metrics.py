"""Refactors keep numbers: the metrics of a few tiny runs are pinned and must stay bit-identical.

Each run goes through the real entry point in its own process, with one thread and torch's
AVX2 kernels (``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``), so the floats do not depend on how the
cores are shared or which vector unit the CPU has. The pinned values live in
``data/pinned_metrics.json``; a change that is *meant* to change numbers regenerates them with

    python tests/trainer/test_pinned_metrics.py

and says why in its commit message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PINNED = Path(__file__).parent / "data" / "pinned_metrics.json"
# Measurements of time and memory vary from run to run; everything else must not.
UNPINNED_PREFIXES = ("timing_s/", "perf/")

DETERMINISTIC_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
                     "MKL_CBWR": "AVX2", "TQDM_DISABLE": "1", "KLPPO_QUIET": "1"}


def pinned_runs(model: Path, task: Path, ranked: Path, words: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (entry module, overrides without the run folder) of each pinned run."""
    ppo = [
        f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=64", "data.max_response_length=16",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "trainer.total_training_steps=3",
    ]
    return {
        "ppo_offline_gae_adaptive_kl_packed": ("klppo.trainer.main_ppo", ppo + [
            f"data.train_files={task / 'offline.parquet'}", "actor_rollout_ref.rollout.name=offline",
            "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "trainer.save_freq=2",
        ]),
        "ppo_online_gae_with_validation": ("klppo.trainer.main_ppo", ppo + [
            f"data.train_files={task / 'train.parquet'}", f"data.val_files={task / 'val.parquet'}",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "algorithm.use_kl_in_reward=true", "trainer.test_freq=2", "actor_rollout_ref.actor.entropy_coeff=0.01",
        ]),
        "grpo_offline_rankings_kl_loss": ("klppo.trainer.main_ppo", ppo + [
            f"data.train_files={ranked}", "actor_rollout_ref.rollout.name=offline",
            "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ]),
        "sft": ("klppo.trainer.main_sft", [
            f"data.train_files={task / 'sft.parquet'}", f"data.val_files={task / 'sft.parquet'}",
            "data.max_length=96", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
            f"model.partial_pretrain={model}", "optim.lr=3e-3", "trainer.total_training_steps=4",
        ]),
        "rm_bradley_terry": ("klppo.trainer.main_rm", [
            f"data.train_files={words}", f"data.val_files={words}", "data.max_prompt_length=64",
            "data.max_response_length=16", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
            f"model.partial_pretrain={model}", "optim.lr=3e-3", "trainer.total_training_steps=4",
        ]),
    }


def run_pinned(name: str, module: str, overrides: list[str], out: Path) -> list[dict]:
    """Run one pinned run in a fresh process; its metrics without the time and memory ones."""
    run_dir = out / name
    cmd = [sys.executable, "-m", module, *overrides, f"trainer.default_local_dir={run_dir}", "trainer.logger=[]",
           "trainer.device=cpu", "trainer.resume_mode=disable"]
    env = {**os.environ, **DETERMINISTIC_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(UNPINNED_PREFIXES)} for r in records]


def _inputs(out: Path) -> tuple[Path, Path, Path, Path]:
    """The tiny model, the arithmetic task, a ranked file and a word-ranking file, as conftest makes them."""
    spec = importlib.util.spec_from_file_location("klppo_tests_conftest", Path(__file__).parents[1] / "conftest.py")
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)

    from klppo.data.arithmetic import (
        arithmetic_corpus,
        write_arithmetic_offline_parquet,
        write_arithmetic_parquet,
        write_arithmetic_ranked_parquet,
        write_arithmetic_sft_parquet,
    )
    from klppo.models.tiny import build_tiny_model_folder

    model = build_tiny_model_folder(out / "model", arithmetic_corpus(200, 0), seed=0, **shared.TINY)
    task = out / "task"
    task.mkdir()
    write_arithmetic_parquet(task / "train.parquet", 32, seed=1)
    write_arithmetic_offline_parquet(task / "offline.parquet", 32, seed=2, n_responses=2)
    write_arithmetic_parquet(task / "val.parquet", 8, seed=3, split="test")
    write_arithmetic_sft_parquet(task / "sft.parquet", 64, seed=4, wrong_fraction=0.5)
    ranked = write_arithmetic_ranked_parquet(task / "ranked.parquet", 16, 5, n_responses=4)
    words = shared._write_word_ranking(task / "words.parquet", 16, 0)
    return model, task, ranked, words


def measure_all(out: Path) -> dict[str, list[dict]]:
    runs = pinned_runs(*_inputs(out))
    return {name: run_pinned(name, module, overrides, out / "runs") for name, (module, overrides) in runs.items()}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    return measure_all(tmp_path_factory.mktemp("pinned"))


@pytest.mark.parametrize("name", sorted(json.loads(PINNED.read_text())) if PINNED.is_file() else [])
def test_tiny_runs_reproduce_their_pinned_metrics_bit_for_bit(measured, name):
    pinned = json.loads(PINNED.read_text())[name]
    got = measured[name]
    assert [r["step"] for r in got] == [r["step"] for r in pinned]
    for mine, theirs in zip(got, pinned):
        assert mine.keys() == theirs.keys(), (name, mine["step"], sorted(mine.keys() ^ theirs.keys()))
        differing = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
        assert not differing, (name, mine["step"], differing)


def test_every_pinned_run_is_pinned():
    assert PINNED.is_file() and sorted(json.loads(PINNED.read_text())) == sorted(
        pinned_runs(Path("m"), Path("t"), Path("r"), Path("w")))


if __name__ == "__main__":  # regenerate the pinned values (a change meant to change numbers)
    with tempfile.TemporaryDirectory() as tmp:
        values = measure_all(Path(tmp))
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps(values, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}: {', '.join(f'{k} ({len(v)} steps)' for k, v in values.items())}")
