"""The parts of vLLM rollouts that need no engine: request seeds, the CPU KV cache's size, the
process state an engine must leave as it found it, and the clear error where vLLM is missing."""

import hashlib
import importlib.util
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from klppo.algo import rollout_probs_diff_metrics
from klppo.rollout.vllm import MIN_CPU_KV_BYTES, cpu_kv_cache_bytes, kv_bytes_per_token, process_state_kept, request_seed
from klppo.models.tiny import tiny_model_config
from tests.fake_vllm import engine_settings as settings

CPU = torch.device("cpu")


def test_request_seeds_are_stable_distinct_and_fit_in_62_bits():
    seeds = {request_seed(42, step, prompt, sample) for step in range(3) for prompt in range(50) for sample in range(4)}
    assert len(seeds) == 600 and all(0 <= s < 2**62 for s in seeds)
    assert request_seed(42, 1, 7, 0) == request_seed(42, 1, 7, 0)
    assert request_seed(42, 1, 7, 0) != request_seed(43, 1, 7, 0) != request_seed(42, 1, 0, 7)
    # The same on every machine and in every run: blake2b of the little-endian 64-bit integers, 62 bits kept.
    digest = hashlib.blake2b((42).to_bytes(8, "little") + (1).to_bytes(8, "little") + (7).to_bytes(8, "little")
                             + (0).to_bytes(8, "little"), digest_size=8).digest()
    assert request_seed(42, 1, 7, 0) == int.from_bytes(digest, "little") >> 2 == 8714789555595921


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer_on_one_tensor_parallel_rank():
    config = tiny_model_config(384, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    # 2 (K and V) x 3 layers x 2 KV heads x head_dim 16 x 4 bytes = 768 bytes; 2 ranks hold one head each
    assert kv_bytes_per_token(config, torch.float32, 1) == 768
    assert kv_bytes_per_token(config, torch.bfloat16, 2) == 2 * 3 * 1 * 16 * 2


def test_the_cpu_kv_cache_holds_every_sequence_of_a_generation_within_a_quarter_of_the_free_memory():
    config = tiny_model_config(384, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    per_token = kv_bytes_per_token(config, torch.float32, 1)  # 65,536 bytes
    s = settings(rows_per_generation=64, max_model_len=480)
    assert cpu_kv_cache_bytes(config, s, free_bytes=1 << 40) == 64 * (480 + 128) * per_token
    assert cpu_kv_cache_bytes(config, settings(rows_per_generation=1000, max_num_seqs=8, max_model_len=480), 1 << 40) \
        == 8 * 608 * per_token  # no more at once than max_num_seqs
    assert cpu_kv_cache_bytes(config, s, free_bytes=4 << 30) == 1 << 30  # a quarter of 4 GiB
    assert cpu_kv_cache_bytes(config, settings(rows_per_generation=1), free_bytes=1 << 40) == MIN_CPU_KV_BYTES


def test_process_state_kept_undoes_what_an_engine_does_to_the_process(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    expected = (torch.rand(2), np.random.rand(), random.random())
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    threads = torch.get_num_threads()
    with process_state_kept(CPU):  # what building a vLLM engine on CPU does
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        torch.set_num_threads(1)
        torch.set_num_threads = lambda n: None
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        torch.set_default_dtype(torch.float64)
    assert (torch.rand(2).tolist(), np.random.rand(), random.random()) == (expected[0].tolist(), *expected[1:])
    assert torch.get_num_threads() == threads and os.environ["LOCAL_WORLD_SIZE"] == "2"
    torch.set_num_threads(max(1, threads - 1))  # set_num_threads works again
    assert torch.get_num_threads() == max(1, threads - 1)
    torch.set_num_threads(threads)
    assert torch.get_default_dtype() == torch.float32


def test_rollout_probs_diff_metrics_by_hand():
    # Two real tokens per row: probabilities (trainer, rollout) = (0.5, 0.5), (0.9, 0.6) | (0.2, 0.3), (0.4, pad)
    old = torch.tensor([[0.5, 0.9], [0.2, 0.4]]).log()
    rollout = torch.tensor([[0.5, 0.6], [0.3, 1.0]]).log()
    mask = torch.tensor([[True, True], [True, False]])
    m = rollout_probs_diff_metrics(old, rollout, mask)
    # |diffs| 0, 0.3, 0.1: mean 0.4 / 3, max 0.3, sample std sqrt(((0 - m)^2 + (0.3 - m)^2 + (0.1 - m)^2) / 2)
    mean = 0.4 / 3
    assert float(m["training/rollout_probs_diff_mean"]) == pytest.approx(mean)
    assert float(m["training/rollout_probs_diff_max"]) == pytest.approx(0.3)
    std = (((0 - mean) ** 2 + (0.3 - mean) ** 2 + (0.1 - mean) ** 2) / 2) ** 0.5
    assert float(m["training/rollout_probs_diff_std"]) == pytest.approx(std)
    # ratios 1, 1.5, 0.667: two of three outside [0.8, 1.25]
    assert float(m["training/rollout_probs_ratio_outside"]) == pytest.approx(2 / 3)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_vllm_rollout_without_vllm_installed_is_one_error_naming_the_install_command(tiny_model_dir, task_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "klppo.cli", "ppo", f"data.train_files={task_dir / 'train.parquet'}",
         f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=vllm",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=64",
         "data.max_response_length=8", "trainer.device=cpu", "trainer.logger=[]", f"trainer.default_local_dir={run_dir}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "needs the vllm package" in result.stderr and "bash scripts/setup.sh --vllm" in result.stderr
    assert not run_dir.exists()  # stopped before anything was written
