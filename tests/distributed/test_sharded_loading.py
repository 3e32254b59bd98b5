"""Models sharded over ranks are built on the meta device and filled shard by shard from rank 0's
reading of the folder; the weights are bit-identical to ``from_pretrained`` in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from klppo.errors import UserError
from klppo.models.load import empty_model_for, load_causal_lm, load_critic, load_reward_model
from klppo.models.sharded_load import WeightReader, full_tensors
from klppo.models.tiny import build_tiny_model_folder

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CPU = torch.device("cpu")


def _torchrun(nproc: int, out: Path, *specs: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "sharded_load_worker.py"), str(out), *specs]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """A tiny model with its own LM head (not tied to the embeddings), saved in bf16 in two shards."""
    folder = build_tiny_model_folder(tmp_path_factory.mktemp("untied"), ["two plus three is five"] * 20, seed=1,
                                     vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.nn.init.normal_(model.lm_head.weight)  # a head of its own
    (folder / "model.safetensors").unlink()
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _expected(tiny_model_dir, untied_model_dir) -> dict[str, dict]:
    return {
        "tied": load_causal_lm(str(tiny_model_dir), key="k", device=CPU).state_dict(),
        "untied": load_causal_lm(str(untied_model_dir), key="k", device=CPU).state_dict(),
        "critic": load_critic(str(tiny_model_dir), key="k", device=CPU, seed=3).state_dict(),
        "reward": load_reward_model(str(tiny_model_dir), key="k", device=CPU, seed=3).state_dict(),
    }


@pytest.mark.parametrize("nproc", [1, 2])
def test_sharded_loading_gives_the_weights_from_pretrained_gives(tiny_model_dir, untied_model_dir, tmp_path, nproc):
    _torchrun(nproc, tmp_path, f"tied=causal_lm:{tiny_model_dir}", f"untied=causal_lm:{untied_model_dir}",
              f"critic=critic:{tiny_model_dir}", f"reward=reward_model:{tiny_model_dir}")
    for name, expected in _expected(tiny_model_dir, untied_model_dir).items():
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        expected = {k: v for k, v in expected.items() if k in got or k != "lm_head.weight"}
        assert set(got) <= set(expected) and set(expected) - set(got) <= {"lm_head.weight"}, name
        for key, value in got.items():
            assert torch.equal(value, expected[key]), (name, key)
    tied = torch.load(tmp_path / "tied.pt", weights_only=True)
    if "lm_head.weight" in tied:  # a tied head is the embedding
        assert torch.equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # a persistent buffer, trained (not computed)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 (layer 1 is a mixture of experts) whose router's correction bias is not
    its initial zeros, saved under the model's own tensor names (folders as save_pretrained writes
    them, experts one by one, are ``saved_moe_dirs``)."""
    folder = tmp_path_factory.mktemp("moe")
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=1, topk_group=1, n_shared_experts=1, num_attention_heads=2,
                              num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config)
    model.get_buffer(BIAS).copy_(torch.tensor([0.5, -0.25, 1.0, 2.0]))
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder


def test_sharded_loading_keeps_a_trained_buffer_in_the_model_its_generation_copy_and_its_export(
        moe_model_dir, tiny_model_dir, tmp_path):
    expected = load_causal_lm(str(moe_model_dir), key="k", device=CPU).state_dict()
    assert expected[BIAS].abs().sum() > 0  # from_pretrained reads the buffer
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "buffers_worker.py"), str(moe_model_dir), str(tiny_model_dir), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    saved = torch.load(tmp_path / "buffers.pt", weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    wrong = [(name, key) for name, state in (("sharded", saved["sharded"]), ("generation copy", saved["copy"]),
                                             ("export", exported))
             for key, value in expected.items() if key not in state or not torch.equal(state[key], value)]
    assert not wrong
    assert saved["sharded"].keys() == saved["copy"].keys() == exported.keys() == expected.keys()


def test_a_folder_without_a_persistent_buffer_is_refused_by_sharded_loading_as_by_from_pretrained(moe_model_dir,
                                                                                                  tmp_path):
    folder = tmp_path / "no_bias"
    folder.mkdir()
    (folder / "config.json").write_bytes((moe_model_dir / "config.json").read_bytes())
    state = load_file(moe_model_dir / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != BIAS}, folder / "model.safetensors", metadata={"format": "pt"})
    model = empty_model_for("causal_lm", str(folder), key="k")
    with pytest.raises(UserError, match=BIAS):
        full_tensors(model, WeightReader(folder, "k"), new_heads=False)
    with pytest.raises(UserError, match=BIAS):
        load_causal_lm(str(folder), key="k", device=CPU)


@pytest.fixture(scope="module")
def saved_moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3-MoE and Mixtral folders as save_pretrained writes them: every expert's projections
    one by one (and Mixtral's router under its old name), where the models hold one fused tensor
    per layer that transformers' conversion builds as it loads them."""
    from transformers import AutoConfig

    folders = {}
    for kind, keys in {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}.items():
        config = AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, **keys)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
        folders[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folders[kind])
        stored = set(load_file(folders[kind] / "model.safetensors"))
        assert any(".experts.0." in name for name in stored) and not stored >= set(model.state_dict())
    return folders


def test_sharded_loading_converts_moe_experts_stored_one_by_one_as_from_pretrained_does(saved_moe_dirs, tmp_path):
    specs = [f"{kind}_{role}={role}:{folder}" for kind, folder in saved_moe_dirs.items() for role in ("causal_lm", "critic")]
    _torchrun(2, tmp_path, *specs)
    for kind, folder in saved_moe_dirs.items():
        for role, expected in (("causal_lm", load_causal_lm(str(folder), key="k", device=CPU).state_dict()),
                               ("critic", load_critic(str(folder), key="k", device=CPU, seed=3).state_dict())):
            got = torch.load(tmp_path / f"{kind}_{role}.pt", weights_only=True)
            assert got.keys() == expected.keys(), (kind, role)
            assert all(torch.equal(got[k], expected[k]) for k in expected), (kind, role)
