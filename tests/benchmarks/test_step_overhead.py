"""``benchmarks/step_overhead.py`` on its tiny shape: it runs the three runs and prints each one's table."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "step_overhead.py"


def test_tiny_shape_prints_each_runs_split_of_the_step(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not a torchrun rank
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--steps", "1", "--threads", "1",
                           "--workload", str(tmp_path / "workload"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    print(done.stdout)
    figures = json.loads(out.read_text())
    for run in ("ppo", "offline", "grpo"):
        summary = figures[run]
        assert f"== {run}: median of 1 steps" in done.stdout
        assert summary["wall_ms"] > 0 and summary["model_ms"]["model forward"] > 0
        assert summary["model_ms"]["backward"] > 0 and summary["model_ms"]["optimizer step"] > 0
        assert "update_actor" in summary["phases_ms"] and summary["functions"]  # phases and klppo functions
    assert "gen" in figures["ppo"]["phases_ms"] and "kl_probe" in figures["offline"]["phases_ms"]
    assert "update_critic" not in figures["grpo"]["phases_ms"]  # GRPO has no critic
    assert "overhead by function" in done.stdout
    assert all(figures[run]["page_faults"] >= 0 for run in ("ppo", "offline", "grpo"))
    assert "minor page faults per step" in done.stdout
