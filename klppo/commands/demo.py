"""``klppo demo``: a complete KL-regularised PPO run that needs nothing from outside.

1. writes an arithmetic word-problem task in GSM8K's format (train / val / SFT Parquet), its
   validation problems disjoint from every training problem (no shared (a, op, b) triple);
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

TRAIN_PROMPTS, VAL_PROMPTS, SFT_EXAMPLES = 1024, 500, 8192
# Operands in [0, 20): 610 (a, op, b) triples, of which 122 are held out for validation only. The
# tiny model must compute sums it never saw; with 8,192 SFT examples it gets about half of them
# right (at 2,048 examples, 0.15: it memorised instead).
MAX_OPERAND = 20
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
        "trainer.total_epochs=3",
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
    train = {"max_operand": MAX_OPERAND, "part": "train"}
    write_arithmetic_parquet(data_dir / "train.parquet", TRAIN_PROMPTS, seed, **train)
    # Validation problems come from the held-out part: no (a, op, b) triple of any training problem.
    write_arithmetic_parquet(data_dir / "val.parquet", VAL_PROMPTS, seed + 1_000_003, split="test",
                             max_operand=MAX_OPERAND, part="held_out")
    write_arithmetic_sft_parquet(
        data_dir / "sft.parquet", SFT_EXAMPLES, seed + 2_000_003, wrong_fraction=WRONG_FRACTION, **train
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


# ``klppo demo --lora``: the PPO actor trains rank-16 adapters only (its reference is the SFT
# model under them, adapters off); adapters need a larger learning rate than full fine-tuning.
LORA = {"actor_rollout_ref.model.lora_rank": "16", "actor_rollout_ref.model.lora_alpha": "32",
        "actor_rollout_ref.actor.optim.lr": "1e-3"}


def with_changes(overrides: list[str], changes: dict[str, str]) -> list[str]:
    """``overrides`` with the keys of ``changes`` set to their values (replaced in place, or appended)."""
    keys = {item.split("=", 1)[0] for item in overrides}
    replaced = [f"{k}={changes[k]}" if k in changes else f"{k}={v}" for k, v in (o.split("=", 1) for o in overrides)]
    return replaced + [f"{k}={v}" for k, v in changes.items() if k not in keys]


def warm_start(out: Path, seed: int, print_fn) -> tuple[Path, Path]:
    """The task's data and the SFT model every demo starts from: (data dir, SFT model dir)."""
    from klppo.config import load_sft_config
    from klppo.commands.main_sft import run_sft

    data_dir, init_dir = prepare(out, seed, print_fn)
    sft = sft_overrides(data_dir, init_dir, out / "sft", seed)
    print_fn("[demo] SFT warm start: klppo sft " + " ".join(sft))
    return data_dir, run_sft(load_sft_config(None, sft), print_fn=print_fn)


def run_demo(out: Path, seed: int, ppo_steps: int, lora: bool = False, print_fn=print) -> list[dict]:
    from klppo.commands.main_ppo import run_ppo

    quiet_libraries()
    start = time.perf_counter()
    data_dir, sft_dir = warm_start(out, seed, print_fn)
    ppo = ppo_overrides(data_dir, sft_dir, out / ("ppo_lora" if lora else "ppo"), seed, ppo_steps)
    if lora:
        ppo = with_changes(ppo, LORA)
    print_fn("[demo] KL-regularised PPO" + (" of LoRA adapters" if lora else "") + ": klppo ppo " + " ".join(ppo))
    records = run_ppo(None, ppo, print_fn=print_fn)
    print_fn("\n" + summary_table(records))
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s")
    run_dir = out / ("ppo_lora" if lora else "ppo")
    print_fn(f"[demo] metrics: {run_dir / 'metrics.jsonl'}  checkpoint: {run_dir}  exported actor: "
             f"{run_dir / 'actor_hf'}" + (f"  adapter: {run_dir / 'actor_adapter'}" if lora else ""))
    return records


RANKED_PROMPTS, RM_PROMPTS, RANKED_VAL_PROMPTS = 1024, 512, 200


