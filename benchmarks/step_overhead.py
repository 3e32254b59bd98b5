"""Where a PPO step's time goes on CPU: the models' own forwards and backwards, and everything else.

    python benchmarks/step_overhead.py                      # issue #33's workload: ppo, offline, grpo
    python benchmarks/step_overhead.py --runs grpo --steps 8
    python benchmarks/step_overhead.py --size tiny --steps 2 # the smoke test's shape (seconds)

Workload (issue #33): a random Qwen2 of 5.0M parameters (vocab 4,096, hidden 256, MLP 688, 4
layers, 4/2 heads, untied) with a locally trained tokenizer, 16 sequences of 32 prompt + 32
response tokens, temperature 0.7, fp32, one process, through ``run_ppo`` with every default not
named here:
- ppo: 16 prompts x 1 response (hf generate), GAE with a critic, a random reward model, the KL
  in the reward (k1, 0.05);
- offline: the same on recorded responses (no generation; the sampled KL probe runs on every
  step here, ``probe_every`` 1, so that each measured step profiles it: by default a run probes
  every 4th step, and the report prints that share too);
- grpo: 4 prompts x 4 responses, the same reward model, a KL loss (k3, 0.05).
Every response is exactly 32 tokens: the model never samples EOS (one hidden dimension of its
residual stream is a positive constant and the EOS row of the LM head reads it x -100), and
the recorded responses are cut at 32 tokens.

What is measured, per step (the first ``--skip`` steps are left out, the median over the rest):
- wall: from ``train_step``'s start to the progress bar's advance after logging (a step's
  checkpoint is off: trainer.save_freq -1; the last step saves, and is left out too);
- model: the models' own forwards (forward hooks on the actor, reference, critic and reward
  models; the decode steps of ``generate`` included), the backward calls and the optimiser
  steps. Everything else is overhead: ``generate``'s own (sampling, cache, stopping) and
  klppo's (planning, packing, losses' bookkeeping, metrics, guards, logging, ...);
- per phase (``timing_s/<phase>``) the same split; "between phases" is the step's time outside
  every phase;
- per klppo function, the time it spends outside the models and outside other klppo functions
  (every function and method of the klppo package is wrapped with a timer for the run), and
  its calls per step: the top ``--top`` are printed.
- minor page faults per step and per phase: pages the step's allocations had mapped afresh. A
  steady step reuses the memory of the one before, so this stays near 0; at 2414fa9's parent
  glibc unmapped every freed block of 1 MiB and more, and the ppo run faulted 115,762 pages a
  step (452 MiB), 62,228 of them in update_actor, which cost its update 1.4-1.5x. The time
  split cannot show that cost (it is inside the models' own forwards), the count does.
Timing wraps add about a microsecond per klppo call (a few ms per step here), counted in the
overhead. ``--clock process`` measures process CPU time instead of wall time, steadier on a
machine shared with other work (use it with ``--threads 1``: with more threads the OpenMP
threads' spinning counts as work).

A benchmark, not a test: it prints numbers and asserts nothing (tests/benchmarks runs it on
``--size tiny`` to see that it runs). ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

SHAPES = {  # vocab, hidden, mlp, layers, heads, kv heads, prompt tokens, response tokens, prompts scale
    "issue33": dict(vocab=4096, hidden=256, mlp=688, layers=4, heads=4, kv_heads=2, prompt=32, response=32),
    "tiny": dict(vocab=512, hidden=32, mlp=64, layers=2, heads=2, kv_heads=1, prompt=8, response=8),
}
RUNS = ("ppo", "offline", "grpo")
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "x", "y"]


# ---- the workload ----


def corpus(n: int, seed: int) -> list[str]:
    """Sentences of made-up words: enough distinct text for a BPE vocabulary of thousands."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(n)]


