"""TRL's sides of ``benchmarks/vs_trl.py``, run in TRL's own environment (no klppo import).

    <trl python> benchmarks/vs_trl.py --worker trl-grpo --work DIR --json OUT    # what vs_trl.py runs

Each reads the shared inputs and the workload from ``DIR`` (written by vs_trl.py), trains with
TRL's trainer as its users do, and writes ``OUT``: per optimiser step the step's,
generation's and update's seconds, plus the mean response length and, on CUDA, the peak of
``torch.cuda.max_memory_allocated``. Timing wraps TRL's own methods and functions from outside
(TRL's code runs unchanged); on CUDA every clock read follows a synchronise.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


class Clock:
    """Seconds per optimiser step, and the parts of the step spent in wrapped calls."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.steps, self.lengths = cuda, [], []
        self.last = self.mark = None
        self.spent: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()  # host sync: the clock reads the device's finished work
        return time.perf_counter()

    def timed(self, name: str, fn):
        """``fn`` with its time added to this step's ``name``."""
        def wrapper(*args, **kwargs):
            start = self.now()
            out = fn(*args, **kwargs)
            self.spent[name] = self.spent.get(name, 0.0) + self.now() - start
            return out
        return wrapper

    def step_end(self, update_s: float | None = None) -> None:
        end = self.now()
        step = end - self.last
        gen = self.spent.get("gen", 0.0)
        update = update_s if update_s is not None else step - self.spent.get("score", 0.0)
        self.steps.append({"step_s": step, "gen_s": gen, "update_s": update})
        self.last, self.mark, self.spent = end, None, {}


class StepCallback(TrainerCallback):
    """Closes a step at every ``on_step_end``; the first step starts at ``on_train_begin``."""

    def __init__(self, clock: Clock, update_from_mark: bool = False) -> None:
        self.clock, self.update_from_mark = clock, update_from_mark

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.last = self.clock.now()

    def on_step_end(self, args, state, control, **kwargs):
        update = None
        if self.update_from_mark and self.clock.mark is not None:
            update = self.clock.now() - self.clock.mark
        self.clock.step_end(update)


def batch_split(rows: int, micro: int) -> tuple[int, int]:
    """(per-device batch, accumulation steps) of one optimiser step over ``rows`` sequences."""
    micro = min(micro, rows)
    if rows % micro:
        raise ValueError(f"TRL's micro-batch {micro} does not divide the batch of {rows} sequences")
    return micro, rows // micro


def common_args(w: dict, out: Path) -> dict:
    """TrainingArguments both TRL trainers take, set as klppo's side runs: no checkpointing of
    activations, fp32 on CPU and bf16 autocast over fp32 weights on CUDA, no saving, no reports."""
    cpu = w["device"] == "cpu"
    if not cpu and w["dtype"] == "bfloat16":
        # The PPOTrainer builds its own Accelerator, which reads the precision from the environment
        # (``accelerate launch --mixed_precision bf16`` sets it), not from ``bf16=True``.
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    return dict(output_dir=str(out), learning_rate=w["lr"], logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=cpu, bf16=not cpu and w["dtype"] == "bfloat16", gradient_checkpointing=False, seed=w["seed"],
                disable_tqdm=True, dataloader_num_workers=0)


def trl_grpo(work: Path, w: dict, clock: Clock) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.vs_trl import compute_score

    prompts = json.loads((work / "prompts.json").read_text())["grpo"]
    micro, accum = batch_split(w["grpo_prompts"] * w["grpo_n"], w["trl_micro_batch"])
    config = GRPOConfig(
        **common_args(w, work / "out_trl_grpo"), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_generations=w["grpo_n"], max_completion_length=w["response_tokens"], temperature=w["grpo_temperature"],
        beta=w["grpo_kl_coef"], epsilon=0.2, loss_type="dapo", max_steps=w["steps"], shuffle_dataset=False,
        generation_kwargs={"min_new_tokens": w["response_tokens"]}, model_init_kwargs={"dtype": torch.float32})

    def reward(completions, **kwargs) -> list[float]:
        return [compute_score("vs_trl", c, "") for c in completions]

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[StepCallback(clock)])
    generate = trainer._generate_single_turn

    def counted(*args, **kwargs):
        completion_ids, logprobs = generate(*args, **kwargs)
        clock.lengths += [len(ids) for ids in completion_ids]
        return completion_ids, logprobs

    trainer._generate_single_turn = clock.timed("gen", counted)
    trainer._generate_and_score_completions = clock.timed("score", trainer._generate_and_score_completions)
    trainer.train()


def trl_ppo(work: Path, w: dict, clock: Clock) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    ids = json.loads((work / "prompts.json").read_text())["ppo_ids"]
    rows = w["ppo_prompts"]
    micro, accum = batch_split(rows, w["trl_micro_batch"])
    config = PPOConfig(
        **common_args(w, work / "out_trl_ppo"), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_mini_batches=1, num_ppo_epochs=1, total_episodes=rows * w["steps"], local_rollout_forward_batch_size=rows,
        response_length=w["response_tokens"], temperature=w["ppo_temperature"], kl_coef=w["ppo_kl_coef"],
        kl_estimator="k1", cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95, stop_token=None,
        missing_eos_penalty=None, num_sample_generations=0)
    model, fp32 = work / "model", dict(dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    torch.manual_seed(w["seed"] + 3)  # the value head's initialisation
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=AutoModelForCausalLM.from_pretrained(model, **fp32),
        ref_model=AutoModelForCausalLM.from_pretrained(model, **fp32),
        reward_model=AutoModelForSequenceClassification.from_pretrained(work / "reward_model", num_labels=1, **fp32),
        value_model=AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, **fp32),
        train_dataset=Dataset.from_dict({"input_ids": ids}), callbacks=[StepCallback(clock, update_from_mark=True)])
    generate, forward = module.batch_generation, module.forward

    def counted(model, queries, *args, **kwargs):
        query_responses, logits = generate(model, queries, *args, **kwargs)
        clock.lengths += [query_responses.shape[1] - queries.shape[1]] * len(queries)
        return query_responses, logits

    def marked(model, *args, **kwargs):
        if model is trainer.model and clock.mark is None:  # the first training forward of the step
            clock.mark = clock.now()
        return forward(model, *args, **kwargs)

    module.batch_generation, module.forward = clock.timed("gen", counted), marked
    trainer.train()


def main(side: str, work: Path, out: Path) -> None:
    import transformers
    import trl

    w = json.loads((work / "workload.json").read_text())
    if w["threads"]:
        torch.set_num_threads(w["threads"])
    cuda = w["device"] == "cuda"
    clock = Clock(cuda)
    (trl_grpo if side == "trl-grpo" else trl_ppo)(work, w, clock)
    result = {"side": side, "steps": clock.steps, "response_length": statistics.mean(clock.lengths),
              "cuda_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}
    out.write_text(json.dumps(result))
