"""Model folders load without running code from them, and a folder that cannot give a usable model
(no or damaged weights, weights missing from the backbone, a tokenizer that cannot encode text)
is one UserError naming the folder and the fix, before any training starts."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from klppo.errors import UserError
from klppo.models.load import (
    check_trained_score_head, load_causal_lm, load_critic, load_reward_model, load_tokenizer,
)

KEY = "actor_rollout_ref.model.path"
CPU = torch.device("cpu")


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.fixture
def folder(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model folder to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _as_bin_only(folder: Path, weights: dict) -> None:
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def test_a_reward_model_without_a_pad_token_pads_with_the_first_of_several_eos_ids(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 2], "pad_token_id": None}))
    model = load_reward_model(str(folder), key="reward_model.model.path", device=CPU)  # a list as the pad id was refused
    assert model.config.pad_token_id == 1


def test_a_folder_with_only_pytorch_model_bin_loads_the_same_weights_safely(folder, tiny_model_dir):
    _as_bin_only(folder, load_file(folder / "model.safetensors"))
    loaded = load_causal_lm(str(folder), key=KEY, device=CPU).state_dict()
    expected = load_causal_lm(str(tiny_model_dir), key=KEY, device=CPU).state_dict()
    assert loaded.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(loaded[name], expected[name], rtol=0, atol=0)


def test_a_pickled_bin_with_a_payload_is_refused_and_never_runs(folder, tmp_path):
    marker = tmp_path / "payload_ran"
    weights = load_file(folder / "model.safetensors")
    _as_bin_only(folder, {**weights, "model.norm.weight": Payload(marker)})
    with pytest.raises(UserError, match=r"model folder '.*' cannot be read .*convert them to safetensors"):
        load_causal_lm(str(folder), key=KEY, device=CPU)
    assert not marker.exists()


def test_a_folder_without_weights_is_refused_naming_the_files(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"holds no model weights \(model.safetensors or pytorch_model.bin\)"):
        load_causal_lm(str(folder), key=KEY, device=CPU)


@pytest.mark.parametrize("keep", [4, 100, 20_000])
def test_a_truncated_safetensors_file_is_refused(folder, keep):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(UserError, match=f"{KEY}: model folder '{folder}' cannot be read .*copy the folder again"):
        load_causal_lm(str(folder), key=KEY, device=CPU)


def test_weights_missing_from_the_backbone_are_refused_but_a_fresh_head_is_not(folder):
    weights = load_file(folder / "model.safetensors")
    assert load_critic(str(folder), key="critic.model.path", device=CPU) is not None  # value head is new
    assert load_reward_model(str(folder), key="reward_model.model.path", device=CPU) is not None  # score head too
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for load in (load_causal_lm, load_critic, load_reward_model):
        with pytest.raises(UserError, match=r"lack 'model.layers.1.mlp.up_proj.weight' \(1 tensors missing\)"):
            load(str(folder), key=KEY, device=CPU)


def test_a_sharded_folder_missing_a_shard_is_refused(folder):
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    first = folder / "model-00001-of-00002.safetensors"
    save_file({k: weights[k] for k in names[:5]}, first, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors"
                                            for i, k in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="lacks the weight shard 'model-00002-of-00002.safetensors'"):
        load_causal_lm(str(folder), key=KEY, device=CPU)


def test_remote_code_named_by_a_folder_is_never_run(folder, tmp_path):
    marker = tmp_path / "remote_code_ran"
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="klppo_evil", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (folder / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    for load in (load_causal_lm, load_critic):
        with pytest.raises(UserError, match=r"needs the Python code its config.json names \(auto_map\)"):
            load(str(folder), key=KEY, device=CPU)
    assert not marker.exists()


@pytest.mark.parametrize("removed", [("tokenizer.json",),
                                     ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")])
def test_a_folder_without_its_tokenizer_files_is_refused_before_training(folder, removed):
    for name in removed:
        (folder / name).unlink()
    with pytest.raises(UserError, match="turns ordinary text into no tokens .*tokenizer.json included"):
        load_tokenizer(str(folder), KEY)


def test_a_tokenizer_far_smaller_than_the_models_vocabulary_is_refused(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    with pytest.raises(UserError, match=r"has 384 tokens but the model has 4096 embedding rows"):
        load_tokenizer(str(folder), KEY)


def test_a_damaged_tokenizer_file_is_refused_naming_the_folder(folder):
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(UserError, match=f"{KEY}: the tokenizer in '{folder}' cannot be read"):
        load_tokenizer(str(folder), KEY)


def test_the_tiny_models_own_tokenizer_is_usable(tiny_model_dir):
    assert load_tokenizer(str(tiny_model_dir), KEY).padding_side == "left"


def test_the_tiny_models_tokenizer_reloads_with_one_id_per_embedding_row(tiny_model_dir):
    """transformers reloads a qwen2 folder's tokenizer as Qwen2Tokenizer, which added an unk token
    <|endoftext|> at id 384 of a model with 384 rows: a prompt with that text indexed past the
    embedding (an IndexError on CPU, a device-side assert on CUDA)."""
    from transformers import AutoConfig, AutoTokenizer

    rows = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == rows
    assert max(tokenizer("What is <|endoftext|> + 1?")["input_ids"]) < rows


def test_a_tokenizer_whose_unk_token_has_no_embedding_row_is_refused(folder):
    """The tiny folder as the builder used to save it: no unk_token in tokenizer_config.json."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("unk_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"has unk_token '<\|endoftext\|>' at id 384, but the model has 384 embedding "
                                        r"rows .*\"unk_token\": null in tokenizer_config.json"):
        load_tokenizer(str(folder), KEY)


