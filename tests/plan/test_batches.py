"""klppo plan's Batches arithmetic against hand-worked configs, verl's documented examples, the
degenerate combinations (refused by the planner and at the start of a run alike) and examples/."""

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from klppo.config import load_ppo_config
from klppo.data.batching import MicroBatching, micro_batch_plan
from klppo.errors import UserError
from klppo.rewards.score import make_reward_fn
from klppo.run.build import build_multi_turn, load_datasets
from tests.rollout.test_function_tools import FUNCTIONS
from tests.test_example_configs import is_example_config
from klppo.plan.batches import (
    LengthSample, batch_problems, bound_lengths, format_batches, plan_batches, sample_lengths,
)

REQUIRED = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
ACTOR = "actor_rollout_ref.actor"
EXAMPLES = Path(__file__).parents[2] / "examples"


def config(*overrides: str):
    return load_ppo_config(None, REQUIRED + list(overrides))


def equal_lengths(n: int, prompt: int, response: int, num_prompts: int) -> LengthSample:
    """One prompt's n samples, all alike: every batch the planner fills has these lengths."""
    return LengthSample((prompt,) * n, (response,) * n, num_prompts, "hand-made")


# ---- hand-worked configs ----


def test_verl_gsm8k_quickstart_makes_four_mini_batches_of_sixteen_accumulation_steps():
    # verl's quickstart: 256 prompts, mini-batches of 64, micro-batches of 4 on 1 GPU, n = 1.
    # 256 / 64 = 4 mini-batches = 4 optimiser steps (1 epoch); 64 / 4 = 16 micro-batches each.
    # Old log-probs in micro-batches of 8: 256 / 8 = 32 forwards. 7473 GSM8K prompts / 256 = 29 steps
    # per epoch (the last partial batch dropped), x 15 epochs = 435 steps.
    cfg = config("data.train_batch_size=256", f"{ACTOR}.ppo_mini_batch_size=64",
                 f"{ACTOR}.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.total_epochs=15")
    plan = plan_batches(cfg, 1, equal_lengths(1, 100, 200, 7473))
    for role in (plan.actor, plan.critic):
        assert (role.mini_batches_per_step, role.mini_batch_samples, role.share_samples) == (4, 64, 64)
        assert (role.optimizer_steps_per_ppo_step, role.micro_batches_per_mini_batch, role.gradient_accumulation) == (4, 16, 16)
    assert (plan.old_log_prob.rows_per_rank, plan.old_log_prob.micro_batches) == (256, 32)
    assert plan.ref is None  # no KL term: no reference forward
    assert (plan.steps_per_epoch, plan.total_steps) == (29, 435)
    # 256 samples x (100 + 200) tokens; the bound is 256 x (512 + 512) with the default lengths.
    assert (plan.tokens_per_step_mean, plan.tokens_per_step_bound) == (76800, 262144)


def test_grpo_on_eight_gpus_multiplies_the_mini_batch_by_rollout_n_and_divides_it_by_the_ranks():
    # 1024 prompts x n 5 = 5120 samples per step, 640 per rank. Mini-batches of 256 prompts:
    # 1024 / 256 = 4, each 256 x 5 = 1280 samples, 1280 / 8 = 160 per rank, 160 / 32 = 5 micro-batches.
    # 2 epochs: 2 x 4 = 8 optimiser steps. The reference scores its 640 rows 40 at a time: 16 forwards.
    cfg = config("data.train_batch_size=1024", "actor_rollout_ref.rollout.n=5", f"{ACTOR}.ppo_mini_batch_size=256",
                 f"{ACTOR}.ppo_micro_batch_size_per_gpu=32", f"{ACTOR}.ppo_epochs=2", "algorithm.adv_estimator=grpo",
                 f"{ACTOR}.use_kl_loss=true", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
                 "trainer.n_gpus_per_node=8", "trainer.total_training_steps=100")
    plan = plan_batches(cfg, 8, equal_lengths(5, 100, 300, 5000))
    assert (plan.samples_per_step, plan.prompts_per_rank, plan.samples_per_rank) == (5120, 128, 640)
    a = plan.actor
    assert (a.mini_batches_per_step, a.mini_batch_samples, a.share_samples, a.micro_batch_rows) == (4, 1280, 160, 32)
    assert (a.micro_batches_per_mini_batch, a.optimizer_steps_per_ppo_step) == (5, 8)
    assert plan.critic is None
    assert (plan.ref.rows_per_rank, plan.ref.micro_batches) == (640, 16)
    assert plan.old_log_prob.micro_batches == 1  # log_prob_micro_batch_size_per_gpu unset: all 640 at once
    assert (plan.steps_per_epoch, plan.total_steps) == (4, 100)  # 5000 // 1024; total_training_steps wins


