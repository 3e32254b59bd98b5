"""verl's SFT trainer configs in ``klppo sft``: its own sft_trainer.yaml and its example scripts'
command lines load, verl's spellings act, the keys klppo does not act on are one warning, and
those that would train something else are refused by name."""

from pathlib import Path

import pytest

from klppo.config import load_sft_config
from klppo.errors import UserError

VERL_SFT_YAML = Path(__file__).parent / "data" / "verl_sft_trainer.yaml"
# examples/sft/gsm8k/run_qwen_05_sp2.sh (verl b178a3cd5), paths written out
GSM8K_SCRIPT = ["data.train_files=train.parquet", "data.val_files=test.parquet", "data.prompt_key=extra_info",
                "data.response_key=extra_info", "optim.lr=1e-4", "data.prompt_dict_keys=['question']",
                "+data.response_dict_keys=['answer']", "data.micro_batch_size=4",
                "model.partial_pretrain=models/Qwen2.5-0.5B-Instruct", "trainer.default_local_dir=out",
                "trainer.project_name=gsm8k-sft", "trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct-sp2",
                "trainer.logger=console", "trainer.total_training_steps=1", "ulysses_sequence_parallel_size=2",
                "use_remove_padding=true"]


def test_verls_own_sft_trainer_yaml_loads_without_a_warning_and_its_settings_act():
    notes = []
    cfg = load_sft_config(str(VERL_SFT_YAML), notes=notes)
    assert notes == []  # every key is klppo's, verl's spelling of one, or at verl's default
    assert (cfg.optim.warmup_style, cfg.optim.lr_warmup_steps_ratio, cfg.optim.betas) == ("cosine", 0.1, [0.9, 0.95])
    assert (cfg.data.prompt_key, cfg.data.response_key, cfg.data.micro_batch_size_per_gpu) == ("question", "answer", 4)
    assert cfg.trainer.default_local_dir == "checkpoints/gsm8k-sft/test" and cfg.model.enable_gradient_checkpointing


def test_verls_gsm8k_sft_script_loads_with_one_warning_naming_what_has_no_effect():
    notes = []
    cfg = load_sft_config(None, GSM8K_SCRIPT, notes=notes)
    assert (cfg.data.prompt_dict_keys, cfg.data.response_dict_keys) == (["question"], ["answer"])
    assert notes[0].startswith("warning: 3 verl settings in this config have no effect in klppo")
    assert "data.micro_batch_size=4: no effect in klppo (verl's SFT trainer reads data.micro_batch_size_per_gpu" \
        in notes[1]  # verl's own SFT trainer never reads it
    assert "ulysses_sequence_parallel_size=2" in notes[2] and "use_remove_padding=true" in notes[3]


def test_verls_sft_spellings_act_where_klppo_has_the_knob():
    cfg = load_sft_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "optim.lr_scheduler=cosine",
                                 "trainer.seed=7", "model.fsdp_config.cpu_offload=true"])
    assert (cfg.optim.warmup_style, cfg.data.seed, cfg.model.fsdp_config.offload_policy) == ("cosine", 7, True)


@pytest.mark.parametrize("override, problem", [
    ("model.trust_remote_code=true", "model.trust_remote_code = true: klppo never runs code from a model folder"),
    ("data.chat_template=x", "data.chat_template = x: verl's SFT refuses it too"),
    ("optim.lr_scheduler=wsd", "optim.warmup_style = 'wsd' is not one of 'constant', 'cosine'"),
    ("trainer.seed=3", "trainer.seed = 3 and data.seed = 5 set the same knob"),
])
def test_verl_sft_settings_klppo_cannot_honour_are_errors_naming_the_key(override, problem):
    with pytest.raises(UserError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        load_sft_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "trainer.n_gpus_per_node=2",
                               "data.train_batch_size=8", "data.seed=5", override])


def test_verls_row_caps_act_in_sft():
    cfg = load_sft_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "data.train_max_samples=100",
                                 "data.val_max_samples=10"])
    assert (cfg.data.train_max_samples, cfg.data.val_max_samples) == (100, 10)


def test_a_key_neither_has_is_still_unknown():
    with pytest.raises(UserError, match="unknown key 'data.prompt_dict_key'"):
        load_sft_config(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "data.prompt_dict_key=[a]"])


def test_verls_sft_module_path_starts_from_verls_sft_defaults_and_klppo_sft_from_its_own(monkeypatch):
    """verl's fsdp_sft_trainer loads its sft_trainer config; so does klppo's shim of that path."""
    import klppo.commands.main_sft as main_sft
    from klppo.trainer import fsdp_sft_trainer

    loaded = {}
    monkeypatch.setattr(main_sft, "run_sft", lambda cfg: loaded.setdefault("cfg", cfg))
    required = ["data.train_files=t.parquet", "model.partial_pretrain=m"]
    assert fsdp_sft_trainer.main(required) == 0
    verl = loaded.pop("cfg")
    assert (verl.optim.betas, verl.optim.lr_warmup_steps_ratio, verl.optim.warmup_style) == ([0.9, 0.95], 0.1, "cosine")
    assert (verl.trainer.total_epochs, verl.data.prompt_key, verl.data.micro_batch_size_per_gpu) == (4, "question", 4)
    assert main_sft.main(required) == 0
    own = loaded.pop("cfg")
    assert (own.optim.betas, own.optim.warmup_style, own.trainer.total_epochs) == ([0.9, 0.999], "constant", 1)
    assert fsdp_sft_trainer.main(required + ["optim.betas=[0.8,0.9]", "trainer.total_epochs=2"]) == 0
    assert (loaded["cfg"].optim.betas, loaded["cfg"].trainer.total_epochs) == ([0.8, 0.9], 2)  # the command line wins
