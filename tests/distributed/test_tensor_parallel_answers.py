"""A tensor-parallel vLLM engine's ranks hold one conversation each and must feed the engine the same
tokens: the group's first rank runs the tools (and interactions) and every member takes its answers."""

import json
import subprocess
import sys
from pathlib import Path

from launch import ROOT, _env

WORKER = Path(__file__).with_name("tp_answers_worker.py")


def test_each_tensor_parallel_group_takes_its_first_ranks_answers(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER),
           str(tiny_model_dir), str(tmp_path)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["calls"] for r in reports] == [1, 0, 1, 0]  # the tools ran once per group
    assert ["rank 0 says hello" in r["reply"] for r in reports] == [True, True, False, False]
    assert ["rank 2 says hello" in r["reply"] for r in reports] == [False, False, True, True]
    assert reports[0]["tokens"] == reports[1]["tokens"] and reports[2]["tokens"] == reports[3]["tokens"]
    # an interaction: one instance per conversation, started, asked twice and finished on the group's first rank
    assert [r["interactions"] for r in reports] == [[1, 2, 1], [0, 0, 0], [1, 2, 1], [0, 0, 0]]
    assert ["rank 0 asks again" in r["user_turns"] for r in reports] == [True, True, False, False]
    assert reports[0]["chat"] == reports[1]["chat"] and reports[2]["chat"] == reports[3]["chat"]
    # where the first rank's work fails, its whole group hears of it instead of waiting for an answer
    assert reports[0]["failure"] == "division by zero"
    assert reports[1]["failure"] == "rank 0, which computes this group's answers, failed: ZeroDivisionError: division by zero"
    assert reports[3]["failure"].startswith("rank 2, which computes")
