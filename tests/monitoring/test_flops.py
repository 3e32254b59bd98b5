"""FLOPs count what runs (causal attention, the LM head where log-probs are read, no embedding
FLOPs); MFU divides by the peak of the compute dtype, and the device name picks the card."""

from types import SimpleNamespace

import pytest
import torch

from klppo.config import load_ppo_config
from klppo.monitoring import flops
from klppo.run.settings import compile_ppo

# hidden 4, 1 layer, 2 heads of dim 2, 1 KV head, MLP 8, vocabulary 10
CONFIG = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=2, intermediate_size=8, vocab_size=10)


def test_flops_of_a_sequence_counted_by_hand():
    # projections per layer: q 4x4 + k, v 2 x 4x2 + o 4x4 + gate/up/down 3 x 4x8 = 16 + 16 + 16 + 96 = 144 weights
    #   -> 2 x 144 x 3 tokens = 864
    # causal attention: 3 x 4 / 2 = 6 query-key pairs x 4 x (2 heads x dim 2) = 96
    # LM head at 2 response positions: 2 x 4 x 10 x 2 = 160; the embedding lookup: 0
    assert flops.model_flops(CONFIG, [3], training=False, head_positions=2) == 864 + 96 + 160
    assert flops.model_flops(CONFIG, [3], training=True, head_positions=2) == 3 * 1120
    # a value head (1 output) at every token: 2 x 4 x 1 x 3 = 24
    assert flops.model_flops(CONFIG, [3], training=False, head_outputs=1) == 864 + 96 + 24


def test_attention_grows_with_each_sequences_square_not_the_batchs():
    one = flops.model_flops(CONFIG, [3], training=False, head_positions=0)
    assert flops.model_flops(CONFIG, [3, 3], training=False, head_positions=0) == 2 * one


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", 989e12, 67e12),  # SXM5
    ("NVIDIA H100 PCIe", 756e12, 51e12),
    ("NVIDIA H100 NVL", 835e12, 60e12),
    ("NVIDIA H200", 989e12, 67e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
    ("NVIDIA GeForce RTX 4090", None, None),
])
def test_the_device_name_tells_the_h100_cards_apart(name, bf16, fp32):
    assert flops.peak_flops_by_name(name, torch.bfloat16) == bf16
    assert flops.peak_flops_by_name(name, torch.float16) == bf16
    assert flops.peak_flops_by_name(name, torch.float32) == fp32


def test_mfu_divides_by_the_compute_dtypes_peak_not_the_fp32_master_parameters(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    work = flops.UpdateWork(CONFIG, epochs=2, dtype=torch.bfloat16, head_positions=2)
    metrics = flops.update_efficiency_metrics(cuda, {"update_actor": 1e-9}, [3], {"actor": work})
    assert metrics["perf/mfu/actor"] == pytest.approx(2 * 3 * 1120 / (1e-9 * 989e12))


def test_the_compute_dtype_of_each_trained_model_is_compiled_from_its_fsdp_config():
    cfg = load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
                                 "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16"])
    s = compile_ppo(cfg, world_size=1)
    assert (s.actor.compute_dtype, s.critic.compute_dtype) == (torch.bfloat16, torch.float32)
