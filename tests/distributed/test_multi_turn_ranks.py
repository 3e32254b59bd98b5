"""Multi-turn rollouts on two ranks whose conversations end at different turns: the sharded actor's ranks
keep decoding together (a rank out of turns decodes stand-ins, which leave its random stream alone)
and train what the gathered copy's ranks train, each rank decoding alone."""

import json
import subprocess
import sys
from pathlib import Path

from launch import ROOT, _env, assert_same_metrics

from klppo.monitoring.logger import read_metrics
from tests.trainer.test_multi_turn_run import (
    PROMPT_TOKENS, SHORT_GSM8K_TOOL_CONFIG, _tool_task, turns_reward, turns_score,
)

WORKER = Path(__file__).with_name("multi_turn_worker.py")


def test_two_ranks_train_the_same_conversations_with_either_generation_weights(ppo_overrides, task_dir, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(SHORT_GSM8K_TOOL_CONFIG)
    data = _tool_task(task_dir, tmp_path / "train.parquet")

    def run(name: str, weights: str) -> list[dict]:
        overrides = ppo_overrides(tmp_path / name, **{
            "data.train_files": data, "data.max_prompt_length": PROMPT_TOKENS,
            "actor_rollout_ref.rollout.name": "hf",
            "actor_rollout_ref.rollout.generation_weights": weights, "actor_rollout_ref.rollout.response_length": 128,
            "actor_rollout_ref.rollout.multi_turn.enable": "true",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": tools,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": 24,
            "trainer.total_training_steps": 2, "trainer.n_gpus_per_node": 2,
            "trainer.rollout_data_dir": tmp_path / name / "rollouts", **turns_reward(tmp_path)})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               *overrides]
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return read_metrics(tmp_path / name)

    sharded, gathered = run("sharded", "sharded"), run("gathered", "gathered")
    assert [(r["num_turns/min"], r["num_turns/max"]) for r in sharded] == [(2, 6), (2, 6)]  # rank 0: one turn
    assert_same_metrics(sharded, gathered)
    # each conversation is scored with its own turns and tool rewards, gathered from the rank that ran it
    logged = [json.loads(line) for line in (tmp_path / "sharded" / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert sorted({turns_score(line["output"]) for line in logged}) == [2, 26]
    assert all(line["score"] == turns_score(line["output"]) for line in logged)
