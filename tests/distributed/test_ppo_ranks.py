"""PPO runs on several ranks, launched as users launch them: ``torchrun ... -m klppo.commands.main_ppo``.

The strongest checks are equivalences: two ranks (and an HSDP mesh of four) train exactly as
one process does on the same global batch, and a 2-rank run saved and resumed in new
processes repeats the uninterrupted run. Every process runs one thread, so the float results
do not depend on how the two CPU cores are shared.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from launch import assert_same_metrics, assert_same_weights, exact_ppo_overrides, launch, run_ok
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from klppo.errors import UserError
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo

STEPS = 4


@pytest.fixture(scope="module")
def exact_overrides(tiny_model_dir, task_dir):
    """overrides(run_dir, world, **changes): ``launch.exact_ppo_overrides`` of the tiny model and task."""
    return lambda run_dir, world, **changes: exact_ppo_overrides(tiny_model_dir, task_dir, run_dir, world, STEPS,
                                                                 **changes)


@pytest.fixture(scope="module")
def runs(exact_overrides, tmp_path_factory):
    """One process, two ranks, and two ranks stopped at step 2 then resumed in new processes."""
    out = tmp_path_factory.mktemp("ranks")
    run_ok(exact_overrides(out / "one", 1), None)
    run_ok(exact_overrides(out / "two", 2), 2)
    run_ok(exact_overrides(out / "resumed", 2, **{"trainer.total_training_steps": 2}), 2)
    run_ok(exact_overrides(out / "resumed", 2), 2)
    return out


def test_two_ranks_train_exactly_as_one_process(runs):
    one, two = read_metrics(runs / "one"), read_metrics(runs / "two")
    assert len(one) == STEPS and "global_seqlen/minmax_diff" in two[-1]
    assert 0.0 < two[0]["perf/overlap_ratio"] <= 1.0 and "perf/overlap_ratio" not in one[0]
    assert "perf/overlap_ratio" not in two[1]  # profiled at step 1 and every 10th
    assert_same_metrics(one, two)
    assert_same_weights(runs / "one" / "actor_hf", runs / "two" / "actor_hf")


def test_a_two_rank_run_resumed_in_new_processes_repeats_the_uninterrupted_run(runs):
    resumed = read_metrics(runs / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_same_metrics(read_metrics(runs / "two"), resumed)
    assert_same_weights(runs / "two" / "actor_hf", runs / "resumed" / "actor_hf")
    step_2 = runs / "resumed" / "global_step_2"
    assert sorted(p.name for p in step_2.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    assert (step_2 / "weights" / ".metadata").is_file()


def test_a_two_rank_checkpoint_exports_in_one_process_to_what_the_ranks_exported(runs, tmp_path):
    from klppo.commands.export import export_checkpoint

    from safetensors.torch import load_file

    export_checkpoint(str(runs / "two"), str(tmp_path / "hf"), print_fn=lambda *a, **k: None)
    ranks, one = load_file(runs / "two" / "actor_hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert ranks.keys() == one.keys() and all(torch.equal(ranks[k], one[k]) for k in ranks)  # bit for bit


def test_the_exported_actor_is_a_plain_transformers_model(runs):
    config = json.loads((runs / "two" / "actor_hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    exported = AutoModelForCausalLM.from_pretrained(runs / "two" / "actor_hf")
    reference = AutoModelForCausalLM.from_pretrained(runs / "one" / "actor_hf")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def test_resuming_with_another_number_of_ranks_is_refused(exact_overrides, runs):
    done = launch(exact_overrides(runs / "two", 1, **{"trainer.total_training_steps": STEPS + 1}), None)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "was not saved by 1 rank" in done.stderr and "Traceback" not in done.stderr


def test_an_hsdp_mesh_of_four_ranks_trains_as_one_process(exact_overrides, runs, tmp_path):
    fsdp = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
    hsdp = {fsdp: 2, "critic.model.fsdp_config.fsdp_size": 2, "trainer.total_training_steps": 2, "trainer.save_freq": -1}
    run_ok(exact_overrides(tmp_path / "four", 4, **hsdp), 4)
    assert_same_metrics(read_metrics(runs / "one")[:2], read_metrics(tmp_path / "four"))


def test_bf16_online_run_with_validation_on_two_ranks(ppo_overrides, task_dir, tmp_path):
    """Sampling with synced ranks, shared validation, bf16 mixed precision, the offload options, and
    gradient checkpointing."""
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    overrides = ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
        "actor_rollout_ref.rollout.name": "hf", "trainer.test_freq": 1, "trainer.n_gpus_per_node": 2,
        f"{fsdp}.dtype": "bfloat16", f"{fsdp}.offload_policy": "true", f"{fsdp}.reshard_after_forward": "false",
        f"{fsdp}.param_offload": "true", f"{fsdp}.optimizer_offload": "true",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "true",
        "critic.model.fsdp_config.dtype": "bfloat16",
    })
    run_ok(overrides, 2)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(records[-1][k]) for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"))
    assert "val-core/openai/gsm8k/reward/mean@1" in records[-1]


def test_one_process_with_fsdp_options_shards_over_a_group_of_one(ppo_overrides, tmp_path):
    # fsdp_size 32 on one rank: at least the world, so every rank's shard group is the world (verl's reading)
    run_ok(ppo_overrides(**{"actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
                            "actor_rollout_ref.actor.fsdp_config.fsdp_size": 32,
                            "trainer.total_training_steps": 1}), None)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_a_failure_on_one_rank_stops_every_rank_with_the_error_shown(ppo_overrides, tmp_path):
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(
        "import os\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise RuntimeError('the reward service is unreachable from rank 1')\n"
        "    return 0.0\n"
    )
    overrides = ppo_overrides(**{"custom_reward_function.path": reward, "trainer.n_gpus_per_node": 2})
    done = launch(overrides, 2, timeout=120)  # a hang would time out here
    assert done.returncode != 0
    # One rule on every rank, as in one process: each stops with the same one-line error naming the
    # function, its file and the prompt's row, and none with a traceback (torchrun's report aside).
    # (torchrun may stop rank 0 before it prints its copy of the error.)
    errors = {line for line in done.stderr.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, done.stderr[-3000:]
    error = errors.pop()
    assert "offline.parquet row " in error and f"compute_score in '{reward}' raised RuntimeError" in error
    assert "the reward service is unreachable from rank 1" in error
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr
    assert "exitcode  : 2" in done.stderr, done.stderr[-3000:]


def test_a_world_that_differs_from_the_config_is_a_clear_error(ppo_overrides):
    with pytest.raises(UserError, match=r"trainer.n_gpus_per_node x trainer.nnodes = 2 x 1 = 2 ranks, but this run was "
                                        r"launched as 1 process; launch it with torchrun --nproc_per_node 2"):
        run_ppo(None, ppo_overrides(**{"trainer.n_gpus_per_node": 2}), print_fn=lambda *a: None)


def _reward_model(tiny_model_dir, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


def test_two_reward_models_ranking_responses_on_two_ranks_score_as_one_process(ppo_overrides, tiny_model_dir, tmp_path):
    """Sharded reward models score each rank's rows; the rankings are distilled on the gathered batch."""
    rm_a, rm_b = _reward_model(tiny_model_dir, tmp_path / "rm_a", 0), _reward_model(tiny_model_dir, tmp_path / "rm_b", 1)

    def overrides(name: str, world: int) -> list[str]:
        return ppo_overrides(tmp_path / name, **{
            "reward_model.enable": "true", "reward_model.model.path": rm_a,
            "reward_model.model.extra_paths": f"[{rm_b}]", "reward_model.rank_responses": "true",
            "trainer.n_gpus_per_node": world})

    run_ok(overrides("one", 1), None)
    run_ok(overrides("two", 2), 2)
    assert_same_metrics(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"))


def test_ranks_share_validation_and_gather_the_same_figures_as_one_process(ppo_overrides, task_dir, tmp_path):
    """Before training, two ranks validating half of the 8 prompts each (greedy) measure what one process does.

    Batches of 3 prompts split 2 + 1 over the ranks; a stand-in fills the short share.
    """
    def overrides(name: str, world: int) -> list[str]:
        return ppo_overrides(tmp_path / name, **{
            "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
            "data.val_batch_size": 3, "actor_rollout_ref.rollout.name": "hf", "trainer.total_training_steps": 1,
            "trainer.n_gpus_per_node": world, "trainer.validation_data_dir": tmp_path / name / "val_samples",
            "trainer.rollout_data_dir": tmp_path / name / "samples"})

    run_ok(overrides("one", 1), None)
    run_ok(overrides("two", 2), 2)
    before_one, before_two = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]
    assert before_one["step"] == before_two["step"] == 0
    assert before_one.keys() == before_two.keys() and "val-aux/kl_to_ref" in before_two
    for key in before_one:
        if not key.startswith(("timing_s/", "perf/")):  # each rank's own time and memory
            assert math.isclose(before_one[key], before_two[key], rel_tol=1e-6, abs_tol=1e-6), key
    # the responses as text: every rank's, in the records' order (rank 0 writes them)
    texts = [(tmp_path / name / "val_samples" / "0.jsonl").read_text() for name in ("one", "two")]
    assert texts[0] == texts[1] and len(texts[0].splitlines()) == 8
    assert len((tmp_path / "two" / "samples" / "1.jsonl").read_text().splitlines()) == 8 * 2


