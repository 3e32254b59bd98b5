"""verl's Hydra forms load as they are: ``--config-path DIR --config-name NAME`` (a YAML file there,
or verl's own ppo_trainer / ppo_megatron_trainer), and a YAML file's ``hydra:`` and
``defaults: [ppo_trainer, _self_]`` sections, as verl's example configs start."""

import pytest
import yaml

from klppo.cli import main
from klppo.commands.main_ppo import main as ppo_main
from klppo.config import load_ppo_config
from klppo.errors import UserError

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]
VERL_STYLE = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - {base}
  - _self_

data:
  max_prompt_length: 1024
  train_batch_size: 256
actor_rollout_ref:
  rollout:
    name: hf
    n: 8
"""


def _write(folder, name, base="ppo_trainer", body=VERL_STYLE):
    path = folder / f"{name}.yaml"
    path.write_text(body.format(base=base))
    return path


def _validate(capsys, *argv):
    code = main(["validate-config", *argv, *REQUIRED])
    out, err = capsys.readouterr()
    return code, (yaml.safe_load(out) if code == 0 else None), err


def test_a_verl_example_config_with_its_hydra_and_defaults_sections_loads_by_config_name(tmp_path, capsys):
    _write(tmp_path, "gsm8k_grpo")
    code, cfg, err = _validate(capsys, f"--config-path={tmp_path}", "--config-name=gsm8k_grpo")
    assert code == 0, err
    assert cfg["data"]["max_prompt_length"] == 1024 and cfg["actor_rollout_ref"]["rollout"]["n"] == 8
    assert cfg["trainer"]["save_freq"] == -1  # the rest is verl's ppo_trainer tree
    assert "the hydra section of" in err and "has no effect" in err
    # the same file given as klppo's positional config, and --config-name with .yaml
    assert _validate(capsys, str(tmp_path / "gsm8k_grpo.yaml"))[1] == cfg
    assert _validate(capsys, "--config-path", str(tmp_path), "--config-name", "gsm8k_grpo.yaml")[1] == cfg


def test_verls_own_config_names_need_no_file_and_megatrons_trains_with_fsdp2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # verl's scripts pass --config-path=config, relative to verl's package
    code, cfg, err = _validate(capsys, "--config-path=config", "--config-name=ppo_trainer")
    assert code == 0 and "strategy" not in err
    code, cfg, err = _validate(capsys, "--config-path=config", "--config-name=ppo_megatron_trainer")
    assert code == 0, err
    assert "actor_rollout_ref.actor.strategy, actor_rollout_ref.ref.strategy, critic.strategy = 'megatron': " \
           "training with FSDP2" in err
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == cfg["critic"]["strategy"] == "fsdp2"


def test_a_file_whose_defaults_name_the_megatron_config_trains_with_fsdp2_as_one_warning_says(tmp_path):
    notes = []
    cfg = load_ppo_config(_write(tmp_path, "m", base="ppo_megatron_trainer"), REQUIRED, notes=notes)
    assert cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    assert len([n for n in notes if "= 'megatron': training with FSDP2" in n]) == 1


@pytest.mark.parametrize("defaults, message", [
    ("[ppo_trainer, {actor@actor_rollout_ref.actor: megatron_actor}, _self_]", "klppo starts every config from"),
    ("[my_base, _self_]", "'my_base'"),
    ("[_self_, ppo_trainer]", "put _self_ ahead of ppo_trainer, so verl's defaults would override"),
])
def test_defaults_klppo_cannot_honour_are_refused_naming_them(tmp_path, defaults, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"defaults: {defaults}\ndata:\n  train_batch_size: 8\n")
    with pytest.raises(UserError, match=message):
        load_ppo_config(path, REQUIRED)


def test_config_name_mistakes_are_one_line_errors(tmp_path, capsys):
    _write(tmp_path, "real")
    for argv, message in [
        ([f"--config-path={tmp_path}", "--config-name=missing"], f"no file {tmp_path}/missing.yaml"),
        ([f"--config-path={tmp_path}"], "no --config-name names the file in it"),
        ([str(tmp_path / "real.yaml"), f"--config-path={tmp_path}", "--config-name=real"], "give one of the two"),
    ]:
        code, _, err = _validate(capsys, *argv)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_klppo_ppo_trains_from_a_config_named_as_verls_scripts_name_it(ppo_overrides, tmp_path, capsys):
    _write(tmp_path, "run", base="ppo_megatron_trainer", body="defaults:\n  - {base}\n  - _self_\n")
    overrides = ppo_overrides(tmp_path / "out", **{"trainer.total_training_steps": 1})
    assert ppo_main([f"--config-path={tmp_path}", "--config-name=run", *overrides]) == 0
    assert (tmp_path / "out" / "actor_hf" / "config.json").exists()