def prepare_rankings(data_dir: Path, seed: int) -> None:
    """Ranked data for the arithmetic task: 4 answers per prompt ranked by closeness to the truth
    (training problems only), and the same recorded answers without their rankings, for a run
    whose reward model ranks them."""
    import pyarrow.parquet as pq

    from klppo.data.arithmetic import write_arithmetic_ranked_parquet

    size = {"max_operand": MAX_OPERAND, "n_responses": 4, "part": "train"}
    ranked = write_arithmetic_ranked_parquet(data_dir / "ranked.parquet", RANKED_PROMPTS, seed + 3_000_017, **size)
    write_arithmetic_ranked_parquet(data_dir / "rm_train.parquet", RM_PROMPTS, seed + 4_000_037, **size)
    write_arithmetic_ranked_parquet(data_dir / "ranked_val.parquet", RANKED_VAL_PROMPTS, seed + 5_000_011,
                                    **{**size, "part": "held_out"})
    pq.write_table(pq.read_table(ranked).drop_columns(["ranking"]), data_dir / "responses.parquet")


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
        # The guards' KL is sampled from the policy on the step's prompts (offline): all 32 of
        # them, as the default 8 gave a probe noisy enough (0.05 to 0.16 at a true 0.085) to trip
        # the rollback at 0.15.
        "algorithm.kl_ctrl.probe_prompts=32",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={max(1, steps // 4)}",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}",
    ]


def rm_ranked_overrides(data_dir: Path, sft_dir: Path, rm_dir: Path, out_dir: Path, seed: int,
                        steps: int) -> list[str]:
    """The offline rankings run with the trained reward model ranking the same recorded answers
    (``responses.parquet`` has no rankings); its validation reward is the reward model's score."""
    changes = {"data.train_files": str(data_dir / "responses.parquet"), "reward_model.enable": "true",
               "reward_model.model.path": str(rm_dir), "reward_model.rank_responses": "true"}
    return with_changes(offline_rankings_overrides(data_dir, sft_dir, out_dir, seed, steps), changes)


def val_only_overrides(data_dir: Path, model_dir: Path, out_dir: Path) -> list[str]:
    """Greedy exact match of ``model_dir`` on the validation problems (``trainer.val_only``)."""
    return [f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
            "data.max_prompt_length=64", "data.max_response_length=24", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=hf", "trainer.val_only=true", "trainer.resume_mode=disable",
            f"trainer.default_local_dir={out_dir}"]


def rankings_table(sft: dict, recorded: list[dict], rm_ranked: list[dict], rm_accuracy: dict) -> str:
    """SFT model vs offline PPO on the recorded rankings vs on the reward model's rankings."""
    val_key = next(k for k in sft if k.startswith("val-core/"))
    kl, recorded, rm_ranked = "val-aux/kl_to_ref", [last_validated(recorded)], [last_validated(rm_ranked)]
    lines = [f"{'':38s}{'SFT model':>11s}{'recorded rankings':>19s}{'RM rankings':>13s}",
             f"{'val accuracy (greedy)':38s}{sft[val_key]:11.3f}{recorded[-1][val_key]:19.3f}"
             f"{rm_accuracy[val_key]:13.3f}",
             f"{'KL to SFT model (per token, sampled)':38s}{sft.get(kl, 0.0):11.3f}{recorded[-1].get(kl, 0.0):19.3f}"
             f"{rm_ranked[-1].get(kl, 0.0):13.3f}"]
    return "\n".join(lines)


def run_rankings_demo(out: Path, seed: int, ppo_steps: int, lora: bool = False, print_fn=print) -> list[dict]:
    """SFT as in the main demo and a reward model trained on other rankings; then offline KL-PPO
    (no generation during training) twice on the same recorded answers: ranked as recorded, and
    ranked by the reward model. Both are distilled into rewards by Bradley-Terry."""
    from klppo.config import load_rm_config
    from klppo.monitoring.logger import read_metrics
    from klppo.commands.main_ppo import run_ppo
    from klppo.commands.main_rm import run_rm

    quiet_libraries()
    start = time.perf_counter()
    data_dir, sft_dir = warm_start(out, seed, print_fn)
    prepare_rankings(data_dir, seed)
    rm = rm_overrides(data_dir, sft_dir, out / "rm", seed)
    print_fn("[demo] reward model from rankings: klppo rm " + " ".join(rm))
    rm_dir = run_rm(load_rm_config(None, rm), print_fn=print_fn)
    rm_pair_accuracy = read_metrics(out / "rm")[-1]["val/pair_accuracy"]
    lora_changes = LORA if lora else {}
    ppo = with_changes(offline_rankings_overrides(data_dir, sft_dir, out / "ppo_rankings", seed, ppo_steps),
                       lora_changes)
    print_fn("[demo] offline KL-PPO from the recorded rankings: klppo ppo " + " ".join(ppo))
    recorded = run_ppo(None, ppo, print_fn=print_fn)
    ppo = with_changes(rm_ranked_overrides(data_dir, sft_dir, rm_dir, out / "ppo_rm_rankings", seed, ppo_steps),
                       lora_changes)
    print_fn("[demo] offline KL-PPO from the reward model's rankings: klppo ppo " + " ".join(ppo))
    rm_ranked = run_ppo(None, ppo, print_fn=print_fn)
    check = val_only_overrides(data_dir, out / "ppo_rm_rankings" / "actor_hf", out / "val_rm_rankings")
    print_fn("[demo] its greedy accuracy: klppo ppo " + " ".join(check))
    rm_accuracy = run_ppo(None, check, print_fn=print_fn)[0]
    print_fn("\n" + rankings_table(recorded[0], recorded, rm_ranked, rm_accuracy))
    print_fn(f"reward model pairwise accuracy on held-out rankings: {rm_pair_accuracy:.3f} (chance 0.5)")
    print_fn(f"\n[demo] finished in {time.perf_counter() - start:.0f} s; runs under {out}")
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="demo_runs/arithmetic", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task, model and run")
    parser.add_argument("--ppo-steps", type=int, default=None,
                        help="PPO iterations (default: 40; 80 with --reward-hacking)")
    parser.add_argument("--offline-rankings", action="store_true",
                        help="learn from ranked responses instead: a reward model, then offline KL-PPO on the "
                             "recorded rankings and on the reward model's")
    parser.add_argument("--lora", action="store_true", help="PPO trains LoRA adapters (rank 16) instead of all weights")
    parser.add_argument("--reward-hacking", action="store_true",
                        help="train on a biased grader that pays more for the answer one too many than for the right one, with "
                             "exact match as a held-out gold reward: the divergence guard reports the gaming")
    args = parser.parse_args(argv)
    demo = run_rankings_demo if args.offline_rankings else run_demo
    if args.reward_hacking:
        from klppo.commands.demo_reward_hacking import run_reward_hacking_demo

        demo = run_reward_hacking_demo
    steps = args.ppo_steps or (80 if args.reward_hacking else 40)
    return run_cli(lambda: demo(Path(args.out), args.seed, steps, args.lora))


if __name__ == "__main__":
    sys.exit(main())
