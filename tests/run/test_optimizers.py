"""verl's optim.optimizer / optimizer_impl / override_optimizer_config: the optimiser a model trains with
is built as verl builds it (Adam-like names get betas, the override wins), keeps klppo's decay groups,
is refused with a reason where no PPO step can drive it, and a run with it trains and resumes exactly."""

import textwrap

import pytest
import torch

from klppo.commands.main_ppo import run_ppo
from klppo.config import load_ppo_config
from klppo.errors import UserError
from klppo.run.setup import build_optimizer


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def test_an_optimiser_is_built_as_verl_builds_it_with_klppos_decay_groups():
    sgd = build_optimizer(model(), lr=0.1, weight_decay=0.01, betas=(0.9, 0.999), name="SGD",
                          override={"momentum": 0.9, "nesterov": True})
    assert type(sgd) is torch.optim.SGD and "betas" not in sgd.defaults  # not Adam-like: no betas, as verl
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.01, 0.0]  # no decay on biases and norm weights
    assert [len(g["params"]) for g in sgd.param_groups] == [1, 3]
    adam = build_optimizer(model(), lr=0.1, weight_decay=0.01, betas=(0.8, 0.9), name="Adam",
                           override={"weight_decay": 0.5})
    assert adam.defaults["betas"] == (0.8, 0.9) and [g["weight_decay"] for g in adam.param_groups] == [0.5, 0.0]
    assert adam.defaults["fused"]  # every parameter on the CPU: torch's fused step, as AdamW's
    assert type(build_optimizer(model(), lr=0.1, weight_decay=0.0, betas=(0.9, 0.999))) is torch.optim.AdamW


def test_an_optimiser_of_your_own_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "my_optimizers.py").write_text(textwrap.dedent("""\
        import torch

        class HalfStep(torch.optim.SGD):
            pass
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    optimizer = build_optimizer(model(), lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), name="HalfStep",
                                impl="my_optimizers")
    assert type(optimizer).__name__ == "HalfStep"


@pytest.mark.parametrize("changes, message", [
    (["optim.optimizer=LBFGS"], "optim.optimizer = 'LBFGS' cannot train here: it re-evaluates the loss through a"),
    (["optim.optimizer=Muon"], "optim.optimizer = 'Muon' cannot train here: it takes matrices only"),
    (["optim.optimizer=AdamW8"], "optim.optimizer = 'AdamW8' is not an optimiser class of torch.optim; it has "),
    (["optim.optimizer_impl=no_such_optimizers"], "optim.optimizer_impl = 'no_such_optimizers' is not installed"),
    (["optim.override_optimizer_config=5"], "optim.override_optimizer_config: expected a mapping of names to values"),
])
def test_an_optimiser_no_ppo_step_can_drive_is_refused_naming_the_key(changes, message):
    with pytest.raises(UserError) as info:
        load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
                               *[f"actor_rollout_ref.actor.{c}" for c in changes]])
    assert f"actor_rollout_ref.actor.{message}" in str(info.value)


def test_a_run_with_sgd_and_momentum_resumed_after_a_crash_repeats_the_uninterrupted_run(
        ppo_overrides, tmp_path, crashed_and_resumed):
    """SGD's momentum buffers are part of the checkpoint: without them the resumed steps would differ."""
    changes = {"actor_rollout_ref.actor.optim.optimizer": "SGD", "critic.optim.optimizer": "SGD",
               "actor_rollout_ref.actor.optim.override_optimizer_config": "{momentum: 0.9}",
               "critic.optim.override_optimizer_config": "{momentum: 0.9}",
               "actor_rollout_ref.actor.optim.lr": 0.05, "critic.optim.lr": 0.05,
               "trainer.total_training_steps": 4, "trainer.save_freq": 2}
    full, resumed = crashed_and_resumed(ppo_overrides, changes)
    assert [r["step"] for r in resumed] == [3, 4] and resumed == full[2:]
    adamw = run_ppo(None, ppo_overrides(tmp_path / "adamw", **{"trainer.total_training_steps": 2}),
                    print_fn=lambda *a, **k: None)
    assert full[1]["actor/pg_loss"] != adamw[1]["actor/pg_loss"]  # another optimiser trained


def test_sft_and_reward_model_training_take_verls_optimiser_keys_too():
    from klppo.config.parse import load_rm_config, load_sft_config

    for load in (load_sft_config, load_rm_config):
        cfg = load(None, ["data.train_files=t.parquet", "model.partial_pretrain=m", "optim.optimizer=SGD",
                          "optim.override_optimizer_config={momentum: 0.5}"])
        assert (cfg.optim.optimizer, cfg.optim.override_optimizer_config) == ("SGD", {"momentum": 0.5})
