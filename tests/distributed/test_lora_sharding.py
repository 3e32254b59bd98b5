"""How FSDP2 shards a LoRA model (in this process, over a gloo group of one): the adapters and the
frozen block weights are sharded, the frozen root (tied embeddings, final norm) stays whole and
tied in fp32, and is sharded as usual under mixed precision."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from klppo.distributed import apply_fsdp2, materialize
from klppo.models.lora import LoraSpec, add_adapters
from klppo.models.sharded_load import empty_model
from klppo.models.tiny import tiny_model_config


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_the_frozen_root_stays_whole_and_tied_in_fp32_only(group_of_one, param_dtype):
    config = tiny_model_config(50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    model = empty_model(AutoModelForCausalLM, config)
    add_adapters(model, LoraSpec("x", rank=4, alpha=8, target_modules="all-linear"), train_head=False)
    apply_fsdp2(model, group_of_one, param_dtype=param_dtype, replicate_frozen_root=True)
    materialize(model, torch.device("cpu"))
    params = dict(model.named_parameters())
    whole = {name for name, p in params.items() if not isinstance(p, DTensor)}
    assert whole == ({"model.embed_tokens.weight", "model.norm.weight"} if param_dtype is None else set())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(params["model.layers.0.self_attn.q_proj.lora_A.default.weight"], DTensor)
    assert isinstance(params["model.layers.0.self_attn.q_proj.base_layer.weight"], DTensor)


def test_merged_weights_of_a_bf16_sharded_model_merge_its_fp32_masters_even_after_a_forward(group_of_one):
    from klppo.distributed import fill_sharded
    from klppo.models.lora import initial_adapter_values
    from klppo.run.adapters import merged_weights

    config = tiny_model_config(50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    spec = LoraSpec("x", rank=4, alpha=8, target_modules="all-linear")
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    add_adapters(plain, spec, train_head=False)
    values = {n: v if ".lora_A." in n else torch.randn_like(v) * 1e-3  # a small update, as early in training
              for n, v in initial_adapter_values(plain, spec, seed=0).items()}
    plain.load_state_dict(values, strict=False, assign=True)
    state = plain.state_dict()
    model = empty_model(AutoModelForCausalLM, config)
    add_adapters(model, spec, train_head=False)
    apply_fsdp2(model, group_of_one, param_dtype=torch.bfloat16, reshard_after_forward=False)
    materialize(model, torch.device("cpu"))
    fill_sharded(model, lambda name: state[name])
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # leaves the blocks' whole bf16 parameters gathered
    got = dict(merged_weights(model, torch.bfloat16, torch.device("cpu")))
    expected = dict(merged_weights(plain, torch.bfloat16, torch.device("cpu")))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in got)
    q = "model.layers.0.self_attn.q_proj"  # merged from bf16 weights, the update would round differently
    bf16_merge = (state[f"{q}.base_layer.weight"].bfloat16().float() + 2.0 * state[f"{q}.lora_B.default.weight"]
                  @ state[f"{q}.lora_A.default.weight"]).bfloat16()
    assert not torch.equal(got[f"{q}.weight"], bf16_merge)