def texts_of(tokenizer, n: int, length: int, seed: int) -> list[str]:
    """``n`` texts of exactly ``length`` tokens (decoded random tokens, kept when they re-encode so)."""
    rng, out = random.Random(seed), []
    specials = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in specials]
    while len(out) < n:
        text = tokenizer.decode([rng.choice(ids) for _ in range(length + 8)])
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(encoded) >= length:
            cut = tokenizer.decode(encoded[:length])
            if len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == length:
                out.append(cut)
    return out


def build_model(out: Path, shape: dict, seed: int = 0) -> Path:
    """A random untied Qwen2 of ``shape`` that never samples EOS (see the module's docstring)."""
    from transformers import Qwen2ForCausalLM

    from klppo.models.rng import seeded
    from klppo.models.tiny import save_tokenizer, tiny_model_config, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(corpus(20000 if shape["vocab"] > 1000 else 2000, seed),
                                     vocab_size=shape["vocab"], chat_template=False)
    config = tiny_model_config(shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                               num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                               num_key_value_heads=shape["kv_heads"], pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    config.tie_word_embeddings = False
    with seeded(seed, torch.device("cpu")):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # hidden dimension 0 is 1 after the embedding and nothing writes to it
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = -100.0  # EOS logit: -100 x a positive number
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)  # reloads with exactly the model's rows
    return out


def build_reward_model(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """A one-label sequence-classification model on the actor's backbone, its head random."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    from klppo.models.rng import seeded

    logging.set_verbosity_error()  # the backbone's unused LM head is reported otherwise
    with seeded(seed, torch.device("cpu")):
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


def build_data(model_dir: Path, out: Path, shape: dict, rows: int = 128, seed: int = 2) -> None:
    """train.parquet (plain-text prompts) and offline.parquet (the same, one recorded response each)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = texts_of(tokenizer, rows, shape["prompt"], seed)
    responses = texts_of(tokenizer, rows, shape["response"] + 4, seed + 1)  # cut to the length, no EOS
    base = [{"data_source": "bench", "prompt": p, "ability": "none",
             "reward_model": {"style": "model", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(base), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{**r, "responses": [responses[i]]} for i, r in enumerate(base)]),
                   out / "offline.parquet")


def build_workload(root: Path, size: str) -> Path:
    """The model, reward model and data folders under ``root`` (kept: a second call reuses them)."""
    root = root / size
    if not (root / "offline.parquet").exists():
        root.mkdir(parents=True, exist_ok=True)
        shape = SHAPES[size]
        build_model(root / "model", shape)
        build_reward_model(root / "model", root / "rm")
        build_data(root / "model", root, shape)
    return root


def overrides(run: str, root: Path, run_dir: Path, steps: int, size: str) -> list[str]:
    """``run_ppo``'s overrides of run ``run`` (ppo | offline | grpo) on the workload in ``root``."""
    shape = SHAPES[size]
    s = {
        "data.train_files": root / ("offline.parquet" if run == "offline" else "train.parquet"),
        "data.max_prompt_length": shape["prompt"], "data.max_response_length": shape["response"],
        "actor_rollout_ref.model.path": root / "model", "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.actor.optim.lr": 1e-6, "critic.optim.lr": 1e-5,
        "reward_model.enable": "true", "reward_model.model.path": root / "rm",
        "trainer.total_training_steps": steps, "trainer.logger": "[]", "trainer.device": "cpu",
        "trainer.default_local_dir": run_dir, "trainer.save_freq": -1,
    }
    if run == "grpo":
        s.update({"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
                  "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.name": "hf",
                  "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": "true",
                  "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.actor.kl_loss_coef": 0.05})
    else:
        s.update({"data.train_batch_size": 16, "actor_rollout_ref.rollout.n": 1,
                  "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
                  "actor_rollout_ref.rollout.name": "offline" if run == "offline" else "hf",
                  "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": "true",
                  "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.kl_coef": 0.05})
        if run == "offline":
            s["algorithm.kl_ctrl.probe_every"] = 1  # profiled on every measured step
    return [f"{k}={v}" for k, v in s.items()]


# ---- the clock: models, phases, klppo functions ----

FORWARD, BACKWARD, OPTIMIZER = "model forward", "backward", "optimizer step"
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


@dataclass
class StepRecord:
    """One step's seconds: in all, in the models (by kind), per phase, per function outside the models."""

    wall: float = 0.0
    models: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    phases: dict[str, list[float]] = field(default_factory=dict)  # name -> [seconds, of them in the models]
    functions: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))  # [s, calls]
    torch_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # outside the models, by caller
    faults: int = 0  # minor page faults: pages the step's allocations had mapped afresh
    phase_faults: dict[str, int] = field(default_factory=dict)