def test_a_tokenizer_larger_than_the_models_embedding_is_refused(folder):
    """An ordinary vocabulary entry past the rows (a tokenizer of a larger model) is refused too."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(UserError, match=r"has token '.*' at id 383, but the model has 300 embedding rows"):
        load_tokenizer(str(folder), KEY)


def test_a_reward_model_that_scores_ppo_must_bring_its_trained_score_head(folder, tmp_path):
    """A causal LM gets a fresh (random) head from load_reward_model, which klppo rm trains; scoring
    PPO's responses with it would give random rewards. A saved reward model passes."""
    with pytest.raises(UserError, match=r"reward_model.model.path: '.*' holds Qwen2ForCausalLM with no trained score "
                                        r"head \('score.weight' is not in its weights\)"):
        check_trained_score_head(str(folder), "reward_model.model.path")
    load_reward_model(str(folder), key="reward_model.model.path", device=CPU).save_pretrained(tmp_path / "rm")
    check_trained_score_head(str(tmp_path / "rm"), "reward_model.model.path")


def test_a_critic_or_reward_model_folder_is_refused_as_the_actor(folder, tmp_path):
    load_critic(str(folder), key="critic.model.path", device=CPU).save_pretrained(tmp_path / "critic")
    with pytest.raises(UserError, match=r"holds a Qwen2ForTokenClassification, not a causal language model"):
        load_causal_lm(str(tmp_path / "critic"), key=KEY, device=CPU)


def test_causal_lms_not_named_for_causal_lm_load_as_the_actor(tiny_model_dir, tmp_path):
    """GPT-2 saves itself as GPT2LMHeadModel: transformers' AutoModelForCausalLM names the classes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert type(load_causal_lm(str(tmp_path / "gpt2"), key=KEY, device=CPU)).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize("load", [load_causal_lm, load_critic, load_reward_model], ids=lambda f: f.__name__)
def test_activation_checkpointing_is_turned_on_without_a_deprecation_warning(load, tiny_model_dir):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5.2x deprecates gradient_checkpointing_enable
        model = load(str(tiny_model_dir), key=KEY, device=CPU, gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in model.base_model.layers)  # every decoder layer recomputes


def test_a_transformers_without_activation_checkpointing_enable_gets_the_older_spelling():
    from klppo.models.load import enable_activation_checkpointing

    class Older:  # transformers 5.17 (the GPU machine's) has only gradient_checkpointing_enable
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    model = Older()
    enable_activation_checkpointing(model)
    assert model.kwargs == {"use_reentrant": False}