def test_a_critic_with_its_own_mini_batch_and_epochs_has_its_own_counts():
    # Actor: 64 / 16 = 4 mini-batches of 16 x 2 = 32 samples, 16 per rank on 2 ranks, micro 4: 4 micro-batches.
    # Critic: 64 / 32 = 2 mini-batches of 64 samples, 32 per rank, micro 8: 4; 3 epochs x 2 = 6 steps.
    cfg = config("data.train_batch_size=64", "actor_rollout_ref.rollout.n=2", f"{ACTOR}.ppo_mini_batch_size=16",
                 f"{ACTOR}.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=32",
                 "critic.ppo_micro_batch_size_per_gpu=8", "critic.ppo_epochs=3", "trainer.n_gpus_per_node=2")
    plan = plan_batches(cfg, 2, equal_lengths(2, 10, 10, 640))
    assert (plan.actor.mini_batches_per_step, plan.actor.share_samples, plan.actor.micro_batches_per_mini_batch) == (4, 16, 4)
    c = plan.critic
    assert (c.mini_batches_per_step, c.share_samples, c.micro_batches_per_mini_batch, c.optimizer_steps_per_ppo_step) == (2, 32, 4, 6)
    assert plan.steps_per_epoch == 10 and plan.total_steps == 30 * 10  # 640 / 64, default total_epochs 30


def test_uneven_mini_batches_are_planned_as_verl_trains_them():
    # 192 prompts x n 5 = 960 samples, 40 per rank on 24 ranks. A mini-batch of 64 prompts is 320
    # samples, 13.3 per rank: each rank takes 13 (verl floors it), 312 in all, and its 40 rows
    # make mini-batches of 13, 13, 13 and 1: 4 optimiser steps, the last of 24 samples.
    cfg = config("data.train_batch_size=192", "actor_rollout_ref.rollout.n=5", f"{ACTOR}.ppo_mini_batch_size=64",
                 "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=8", "trainer.nnodes=3")
    plan = plan_batches(cfg, 24, equal_lengths(5, 10, 10, 1000))
    a = plan.actor
    assert (a.mini_batches_per_step, a.mini_batch_samples, a.share_samples, a.optimizer_steps_per_ppo_step) == (4, 312, 13, 4)
    # 96 prompts in mini-batches of 40 on one rank: 40, 40 and 16.
    plan = plan_batches(config("data.train_batch_size=96", f"{ACTOR}.ppo_mini_batch_size=40"), 1,
                        equal_lengths(1, 10, 10, 1000))
    assert (plan.actor.mini_batches_per_step, plan.actor.share_samples) == (3, 40)


def test_no_micro_batch_size_runs_a_ranks_whole_share_at_once():
    plan = plan_batches(config("data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8"), 1, equal_lengths(1, 1, 1, 8))
    assert (plan.actor.micro_batch_rows, plan.actor.micro_batches_per_mini_batch) == (8, 1)


def test_mean_tokens_come_from_the_sample_and_the_bound_from_the_configured_maxima():
    # Samples of 3 + 5 and 7 + 9 tokens: mean 12; 16 prompts x n 2 = 32 samples: 384 tokens; bound 32 x (20 + 30).
    lengths = LengthSample((3, 7), (5, 9), 16, "hand-made")
    cfg = config("data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2",
                 "data.max_prompt_length=20", "data.max_response_length=30")
    plan = plan_batches(cfg, 1, lengths)
    assert (plan.tokens_per_step_mean, plan.tokens_per_step_bound) == (384, 1600)


