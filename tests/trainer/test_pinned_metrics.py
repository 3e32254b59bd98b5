"""Refactors keep numbers: the metrics of a few tiny runs are pinned and must stay bit-identical.

Each run goes through the real entry point in its own process, with one thread and torch's
AVX2 kernels (``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``), so the floats do not depend on how the
cores are shared. They still differ in the last bits between CPU kinds (an AVX-512/AMX Xeon and
the machine the first values came from differ by about 1e-7 relatively in every run), so
``data/pinned_metrics.json`` holds one set of values per CPU kind (``cpu_kind``: the vector
extensions present, and torch's version): a run on a recorded kind must match its values bit
for bit; on another kind, the values of every recorded kind within ``REL_TOL`` (still far below
what any change to the math moves). A change that is *meant* to change numbers regenerates them
(this machine's kind alone; the others then compare within tolerance) with

    python tests/trainer/test_pinned_metrics.py            # --add: add this CPU kind, keep the others

and says why in its commit message.
"""

from __future__ import annotations

import importlib.util
import json
import math
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
REL_TOL = 1e-5  # between CPU kinds; the differences seen are about 1e-7
# Checked bit for bit on a recorded CPU kind only: 1 - var(returns - values) / var(returns) on the
# tiny runs divides by a variance near 0, so a 1e-7 change in its inputs moved it by 10% (or 3e-5
# relatively at 0.006) between CPU kinds.
ILL_CONDITIONED = ("critic/vf_explained_var",)
# The vector extensions whose presence changes which float kernels torch, MKL and oneDNN run.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_kind() -> str:
    """The CPU's relevant vector extensions and torch's version, e.g. 'avx2+avx512f torch 2.13.0+cpu'."""
    import torch

    try:
        words = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    except (OSError, StopIteration):
        words = set()
    return f"{'+'.join(f for f in ISA_FLAGS if f in words) or 'unknown'} torch {torch.__version__}"

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
        "ppo_offline_gae_adaptive_kl_packed": ("klppo.commands.main_ppo", ppo + [
            f"data.train_files={task / 'offline.parquet'}", "actor_rollout_ref.rollout.name=offline",
            "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128", "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive", "trainer.save_freq=2",
        ]),
        "ppo_online_gae_with_validation": ("klppo.commands.main_ppo", ppo + [
            f"data.train_files={task / 'train.parquet'}", f"data.val_files={task / 'val.parquet'}",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "algorithm.use_kl_in_reward=true", "trainer.test_freq=2", "actor_rollout_ref.actor.entropy_coeff=0.01",
        ]),
        "grpo_offline_rankings_kl_loss": ("klppo.commands.main_ppo", ppo + [
            f"data.train_files={ranked}", "actor_rollout_ref.rollout.name=offline",
            "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ]),
        "sft": ("klppo.commands.main_sft", [
            f"data.train_files={task / 'sft.parquet'}", f"data.val_files={task / 'sft.parquet'}",
            "data.max_length=96", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
            f"model.partial_pretrain={model}", "optim.lr=3e-3", "trainer.total_training_steps=4",
        ]),
        "rm_bradley_terry": ("klppo.commands.main_rm", [
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


def pinned_by_kind() -> dict[str, dict[str, list[dict]]]:
    return json.loads(PINNED.read_text())["by_cpu_kind"] if PINNED.is_file() else {}


def differences(got: list[dict], pinned: list[dict], rel_tol: float) -> list:
    """(step, key, got, pinned) of every value that differs by more than ``rel_tol`` (0: at all)."""
    assert [r["step"] for r in got] == [r["step"] for r in pinned]
    out = []
    for mine, theirs in zip(got, pinned):
        # Every pinned key is still logged; keys added since a kind was recorded are checked where recorded.
        assert theirs.keys() <= mine.keys(), (mine["step"], sorted(theirs.keys() - mine.keys()))
        out += [(mine["step"], k, mine[k], theirs[k]) for k in theirs
                if mine[k] != theirs[k] and not (rel_tol and k in ILL_CONDITIONED)
                and not math.isclose(mine[k], theirs[k], rel_tol=rel_tol, abs_tol=rel_tol * 1e-2)]
    return out


RUN_NAMES = sorted(next(iter(pinned_by_kind().values()), {}))


@pytest.mark.parametrize("name", RUN_NAMES)
def test_tiny_runs_reproduce_their_pinned_metrics_bit_for_bit(measured, name):
    """Bit for bit on a recorded CPU kind; within REL_TOL of every recorded kind on another."""
    sets, kind = pinned_by_kind(), cpu_kind()
    if kind in sets:
        assert not (found := differences(measured[name], sets[kind][name], 0.0)), (name, kind, found[:4])
        return
    for other, runs in sets.items():
        found = differences(measured[name], runs[name], REL_TOL)
        assert not found, (name, f"this CPU kind ({kind}) is not recorded; against {other}, within {REL_TOL}:",
                           found[:4], "a change meant to move numbers regenerates them (see the module docstring)")


def test_every_pinned_run_is_pinned_for_every_recorded_cpu_kind():
    expected = sorted(pinned_runs(Path("m"), Path("t"), Path("r"), Path("w")))
    assert pinned_by_kind() and all(sorted(runs) == expected for runs in pinned_by_kind().values())


if __name__ == "__main__":  # regenerate the pinned values (a change meant to change numbers); --add keeps the others
    with tempfile.TemporaryDirectory() as tmp:
        values = measure_all(Path(tmp))
    sets = pinned_by_kind() if "--add" in sys.argv else {}
    sets[cpu_kind()] = values
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps({"by_cpu_kind": sets}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED} for {cpu_kind()}: {', '.join(f'{k} ({len(v)} steps)' for k, v in values.items())}")
