"""``klppo demo``: a complete KL-regularised PPO run that needs nothing from outside.

1. writes an arithmetic word-problem task in GSM8K's format (train / val / SFT Parquet);
2. trains a tokenizer on it and builds a tiny Qwen2-shaped model (random init);
3. warm-starts the model with SFT on solutions of which a fixed share carry a systematic
   off-by-one error, so the warm-started policy is often wrong in a consistent way;
4. runs PPO (HF generate rollouts, GSM8K rule reward, critic with GAE, KL to the SFT model
   in the reward) and prints a before/after table.

Every setting is an ordinary config override, printed at the start, so the run can be
reproduced with ``klppo sft`` and ``klppo ppo``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from klppo.cli_support import quiet_libraries, run_cli

TRAIN_PROMPTS, VAL_PROMPTS, SFT_EXAMPLES = 1024, 500, 2048
MAX_OPERAND = 10  # operands in [0, 10): a task the tiny model learns in a minute of SFT
WRONG_FRACTION = 0.6  # share of SFT solutions that answer one too many
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def sft_overrides(data_dir: Path, init_dir: Path, out_dir: Path, seed: int) -> list[str]:
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
        "trainer.total_epochs=10",
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


def prepare(out: Path, seed: int, print_fn=print) -> tuple[Path, Path]:
    """Write the task's Parquet files and the initial tiny model; returns (data dir, model dir)."""
    from klppo.data.arithmetic import (
        arithmetic_corpus,
        write_arithmetic_parquet,
        write_arithmetic_sft_parquet,
    )
    from klppo.models.tiny import build_tiny_model_folder

    data_dir = out / "data"
    size = {"max_operand": MAX_OPERAND}
    write_arithmetic_parquet(data_dir / "train.parquet", TRAIN_PROMPTS, seed, **size)
    write_arithmetic_parquet(data_dir / "val.parquet", VAL_PROMPTS, seed + 1_000_003, split="test", **size)
    write_arithmetic_sft_parquet(
        data_dir / "sft.parquet", SFT_EXAMPLES, seed + 2_000_003, wrong_fraction=WRONG_FRACTION, **size
    )
    init_dir = build_tiny_model_folder(out / "init", arithmetic_corpus(2000, seed, **size), seed=seed, **MODEL)
    print_fn(f"[demo] task written to {data_dir}; tiny model and tokenizer built in {init_dir}")
    return data_dir, init_dir


def summary_table(records: list[dict], reward_label: str | None = "train mean reward (sampled)") -> str:
    """Before (step 0: the SFT model) vs after (the last step) on the numbers that matter."""
    val_key = next(k for k in records[0] if k.startswith("val-core/"))
    first_train = next(r for r in records if r["step"] >= 1)
    last = records[-1]
    rows = [
        ("val accuracy (greedy)", records[0][val_key], last[val_key]),
        *([(reward_label, first_train["critic/score/mean"], last["critic/score/mean"])] if reward_label else []),
        ("KL to SFT model (per token, sampled)", records[0].get("val-aux/kl_to_ref", 0.0),
         last.get("val-aux/kl_to_ref", 0.0)),
    ]
    lines = [f"{'':34s}{'SFT model':>12s}{'after PPO':>12s}"]
    lines += [f"{name:34s}{before:12.3f}{after:12.3f}" for name, before, after in rows]
    return "\n".join(lines)