# ---- token budgets: the trainer's packing on the sample's lengths ----


LENGTHS = LengthSample((30, 5, 60, 12, 44, 7, 90, 21), (50, 3, 40, 70, 9, 100, 10, 33), 8, "hand-made")


def test_the_token_budget_estimate_is_what_micro_batch_plan_gives_on_the_same_lengths():
    # One mini-batch holds the whole sample (8 prompts, n 1), so the count is the trainer's for it.
    cfg = config("data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8", f"{ACTOR}.use_dynamic_bsz=true",
                 f"{ACTOR}.ppo_max_token_len_per_gpu=200", "data.max_prompt_length=100", "data.max_response_length=100")
    plan = plan_batches(cfg, 1, LENGTHS)
    expected = micro_batch_plan(LENGTHS.sequence_tokens, MicroBatching(max_tokens=200))
    assert plan.actor.micro_batches_per_mini_batch == len(expected) and plan.actor.estimated
    assert plan.actor.micro_batch_rows is None and plan.actor.max_tokens == 200
    # The critic (use_dynamic_bsz follows the actor's, its budget is its own 32768) packs it all in one.
    assert plan.critic.micro_batches_per_mini_batch == 1
    assert sum(LENGTHS.sequence_tokens) > 200 * 2  # the case is not trivial: at least 3 micro-batches


def test_every_rank_runs_the_largest_micro_batch_count_any_rank_needs():
    # On 2 ranks without balancing, rank 0 gets the first 4 samples and rank 1 the last 4.
    cfg = config("data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8", f"{ACTOR}.use_dynamic_bsz=true",
                 f"{ACTOR}.ppo_max_token_len_per_gpu=200", "data.max_prompt_length=100", "data.max_response_length=100",
                 "trainer.n_gpus_per_node=2")
    # Rank 0: 20 + 30 + 40 + 50 = 140 tokens, one micro-batch; rank 1: 4 x 100 = 400 tokens, two.
    lengths = LengthSample((10, 20, 30, 40, 50, 50, 50, 50), (10, 10, 10, 10, 50, 50, 50, 50), 8, "hand-made")
    plan = plan_batches(cfg, 2, lengths)
    seqs, split = lengths.sequence_tokens, MicroBatching(max_tokens=200)
    counts = [len(micro_batch_plan(seqs[:4], split)), len(micro_batch_plan(seqs[4:], split))]
    assert counts == [1, 2]
    assert plan.actor.micro_batches_per_mini_batch == max(counts)


def test_a_token_budgeted_forward_packs_a_ranks_share_of_the_whole_step():
    # Old log-probs of all 8 samples on 1 rank under a budget of 150 tokens.
    cfg = config("data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=4",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=150",
                 "data.max_prompt_length=100", "data.max_response_length=50")
    lengths = LengthSample((30, 5, 60, 12, 44, 7, 90, 21), (50, 3, 40, 50, 9, 10, 10, 33), 8, "hand-made")
    plan = plan_batches(cfg, 1, lengths)
    assert plan.old_log_prob.micro_batches == len(micro_batch_plan(lengths.sequence_tokens, MicroBatching(max_tokens=150)))


def test_dynamic_batch_sizes_ignore_the_micro_batch_size_as_verl_does():
    # mini 16 x n 1 / 4 ranks = 4 samples; a micro size of 8 would not fit, but the token budget decides.
    cfg = config("data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=16", f"{ACTOR}.ppo_micro_batch_size_per_gpu=8",
                 f"{ACTOR}.use_dynamic_bsz=true", "trainer.n_gpus_per_node=4")
    assert batch_problems(cfg, 4) == []
    # 4 samples of 1024 tokens (bounds) under 16384 per micro-batch: one micro-batch.
    assert plan_batches(cfg, 4, bound_lengths(cfg, 16, "bounds")).actor.micro_batches_per_mini_batch == 1


