"""Rank 0's export copy of a sharded model is built on the meta device and takes the gathered
tensors as they are: no random initialisation of a full fp32 model while the other ranks wait.
Run in this process over a gloo group of one."""

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from klppo.distributed import apply_fsdp2, gather_full_model
from klppo.models.rng import seeded
from klppo.models.tiny import tiny_model_config


@pytest.mark.parametrize("cls, tied", [(Qwen2ForCausalLM, True), (Qwen2ForCausalLM, False),
                                       (Qwen2ForTokenClassification, False)])
def test_the_export_copy_is_built_on_meta_and_equals_the_sharded_model(group_of_one, monkeypatch, cls, tied):
    config = tiny_model_config(50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    config.tie_word_embeddings, config.num_labels = tied, 1
    with seeded(0, torch.device("cpu")):
        model = cls(config).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    apply_fsdp2(model, group_of_one)

    built_on = []
    plain_init = cls.__init__

    def spy(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        built_on.append({p.device.type for p in self.parameters()})

    monkeypatch.setattr(cls, "__init__", spy)
    copy = gather_full_model(model)
    assert built_on == [{"meta"}]
    assert type(copy) is cls
    assert not any(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    state = copy.state_dict()
    assert sorted(state) == sorted(weights) and all(torch.equal(state[k], weights[k]) for k in weights)
    assert torch.equal(copy.eval()(input_ids=ids).logits, logits)  # rotary buffers came along
    if tied:
        assert copy.lm_head.weight is copy.model.embed_tokens.weight