def run_demo(out: Path, seed: int, ppo_steps: int, print_fn=print) -> list[dict]:
    from klppo.config import load_sft_config
    from klppo.trainer.main_ppo import run_ppo
    from klppo.trainer.main_sft import run_sft

    quiet_libraries()
    start = time.perf_counter()
    data_dir, init_dir = prepare(out, seed, print_fn)
    sft = sft_overrides(data_dir, init_dir, out / "sft", seed)
    print_fn("[demo] SFT warm start: klppo sft " + " ".join(sft))
    sft_dir = run_sft(load_sft_config(None, sft), print_fn=print_fn)
    ppo = ppo_overrides(data_dir, sft_dir, out / "ppo", seed, ppo_steps)
    print_fn("[demo] KL-regularised PPO: klppo ppo " + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    print_fn("\n" + summary_table(records))
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s")
    print_fn(f"[demo] metrics: {out / 'ppo' / 'metrics.jsonl'}  checkpoint: {out / 'ppo'}  "
             f"exported actor: {out / 'ppo' / 'actor_hf'}")
    return records


RANKED_PROMPTS, RM_PROMPTS, RANKED_VAL_PROMPTS = 1024, 512, 200


def prepare_rankings(data_dir: Path, seed: int) -> None:
    """Ranked data for the arithmetic task: 4 answers per prompt ranked by closeness to the truth."""
    from klppo.data.arithmetic import write_arithmetic_ranked_parquet

    size = {"max_operand": MAX_OPERAND, "n_responses": 4}
    write_arithmetic_ranked_parquet(data_dir / "ranked.parquet", RANKED_PROMPTS, seed + 3_000_017, **size)
    write_arithmetic_ranked_parquet(data_dir / "rm_train.parquet", RM_PROMPTS, seed + 4_000_037, **size)
    write_arithmetic_ranked_parquet(data_dir / "ranked_val.parquet", RANKED_VAL_PROMPTS, seed + 5_000_011, **size)


def rm_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int) -> list[str]:
    return [
        f"data.train_files={data_dir / 'rm_train.parquet'}",
        f"data.val_files={data_dir / 'ranked_val.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=24", "data.train_batch_size=32",
        f"data.seed={seed}", f"model.partial_pretrain={sft_dir}", "optim.lr=1e-3", "trainer.total_epochs=2",
        f"trainer.default_local_dir={out_dir}",
    ]


def offline_rankings_overrides(data_dir: Path, sft_dir: Path, out_dir: Path, seed: int, steps: int) -> list[str]:
    return [
        f"data.train_files={data_dir / 'ranked.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=24", "data.train_batch_size=32",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={sft_dir}",
        "actor_rollout_ref.rollout.name=offline", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=2e-5",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "reward_model.ranking.method=bradley_terry",
        "algorithm.adv_estimator=grpo", "algorithm.kl_ctrl.target_kl=0.1",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={max(1, steps // 4)}",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}",
    ]


def run_rankings_demo(out: Path, seed: int, ppo_steps: int, print_fn=print) -> list[dict]:
    """SFT as in the main demo, a reward model trained on part of the rankings, then offline
    KL-PPO on rewards distilled from the rankings (no generation during training)."""
    from klppo.config import load_rm_config, load_sft_config
    from klppo.monitoring.logger import read_metrics
    from klppo.trainer.main_ppo import run_ppo
    from klppo.trainer.main_rm import run_rm
    from klppo.trainer.main_sft import run_sft

    quiet_libraries()
    start = time.perf_counter()
    data_dir, init_dir = prepare(out, seed, print_fn)
    prepare_rankings(data_dir, seed)
    sft_dir = run_sft(load_sft_config(None, sft_overrides(data_dir, init_dir, out / "sft", seed)), print_fn=print_fn)
    rm = rm_overrides(data_dir, sft_dir, out / "rm", seed)
    print_fn("[demo] reward model from rankings: klppo rm " + " ".join(rm))
    run_rm(load_rm_config(None, rm), print_fn=print_fn)
    rm_accuracy = read_metrics(out / "rm")[-1]["val/pair_accuracy"]
    ppo = offline_rankings_overrides(data_dir, sft_dir, out / "ppo_rankings", seed, ppo_steps)
    print_fn("[demo] offline KL-PPO from rankings: klppo ppo " + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    print_fn("\n" + summary_table(records, reward_label=None))
    print_fn(f"reward model pairwise accuracy on held-out rankings: {rm_accuracy:.3f} (chance 0.5)")
    kls = [r["val-aux/kl_to_ref"] for r in records if "val-aux/kl_to_ref" in r]
    print_fn(f"KL to the SFT model on sampled responses: at most {max(kls):.3f} per token over the run "
             "(algorithm.kl_ctrl.target_kl = 0.1)")
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s; runs under {out}")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="demo_runs/arithmetic", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, model and run")
    parser.add_argument("--ppo-steps", type=int, default=40, help="PPO iterations (default: %(default)s)")
    parser.add_argument("--offline-rankings", action="store_true",
                        help="learn from ranked responses instead: a reward model, then offline KL-PPO")
    args = parser.parse_args(argv)
    demo = run_rankings_demo if args.offline_rankings else run_demo
    return run_cli(lambda: demo(Path(args.out), args.seed, args.ppo_steps))


if __name__ == "__main__":
    sys.exit(main())
