"""param_offload / optimizer_offload: models and optimiser state visit the device only for their phases."""

import torch
from offload_kit import RecordingLinear

from klppo.run.offload import Offloader, move_optimizer_state


def _stepped(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return optimizer


def test_optimizer_state_moves_but_adam_step_counts_stay_on_cpu():
    optimizer = _stepped(torch.nn.Linear(2, 2))
    move_optimizer_state(optimizer, torch.device("meta"))
    for state in optimizer.state.values():
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"


def test_offloaded_models_live_on_cpu_and_visit_the_device_for_their_phase():
    actor, critic, ref = RecordingLinear(), RecordingLinear(), RecordingLinear()
    offloader = Offloader(torch.device("cuda", 0))  # nothing is moved for real: .to() is recorded
    offloader.register("actor", actor, param_offload=True)
    offloader.register("critic", critic, param_offload=False)
    assert actor.moves == ["cpu"] and "critic" not in offloader.held
    with offloader.resident("actor", "critic", "ref"):  # roles without offload are left alone
        assert actor.moves == ["cpu", "cuda"]
        offloader.register("ref", ref, param_offload=False)
    assert actor.moves == ["cpu", "cuda", "cpu"] and critic.moves == [] and ref.moves == []


def test_a_cpu_run_has_nothing_to_offload():
    model = RecordingLinear()
    offloader = Offloader(torch.device("cpu"))
    offloader.register("actor", model, param_offload=True, optimizer=_stepped(model), optimizer_offload=True)
    with offloader.resident("actor"):
        pass
    assert model.moves == [] and offloader.held == {}
