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
    # Clip-Cov's no-grad forward per epoch: a third of a training pass more
    work = flops.UpdateWork(CONFIG, epochs=2, dtype=torch.bfloat16, head_positions=2, no_grad_passes=2)
    metrics = flops.update_efficiency_metrics(cuda, {"update_actor": 1e-9}, [3], {"actor": work})
    assert metrics["perf/mfu/actor"] == pytest.approx((2 + 2 / 3) * 3 * 1120 / (1e-9 * 989e12))


def test_the_compute_dtype_of_each_trained_model_is_compiled_from_its_fsdp_config():
    cfg = load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
                                 "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16"])
    s = compile_ppo(cfg, world_size=1)
    assert (s.actor.compute_dtype, s.critic.compute_dtype) == (torch.bfloat16, torch.float32)


# ---- the weights a token multiplies through, counted on the model ----

TINY = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4)
ATTENTION = 8 * 8 + 2 * 8 * 4 + 8 * 8  # q, k, v, o of TINY: 192 weights


def _built(kind, **keys):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **TINY, **keys)
    return AutoModelForCausalLM.from_config(config), config


def test_a_dense_models_counted_weights_are_its_llama_layout():
    model, config = _built("qwen2", intermediate_size=12)
    assert flops.decoder_weights_per_token(model, config) == 2 * (ATTENTION + 3 * 8 * 12)
    assert flops.decoder_weights_per_token(model, config) == 2 * flops.dense_layer_weights(config)


def test_a_token_multiplies_through_its_routed_experts_only_mixtral_by_hand():
    # per layer: attention 192 + router 8 x 4 experts + 2 of the 4 experts' gate, up, down (3 x 8 x 6)
    model, config = _built("mixtral", intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
    assert flops.decoder_weights_per_token(model, config) == 2 * (ATTENTION + 32 + 2 * 3 * 8 * 6)


def test_dense_and_sparse_layers_and_a_shared_expert_qwen2_moe_by_hand():
    # layer 0 dense (mlp_only_layers): MLP 12 wide; layer 1: router 32, 2 of 4 experts 6 wide, the shared
    # expert (10 wide) and its gate (8 x 1)
    model, config = _built("qwen2_moe", intermediate_size=12, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=6, shared_expert_intermediate_size=10, mlp_only_layers=[0])
    dense, sparse = ATTENTION + 3 * 8 * 12, ATTENTION + 32 + 2 * 3 * 8 * 6 + 3 * 8 * 10 + 8
    assert flops.decoder_weights_per_token(model, config) == dense + sparse


def test_a_list_of_expert_modules_counts_its_top_k_share():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.Linear(8, 8)  # 64 weights (its bias is no matrix product)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 6, bias=False) for _ in range(4))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    config = SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=1)
    assert flops.decoder_weights_per_token(model, config) == 2 * (64 + 48)


def test_lora_adapters_are_weights_a_token_multiplies_through():
    from peft import LoraConfig, get_peft_model

    model, config = _built("qwen2", intermediate_size=12)
    dense = flops.decoder_weights_per_token(model, config)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert flops.decoder_weights_per_token(lora, config) == dense + 2 * (2 * (8 + 8) + 2 * (8 + 4))


def test_experts_without_a_top_k_or_a_model_without_its_layer_stack_are_not_counted():
    model, config = _built("mixtral", intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
    assert flops.decoder_weights_per_token(model, SimpleNamespace(num_hidden_layers=2)) is None
    assert flops.decoder_weights_per_token(torch.nn.Linear(2, 2), SimpleNamespace(num_hidden_layers=2)) is None


def test_model_flops_charge_the_counted_weights_in_place_of_the_dense_layout():
    # 100 weights per token over the layers: 2 x 100 x 3 tokens; attention and the head as counted above
    assert flops.model_flops(CONFIG, [3], training=False, head_positions=2, layer_weights=100) == 600 + 96 + 160


def test_a_runs_mfu_counts_a_mixture_of_experts_actors_routed_experts(monkeypatch):
    from klppo.trainer.step_metrics import efficiency_metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    model, config = _built("mixtral", intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
    settings = SimpleNamespace(actor=SimpleNamespace(ppo_epochs=1, compute_dtype=torch.bfloat16, cov=None))
    parts = SimpleNamespace(actor=model, critic=None, settings=settings, device=torch.device("cuda", 0))
    batch = SimpleNamespace(prompt_mask=torch.tensor([[1, 1]]), response_attention=torch.tensor([[1, 1, 0]]))
    metrics = efficiency_metrics(parts, batch, {"update_actor": 1.0})
    expected = flops.model_flops(config, [4], training=True, head_positions=2,
                                 layer_weights=2 * (ATTENTION + 32 + 2 * 3 * 8 * 6))
    assert metrics["perf/mfu/actor"] == pytest.approx(expected / 989e12)


def test_a_sliding_window_pairs_each_token_with_its_last_w_tokens():
    # 5 tokens, window 3: the tokens see 1, 2, 3, 3, 3 keys
    assert flops.causal_pairs(5, 3) == 12 and flops.causal_pairs(5) == flops.causal_pairs(5, 5) == 15
    assert flops.causal_pairs(2, 3) == 3


def test_sliding_layers_charge_their_windows_pairs_only():
    # CONFIG's one layer, sliding with window 2: 3 tokens see 1, 2, 2 keys = 5 pairs x 4 x 4 = 80, not 96
    sliding = SimpleNamespace(**vars(CONFIG), sliding_window=2, layer_types=["sliding_attention"])
    assert flops.model_flops(sliding, [3], training=False, head_positions=2) == 864 + 80 + 160
    mistral = SimpleNamespace(**vars(CONFIG), sliding_window=2)  # no layer_types: every layer slides
    assert flops.model_flops(mistral, [3], training=False, head_positions=2) == 864 + 80 + 160
    full = SimpleNamespace(**vars(CONFIG), sliding_window=2, layer_types=["full_attention"])
    assert flops.model_flops(full, [3], training=False, head_positions=2) == 864 + 96 + 160
