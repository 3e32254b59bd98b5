"""``klppo export``: a checkpoint's model as the Hugging Face folder the run itself exports, read
in one process from the run's folder and its config.yaml."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from klppo.cli import main
from klppo.commands.main_ppo import run_ppo
from klppo.commands.export import export_checkpoint


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def weights(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_files(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, task_dir, tmp_path_factory):
    """A 2-step offline GAE run (actor and critic) checkpointed at both steps, through the CLI."""
    out = tmp_path_factory.mktemp("export") / "run"
    settings = {
        "data.train_files": task_dir / "offline.parquet", "data.max_prompt_length": 64, "data.max_response_length": 16,
        "data.train_batch_size": 8, "actor_rollout_ref.model.path": tiny_model_dir,
        "actor_rollout_ref.rollout.name": "offline", "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.optim.lr": 1e-3,
        "critic.optim.lr": 1e-3, "trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.logger": "[]",
        "trainer.device": "cpu", "trainer.default_local_dir": out}
    assert main(["ppo", *[f"{k}={v}" for k, v in settings.items()]]) == 0
    return out


def test_the_newest_checkpoint_exports_to_exactly_what_the_run_exported(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    assert "exported actor of step 2 to" in capsys.readouterr().out
    assert_same_files(run_dir / "actor_hf", tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").get_vocab() == AutoTokenizer.from_pretrained(
        run_dir / "actor_hf").get_vocab()
    assert not (tmp_path / "hf_adapter").exists()  # full fine-tuning: no adapter


def test_an_earlier_checkpoint_and_the_critic_export_too(run_dir, tiny_model_dir, tmp_path):
    export_checkpoint(str(run_dir / "global_step_1"), str(tmp_path / "step1"), print_fn=quiet)
    step1, final = weights(tmp_path / "step1"), weights(run_dir / "actor_hf")
    assert any(not torch.equal(step1[k], final[k]) for k in final)  # one more update apart
    AutoModelForCausalLM.from_pretrained(tmp_path / "step1")
    export_checkpoint(str(run_dir), str(tmp_path / "critic"), which="critic", print_fn=quiet)
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert critic.config.num_labels == 1
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[0].mlp.up_proj.weight
    assert not torch.equal(critic.model.layers[0].mlp.up_proj.weight, base)  # the trained critic's, not the base's


@pytest.mark.parametrize("case, problem", [
    ("exists", "exists; choose another path, or pass --force to replace it"),
    ("no checkpoint", "holds no checkpoint (no latest_checkpointed_iteration.txt)"),
    ("not a folder", "is not a folder; give a run's folder"),
    ("no config", "does not exist: the run writes its config there; give it with --config"),
    ("into the checkpoint", "is in or holds the checkpoint"),
])
def test_bad_paths_are_one_line_errors_that_write_nothing(run_dir, tmp_path, capsys, case, problem):
    import shutil

    args = {"exists": [str(run_dir), str(tmp_path)],
            "no checkpoint": [str(tmp_path), str(tmp_path / "out")],
            "not a folder": [str(tmp_path / "nope"), str(tmp_path / "out")],
            "into the checkpoint": [str(run_dir / "global_step_1"), str(run_dir / "global_step_1" / "hf")]}
    if case == "no config":
        moved = shutil.copytree(run_dir / "global_step_2", tmp_path / "elsewhere" / "global_step_2")
        args[case] = [str(moved), str(tmp_path / "out")]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", *args[case]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_checkpoint_moved_away_from_its_run_exports_with_its_config_given(run_dir, tmp_path):
    import shutil

    moved = shutil.copytree(run_dir / "global_step_2", tmp_path / "kept" / "global_step_2")
    export_checkpoint(str(moved), str(tmp_path / "hf"), config=str(run_dir / "config.yaml"), print_fn=quiet)
    assert_same_files(run_dir / "actor_hf", tmp_path / "hf")


def test_a_grpo_runs_critic_is_refused_by_name(tiny_model_dir, task_dir, tmp_path, ppo_overrides):
    run_ppo(None, ppo_overrides(run_dir=tmp_path / "grpo", **{"algorithm.adv_estimator": "grpo",
                                                              "trainer.total_training_steps": 1}), print_fn=quiet)
    with pytest.raises(Exception, match=r"--model critic: the run trained no critic \(algorithm.adv_estimator = "
                                        r"'grpo'\); export its actor"):
        export_checkpoint(str(tmp_path / "grpo"), str(tmp_path / "critic"), which="critic", print_fn=quiet)


def test_an_sft_checkpoint_exports_as_its_run_did(tiny_model_dir, task_dir, tmp_path):
    assert main(["sft", f"data.train_files={task_dir / 'sft.parquet'}", "data.max_length=96",
                 "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
                 f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3", "trainer.total_training_steps=2",
                 "trainer.save_freq=2",
                 f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]", "trainer.device=cpu"]) == 0
    export_checkpoint(str(tmp_path / "sft"), str(tmp_path / "hf"), print_fn=quiet)
    assert_same_files(tmp_path / "sft" / "hf", tmp_path / "hf")
