"""``benchmarks/gpu_check.py`` as a user meets it on a CPU: the tiny smoke run, and the GPU default refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not a torchrun rank
        env.pop(key, None)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_tiny_cpu_run_reports_positive_throughput_and_an_mfu_key_with_and_without_checkpointing(tmp_path):
    out = tmp_path / "figures.json"
    result = gpu_check("--device", "cpu", "--size", "tiny", "--batch", 8, "--iterations", 2, "--compare-checkpointing",
                       "--json", out)
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    again = figures["with_checkpointing"]  # the same process, the actor's blocks then checkpointed
    assert not figures["gradient_checkpointing"] and again["gradient_checkpointing"]
    assert again["actor_update_tokens_per_s_per_gpu"] > 0 and again["timed_iterations"] == 1
    assert "with gradient checkpointing" in result.stdout
    # no CUDA: no measured matmul peak either
    assert figures["measured_peak_tflops"] is None and figures["actor_update_mfu_vs_measured_peak"] is None
    assert figures["actor_update_tokens_per_s_per_gpu"] > 0
    assert figures["iteration_tokens_per_s_per_gpu"] > 0
    assert figures["timed_iterations"] == 1  # the warm-up is left out
    assert figures["world_size"] == 1
    # peak_flops knows no CPU peak, so there is no MFU and no verdict on the target.
    assert "actor_update_mfu" in figures and figures["actor_update_mfu"] is None
    assert figures["meets_target"] is None
    assert "actor update MFU (%)" in result.stdout and "peak memory (GB)" in result.stdout


def test_default_gpu_configuration_on_cpu_is_refused_in_one_line():
    result = gpu_check("--device", "cpu")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--size tiny" in lines[0], result.stderr
    assert result.stdout == ""


def test_the_auto_attention_on_cpu_is_the_loop_and_varlen_is_refused_there(tmp_path):
    out = tmp_path / "figures.json"
    result = gpu_check("--device", "cpu", "--size", "tiny", "--batch", 4, "--iterations", 2, "--json", out)
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert (figures["attn"], figures["attn_implementation"]) == ("auto", "klppo_packed_sdpa")
    refused = gpu_check("--device", "cpu", "--size", "tiny", "--attn", "varlen")
    assert refused.returncode == 2 and "--attn varlen needs torch's varlen kernel" in refused.stderr
