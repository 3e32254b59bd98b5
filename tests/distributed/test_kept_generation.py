"""HF generation with a static KV cache keeps its model and caches from one generation to the next.

A compiled decoding step replays CUDA graphs recorded on the addresses of the model's parameters and
of the cache's tensors. A generation copy built afresh every step, and transformers' own static
cache (a new one at every ``generate`` call), moved both, so every step recorded the graphs again
(torch 2.11 counts each re-recording; past 128 it decodes that function without CUDA graphs). Now
the copy is built once and the actor's current weights are written into it in place, and each
shape's cache is kept and emptied in place: the same addresses every step, the same samples as a
fresh copy and a fresh cache. CUDA graphs cannot run here; the addresses they depend on are what
these tests check.
"""

from types import SimpleNamespace

import pytest
import torch

from klppo.commands.main_ppo import run_ppo
from klppo.config.schema import FSDPConfig
from klppo.data.rl_dataset import load_rl_dataset
from klppo.distributed import DistEnv
from klppo.models.load import load_tokenizer
from klppo.rollout.hf import Decoding, SamplingParams, StaticCaches, hf_rollout
from klppo.run.setup import Sharder, load_model
from klppo.trainer import responses
from klppo.trainer.responses import generation_copy, generation_decoding, generation_model

ONE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_distributed=True)
PARAMS = SamplingParams(n=2, max_new_tokens=6)


@pytest.fixture
def bf16_parts(group_of_one, tiny_model_dir, task_dir):
    """parts(mode, offloaded=False) -> what ``generation_model`` reads: the tiny actor under FSDP2 in one
    process computing in bf16 (so generation takes a cast copy), decoding as ``mode`` says."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = load_rl_dataset(task_dir / "train.parquet", tokenizer, max_prompt_length=64, log=lambda *_: None)[:6]

    def parts(mode: str, offloaded: bool = False) -> SimpleNamespace:
        actor = load_model("causal_lm", str(tiny_model_dir), key="k", env=ONE_PROCESS, sharder=Sharder(ONE_PROCESS),
                           fsdp=FSDPConfig(dtype="bfloat16"))
        settings = SimpleNamespace(generation_weights="gathered", actor_lora=False, hf_decoding=Decoding(mode, 64 + 6),
                                   actor=SimpleNamespace(compute_dtype=torch.bfloat16), actor_offloaded=offloaded)
        return SimpleNamespace(actor=actor, env=ONE_PROCESS, settings=settings, tokenizer=tokenizer, records=records,
                               kept_generation_model=None, kv_caches=StaticCaches())

    return parts


def generate(parts, records=None, seed: int = 3) -> tuple[torch.nn.Module, torch.Tensor]:
    """(the model it generated with, its (B, T) response ids), as a PPO step samples, from ``seed``."""
    torch.manual_seed(seed)
    with generation_model(parts) as (model, sharded):
        batch = hf_rollout(model, records or parts.records, parts.tokenizer, PARAMS, synced_gpus=sharded,
                           device=parts.env.device, decoding=generation_decoding(parts, sharded))
    return model, batch.response_ids


def addresses(model: torch.nn.Module) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


def cache_addresses(caches: StaticCaches) -> list[int]:
    return [t.data_ptr() for t in caches.tensors()]


@torch.no_grad()
def train_a_little(actor: torch.nn.Module, seed: int) -> None:
    """Move every one of the actor's shards, as an optimiser step would (in place)."""
    torch.manual_seed(seed)
    for param in actor.parameters():
        local = param.to_local()
        local.add_(torch.randn_like(local) * 1e-2)


def test_a_static_cache_keeps_the_copy_and_writes_each_steps_weights_into_it(bf16_parts):
    parts = bf16_parts("static")
    first, _ = generate(parts)
    assert parts.kept_generation_model is first
    kept = addresses(first)
    for step in (1, 2):
        train_a_little(parts.actor, seed=step)
        model, sampled = generate(parts, seed=10 + step)
        assert model is first and addresses(model) == kept
        fresh = generation_copy(parts.actor, torch.bfloat16, parts.env.device)
        assert model.state_dict().keys() == fresh.state_dict().keys()
        for name, tensor in fresh.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name
        # the same samples as a step that builds its copy afresh and decodes into a new cache
        again = bf16_parts("static")
        again.actor.load_state_dict(parts.actor.state_dict())
        again.settings.actor_offloaded = True  # nothing kept
        _, fresh_sampled = generate(again, seed=10 + step)
        assert again.kept_generation_model is None and len(again.kv_caches) == 0
        assert torch.equal(sampled, fresh_sampled)


def test_each_shapes_cache_is_kept_and_emptied_in_place(bf16_parts):
    parts = bf16_parts("static")
    generate(parts)
    first = cache_addresses(parts.kv_caches)
    _, twice = generate(parts, seed=4)
    assert cache_addresses(parts.kv_caches) == first and len(parts.kv_caches) == 1
    generate(parts, records=parts.records[:2])  # other rows (validation, the KL probe): a cache of their own
    assert len(parts.kv_caches) == 2 and cache_addresses(parts.kv_caches)[: len(first)] == first
    # a cache emptied in place decodes as a new one
    parts.kv_caches = StaticCaches()
    _, fresh = generate(parts, seed=4)
    assert torch.equal(twice, fresh)


@pytest.mark.parametrize("mode, offloaded", [("dynamic", False), ("static", True)])
def test_the_dynamic_cache_and_an_offloaded_actor_keep_nothing(bf16_parts, mode, offloaded):
    parts = bf16_parts(mode, offloaded)
    first, _ = generate(parts)
    second, _ = generate(parts)
    assert parts.kept_generation_model is None and len(parts.kv_caches) == 0 and second is not first


def test_a_kept_copy_is_used_whatever_the_free_memory_says_later(bf16_parts, monkeypatch):
    parts = bf16_parts("static")
    parts.settings.generation_weights = "auto"
    first, _ = generate(parts)
    monkeypatch.setattr(responses, "available_bytes", lambda device: 0)  # the kept copy itself takes memory
    assert responses.uses_gathered_copy(parts)
    assert generate(parts)[0] is first


def test_a_run_that_keeps_its_generation_copy_trains_as_one_that_builds_it_every_step(
        ppo_overrides, task_dir, tmp_path, monkeypatch):
    """A bf16 actor under FSDP2 in one process, hf_decoding=static: the copy is built once and refreshed
    in place; the run logs the metrics of the same run with a new copy every step."""
    built = []
    original = responses.generation_copy
    monkeypatch.setattr(responses, "generation_copy", lambda *a: built.append(1) or original(*a))

    def run(name: str) -> list[dict]:
        records = run_ppo(None, ppo_overrides(tmp_path / name, **{
            "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
            "actor_rollout_ref.rollout.hf_decoding": "static", "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
            "trainer.total_training_steps": 3, "actor_rollout_ref.actor.optim.lr": 1e-3}), print_fn=lambda *a, **k: None)
        return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records]

    kept = run("kept")
    assert built == [1]
    monkeypatch.setattr(responses, "keeps_generation_model", lambda parts: False)
    rebuilt = run("rebuilt")
    assert built == [1, 1, 1, 1]
    assert len(kept) == 3 and kept == rebuilt
