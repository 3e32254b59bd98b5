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