# ---- degenerate combinations: refused by the planner and at the start of a run ----


DEGENERATE = {
    # mini 2 x n 1 = 2 samples over 4 ranks; multiples of 4 dividing 8 prompts: 4, 8.
    "share below one sample": (["data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=2"], 4,
                               f"{ACTOR}.ppo_mini_batch_size = 2 x actor_rollout_ref.rollout.n 1 = 2 samples per "
                               "mini-batch leave each of the 4 ranks less than one sample",
                               f"set {ACTOR}.ppo_mini_batch_size to a multiple of 4 such as 4"),
    # mini 16 x n 1 / 4 ranks = 4 samples, fewer than the micro-batch of 8.
    "micro larger than share": (["data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=16",
                                 f"{ACTOR}.ppo_micro_batch_size_per_gpu=8"], 4,
                                f"{ACTOR}.ppo_micro_batch_size_per_gpu = 8 is larger than a rank's share of the "
                                f"mini-batch ({ACTOR}.ppo_mini_batch_size 16 x actor_rollout_ref.rollout.n 1 / 4 ranks "
                                "= 4 samples): set it to 4 or less"),
    # mini 16 x n 3 / 2 ranks = 24 samples (48 on one rank, which 16 divides); the largest divisor of 24 up to 16: 12.
    "micro not dividing share": (["data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=16",
                                  "actor_rollout_ref.rollout.n=3", f"{ACTOR}.ppo_micro_batch_size_per_gpu=16"], 2,
                                 f"{ACTOR}.ppo_micro_batch_size_per_gpu = 16 must divide a rank's share of the "
                                 "mini-batch (", "/ 2 ranks = 24 samples); set it to a divisor such as 12"),
    # 10 prompts over 4 ranks (mini 10 x n 2 = 20 samples split, 5 each, but the prompts do not).
    "prompts not splitting": (["data.train_batch_size=10", f"{ACTOR}.ppo_mini_batch_size=10",
                               "actor_rollout_ref.rollout.n=2"], 4,
                              "data.train_batch_size = 10 prompts do not split evenly over the 4 ranks",
                              "make it a multiple of 4"),
    # 256 + 256 tokens cannot fit a budget of 500, on any number of ranks.
    "budget below one sequence": (["data.max_prompt_length=256", "data.max_response_length=256",
                                   f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=500"], 1,
                                  f"{ACTOR}.ppo_max_token_len_per_gpu = 500 is smaller than the longest sequence",
                                  "raise it to at least 512"),
    # 64 prompts in a step of 32, on any number of ranks (verl asserts it too).
    "mini larger than the step": (["data.train_batch_size=32", f"{ACTOR}.ppo_mini_batch_size=64"], 1,
                                  f"{ACTOR}.ppo_mini_batch_size = 64 is larger than data.train_batch_size = 32 "
                                  "(prompts per step); set it to 32 or less"),
}


@pytest.mark.parametrize("case", DEGENERATE, ids=list(DEGENERATE))
def test_a_degenerate_combination_is_refused_with_its_fix_at_run_start(case):
    overrides, world, *expected = DEGENERATE[case]
    with pytest.raises(UserError) as at_start:  # config validation, before any model loads
        config(*overrides, f"trainer.n_gpus_per_node={world}")
    assert all(text in str(at_start.value) for text in expected), str(at_start.value)


@pytest.mark.parametrize("case", [c for c in DEGENERATE if DEGENERATE[c][1] > 1])
def test_the_planner_refuses_a_world_where_the_config_degenerates_with_the_same_fix(case):
    overrides, world, *expected = DEGENERATE[case]
    cfg = config(*overrides)  # fine on one rank
    assert batch_problems(cfg, 1) == []
    assert any(all(text in p for text in expected) for p in batch_problems(cfg, world)), batch_problems(cfg, world)
    with pytest.raises(UserError) as planned:
        plan_batches(cfg, world, bound_lengths(cfg, 1000, "bounds"))
    assert all(text in str(planned.value) for text in expected)


def test_the_run_refuses_a_world_where_the_combination_degenerates_when_it_compiles_its_settings():
    from klppo.run.settings import compile_ppo

    cfg = config("data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=16", f"{ACTOR}.ppo_micro_batch_size_per_gpu=8")
    compile_ppo(cfg, 2)  # 8 samples per rank: one micro-batch of 8
    with pytest.raises(UserError, match="is larger than a rank's share .* = 4 samples\\): set it to 4 or less"):
        compile_ppo(cfg, 4)


def test_a_data_set_smaller_than_one_step_is_refused_as_the_trainer_refuses_it():
    cfg = config("data.train_batch_size=16", f"{ACTOR}.ppo_mini_batch_size=16")
    with pytest.raises(UserError, match=r"data.train_batch_size=16 is larger than the dataset \(10 prompts"):
        plan_batches(cfg, 1, equal_lengths(1, 1, 1, 10))


# ---- the length sample ----


class WordTokenizer:
    """One token per word; a chat template that joins the messages and adds one token (two
    more with enable_thinking=False: an empty thought, as Qwen3's template writes it)."""

    chat_template = "words"
    eos_token_id = 0

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=False, enable_thinking=True):
        thought = "" if enable_thinking else " <think> </think>"
        return " ".join(m["content"] for m in conversation) + " <assistant>" + thought

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] * len(t.split()) for t in texts]}


