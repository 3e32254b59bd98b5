"""What every ``klppo demo`` starts from: the arithmetic task, the tiny model, its SFT warm start,
and the PPO run's overrides (``klppo demo`` trains with them; ``--offline-rankings`` and
``--reward-hacking`` change some). Every setting is an ordinary config override.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoSize:
    """How much data the demo writes and how long its SFT trains (smaller in the suite's learning test)."""

    train_prompts: int = 1024
    val_prompts: int = 500
    sft_examples: int = 8192
    sft_epochs: int = 3


# Operands in [0, 20): 610 (a, op, b) triples, of which 122 are held out for validation only. The
# tiny model must compute sums it never saw; with 8,192 SFT examples it gets about half of them
# right (at 2,048 examples, 0.15: it memorised instead).
MAX_OPERAND = 20
WRONG_FRACTION = 0.6  # share of SFT solutions that answer one too many
# Where their error sits: "answer" ("7 + 5 = 12 #### 13"), which PPO unlearns on held-out problems
# on seeds 0-4; "result" ("7 + 5 = 13 #### 13") moved them either way (README). The offline-rankings
# demo, measured on "result" and no better on "answer" (4 of 6 runs gain on either), keeps it.
SFT_ERROR = "answer"
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def sft_overrides(data_dir: Path, init_dir: Path, out_dir: Path, seed: int, epochs: int = DemoSize.sft_epochs
                  ) -> list[str]:
    return [
        f"data.train_files={data_dir / 'sft.parquet'}",
        "data.max_length=96",
        "data.train_batch_size=64",
        f"data.seed={seed}",
        f"model.partial_pretrain={init_dir}",
        "optim.lr=3e-3",
        "optim.lr_warmup_steps=10",
        "optim.warmup_style=cosine",
        "optim.min_lr_ratio=0.1",
        f"trainer.total_epochs={epochs}",
        f"trainer.default_local_dir={out_dir}",
    ]


def ppo_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        "data.max_prompt_length=64",
        "data.max_response_length=24",
        "data.train_batch_size=32",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={sft_dir}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.optim.lr=2e-4",
        "critic.optim.lr=1e-3",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.02",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={max(1, steps // 4)}",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out_dir}",
    ]


def prepare(out: Path, seed: int, print_fn=print, size: DemoSize = DemoSize(), sft_error: str = SFT_ERROR
            ) -> tuple[Path, Path]:
    """Write the task's Parquet files and the initial tiny model; returns (data dir, model dir)."""
    from klppo.data.arithmetic import (
        arithmetic_corpus,
        write_arithmetic_parquet,
        write_arithmetic_sft_parquet,
    )
    from klppo.models.tiny import build_tiny_model_folder

    data_dir = out / "data"
    train = {"max_operand": MAX_OPERAND, "part": "train"}
    write_arithmetic_parquet(data_dir / "train.parquet", size.train_prompts, seed, **train)
    # Validation problems come from the held-out part: no (a, op, b) triple of any training problem.
    write_arithmetic_parquet(data_dir / "val.parquet", size.val_prompts, seed + 1_000_003, split="test",
                             max_operand=MAX_OPERAND, part="held_out")
    write_arithmetic_sft_parquet(
        data_dir / "sft.parquet", size.sft_examples, seed + 2_000_003, wrong_fraction=WRONG_FRACTION,
        error=sft_error, **train
    )
    init_dir = build_tiny_model_folder(out / "init", arithmetic_corpus(2000, seed, **train), seed=seed, **MODEL)
    print_fn(f"[demo] task written to {data_dir}; tiny model and tokenizer built in {init_dir}")
    return data_dir, init_dir


def last_validated(records: list[dict]) -> dict:
    """The last record with validation metrics (a step a guard acted on is not validated)."""
    return next(r for r in reversed(records) if any(k.startswith("val-core/") for k in r))


def summary_table(records: list[dict], reward_label: str | None = "train mean reward (sampled)") -> str:
    """Before (step 0: the SFT model) vs after (the last validated step) on the numbers that matter."""
    val_key = next(k for k in records[0] if k.startswith("val-core/"))
    first_train = next(r for r in records if r["step"] >= 1)
    last = last_validated(records)
    rows = [
        ("val accuracy (greedy)", records[0][val_key], last[val_key]),
        *([(reward_label, first_train["critic/score/mean"], last["critic/score/mean"])] if reward_label else []),
        ("KL to SFT model (per token, sampled)", records[0].get("val-aux/kl_to_ref", 0.0),
         last.get("val-aux/kl_to_ref", 0.0)),
    ]
    lines = [f"{'':34s}{'SFT model':>12s}{'after PPO':>12s}"]
    lines += [f"{name:34s}{before:12.3f}{after:12.3f}" for name, before, after in rows]
    return "\n".join(lines)


# By default the demo's PPO actor trains rank-16 LoRA adapters only (its reference is the SFT model
# under them, adapters off; ``klppo demo --full`` trains every weight at ppo_overrides' lr). Chosen
# by measurement (README, "The demo", all five seeds): full fine-tuning raised the training reward
# but moved held-out accuracy either way; adapters at lr 1e-3 did no better on seed 2 and, on an
# earlier SFT model of seed 1, drove the KL past the rollback guard's 0.15 by step 4.
LORA = {"actor_rollout_ref.model.lora_rank": "16", "actor_rollout_ref.model.lora_alpha": "32",
        "actor_rollout_ref.actor.optim.lr": "5e-4"}


def demo_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int, steps: int, lora: bool = True) -> list[str]:
    """The PPO run of ``klppo demo``: ``ppo_overrides``, of LoRA adapters unless ``lora`` is False."""
    ppo = ppo_overrides(data_dir, sft_dir, out_dir, seed, steps)
    return with_changes(ppo, LORA) if lora else ppo


def with_changes(overrides: list[str], changes: dict[str, str]) -> list[str]:
    """``overrides`` with the keys of ``changes`` set to their values (replaced in place, or appended)."""
    keys = {item.split("=", 1)[0] for item in overrides}
    replaced = [f"{k}={changes[k]}" if k in changes else f"{k}={v}" for k, v in (o.split("=", 1) for o in overrides)]
    return replaced + [f"{k}={v}" for k, v in changes.items() if k not in keys]


def warm_start(out: Path, seed: int, print_fn, size: DemoSize = DemoSize(), sft_error: str = SFT_ERROR
               ) -> tuple[Path, Path]:
    """The task's data and the SFT model a demo starts from: (data dir, SFT model dir)."""
    from klppo.config import load_sft_config
    from klppo.commands.main_sft import run_sft

    data_dir, init_dir = prepare(out, seed, print_fn, size, sft_error)
    sft = sft_overrides(data_dir, init_dir, out / "sft", seed, size.sft_epochs)
    print_fn("[demo] SFT warm start: klppo sft " + " ".join(sft))
    return data_dir, run_sft(load_sft_config(None, sft), print_fn=print_fn)