def minor_faults() -> int:
    """This process's minor page faults so far (a page first touched after the allocator mapped it)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Recorder:
    """Splits time between the models' own work and the rest (see the module's docstring).

    A model region (a root model's forward, a backward, an optimiser step) counts once however
    deep it nests; a klppo function's time is its time outside the model regions it ran and
    outside the klppo functions it called. Calls made inside a model region (klppo's attention
    and fused head run inside the forward) are the model's.
    """

    def __init__(self, clock: str = "wall") -> None:
        self.clock = CLOCKS[clock]
        self.depth, self.region_start, self.region_kind = 0, 0.0, ""
        self.in_models = 0.0  # running total of seconds in model regions
        self.frames: list[list] = []  # per open klppo call: [its children's seconds outside the models, its name]
        self.step: StepRecord | None = None
        self.steps: list[StepRecord] = []
        self.step_start = 0.0
        self.undo: list = []

    # model regions
    def enter(self, kind: str) -> None:
        if self.depth == 0:
            self.region_start, self.region_kind = self.clock(), kind
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            seconds = self.clock() - self.region_start
            self.in_models += seconds
            if self.step is not None:
                self.step.models[self.region_kind] += seconds

    @contextmanager
    def region(self, kind: str):
        self.enter(kind)
        try:
            yield
        finally:
            self.leave()

    # functions
    def timed(self, name: str, fn):
        recorder = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if recorder.depth or recorder.step is None:
                return fn(*args, **kwargs)
            start, models = recorder.clock(), recorder.in_models
            recorder.frames.append([0.0, name])
            try:
                return fn(*args, **kwargs)
            finally:
                children = recorder.frames.pop()[0]
                outside = recorder.clock() - start - (recorder.in_models - models)
                if recorder.frames:
                    recorder.frames[-1][0] += outside
                entry = recorder.step.functions[name]
                entry[0] += outside - children
                entry[1] += 1

        return wrapper

    # steps and phases
    def begin_step(self) -> None:
        self.step, self.step_start, self.step_faults = StepRecord(), self.clock(), minor_faults()

    def end_step(self) -> None:
        if self.step is not None:
            self.step.wall = self.clock() - self.step_start
            self.step.faults = minor_faults() - self.step_faults
            self.steps.append(self.step)
        self.step = None

    def phase(self, original):
        recorder = self

        @contextmanager
        def phase(timer, name: str):
            start, models, faults = recorder.clock(), recorder.in_models, minor_faults()
            try:
                with original(timer, name):
                    yield
            finally:
                if recorder.step is not None:
                    entry = recorder.step.phases.setdefault(name, [0.0, 0.0])
                    entry[0] += recorder.clock() - start
                    entry[1] += recorder.in_models - models
                    faulted = recorder.step.phase_faults
                    faulted[name] = faulted.get(name, 0) + minor_faults() - faults

        return phase

    def patch(self, owner, name: str, value) -> None:
        self.undo.append((owner, name, vars(owner)[name] if name in vars(owner) else None))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self.undo):
            if owner is None:  # a hook's handle
                name.remove()
            elif value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self.undo.clear()


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods called outside the models, by the klppo
    function that called them (``--count-torch-calls``; it slows every torch call a little)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        r = self.recorder
        if r.depth == 0 and r.step is not None:
            r.step.torch_calls[r.frames[-1][1] if r.frames else "(no klppo function)"] += 1
        return func(*args, **(kwargs or {}))


def _klppo_callables(module) -> list[tuple[object, str, object, str]]:
    """(owner, attribute, callable, label) of the functions and methods ``module`` defines."""
    found = []
    for attr, value in list(vars(module).items()):
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            found.append((module, attr, value, f"{module.__name__[6:]}.{attr}"))
        elif inspect.isclass(value) and value.__module__ == module.__name__ and not issubclass(
                value, (torch.autograd.Function, torch.nn.Module, BaseException)):
            for name, member in list(vars(value).items()):
                if name.startswith("__") and name != "__call__":
                    continue
                if isinstance(member, (staticmethod, classmethod)) and inspect.isfunction(member.__func__):
                    found.append((value, name, member, f"{module.__name__[6:]}.{value.__name__}.{name}"))
                elif inspect.isfunction(member):
                    found.append((value, name, member, f"{module.__name__[6:]}.{value.__name__}.{name}"))
    return found


def _third_party() -> list[tuple[object, str, str]]:
    """Library calls klppo makes outside the models, named on their own in the table."""
    from transformers import GenerationMixin, PreTrainedTokenizerBase

    return [(GenerationMixin, "generate", "transformers generate (outside the forwards)"),
            (PreTrainedTokenizerBase, "__call__", "tokenizer encode"),
            (PreTrainedTokenizerBase, "decode", "tokenizer decode"),
            (torch.optim.lr_scheduler.LRScheduler, "step", "torch lr_scheduler.step"),
            (torch.optim.Optimizer, "zero_grad", "torch optimizer.zero_grad")]


def _time_forwards(recorder: Recorder, model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
    """``model``'s forwards count as the models' time (``keep``: the hooks go when the run ends)."""
    handles = [model.register_forward_pre_hook(lambda *a: recorder.enter(FORWARD)),
               model.register_forward_hook(lambda *a: recorder.leave(), always_call=True)]
    if keep:
        recorder.undo += [(None, handle, None) for handle in handles]
    return model


def instrument(recorder: Recorder, parts) -> None:
    """Wrap every klppo function (in every module that names it), the models, backward and the optimisers."""
    wrappers: dict[int, object] = {}
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("klppo.") and m is not None]:
        for owner, attr, value, label in _klppo_callables(module):
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if id(fn) not in wrappers:
                wrappers[id(fn)] = recorder.timed(label, fn)
            wrapped = wrappers[id(fn)]
            recorder.patch(owner, attr, type(value)(wrapped) if isinstance(value, (staticmethod, classmethod)) else wrapped)
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("klppo.") and m is not None]:
        for attr, value in list(vars(module).items()):  # names imported from the module that defines them
            if inspect.isfunction(value) and id(value) in wrappers:
                recorder.patch(module, attr, wrappers[id(value)])
    for owner, attr, label in _third_party():
        recorder.patch(owner, attr, recorder.timed(label, getattr(owner, attr)))
    models = [parts.actor, parts.ref, parts.critic, *parts.reward_models, parts.gold_reward_model]
    for model in {id(m): m for m in models if m is not None}.values():
        _time_forwards(recorder, model)
    from klppo.trainer import responses  # a generation copy of the actor (sharded or LoRA) is a model too

    copy = vars(responses)["generation_copy"]
    recorder.patch(responses, "generation_copy", lambda *a, **k: _time_forwards(recorder, copy(*a, **k), keep=False))
    backward = torch.Tensor.backward

    def timed_backward(tensor, *args, **kwargs):
        with recorder.region(BACKWARD):
            return backward(tensor, *args, **kwargs)

    recorder.patch(torch.Tensor, "backward", timed_backward)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    recorder.undo.append((None, register_optimizer_step_pre_hook(lambda *a: recorder.enter(OPTIMIZER)), None))
    recorder.undo.append((None, register_optimizer_step_post_hook(lambda *a: recorder.leave()), None))


def measured_run(run: str, root: Path, work: Path, *, steps: int, skip: int, size: str, clock: str,
                 profile: Path | None = None, count_torch_calls: bool = False) -> list[StepRecord]:
    """Run ``run`` for ``skip + steps + 1`` steps; the records of the ``steps`` after the skipped ones
    (the last step, which writes the final checkpoint, is left out too)."""
    import cProfile

    from klppo.monitoring.progress import Progress
    from klppo.monitoring.timer import PhaseTimer
    from klppo.commands.main_ppo import run_ppo
    from klppo.trainer.ppo_trainer import PPOTrainer

    recorder, init = Recorder(clock), PPOTrainer.__init__
    profiler = cProfile.Profile() if profile else None

    def instrumented_init(self, parts, *args, **kwargs):
        init(self, parts, *args, **kwargs)
        instrument(recorder, parts)
        train_step, advance = vars(PPOTrainer)["train_step"], vars(Progress)["advance"]

        def timed_step(trainer):
            recorder.begin_step()
            if profiler is not None and skip <= len(recorder.steps) < skip + steps:
                profiler.enable()
            return train_step(trainer)

        def timed_advance(progress, *a, **k):
            advance(progress, *a, **k)
            if profiler is not None:
                profiler.disable()
            recorder.end_step()

        recorder.patch(PPOTrainer, "train_step", timed_step)
        recorder.patch(Progress, "advance", timed_advance)
        recorder.patch(PhaseTimer, "phase", recorder.phase(vars(PhaseTimer)["phase"]))

    run_dir = work / run
    shutil.rmtree(run_dir, ignore_errors=True)
    PPOTrainer.__init__ = instrumented_init
    try:
        with TorchCalls(recorder) if count_torch_calls else contextlib.nullcontext():
            run_ppo(None, overrides(run, root, run_dir, skip + steps + 1, size), print_fn=lambda *a, **k: None)
    finally:
        PPOTrainer.__init__ = init
        recorder.restore()
    if profiler is not None:
        profiler.dump_stats(profile)
    return recorder.steps[skip : skip + steps]


# ---- the bare floor of the update ----


def update_floor(root: Path, work: Path, size: str, repeats: int = 6, clock: str = "wall") -> dict[str, float]:
    """Median ms of klppo's actor and critic updates beside the same updates written as a bare
    PyTorch loop, interleaved, on the same models and the same scored batch of the ppo run (one
    micro-batch, klppo's default split here): forward, log-probs at the response positions (or
    values), a clipped loss, backward, clip, AdamW. The bare loop reads no entropy, no metrics."""
    from klppo.algo import compute_advantage
    from klppo.config import load_ppo_config
    from klppo.monitoring.timer import PhaseTimer
    from klppo.run.build import build_ppo, start_processes
    from klppo.trainer.dynamic_sampling import scored_step_batch
    from klppo.trainer.update import update_actor, update_critic

    shutil.rmtree(work / "floor", ignore_errors=True)
    cfg = load_ppo_config(None, overrides("ppo", root, work / "floor", 2, size))
    parts = build_ppo(cfg, log=lambda *a, **k: None, env=start_processes(cfg))
    s, batch = parts.settings, scored_step_batch(parts, PhaseTimer(), 1).batch
    batch.advantages, batch.returns = compute_advantage("gae", batch.token_level_scores, batch.response_mask,
                                                       batch.group_index, values=batch.values, gamma=1.0, lam=1.0)
    prompt, ids = batch.prompt_ids.shape[1], torch.cat([batch.prompt_ids, batch.response_ids], 1)
    keep = slice(prompt - 1, ids.shape[1] - 1)

    def bare(model, optimizer, loss_fn) -> None:
        loss_fn().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def actor_loss():
        logits = parts.actor(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        logp = torch.log_softmax(logits.float() / s.actor.temperature, -1).gather(-1, ids[:, prompt:, None])[..., 0]
        ratio = torch.exp(logp - batch.old_log_prob)
        return -torch.min(ratio * batch.advantages, ratio.clamp(0.8, 1.2) * batch.advantages).mean()

    def critic_loss():
        values = parts.critic(input_ids=ids, use_cache=False).logits[:, keep, 0]
        return ((values - batch.returns) ** 2).mean()

    cases = {"klppo actor": lambda: update_actor(parts.actor, parts.actor_optimizer, batch, s.actor),
             "bare actor": lambda: bare(parts.actor, parts.actor_optimizer, actor_loss),
             "klppo critic": lambda: update_critic(parts.critic, parts.critic_optimizer, batch, s.critic),
             "bare critic": lambda: bare(parts.critic, parts.critic_optimizer, critic_loss)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats + 1):  # the first round warms up
        for name, run in cases.items():
            start = CLOCKS[clock]()
            run()
            times[name].append(CLOCKS[clock]() - start)
    return {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}


# ---- report ----


def summarise(records: list[StepRecord]) -> dict:
    """Medians over the steps (in ms): wall, models by kind, overhead, phases, functions."""

    def med(values) -> float:
        return 1000 * statistics.median(values) if values else 0.0

    phases = list(dict.fromkeys(name for r in records for name in r.phases))
    functions = {name for r in records for name in r.functions}
    inner = [name for name in phases if name != "step"]
    summary = {
        "steps": len(records),
        "wall_ms": med([r.wall for r in records]),
        "model_ms": {kind: med([r.models.get(kind, 0.0) for r in records]) for kind in (FORWARD, BACKWARD, OPTIMIZER)},
        "overhead_ms": med([r.wall - sum(r.models.values()) for r in records]),
        "phases_ms": {name: {"wall": med([r.phases.get(name, [0, 0])[0] for r in records]),
                             "model": med([r.phases.get(name, [0, 0])[1] for r in records])} for name in inner},
        "functions": {name: {"ms": med([r.functions[name][0] if name in r.functions else 0.0 for r in records]),
                             "calls": statistics.median([r.functions[name][1] if name in r.functions else 0
                                                         for r in records])} for name in functions},
    }
    between = [r.phases.get("step", [0, 0])[0] - sum(r.phases[n][0] for n in inner if n in r.phases) for r in records]
    after = [r.wall - r.phases.get("step", [0, 0])[0] for r in records]
    summary["phases_ms"]["(in the step, between phases)"] = {"wall": med(between), "model": 0.0}
    summary["phases_ms"]["(after the step phase: metrics, log)"] = {"wall": med(after), "model": 0.0}
    callers = {name for r in records for name in r.torch_calls}
    summary["torch_calls"] = {name: statistics.median([r.torch_calls.get(name, 0) for r in records]) for name in callers}
    summary["wrapped_calls"] = statistics.median([sum(int(c) for _, c in r.functions.values()) for r in records])
    summary["page_faults"] = statistics.median([r.faults for r in records])
    summary["phase_page_faults"] = {name: statistics.median([r.phase_faults.get(name, 0) for r in records]) for name in inner}
    return summary


def report(run: str, summary: dict, top: int) -> str:
    m = summary["model_ms"]
    generate = summary["functions"].get("transformers generate (outside the forwards)", {"ms": 0.0})["ms"]
    lines = [f"== {run}: median of {summary['steps']} steps",
             f"step {summary['wall_ms']:.1f} ms = models {sum(m.values()):.1f} (forward {m[FORWARD]:.1f}, backward "
             f"{m[BACKWARD]:.1f}, optimizer {m[OPTIMIZER]:.1f}) + overhead {summary['overhead_ms']:.1f} "
             f"(generate's own {generate:.1f}; {summary['wrapped_calls']:.0f} klppo calls)",
             f"{'phase':<40}{'wall ms':>10}{'models ms':>11}{'overhead ms':>13}"]
    for name, p in sorted(summary["phases_ms"].items(), key=lambda kv: -kv[1]["wall"]):
        lines.append(f"{name:<40}{p['wall']:>10.1f}{p['model']:>11.1f}{p['wall'] - p['model']:>13.1f}")
    if "kl_probe" in summary["phases_ms"]:
        from klppo.config.kl_probe import PROBE_EVERY

        probe = summary["phases_ms"]["kl_probe"]["wall"]
        lines.append(f"offline KL probe: {probe:.1f} ms, {100 * probe / summary['wall_ms']:.1f}% of a step that probes; "
                     f"every {PROBE_EVERY}th step by default: {100 * probe / PROBE_EVERY / (summary['wall_ms'] - probe * (1 - 1 / PROBE_EVERY)):.1f}% of the mean step")
    areas: dict[str, float] = defaultdict(float)
    for name, f in summary["functions"].items():
        areas[name if " " in name else ".".join(name.split(".")[:2])] += f["ms"]
    lines.append("overhead by klppo module (own time, ms/step): " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in sorted(areas.items(), key=lambda kv: -kv[1]) if " " not in name and ms >= 0.5))
    faults = summary.get("page_faults", 0)
    by_phase = sorted(summary.get("phase_page_faults", {}).items(), key=lambda kv: -kv[1])
    mib = faults * resource.getpagesize() / 2**20
    lines.append(f"minor page faults per step: {faults:.0f} ({mib:.0f} MiB mapped afresh and touched; "
                 "steady steps reuse their memory, so this stays near 0), by phase: "
                 + ", ".join(f"{name} {n:.0f}" for name, n in by_phase if n))
    lines.append(f"{'overhead by function (own time)':<60}{'ms/step':>9}{'calls':>8}")
    ranked = sorted(summary["functions"].items(), key=lambda kv: -kv[1]["ms"])[:top]
    lines += [f"{name[:60]:<60}{f['ms']:>9.2f}{f['calls']:>8.0f}" for name, f in ranked]
    if summary["torch_calls"]:
        calls = summary["torch_calls"]
        lines.append(f"{'torch calls outside the models, by caller':<60}{sum(calls.values()):>9.0f}")
        lines += [f"{name[:60]:<60}{n:>9.0f}" for name, n in sorted(calls.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--size", choices=sorted(SHAPES), default="issue33")
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--skip", type=int, default=1, help="first steps left out (warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--top", type=int, default=15, help="functions listed per run")
    p.add_argument("--workload", type=Path, default=None, help="folder for the model and data (kept; default a temp dir)")
    p.add_argument("--floor", action="store_true", help="also time the update as a bare PyTorch loop")
    p.add_argument("--profile", type=Path, default=None, help="folder for a cProfile of each run's measured steps")
    p.add_argument("--count-torch-calls", action="store_true",
                   help="also count the torch calls made outside the models (slows every torch call a little)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = build_workload(args.workload or Path(tmp), args.size)
        shape, figures = SHAPES[args.size], {"size": args.size, "threads": args.threads, "clock": args.clock}
        print(f"workload {args.size}: {shape}; {args.threads} threads, {args.clock} clock")
        for run in args.runs:
            profile = args.profile / f"{run}.prof" if args.profile else None
            if profile:
                profile.parent.mkdir(parents=True, exist_ok=True)
            records = measured_run(run, root, Path(tmp) / "runs", steps=args.steps, skip=args.skip, size=args.size,
                                   clock=args.clock, profile=profile,
                                   count_torch_calls=args.count_torch_calls)
            figures[run] = summarise(records)
            print(report(run, figures[run], args.top), flush=True)
        if args.floor:
            floor = figures["floor_ms"] = update_floor(root, Path(tmp), args.size, clock=args.clock)
            tokens = 16 * (shape["prompt"] + shape["response"])
            print(f"== the update beside a bare PyTorch loop ({tokens} tokens, the same models and batch, interleaved)")
            for model in ("actor", "critic"):
                k, b = floor[f"klppo {model}"], floor[f"bare {model}"]
                print(f"{model}: klppo {k:.1f} ms ({1000 * tokens / k:.0f} tokens/s), bare {b:.1f} ms "
                      f"({1000 * tokens / b:.0f} tokens/s), klppo / bare {k / b:.3f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
