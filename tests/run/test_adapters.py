"""What a run does with LoRA adapters beyond training them (``klppo.run.adapters``): the merged
export and the merged weights an inference engine takes, for nn.Linear and GPT-2's Conv1D."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from klppo.distributed import SINGLE_PROCESS
from klppo.models.lora import ADAPTER, LoraSpec, attach_adapters, lora_layers
from klppo.run.adapters import export_model, merged_weights

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def trained_like(model: torch.nn.Module, targets) -> torch.nn.Module:
    """``model`` with rank-4 adapters on ``targets``, lora_B non-zero as after training."""
    attach_adapters(model, LoraSpec("actor_rollout_ref.model", rank=4, alpha=8, target_modules=targets), seed=0,
                    train_head=False)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    return model.eval()


@pytest.fixture
def gpt2_dir(tiny_model_dir, tmp_path):
    """A random-init tiny GPT-2 (Conv1D layers, tied embeddings) with the tiny model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


# c_attn is (16, 48): merged untransposed it failed with a shape error; attn.c_proj is square (16, 16),
# where the untransposed update merged without a word and gave other logits.
@pytest.mark.parametrize("targets", [("c_attn",), ("attn.c_proj",), "all-linear"])
def test_a_gpt2_conv1d_adapter_exports_merged_weights_and_an_adapter_that_compute_the_adapted_model(
        gpt2_dir, tmp_path, targets):
    model = trained_like(AutoModelForCausalLM.from_pretrained(gpt2_dir), targets)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    export_model(model, tokenizer, tmp_path / "hf", tmp_path / "adapter", SINGLE_PROCESS)
    with torch.no_grad():
        adapted = model(IDS).logits
        base = AutoModelForCausalLM.from_pretrained(gpt2_dir)(IDS).logits
        assert not torch.allclose(adapted, base, atol=1e-3)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        torch.testing.assert_close(merged(IDS).logits, adapted, rtol=1e-5, atol=1e-5)
        with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2_dir), tmp_path / "adapter")
        torch.testing.assert_close(with_adapter(IDS).logits, adapted, rtol=1e-5, atol=1e-5)


def test_merged_weights_merge_in_fp32_then_cast_and_name_the_plain_models_tensors(tiny_model_dir):
    model = trained_like(AutoModelForCausalLM.from_pretrained(tiny_model_dir), "all-linear")
    weights = dict(merged_weights(model, torch.bfloat16, torch.device("cpu")))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(weights) == set(plain.state_dict()) - {"lm_head.weight"}  # tied to the embedding: once
    layer = lora_layers(model)["model.layers.0.self_attn.q_proj"]
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    w = layer.base_layer.weight
    fp32_merge = (w + 2.0 * b @ a).to(torch.bfloat16)  # alpha / r = 8 / 4
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], fp32_merge)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["model.norm.weight"], plain.model.norm.weight.to(torch.bfloat16))
    # each tensor is its own: an engine may keep them while the actor trains on
    assert weights["model.norm.weight"].data_ptr() != model.model.norm.weight.data_ptr()
