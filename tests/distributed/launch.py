"""Launching klppo's entry points on several ranks from tests, and comparing what they wrote."""

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

PPO, SFT, RM = "klppo.commands.main_ppo", "klppo.commands.main_sft", "klppo.commands.main_rm"

ROOT = Path(__file__).parents[2]


def _env() -> dict:
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints every thread's Python stack first.
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def launch(overrides: list[str], nproc: int | None, timeout: int = 300, module: str = PPO) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N -m <module> ...``, or plain python with ``nproc`` None."""
    runner = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *runner, "-m", module, *overrides]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_ok(overrides: list[str], nproc: int | None, module: str = PPO) -> None:
    done = launch(overrides, nproc, module=module)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def exact_ppo_overrides(model: Path, task: Path, run_dir: Path, world: int, steps: int, **changes) -> list[str]:
    """An offline GAE run that exercises every cross-rank path: two mini-batches per step, token-budget
    micro-batches with packing, balanced ranks, adaptive KL in the reward, a critic, and a
    checkpoint every 2 steps."""
    settings = {
        "data.train_files": task / "offline.parquet",
        "data.max_prompt_length": 64, "data.max_response_length": 16, "data.train_batch_size": 8,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.use_remove_padding": "true",
        "actor_rollout_ref.rollout.name": "offline", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.use_dynamic_bsz": "true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 128,
        "actor_rollout_ref.actor.optim.lr": 1e-3, "critic.optim.lr": 1e-3,
        "algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive",
        "trainer.total_training_steps": steps, "trainer.save_freq": 2, "trainer.balance_batch": "true",
        "trainer.logger": "[]", "trainer.device": "cpu", "trainer.n_gpus_per_node": world,
        "trainer.default_local_dir": run_dir,
    }
    settings.update(changes)
    return [f"{k}={v}" for k, v in settings.items()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/", "global_seqlen/"))}  # rank loads differ


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        ra, rb = _comparable(ra), _comparable(rb)
        assert ra.keys() == rb.keys()
        for key in ra:
            assert math.isclose(ra[key], rb[key], rel_tol=1e-4, abs_tol=1e-5), (ra["step"], key, ra[key], rb[key])


def assert_same_weights(a: Path, b: Path, auto_class=AutoModelForCausalLM, atol: float = 1e-5) -> None:
    wa, wb = auto_class.from_pretrained(a).state_dict(), auto_class.from_pretrained(b).state_dict()
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=atol, msg=key)
