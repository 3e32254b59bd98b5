"""``klppo.models.rng.seeded``: a seeded block leaves the run's random streams (CPU and the
rank's CUDA device) where they were, and touches no other device's generator."""

import pytest
import torch

from klppo.models import rng
from klppo.models.load import empty_model_for, load_critic, load_reward_model
from klppo.models.sharded_load import WeightReader, full_tensors


class FakeGenerator:
    def __init__(self, index: int) -> None:
        self.index, self.seeds = index, []

    def manual_seed(self, seed: int) -> None:
        self.seeds.append(seed)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Four visible CUDA devices whose RNG calls are recorded; reseeding all of them is an error."""
    calls = {"get": [], "set": []}
    generators = [FakeGenerator(i) for i in range(4)]
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: calls["get"].append(device) or torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=0: calls["set"].append(device))
    monkeypatch.setattr(torch.cuda, "default_generators", generators, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)

    def reseed_all(seed):
        raise AssertionError("torch.cuda.manual_seed_all: every device's stream would be reseeded")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseed_all)
    return calls, generators


def test_seeded_block_draws_from_the_seed_and_the_cpu_stream_continues_unchanged():
    torch.manual_seed(123)
    expected_after = torch.rand(3)
    torch.manual_seed(123)
    with rng.seeded(7, torch.device("cpu")):
        inside = torch.rand(2)
    assert torch.equal(inside, torch.rand(2, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(torch.rand(3), expected_after)


def test_seeded_forks_and_seeds_only_the_cuda_device_in_use(fake_cuda):
    calls, generators = fake_cuda
    with rng.seeded(5, torch.device("cuda", 1)):
        pass
    assert calls == {"get": [1], "set": [1]}  # device 1 saved and restored, no other
    assert [g.seeds for g in generators] == [[], [5], [], []]


def test_a_cuda_device_without_index_means_the_current_one(fake_cuda):
    calls, generators = fake_cuda
    with rng.seeded(5, torch.device("cuda")):
        pass
    assert calls == {"get": [2], "set": [2]} and generators[2].seeds == [5]


def test_seeded_on_cpu_touches_no_cuda_generator(fake_cuda):
    calls, generators = fake_cuda
    with rng.seeded(5, torch.device("cpu")):
        pass
    assert calls == {"get": [], "set": []} and all(g.seeds == [] for g in generators)


def test_loading_a_critic_or_reward_model_reseeds_no_cuda_stream(tiny_model_dir, fake_cuda):
    calls, generators = fake_cuda  # torch.manual_seed inside the loaders would raise here
    cpu = torch.random.default_generator
    cpu.manual_seed(0)
    expected_after = torch.rand(2)
    cpu.manual_seed(0)
    load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"), seed=3)
    load_reward_model(str(tiny_model_dir), key="reward_model.model.path", device=torch.device("cpu"), seed=3)
    assert torch.equal(torch.rand(2), expected_after)
    assert all(g.seeds == [] for g in generators)


def test_sharded_loading_of_a_new_head_reseeds_no_cuda_stream(tiny_model_dir, fake_cuda):
    calls, generators = fake_cuda  # torch.manual_seed (every CUDA device's stream) would raise here
    model = empty_model_for("critic", str(tiny_model_dir), key="critic.model.path")
    reader = WeightReader(tiny_model_dir, "critic.model.path")
    cpu = torch.random.default_generator
    cpu.manual_seed(0)
    expected_after = torch.rand(2)
    cpu.manual_seed(0)
    tensor_of = full_tensors(model, reader, new_heads=True, seed=3)
    assert torch.equal(torch.rand(2), expected_after)
    assert calls == {"get": [], "set": []} and all(g.seeds == [] for g in generators)
    critic = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"), seed=3)
    assert torch.equal(tensor_of("score.weight"), critic.score.weight)  # the head from_pretrained gives
