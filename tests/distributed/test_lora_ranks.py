"""LoRA on several ranks, launched as users launch it: FSDP2 shards the frozen base weights and the
adapters, and two ranks train exactly as one process (metrics, adapter weights, merged export),
resume exactly in new processes, and generate with a merged gathered copy."""

import math
from pathlib import Path

import pytest
import torch
from launch import RM, assert_same_metrics, assert_same_weights, exact_ppo_overrides, run_ok
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification

from klppo.monitoring.logger import read_metrics

STEPS = 4
LORA = {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16, "critic.model.lora_rank": 4,
        "actor_rollout_ref.actor.optim.lr": 1e-2}


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def assert_same_adapters(a: Path, b: Path) -> None:
    ta, tb = adapter_tensors(a), adapter_tensors(b)
    assert ta.keys() == tb.keys() and ta
    for key in ta:
        torch.testing.assert_close(ta[key], tb[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, task_dir, tmp_path_factory):
    """LoRA actor and critic: one process, two ranks, and two ranks stopped at step 2 then resumed."""
    out = tmp_path_factory.mktemp("lora_ranks")

    def exact_overrides(run_dir: Path, world: int, **changes) -> list[str]:
        return exact_ppo_overrides(tiny_model_dir, task_dir, run_dir, world, STEPS, **changes)

    run_ok(exact_overrides(out / "one", 1, **LORA), None)
    run_ok(exact_overrides(out / "two", 2, **LORA), 2)
    run_ok(exact_overrides(out / "resumed", 2, **LORA, **{"trainer.total_training_steps": 2}), 2)
    run_ok(exact_overrides(out / "resumed", 2, **LORA), 2)
    return out


def test_lora_on_two_ranks_trains_exactly_as_one_process(runs):
    one, two = read_metrics(runs / "one"), read_metrics(runs / "two")
    assert len(one) == STEPS and one[0]["actor/reward_kl_penalty"] == 0.0 == two[0]["actor/reward_kl_penalty"]
    assert_same_metrics(one, two)
    assert_same_adapters(runs / "one" / "actor_adapter", runs / "two" / "actor_adapter")
    assert_same_weights(runs / "one" / "actor_hf", runs / "two" / "actor_hf")


def test_a_two_rank_lora_run_resumed_in_new_processes_repeats_the_uninterrupted_run(runs):
    resumed = read_metrics(runs / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert_same_metrics(read_metrics(runs / "two"), resumed)
    assert_same_adapters(runs / "two" / "actor_adapter", runs / "resumed" / "actor_adapter")


def test_bf16_online_lora_run_on_two_ranks_generates_with_a_merged_copy(ppo_overrides, task_dir, tmp_path):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    overrides = ppo_overrides(**{
        **LORA, "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
        "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.generation_weights": "gathered",
        "trainer.test_freq": 1, "trainer.n_gpus_per_node": 2, f"{fsdp}.dtype": "bfloat16",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "true", "critic.model.fsdp_config.dtype": "bfloat16",
    })
    run_ok(overrides, 2)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and records[0]["val-aux/kl_to_ref"] == 0.0
    assert all(math.isfinite(records[-1][k]) for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"))
    assert records[-1]["response_length/mean"] > 0


def test_a_lora_reward_model_on_two_ranks_trains_exactly_as_one_process(tiny_model_dir, tmp_path, word_ranking_file):
    train = word_ranking_file(tmp_path / "train.parquet", 16, 0)

    def overrides(name: str, world: int) -> list[str]:
        return [f"data.train_files={train}", "data.max_prompt_length=64", "data.max_response_length=16",
                "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", f"model.partial_pretrain={tiny_model_dir}",
                "model.lora_rank=4", "optim.lr=1e-2", "trainer.total_training_steps=2",
                f"trainer.default_local_dir={tmp_path / name}", "trainer.logger=[]", "trainer.device=cpu",
                f"trainer.n_gpus_per_node={world}"]

    run_ok(overrides("one", 1), None, module=RM)
    run_ok(overrides("two", 2), 2, module=RM)
    assert_same_metrics(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"))
    assert_same_adapters(tmp_path / "one" / "adapter", tmp_path / "two" / "adapter")
    assert_same_weights(tmp_path / "one" / "hf", tmp_path / "two" / "hf", AutoModelForSequenceClassification)
