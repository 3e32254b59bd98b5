"""A CPU run on a machine with GPUs leaves CUDA alone: no call that would create a CUDA context
(hundreds of MiB of a GPU another job may be using) from the run's own code or what it calls
(``tests/gpu_host.py`` makes this machine look like such a host and refuses those calls)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from klppo.checkpoint import state as ckpt
from klppo.monitoring.logger import read_metrics
from klppo.monitoring.memory import PeakMemory
from klppo.monitoring.timer import PhaseTimer


WORKER = Path(__file__).parent / "gpu_host_worker.py"
ROOT = Path(__file__).parents[2]


def _run_on_a_gpu_host(overrides: list[str]) -> subprocess.CompletedProcess:
    # A process of its own: torch caches what it saw while CUDA looked available (device meshes
    # among them), which would leak into later tests of this process.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(WORKER), *overrides], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_a_cpu_ppo_run_on_a_gpu_host_trains_validates_saves_and_resumes_without_touching_cuda(
        ppo_overrides, task_dir, tmp_path):
    # FSDP2 over a group of one with offload_policy (pinned memory would need CUDA), validation
    # (seeded sampling), checkpoints (DCP's writer) and a resume (RNG states).
    changes = {"actor_rollout_ref.actor.fsdp_config.offload_policy": "true", "data.val_files": task_dir / "val.parquet",
               "trainer.test_freq": 1, "trainer.save_freq": 1, "trainer.total_training_steps": 1}
    for steps in (1, 2):  # the second run resumes from the first's checkpoint
        done = _run_on_a_gpu_host(ppo_overrides(**{**changes, "trainer.total_training_steps": steps}))
        assert done.returncode == 0, done.stderr[-4000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]
    assert "resumed from" in done.stdout + done.stderr


def test_phases_of_a_cpu_run_wait_for_no_cuda_kernels(gpu_host):
    for timer in (PhaseTimer(memory=PeakMemory(torch.device("cpu"))), PhaseTimer(device=torch.device("cpu")),
                  PhaseTimer()):
        with timer.phase("step"):
            pass
        assert set(timer.metrics()) == {"timing_s/step"}


def test_a_cuda_runs_phases_wait_for_their_kernels(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    timer = PhaseTimer(device=torch.device("cuda", 1))
    with timer.phase("update_actor"):
        pass
    assert synced == [torch.device("cuda", 1)]


def test_a_cpu_run_resuming_a_gpu_runs_rng_state_leaves_the_cuda_generator_alone(gpu_host):
    state = {**ckpt.rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8)}  # as a GPU run saves it
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    ckpt.set_rng_state({**state, "torch": torch.get_rng_state()}, torch.device("cpu"))
    assert torch.equal(torch.rand(2), expected)
