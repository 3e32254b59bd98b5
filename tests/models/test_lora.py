"""LoRA adapters in a Hugging Face model (``klppo.models.lora``): which layers can be adapted, and
saved adapters read whole or refused, never in part."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from klppo.errors import UserError
from klppo.models.lora import LoraSpec, attach_adapters, is_adapter, lora_layers, read_adapter_config

KEY = "actor_rollout_ref.model"
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2))


def saved_peft_adapter(base_dir, out, **config) -> None:
    """An adapter written by peft itself for the model in ``base_dir``, lora_B non-zero (as trained)."""
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, lora_alpha=8, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    model.save_pretrained(str(out))


def loaded_with(base_dir, adapter) -> torch.nn.Module:
    """The base model with the saved adapter, as klppo loads it (lora_adapter_path)."""
    spec = read_adapter_config(LoraSpec(KEY, rank=0, alpha=16, target_modules="all-linear", adapter_path=str(adapter)))
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    attach_adapters(model, spec, seed=0, train_head=False)
    return model


@pytest.mark.parametrize("targets, embedding", [(("wte", "c_attn"), "transformer.wte"),
                                                 (("embed_tokens",), "model.embed_tokens")])
def test_an_embedding_target_is_refused_by_name_before_anything_trains(tiny_model_dir, targets, embedding):
    model = tiny_gpt2() if "wte" in targets else AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(UserError, match=rf"{KEY}.target_modules = .* adapts {embedding} \(Embedding\): klppo trains "
                                        r"LoRA adapters of linear layers only .*its linear layers are \["):
        attach_adapters(model, LoraSpec(KEY, rank=4, alpha=8, target_modules=targets), seed=0, train_head=False)


def test_gpt2_conv1d_layers_get_adapters_that_train():
    model = tiny_gpt2()
    attach_adapters(model, LoraSpec(KEY, rank=4, alpha=8, target_modules="all-linear"), seed=0, train_head=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(name) for name in trained)
    assert "transformer.h.0.attn.c_attn.lora_A.default.weight" in trained
    assert "transformer.h.1.mlp.c_proj.lora_B.default.weight" in trained


def test_a_peft_adapter_whose_targets_are_a_regex_of_the_whole_models_names_loads_as_peft_loads_it(tiny_model_dir,
                                                                                                   tmp_path):
    saved_peft_adapter(tiny_model_dir, tmp_path / "adapter", target_modules=r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
    model = loaded_with(tiny_model_dir, tmp_path / "adapter")
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in model.named_parameters() if is_adapter(name)}
    assert adapted == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    with torch.no_grad():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
        torch.testing.assert_close(model(IDS).logits, expected(IDS).logits, rtol=1e-5, atol=1e-6)


def test_a_saved_adapter_with_modules_to_save_the_actor_does_not_train_is_refused_naming_the_option(tiny_model_dir,
                                                                                                  tmp_path):
    saved_peft_adapter(tiny_model_dir, tmp_path / "adapter", target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(UserError, match=rf"{KEY}.lora_adapter_path: '.*adapter_config.json' sets modules_to_save = "
                                        r"\['lm_head'\], but this model trains adapters only"):
        loaded_with(tiny_model_dir, tmp_path / "adapter")


def test_a_saved_adapter_file_with_tensors_the_model_would_not_use_is_refused_naming_them(tiny_model_dir, tmp_path):
    saved_peft_adapter(tiny_model_dir, tmp_path / "adapter", target_modules=["q_proj"])
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    # what peft writes for bias="lora_only": the adapted layer's bias, trained beside the adapter
    tensors["base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"] = torch.ones(32)
    save_file(tensors, str(path))
    with pytest.raises(UserError, match=rf"{KEY}.lora_adapter_path: '{path}' holds tensors this model would not use "
                                        r"\(base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias\)"):
        loaded_with(tiny_model_dir, tmp_path / "adapter")


def test_a_saved_gpt2_adapter_names_peft_s_causal_lm_task_as_a_ForCausalLM_adapter_does(tmp_path):
    """peft picks PeftModelForCausalLM by the adapter's task type; GPT-2's class is GPT2LMHeadModel."""
    import json

    from klppo.models.lora import save_adapter

    model = tiny_gpt2()
    attach_adapters(model, LoraSpec(KEY, rank=4, alpha=8, target_modules="all-linear"), seed=0, train_head=False)
    save_adapter(tmp_path / "adapter", model, model.state_dict(), "gpt2")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), str(tmp_path / "adapter"))
    assert type(reloaded).__name__ == "PeftModelForCausalLM"


@pytest.mark.parametrize("kind, keys", [
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, kv_lora_rank=8,
                         q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                         n_group=1, topk_group=1)),  # a dense first layer, and shared experts
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_all_linear_adapts_an_moe_models_linear_layers_and_leaves_its_fused_experts_frozen(kind, keys):
    """transformers 5 fuses each MoE layer's experts into 3-D weights and makes its router a module of
    its own: neither is a linear layer. peft would re-aim DeepSeek-V3's dense and shared-expert
    projections (named as version 4's experts were) at the fused weights; klppo adapts the linear layers."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(kind, vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, **keys)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    linear = sorted(name for name, m in model.model.named_modules() if isinstance(m, torch.nn.Linear))
    attach_adapters(model, LoraSpec(KEY, rank=4, alpha=8, target_modules="all-linear"), seed=0, train_head=False)
    adapted = sorted(name.removeprefix("model.") for name in lora_layers(model))
    assert adapted == linear and any(".self_attn." in name for name in adapted)
    assert not [name for name in adapted if name.endswith((".experts", ".gate"))]
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(name) for name in trained)
    model(IDS).logits.sum().backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if p.requires_grad)
