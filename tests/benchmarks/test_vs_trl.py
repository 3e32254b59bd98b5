"""``benchmarks/vs_trl.py --mode cpu --tiny``: klppo's sides run through its trainer on the shared
inputs and the table comes out, every side on fixed-length responses; TRL's sides run beside them
where TRL's environments are built (``bash benchmarks/setup_trl.sh``), else that test is skipped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_RESPONSE = 8  # vs_trl.TINY's response_tokens


def trl_installed() -> bool:
    python = ROOT / ".venv-trl" / "bin" / "python"
    return python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """One invocation for the module: klppo's three sides, and TRL's GRPO side where it is installed."""
    tmp = tmp_path_factory.mktemp("vs_trl")
    sides = ["klppo-ppo", "klppo-offline-ppo", "klppo-grpo"] + (["trl-grpo"] if trl_installed() else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--mode", "cpu", "--tiny", "--work",
           str(tmp / "work"), "--json", str(tmp / "rows.json"), "--sides", *sides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads((tmp / "rows.json").read_text())["rows"]


def test_klppo_sides_train_fixed_length_responses_and_print_the_table(table):
    out, rows = table
    assert [s for s in rows if s.startswith("klppo")] == ["klppo-ppo", "klppo-offline-ppo", "klppo-grpo"]
    for side, row in rows.items():
        assert row["response_length"] == TINY_RESPONSE, side
        assert 0 < row["update_s"] < row["step_s"] and row["e2e_tps"] > 0 and row["peak_gb"] > 0, (side, row)
    assert rows["klppo-offline-ppo"]["kl_probe_s"] > 0 and rows["klppo-offline-ppo"]["gen_s"] < 0.05
    assert "side                 step s   gen s  rest s update s e2e tok/s" in out
    assert "(kl_probe" in out


@pytest.mark.skipif(not trl_installed(), reason="TRL's environment is not built: bash benchmarks/setup_trl.sh")
def test_trl_grpo_runs_beside_klppo_on_the_same_tokens_and_the_ratios_are_printed(table):
    out, rows = table
    assert rows["trl-grpo"]["response_length"] == rows["klppo-grpo"]["response_length"] == TINY_RESPONSE
    assert rows["trl-grpo"]["step_s"] > 0 and rows["trl-grpo"]["peak_gb"] > 0
    assert "trl-grpo: trl 1.16.0" in out
    assert "klppo-grpo / trl-grpo" in out.splitlines()[-1]