def write_rows(path: Path, prompts: list[str], responses: list[list[str]] | None = None) -> str:
    columns = {"data_source": ["x"] * len(prompts), "prompt": [[{"role": "user", "content": p}] for p in prompts]}
    if responses is not None:
        columns["responses"] = responses
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_offline_lengths_are_the_tokenised_prompts_and_recorded_responses(tmp_path):
    files = write_rows(tmp_path / "off.parquet", ["a b c", "a", "a b c d e f g h"],
                       [["x y", "x y z w", "q"], ["x", "x x x x x x x x x x", "q"], ["y", "y y", "q"]])
    cfg = config(f"data.train_files={files}", "actor_rollout_ref.rollout.name=offline", "actor_rollout_ref.rollout.n=2",
                 "data.max_prompt_length=6", "data.max_response_length=5", "data.train_batch_size=2",
                 f"{ACTOR}.ppo_mini_batch_size=2", "data.truncation=left")
    lengths = sample_lengths(cfg, WordTokenizer(), rows=2)
    # Prompts: words + 1 (the template); responses: words + EOS, cut to 5. Only the first 2 rows are read.
    assert lengths.prompt_tokens == (4, 4, 2, 2)
    assert lengths.response_tokens == (3, 5, 2, 5)
    assert lengths.num_prompts == 3 and not lengths.bounds and "recorded responses" in lengths.note
    # The third prompt is 9 tokens: cut to 6 (truncation), or dropped with filter_overlong_prompts.
    assert sample_lengths(cfg, WordTokenizer()).prompt_tokens[4:] == (6, 6)
    filtered = config(f"data.train_files={files}", "actor_rollout_ref.rollout.name=offline",
                      "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=6", "data.filter_overlong_prompts=true")
    assert sample_lengths(filtered, WordTokenizer()).prompt_tokens == (4, 4, 2, 2)
    capped = config(f"data.train_files={files}", "actor_rollout_ref.rollout.name=offline", "data.train_max_samples=2")
    assert sample_lengths(capped, WordTokenizer()).num_prompts == 2  # the rows the run reads


def test_prompts_are_measured_as_the_run_renders_them_with_its_chat_template_kwargs(tmp_path):
    files = write_rows(tmp_path / "on.parquet", ["a b", "a b c d"])
    settings = (f"data.train_files={files}", "actor_rollout_ref.rollout.name=hf", "data.max_prompt_length=16",
                "data.train_batch_size=2", f"{ACTOR}.ppo_mini_batch_size=2")
    assert sample_lengths(config(*settings), WordTokenizer()).prompt_tokens == (3, 5)
    no_thinking = config(*settings, "+data.apply_chat_template_kwargs.enable_thinking=false")
    assert sample_lengths(no_thinking, WordTokenizer()).prompt_tokens == (5, 7)


