"""The Hugging Face export streams the model a block at a time into safetensors files of a bounded
size: what it writes loads with ``from_pretrained`` and holds exactly the model's weights."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from klppo.checkpoint.export import INDEX_FILE, SINGLE_FILE, export_hf
from klppo.distributed import SINGLE_PROCESS, whole_tensor_groups


@pytest.mark.parametrize("auto_class", [AutoModelForCausalLM, AutoModelForTokenClassification])
def test_an_export_split_into_several_files_loads_with_the_same_weights(tiny_model_dir, tmp_path, auto_class):
    kwargs = {"num_labels": 1} if auto_class is AutoModelForTokenClassification else {}
    model = auto_class.from_pretrained(tiny_model_dir, **kwargs)
    out = export_hf(model, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "hf", shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and files[-1].endswith(f"-of-{len(files):05d}.safetensors") and not (out / SINGLE_FILE).exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
    loaded = auto_class.from_pretrained(out)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)
    if auto_class is AutoModelForCausalLM:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_the_groups_are_decoder_blocks_and_runs_of_the_roots_own_parameters(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    groups = [sorted(group) for group in whole_tensor_groups(model)]
    assert groups[0] == ["model.embed_tokens.weight"] and groups[-1] == ["model.norm.weight"]
    assert [{name.split(".")[2] for name in group} for group in groups[1:-1]] == [{"0"}, {"1"}]
    assert sum(len(g) for g in groups) == len(list(model.parameters()))  # the tied head comes once


def test_streamed_files_read_back_with_safetensors_own_reader_in_every_dtype(tmp_path):
    from safetensors import safe_open
    from klppo.checkpoint.export import _ShardWriter

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "f16": torch.randn(7).half(), "f64": torch.randn(2, 2).double(),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "ints": torch.arange(-5, 6), "bools": torch.rand(9) > 0.5,
        "bytes": torch.arange(13, dtype=torch.uint8), "strided": torch.randn(4, 6).t(),  # not contiguous
    }
    writer = _ShardWriter(tmp_path, limit=1 << 20)
    writer.add(dict(list(tensors.items())[:4]))
    writer.add(dict(list(tensors.items())[4:]))
    writer.close()
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "pt"}
        for name, expected in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), name
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no spool file left behind


def test_the_writer_keeps_no_tensor_once_it_is_written(tmp_path):
    import weakref
    from klppo.checkpoint.export import _ShardWriter

    writer = _ShardWriter(tmp_path, limit=1 << 30)  # one file: nothing is finished before close()
    tensor = torch.randn(256, 256)
    alive = weakref.ref(tensor)
    writer.add({"w": tensor})
    del tensor
    assert alive() is None
    writer.close()


def test_a_moe_models_export_and_engine_weights_have_save_pretrained_layout(tiny_model_dir, tmp_path):
    """transformers 5 fuses each layer's experts as it loads a folder and writes them one by one as it
    saves; the export and the weights streamed into vLLM (which loads such folders) do the same."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from klppo.run.adapters import export_model
    from klppo.trainer.responses import engine_weights

    config = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert any(name.endswith("experts.gate_up_proj") for name in model.state_dict())  # fused in the model
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert any(".experts.0.gate_proj." in name for name in saved)  # one by one on disk
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    export_model(model, tokenizer, tmp_path / "hf", tmp_path / "adapter", SINGLE_PROCESS)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    streamed = dict(engine_weights(model, torch.float32, torch.device("cpu"), set()))
    assert streamed.keys() == saved.keys() and all(torch.equal(streamed[k], saved[k]) for k in saved)
