"""Models sharded over ranks are built on the meta device and filled shard by shard from rank 0's
reading of the folder; the weights are bit-identical to ``from_pretrained`` in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from klppo.models.load import load_causal_lm, load_critic, load_reward_model
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
