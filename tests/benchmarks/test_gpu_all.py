"""``benchmarks/gpu_all.sh``: the one call that measures everything on a GPU in under 8 minutes. Its
plan (steps, caps, the deadline), its time keeping (caps, the deadline, a step stopped with its
children at its cap) and its headlines, on CPU; the whole ``--cpu`` run takes 2-3 minutes and is
not run here."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_all.sh"
REQUIRED = ["smoke", "gpu_check", "packed_attn", "generation"]


def gpu_all(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=environment)


@pytest.fixture(scope="module")
def module():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_all", ROOT / "benchmarks" / "gpu_all.py")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # dataclasses look their module up by name
    spec.loader.exec_module(loaded)
    yield loaded
    del sys.modules[spec.name]


@pytest.mark.parametrize("mode", [[], ["--cpu"]])
def test_the_dry_run_lists_every_step_with_its_cap_and_a_deadline_under_8_minutes(mode):
    result = gpu_all(*mode, "--dry-run")
    assert result.returncode == 0, result.stderr
    steps = re.findall(r"^(\w+)\s+(required|optional)\s+cap\s+(\d+) s", result.stdout, re.M)
    names = [name for name, _, _ in steps]
    assert names[: len(REQUIRED)] == REQUIRED or names[:2] + names[3:5] == REQUIRED  # vs_trl third where it exists
    assert all(kind == "required" for name, kind, _ in steps if name in REQUIRED)
    deadline, required = map(int, re.search(r"deadline (\d+) s .* add up to (\d+) s", result.stdout).groups())
    assert deadline <= 480 and required - (150 if "vs_trl" in names else 0) <= deadline
    smoke = next(line for line in result.stdout.splitlines() if line.startswith("smoke"))
    assert "--budget-s 150" in smoke and int(steps[0][2]) >= 150  # the smoke's own budget fits its cap
    assert ("--cpu" in smoke) == bool(mode)
    assert "--compare-checkpointing" in next(line for line in result.stdout.splitlines() if line.startswith("gpu_check"))


def test_without_a_gpu_it_points_at_the_cpu_mode(tmp_path):
    result = gpu_all(OUT=str(tmp_path / "out"))
    assert result.returncode == 2 and "--cpu" in result.stderr


def test_required_steps_take_the_time_left_and_optional_ones_only_their_whole_cap(module):
    required, optional = module.Step("a", [], 100), module.Step("b", [], 60, required=False)
    assert module.step_budget(required, 400) == (100, "")
    assert module.step_budget(required, 70) == (70, "")
    assert module.step_budget(required, 10)[0] is None  # under MIN_STEP_S
    assert module.step_budget(optional, 60) == (60, "")
    assert module.step_budget(optional, 59)[0] is None


def test_a_step_past_its_cap_is_stopped_with_its_children_and_the_rest_still_run(module, tmp_path, monkeypatch):
    marker = tmp_path / "child_alive"
    sleeper = ["bash", "-c", f"(sleep 30; touch {marker}) & echo started; sleep 30"]
    steps = [module.Step("slow", sleeper, 1), module.Step("quick", ["bash", "-c", "echo quick done"], 5),
             module.Step("late", ["true"], 1000, required=False)]
    start = time.perf_counter()
    outcomes = module.run_all(steps, sys.executable, tmp_path, deadline_s=60)
    assert time.perf_counter() - start < 20
    assert outcomes["slow"].status == "timeout" and outcomes["quick"].status == "ok"
    assert outcomes["late"].status.startswith("skipped")  # its whole cap no longer fits the deadline
    logs = (tmp_path / "logs.txt").read_text()
    assert "started" in logs and "quick done" in logs and "slow: timed out" in logs
    assert set((tmp_path / "figures.json").read_text().count(f'"{n}"') for n in ("slow", "quick")) == {1}
    time.sleep(1)
    assert not marker.exists()  # the background child went with its step


def test_the_headlines_carry_each_steps_figures(module):
    smoke = ("PASS  a: 1 [1.0 s]\nFAIL  exact resume from step 2: differ [2.0 s]\n"
             "gpu_smoke: seconds per part: run 3.0; total 98.5 since the process started (imports included)\n"
             "gpu_smoke: 12 passed, 1 failed, 3 skipped\n")
    figures = {}
    assert module.smoke_headline(smoke, figures) == "12/1/3 passed/failed/skipped in 98.5 s; FAIL: exact resume from step 2"
    assert figures["total_s"] == 98.5
    check = {"actor_update_mfu": 0.47, "actor_update_mfu_vs_measured_peak": 0.59, "actor_update_tokens_per_s_per_gpu": 1e5,
             "phase_seconds_mean": {"update_actor": 0.3}, "peak_memory_gb": 40.0, "attn_implementation": "varlen",
             "with_checkpointing": {"actor_update_mfu": 0.36, "actor_update_tokens_per_s_per_gpu": 8e4}}
    text = module.headline(module.Step("gpu_check", [], 1), "", check)
    assert "MFU 47.0% (vs measured peak 59.0%)" in text and "ckpt MFU 36.0%" in text
    assert module.headline(module.Step("gpu_check", [], 1), "", {}) == "no figures"
