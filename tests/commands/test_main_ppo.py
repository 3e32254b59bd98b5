"""``klppo ppo``'s checks before anything loads: a launch that does not match the config is named first."""

import pytest

from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.errors import UserError


def test_a_config_for_4_ranks_launched_as_one_process_names_the_launch_first(ppo_overrides, tmp_path, monkeypatch):
    """Its batch arithmetic for 4 ranks (8 samples per mini-batch / 4 ranks = 2 < the micro-batch of 4)
    is refused too, but after the mistake that causes it: the launch does not match the config."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = ppo_overrides(tmp_path / "run") + ["trainer.n_gpus_per_node=4",
                                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    with pytest.raises(UserError) as info:
        run_ppo(None, overrides, print_fn=lambda *a: None)
    first = str(info.value).splitlines()[1]
    assert first.startswith("  - trainer.n_gpus_per_node x trainer.nnodes = 4 x 1 = 4 ranks, but this run was launched "
                            "as 1 process; launch it with torchrun --nproc_per_node 4 -m klppo.trainer.main_ppo"), first
    assert first.endswith("or set trainer.n_gpus_per_node=1 to run on the launch you have"), first
    assert "/ 4 ranks" in str(info.value)  # the batch arithmetic's own message follows
    assert not (tmp_path / "run").exists()


def test_a_launch_over_several_nodes_is_named_with_its_node_count():
    cfg = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny", "data.train_batch_size=16",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16",
           "trainer.n_gpus_per_node=4", "trainer.nnodes=2"]
    with pytest.raises(UserError, match=r"= 8 ranks, but this run was launched as 2 processes; launch it with torchrun "
                                        r"--nnodes 2 --nproc_per_node 4 .* on each node, or set "
                                        r"trainer.n_gpus_per_node=1 to run"):
        load_ppo_config(None, cfg, launched=2)
    assert load_ppo_config(None, cfg, launched=8).trainer.nnodes == 2
    assert load_ppo_config(None, cfg).trainer.nnodes == 2  # validate-config: nothing launched, nothing to compare


def test_a_runs_config_warnings_are_printed_once_at_its_start_by_rank_zero(ppo_overrides, tmp_path, capsys,
                                                                            monkeypatch):
    """What validate-config warns about, a run says too, before anything loads; torchrun's other ranks say nothing."""
    from klppo.cli import main

    changes = {"+actor_rollout_ref.rollout.layered_summon": "true", "trainer.total_training_steps": 1,
               "trainer.logger": "[console]"}
    assert main(["ppo", *ppo_overrides(tmp_path / "run", **changes)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("warning: 1 verl setting in this config has no effect in klppo (accepted, so verl configs run "
                        "as they are):") and "actor_rollout_ref.rollout.layered_summon=true" in lines[1]
    assert sum("no effect in klppo" in line for line in lines) == 2  # the summary and its one line
    from klppo.cli_support import show_notes

    printed = []
    monkeypatch.setenv("RANK", "1")  # as torchrun sets it in another rank's process
    show_notes(["warning: x"], printed.append)
    monkeypatch.setenv("RANK", "0")
    show_notes(["warning: x"], printed.append)
    assert printed == ["warning: x"]