def test_multi_turn_prompts_are_measured_with_the_tools_schemas_as_the_trainer_renders_them(tmp_path, tiny_model_dir):
    """The chat template shows every prompt the tools' schemas (a tool config's and a function-tool
    file's): the plan counts those tokens as the trainer's own datasets do (``load_datasets``)."""
    questions = ["What is 8 * 9?", "Tom has 3 apples and buys 4 more. How many apples does he have?"]
    path = tmp_path / "tool_rows.parquet"
    pq.write_table(pa.table({"data_source": ["openai/gsm8k"] * 2,
                             "prompt": [[{"role": "user", "content": q}] for q in questions],
                             "reward_model": [{"ground_truth": "72"}, {"ground_truth": "7"}]}), path)
    settings = (f"data.train_files={path}", f"actor_rollout_ref.model.path={tiny_model_dir}",
                "actor_rollout_ref.rollout.name=hf", "data.max_prompt_length=2048", "data.train_batch_size=2",
                f"{ACTOR}.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.multi_turn.enable=true")
    functions = tmp_path / "functions.py"
    functions.write_text(FUNCTIONS)
    with_tools = load_ppo_config(None, [*settings, "actor_rollout_ref.rollout.multi_turn.tool_config_path="
                                        f"{EXAMPLES / 'gsm8k_tool' / 'tools.yaml'}",
                                        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={functions}"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, _, _ = load_datasets(with_tools, tokenizer, make_reward_fn(None, None), lambda _: None,
                                build_multi_turn(with_tools))
    planned = sample_lengths(with_tools, tokenizer).prompt_tokens
    assert planned == tuple(len(r.prompt_ids) for r in train)
    without_tools = sample_lengths(load_ppo_config(None, list(settings)), tokenizer).prompt_tokens
    assert all(a > b + 20 for a, b in zip(planned, without_tools))  # the schema is dozens of tokens
    assert "lookup" in tokenizer.decode(train[0].prompt_ids)  # the function tools' schemas too


def test_online_responses_are_counted_at_their_bound_and_no_tokenizer_means_upper_bounds(tmp_path):
    files = write_rows(tmp_path / "on.parquet", ["a b", "a b c d"])
    cfg = config(f"data.train_files={files}", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=3",
                 "data.max_prompt_length=16", "data.max_response_length=7", "data.train_batch_size=2",
                 f"{ACTOR}.ppo_mini_batch_size=2")
    online = sample_lengths(cfg, WordTokenizer())
    assert online.prompt_tokens == (3, 3, 3, 5, 5, 5) and online.response_tokens == (7,) * 6
    assert "upper bounds" in online.note
    bounds = sample_lengths(cfg, None)
    assert bounds.bounds and bounds.num_prompts == 2 and set(bounds.sequence_tokens) == {16 + 7}
    assert "upper bounds" in bounds.note


def test_the_table_shows_the_plans_numbers():
    cfg = config("data.train_batch_size=1024", "actor_rollout_ref.rollout.n=5", f"{ACTOR}.ppo_mini_batch_size=256",
                 f"{ACTOR}.ppo_micro_batch_size_per_gpu=32", "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=8")
    text = format_batches(plan_batches(cfg, 8, equal_lengths(5, 100, 300, 5000)))
    actor = next(line.split() for line in text.splitlines() if line.strip().startswith("actor"))
    assert actor == ["actor", "4", "1280", "160", "4", "(1", "x", "4)", "32", "samples", "5", "5"]
    assert text.isascii()


# ---- examples/ ----


def _ppo_examples() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*/*.yaml") if "sft" not in p.stem and is_example_config(p))


def expected_from_yaml(doc: dict, num_prompts: int) -> dict:
    """The batch numbers worked out from the YAML alone, with verl's defaults written out:
    rollout.n 1, ppo_epochs 1, the critic's mini-batch and epochs the actor's, a micro size unset
    meaning the whole share, a critic only with gae, 30 epochs, lengths 512."""
    data, arf = doc["data"], doc["actor_rollout_ref"]
    actor, rollout, critic = arf["actor"], arf.get("rollout", {}), doc.get("critic", {})
    world = doc.get("trainer", {}).get("n_gpus_per_node", 1) * doc.get("trainer", {}).get("nnodes", 1)
    n, prompts = rollout.get("n", 1), data["train_batch_size"]
    response = rollout.get("response_length", "${data.max_response_length}")
    response = data.get("max_response_length", 512) if response == "${data.max_response_length}" else response
    longest = data.get("max_prompt_length", 512) + response
    per_epoch = num_prompts // prompts
    trainer = doc.get("trainer", {})
    out = {"samples": prompts * n, "per_epoch": per_epoch,
           "total": trainer.get("total_training_steps") or trainer.get("total_epochs", 30) * per_epoch}
    roles = {"actor": actor}
    if doc.get("algorithm", {}).get("adv_estimator", "gae") == "gae":
        roles["critic"] = {"ppo_mini_batch_size": actor["ppo_mini_batch_size"], "ppo_epochs": actor.get("ppo_epochs", 1),
                           "use_dynamic_bsz": actor.get("use_dynamic_bsz", False), "ppo_max_token_len_per_gpu": 32768,
                           **critic}
    for name, role in roles.items():
        mini = role["ppo_mini_batch_size"]
        share = mini * n // world
        if role.get("use_dynamic_bsz", False):  # every sequence at the bound: KK spreads equal items evenly
            budget = role.get("ppo_max_token_len_per_gpu", 16384)
            micro = next(k for k in range(1, share + 1) if math.ceil(share / k) * longest <= budget)
        else:
            micro = math.ceil(share / (role.get("ppo_micro_batch_size_per_gpu") or share))
        out[name] = (prompts // mini, share, role.get("ppo_epochs", 1) * prompts // mini, micro)
    rows = prompts * n // world  # the old log-probs' rows per rank: sized as the actor's micro-batches unless set
    if rollout.get("log_prob_use_dynamic_bsz", actor.get("use_dynamic_bsz", False)):
        budget = rollout.get("log_prob_max_token_len_per_gpu", actor.get("ppo_max_token_len_per_gpu", 16384))
        out["old_log_prob_micro"] = next(k for k in range(1, rows + 1) if math.ceil(rows / k) * longest <= budget)
    else:
        out["old_log_prob_micro"] = math.ceil(rows / (rollout.get("log_prob_micro_batch_size_per_gpu") or rows))
    return out


@pytest.mark.parametrize("path", _ppo_examples(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_plan_of_each_example_config_has_the_numbers_its_yaml_gives(path):
    doc = yaml.safe_load(path.read_text())
    cfg = load_ppo_config(str(path))
    data_file = Path(cfg.data.train_files)
    # The ranked example ships its data: its row count comes from the file's footer.
    lengths = sample_lengths(cfg, None) if data_file.is_file() else bound_lengths(cfg, 1000, "no data here")
    expected = expected_from_yaml(doc, lengths.num_prompts)
    plan = plan_batches(cfg, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes, lengths)
    assert (plan.samples_per_step, plan.steps_per_epoch, plan.total_steps) == (
        expected["samples"], expected["per_epoch"], expected["total"])
    for name in ("actor", "critic"):
        role = getattr(plan, name)
        got = None if role is None else (role.mini_batches_per_step, role.share_samples,
                                         role.optimizer_steps_per_ppo_step, role.micro_batches_per_mini_batch)
        assert got == expected.get(name), name
    assert plan.old_log_prob.micro_batches == expected["old_log_prob_micro"]
    assert format_batches(plan)  # prints
