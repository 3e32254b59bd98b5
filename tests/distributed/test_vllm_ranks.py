"""vLLM rollouts on several ranks, launched as users launch them (torchrun, one engine per rank
or one per tensor-parallel pair): two ranks train as one process does, and after the run's
updates each engine still generates exactly what HF generate does with the actor's weights."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launch import ROOT, _env, assert_same_metrics, assert_same_weights, run_ok

from klppo.monitoring.logger import read_metrics
from tests.trainer.test_multi_turn_run import turns_reward

pytestmark = pytest.mark.vllm

STEPS = 3
LR = 1e-3
# Weights of runs that differ only in float summation order (micro-batches, packed rows): Adam turns
# a gradient element near its eps into a step of up to lr whose size that order noise moves, so at
# this learning rate a few elements of 100k differ by ~1e-5 after 3 steps while every metric agrees
# to 1e-7. Allowed: 2% of one Adam step per optimiser step.
WEIGHTS_ATOL = 0.02 * LR * STEPS
WORKER = Path(__file__).with_name("vllm_sync_worker.py")


# A reward that varies with the response (the random tiny model never answers right), so returns,
# advantages and the critic's explained variance are not degenerate.
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return (len(solution_str) % 7) / 7\n"


def vllm_overrides(model: Path, task: Path, run_dir: Path, world: int, **changes) -> list[str]:
    """An online GAE run with vLLM rollouts: a critic, adaptive KL in the reward, two mini-batches,
    validation through the engine, a checkpoint every 2 steps."""
    reward = task / "length_reward.py"
    if not reward.exists():
        reward.write_text(REWARD)
    settings = {
        "custom_reward_function.path": reward, "custom_reward_function.name": "compute_score",
        "data.train_files": task / "train.parquet", "data.val_files": task / "val.parquet",
        "data.max_prompt_length": 64, "data.max_response_length": 12, "data.train_batch_size": 8,
        "actor_rollout_ref.model.path": model, "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.optim.lr": LR, "critic.optim.lr": LR,
        "algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive",
        "trainer.total_training_steps": STEPS, "trainer.save_freq": 2, "trainer.test_freq": 2,
        "trainer.logger": "[]", "trainer.device": "cpu", "trainer.n_gpus_per_node": world,
        "trainer.default_local_dir": run_dir,
    }
    settings.update(changes)
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def runs(vllm_model_dir, task_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_ranks")
    run_ok(vllm_overrides(vllm_model_dir, task_dir, out / "one", 1), None)
    run_ok(vllm_overrides(vllm_model_dir, task_dir, out / "two", 2), 2)
    run_ok(vllm_overrides(vllm_model_dir, task_dir, out / "two_tp2", 2,
                          **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}), 2)
    return out


def test_two_ranks_with_an_engine_each_train_as_one_process(runs):
    one, two = read_metrics(runs / "one"), read_metrics(runs / "two")
    assert [r["step"] for r in one] == [0, 1, 2, 3]  # validation before training, then 3 steps
    assert all("val-core/openai/gsm8k/reward/mean@1" in one[i] for i in (0, 2, 3))  # through the engine
    assert all(r["timing_s/weight_sync"] > 0 for r in two[1:])
    assert_same_metrics(one, two)
    assert_same_weights(runs / "one" / "actor_hf", runs / "two" / "actor_hf", atol=WEIGHTS_ATOL)


def test_a_tensor_parallel_pair_of_ranks_trains_as_one_process(runs):
    assert_same_metrics(read_metrics(runs / "one"), read_metrics(runs / "two_tp2"))
    assert_same_weights(runs / "one" / "actor_hf", runs / "two_tp2" / "actor_hf", atol=WEIGHTS_ATOL)


def test_the_engines_log_probs_match_the_trainers_at_every_step(runs):
    for name in ("one", "two", "two_tp2"):
        assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in read_metrics(runs / name)[1:]), name


@pytest.mark.parametrize("world, tp", [(None, 1), (2, 2)], ids=["one_process", "two_ranks_tp2"])
def test_after_the_runs_updates_greedy_engine_responses_equal_hf_generate(world, tp, vllm_model_dir, task_dir, tmp_path):
    overrides = vllm_overrides(vllm_model_dir, task_dir, tmp_path / "run", world or 1,
                               **{"actor_rollout_ref.rollout.tensor_model_parallel_size": tp, "trainer.save_freq": -1,
                                  "trainer.test_freq": -1})
    runner = [] if world is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    done = subprocess.run([sys.executable, *runner, str(WORKER), str(tmp_path), *overrides], env=_env(),
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    for rank in range(world or 1):
        result = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert result["steps"] == STEPS and result["ids"] and result["masks"], result
        assert all(d < 1e-4 for d in result["probs_diff_max"]), result


def test_a_tensor_parallel_pairs_conversations_take_the_first_ranks_tool_replies(vllm_model_dir, task_dir, tmp_path):
    """Both ranks of an engine must feed it the same conversation: only the first runs the tools, and both
    append its replies (a tool whose answers vary would otherwise feed the pair different tokens)."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(textwrap.dedent("""\
        tools:
          - class_name: vllm_tp_tools_worker.RankTool
            config: {}
            tool_schema: {type: function, function: {name: hello, description: greets,
                                                     parameters: {type: object, properties: {}}}}
        """))
    overrides = vllm_overrides(vllm_model_dir, task_dir, tmp_path / "run", 2, **{
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "data.max_prompt_length": 256,
        "data.max_response_length": 96, "actor_rollout_ref.rollout.multi_turn.enable": "true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": tools,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2, "trainer.total_training_steps": 1,
        "trainer.save_freq": -1, "trainer.test_freq": -1, "trainer.val_before_train": "false",
        "trainer.rollout_data_dir": tmp_path / "rollouts", **turns_reward(tmp_path)})
    worker = Path(__file__).with_name("vllm_tp_tools_worker.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(worker), *overrides], env={**_env(), "KLPPO_TEST_CALLS": str(tmp_path)},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert len((tmp_path / "rank0.txt").read_text().splitlines()) == 8 * 2  # each of 16 conversations calls once
    assert not (tmp_path / "rank1.txt").exists()
    logged = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(logged) == 16 and all("rank 0 says hello" in line["output"] for line in logged)
    assert all(line["score"] == 4 + 10 for line in logged)  # 4 turns (one a reply), one tool reward: extra_info's
