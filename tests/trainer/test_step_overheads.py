"""What a PPO step does besides its computation, counted: no garbage collection and no emptying of
CUDA's cache per step or per phase (each waits for the device; the first H200 run spent 0.5 s per
step in gc.collect), and what any collection during the steps must walk: only what the steps made,
the set-up frozen (``klppo.run.collector``). The run is a tiny one on CPU; the two places that
emptied the cache on CUDA (the generation copy's release, the offloader's return of a model to
CPU) are driven with the device faked as CUDA."""

import gc
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from offload_kit import RecordingLinear

import klppo.trainer.responses as responses
from klppo.commands.main_ppo import run_ppo
from klppo.rollout.hf import Decoding
from klppo.run.collector import FROZEN_AT_IMPORT
from klppo.run.offload import Offloader
from klppo.trainer.ppo_trainer import PPOTrainer

CUDA = torch.device("cuda", 0)


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Calls of gc.collect, torch.cuda.empty_cache and torch.cuda.synchronize (the last two do nothing here)."""
    counts: Counter = Counter()
    for owner, name in ((gc, "collect"), (torch.cuda, "empty_cache"), (torch.cuda, "synchronize")):
        original = getattr(owner, name)

        def call(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs) if _name == "collect" else None

        monkeypatch.setattr(owner, name, call)
    return counts


def test_a_tiny_online_run_collects_no_garbage_and_empties_no_cache_in_its_steps(
        ppo_overrides, task_dir, counted, monkeypatch):
    per_step = []
    train_step = PPOTrainer.train_step

    walked = []  # (objects a full collection would walk, objects frozen) in each step

    def counting_step(self):
        before = Counter(counted)
        out = train_step(self)
        per_step.append(Counter(counted) - before)
        walked.append((len(gc.get_objects()), gc.get_freeze_count()))
        return out

    monkeypatch.setattr(PPOTrainer, "train_step", counting_step)
    copies, generation_copy = [], responses.generation_copy
    monkeypatch.setattr(responses, "generation_copy", lambda *a: copies.append(1) or generation_copy(*a))
    # online (the generation copy of a bf16 actor under FSDP2 over a group of one), a critic, validation
    overrides = ppo_overrides(**{"data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
                                 "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
                                 "algorithm.adv_estimator": "gae", "trainer.total_training_steps": 2})
    run_ppo(None, overrides, print_fn=lambda *a, **k: None)
    assert per_step == [Counter(), Counter()] and copies == [1, 1]  # each step generated with a copy
    # a collection in a step walks what the steps made: a small share of what the set-up left frozen
    assert all(frozen > 100_000 and tracked < frozen / 5 for tracked, frozen in walked), walked
    assert gc.get_freeze_count() == FROZEN_AT_IMPORT  # thawed when training ended (before the export's collection)


def test_the_set_up_is_frozen_only_where_nothing_else_froze_it():
    """Python 3.12 starts with objects frozen (``FROZEN_AT_IMPORT``): they are no other library's freeze."""
    from klppo.run.collector import FrozenSetup

    with FrozenSetup() as frozen:
        assert gc.get_freeze_count() > FROZEN_AT_IMPORT + 100_000
        frozen.collect_everything()
        assert gc.get_freeze_count() == FROZEN_AT_IMPORT
    gc.freeze()  # as vLLM does
    try:
        count = gc.get_freeze_count()
        with FrozenSetup() as frozen:
            frozen.collect_everything()
            assert gc.get_freeze_count() > count // 2  # theirs, left frozen (some die by reference count)
    finally:
        gc.unfreeze()


def test_returning_a_model_to_cpu_leaves_its_memory_to_the_caching_allocator(counted):
    offloader = Offloader(CUDA)  # RecordingLinear records its moves instead of making them
    actor = RecordingLinear()
    offloader.register("actor", actor, param_offload=True)
    for _ in range(3):
        with offloader.resident("actor"):
            pass
    assert actor.moves == ["cpu"] + ["cuda", "cpu"] * 3 and counted["empty_cache"] == 0


def test_the_generation_copy_is_dropped_without_emptying_the_cache(counted, monkeypatch):
    dropped = []

    class Copy(torch.nn.Module):
        def __del__(self):
            dropped.append(1)

    monkeypatch.setattr(responses, "uses_gathered_copy", lambda parts: True)
    monkeypatch.setattr(responses, "generation_copy", lambda actor, dtype, device: Copy())
    parts = SimpleNamespace(actor=None, env=SimpleNamespace(device=CUDA), kept_generation_model=None,
                            settings=SimpleNamespace(actor=SimpleNamespace(compute_dtype=torch.bfloat16),
                                                     hf_decoding=Decoding("dynamic"), actor_offloaded=False))
    with responses.generation_model(parts) as (model, sharded):
        assert isinstance(model, Copy) and not sharded
        del model
    assert dropped == [1] and counted["empty_cache"] == 0 and counted["collect"] == 0
