"""A stand-in for the ``vllm`` package that records every call klppo's engine makes, for the tests
that need no vLLM: ``install(monkeypatch)`` puts it in ``sys.modules`` and returns its log.

It keeps the state a GPU engine in sleep mode has, and fails where the real one would: a
generation after a level-2 sleep with no weight load since reads unmapped memory (here a
``RuntimeError``); waking memory that is already mapped is a CUDA error (here too). Responses are
a fixed run of tokens with log-prob -1 each, ending at ``eos`` where one is given.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import torch

from klppo.rollout.vllm import EngineSettings


def engine_settings(**changes) -> EngineSettings:
    """The engine settings of the tests, with ``changes``."""
    base = dict(tensor_parallel_size=1, dtype=torch.float32, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
                max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=96, enforce_eager=None,
                enable_chunked_prefill=True, enable_prefix_caching=True, load_format="dummy",
                sleep_between_generations=True, calculate_log_probs=True, logprobs_mode="processed_logprobs",
                ignore_eos=False, seed=42, rows_per_generation=16)
    return EngineSettings(**{**base, **changes})


class Log(list):
    """The calls, in order: ("init", kwargs), ("sleep", level), ("wake_up", tags), ("load", names),
    ("reset_prefix_cache",), ("generate", params), ("empty_cache",)."""

    def names(self) -> list[str]:
        return [call[0] for call in self]


class Model(torch.nn.Module):
    """The engine's model as ``apply_model`` sees it: Qwen2's layout (the head tied to the
    embeddings), or with ``head=False`` Gemma2's, which has no ``lm_head`` at all."""

    def __init__(self, head: bool = True) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(4, 2)
        if head:
            self.lm_head = torch.nn.Linear(2, 4, bias=False)
            self.lm_head.weight = self.embed_tokens.weight


class FakeLLM:
    log: Log
    response = [5, 6, 7, 8]  # the tokens every request samples (cut at a stop token)
    head = True

    def __init__(self, **kwargs) -> None:
        self.log.append(("init", kwargs))
        self.model = Model(self.head)
        self.mapped = {"weights": True, "kv_cache": True}
        self.weights_valid = True  # the start-up (dummy) weights
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def apply_model(self, func):
        return [func(self.model)]

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))
        self.mapped = {"weights": False, "kv_cache": False}
        self.weights_valid = level == 1  # level 1 keeps the weights on the host, level 2 discards them

    def wake_up(self, tags: list[str]) -> None:
        self.log.append(("wake_up", tuple(tags)))
        for tag in tags:
            if self.mapped[tag]:
                raise RuntimeError(f"CUDA error: wake_up of {tag}, already mapped")
            self.mapped[tag] = True

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        if not self.mapped["weights"]:
            raise RuntimeError("reload_weights into unmapped memory")
        self.log.append(("load", [name for name, _ in kwargs["weights_iterator"]]))
        self.weights_valid = True

    def reset_prefix_cache(self) -> bool:
        self.log.append(("reset_prefix_cache",))
        return True

    def generate(self, requests: list, params: list, use_tqdm: bool = False) -> list:
        self.log.append(("generate", params))
        if not (self.weights_valid and all(self.mapped.values())):
            raise RuntimeError(f"generate with released memory or weights: {self.mapped}, valid={self.weights_valid}")
        return [SimpleNamespace(outputs=[completion(self.response, p)]) for p in params]


def completion(tokens: list[int], p: SimpleNamespace) -> SimpleNamespace:
    """What vLLM returns for one request: tokens up to the first stop token, at most ``max_tokens``."""
    out = []
    for token in tokens[: p.max_tokens]:
        out.append(token)
        if token in (p.stop_token_ids or ()):
            break
    return SimpleNamespace(token_ids=out, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in out])


def install(monkeypatch, *, head: bool = True, response: list[int] | None = None) -> Log:
    """Put the fake ``vllm`` in ``sys.modules`` (and ``torch.cuda.empty_cache`` logging into the same
    record); returns the log of every call."""
    log = Log()
    llm = type("LLM", (FakeLLM,), {"log": log, "head": head, "response": response or FakeLLM.response})
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # found by require_vllm's find_spec
    module.LLM = llm
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return log
