"""What ``VLLMEngine`` asks of vLLM, recorded by a stand-in engine (``tests/fake_vllm.py``) on a
machine without vLLM or a GPU (``on_gpu`` forced where sleep mode is under test): sleep mode never
generates from released weights and empties PyTorch's cache before every wake, the external
launcher runs without the custom all-reduce, and requests stop at every EOS of the model unless
``ignore_eos``."""

from types import SimpleNamespace

import pytest
import torch

from klppo.data.rl_dataset import PromptRecord
from klppo.rollout.hf import SamplingParams
from klppo.rollout.vllm import VLLMEngine
from tests import fake_vllm
from tests.fake_vllm import engine_settings

CPU = torch.device("cpu")
TOKENIZER = SimpleNamespace(eos_token_id=7, pad_token_id=0)
RECORDS = [PromptRecord(i, "x", [], [3, 4, 5], None, {}) for i in range(2)]


def engine(monkeypatch, *, gpu: bool = True, distributed: bool = False, generation_config=None, **changes):
    if gpu:
        monkeypatch.setattr(VLLMEngine, "on_gpu", True)
    extra = {} if generation_config is None else {"generation_config": generation_config}
    return VLLMEngine("model", None, engine_settings(kv_cache_memory_bytes=1 << 26, **changes), CPU, distributed,
                      1 << 30, **extra)


def generations_from_released_weights(log: fake_vllm.Log) -> int:
    """How many generations came after a level-2 sleep with no weight load between."""
    released, count = False, 0
    for call in log:
        if call[0] == "sleep" and call[1] == 2:
            released = True
        elif call[0] == "load":
            released = False
        elif call[0] == "generate":
            count += released
    return count


def generate(e: VLLMEngine, tokenizer=TOKENIZER, **params):
    return e.generate(RECORDS, SamplingParams(n=1, max_new_tokens=8, **params), [1, 2], tokenizer)


def test_a_sleeping_engine_wakes_weights_then_kv_cache_and_refuses_to_generate_from_released_weights(monkeypatch):
    log = fake_vllm.install(monkeypatch)
    e = engine(monkeypatch)
    assert log.names() == ["init", "sleep"] and not e.holds_weights  # built, then asleep (level 2)
    e.load_weights([("w", torch.zeros(1))])
    generate(e)
    assert log.names()[2:] == ["empty_cache", "wake_up", "load", "reset_prefix_cache",
                               "empty_cache", "wake_up", "generate", "sleep"]
    assert [call[1] for call in log if call[0] == "wake_up"] == [("weights",), ("kv_cache",)]
    assert not e.holds_weights  # the sleep after the generation discarded them
    with pytest.raises(AssertionError, match="load_weights first"):
        generate(e)
    e.load_weights([("w", torch.zeros(1))])
    generate(e)
    assert generations_from_released_weights(log) == 0


def test_every_wake_comes_right_after_pytorchs_cache_is_emptied(monkeypatch):
    log = fake_vllm.install(monkeypatch)
    e = engine(monkeypatch)
    for _ in range(2):
        e.load_weights([])
        generate(e)
    names = log.names()
    wakes = [i for i, name in enumerate(names) if name == "wake_up"]
    assert len(wakes) == 4 and all(names[i - 1] == "empty_cache" for i in wakes)


def test_on_cpu_the_engine_never_sleeps_and_keeps_its_weights(monkeypatch):
    log = fake_vllm.install(monkeypatch)
    e = engine(monkeypatch, gpu=False)
    e.load_weights([])
    generate(e)
    generate(e)
    assert log.names() == ["init", "load", "reset_prefix_cache", "generate", "generate"] and e.holds_weights


@pytest.mark.parametrize("distributed", [False, True])
def test_the_external_launcher_runs_without_the_custom_all_reduce(monkeypatch, distributed):
    log = fake_vllm.install(monkeypatch)
    engine(monkeypatch, distributed=distributed)
    kwargs = log[0][1]
    assert kwargs.get("distributed_executor_backend") == ("external_launcher" if distributed else None)
    assert kwargs.get("disable_custom_all_reduce", False) is distributed


def test_requests_stop_at_every_eos_the_model_lists_and_the_mask_ends_at_the_first(monkeypatch):
    # Qwen2.5-Instruct's case: the tokenizer's EOS (7) and a second one in generation_config.json (6).
    log = fake_vllm.install(monkeypatch)
    e = engine(monkeypatch, gpu=False, generation_config=SimpleNamespace(eos_token_id=[7, 6]))
    e.load_weights([])
    batch = generate(e)
    requests = log[-1][1]
    assert all(r.stop_token_ids == [7, 6] and not r.ignore_eos for r in requests)
    assert batch.response_ids.tolist() == [[5, 6]] * 2  # stopped at 6, which is kept
    assert batch.response_mask.all()


def test_ignore_eos_decodes_past_the_eos_and_the_response_still_ends_at_it(monkeypatch):
    log = fake_vllm.install(monkeypatch)
    e = engine(monkeypatch, gpu=False, ignore_eos=True)
    e.load_weights([])
    batch = generate(e)  # samples 5, 6, 7 (the EOS), 8
    requests = log[-1][1]
    assert all(r.stop_token_ids == [] and r.ignore_eos for r in requests)  # vLLM stops at stop tokens regardless
    assert batch.response_mask.tolist() == [[True, True, True, False]] * 2  # decoded to the end, cut for training
    assert batch.response_ids.tolist() == [[5, 6, 7, 0]] * 2