def test_dynamic_sampling_keeps_the_same_groups_on_two_ranks_as_in_one_process(exact_overrides, tmp_path):
    """algorithm.filter_groups: each rank rewards its share of a generation batch, the scores are gathered,
    and every rank keeps the same groups: two ranks draw and train as one process does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from klppo.data.arithmetic import write_arithmetic_offline_parquet

    data = write_arithmetic_offline_parquet(tmp_path / "tied.parquet", 32, seed=2, n_responses=2)
    scores = [[1.0, 0.0] if i % 4 == 0 else [1.0, 1.0] for i in range(32)]  # 1 prompt in 4 has spread
    pq.write_table(pq.read_table(data).append_column("scores", pa.array(scores)), data)
    changes = {"data.train_files": data, "algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": "true",
               "data.train_batch_size": 2, "data.gen_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
               "trainer.total_training_steps": 2}
    run_ok(exact_overrides(tmp_path / "one", 1, **changes), None)
    run_ok(exact_overrides(tmp_path / "two", 2, **changes), 2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert all(r["critic/score/zero_std_frac"] == 0.0 and r["training/filter_groups/kept_groups"] >= 2 for r in two)
    assert max(r["training/filter_groups/gen_batches"] for r in two) > 1
    assert_same_metrics(one, two)
    assert_same_weights(tmp_path / "one" / "actor_hf", tmp_path / "two" / "actor_hf")


def test_uneven_mini_batches_train_on_two_ranks_as_verl_splits_them(exact_overrides, tmp_path):
    """Mini-batches that do not split evenly train as verl's workers train them, and two ranks
    agree with one process: 3 samples per mini-batch over 2 ranks are floored to 1 each, so two
    ranks train as one process with mini-batches of 2; 8 prompts x 2 in mini-batches of 3 prompts
    are 6, 6 and 4 samples, on one rank and on two."""
    steps = {"trainer.total_training_steps": 2}
    floored = {**steps, "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.actor.ppo_mini_batch_size": 3}
    run_ok(exact_overrides(tmp_path / "floored", 2, **floored), 2)
    run_ok(exact_overrides(tmp_path / "even", 1, **{**floored, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}), None)
    assert_same_metrics(read_metrics(tmp_path / "even"), read_metrics(tmp_path / "floored"))
    assert_same_weights(tmp_path / "even" / "actor_hf", tmp_path / "floored" / "actor_hf")

    last_smaller = {**steps, "actor_rollout_ref.actor.ppo_mini_batch_size": 3}
    run_ok(exact_overrides(tmp_path / "one", 1, **last_smaller), None)
    run_ok(exact_overrides(tmp_path / "two", 2, **last_smaller), 2)
    assert_same_metrics(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"))
    assert_same_weights(tmp_path / "one" / "actor_hf", tmp_path / "two" / "actor_hf")
