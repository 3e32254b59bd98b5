"""Multi-turn batches through training: every forward reads a tool's reply as context, the
advantages skip it as if it were not there, and a real run calls its tools, trains and validates."""

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.algo import compute_gae_advantage_return, compute_reinforce_plus_plus_outcome_advantage
from klppo.commands.main_ppo import run_ppo
from klppo.data.batching import MicroBatching
from klppo.errors import UserError
from klppo.models.tiny import save_tokenizer
from klppo.rollout import hf as hf_rollout_module
from klppo.rollout import multi_turn as multi_turn_module
from klppo.rollout.multi_turn import Turn
from klppo.rollout.tools import HARMONY_TOKENS, ToolCall
from klppo.trainer.forwards import compute_log_prob
from tests.rollout.test_multi_turn import GSM8K_INTERACTION_CONFIG, HARMONY_TEMPLATE


# verl's gsm8k tool with a short schema: the tiny tokenizer spends ~350 tokens on verl's own (every
# prompt carries it), which would triple these runs' forwards.
SHORT_GSM8K_TOOL_CONFIG = """\
tools:
  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config: {type: native}
    tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: Scores an answer.,
                  parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}}}
"""
PROMPT_TOKENS = 256  # data.max_prompt_length for the arithmetic prompts with that schema


def with_replies(batch, every: int = 3):
    """``batch`` as a multi-turn batch: every ``every``-th response token (after the first) is a tool's."""
    replies = torch.zeros_like(batch.response_mask)
    replies[:, 1::every] = True
    return dataclasses.replace(batch, response_attention_mask=batch.response_mask.clone(),
                               response_mask=batch.response_mask & ~replies,
                               num_turns=torch.full((len(batch),), 3))


@pytest.mark.parametrize("split", [MicroBatching(), MicroBatching(rows=2, packed=True),
                                   MicroBatching(max_tokens=80, packed=True)], ids=["padded", "packed", "budget"])
def test_every_forward_reads_the_replies_as_context(tiny_model_dir, answer_batch, split):
    """The policy's log-probs in a multi-turn batch are those of one forward over the whole conversation."""
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    single = answer_batch()
    multi = with_replies(single)
    assert bool((multi.response_mask != multi.response_attention).any())
    torch.testing.assert_close(compute_log_prob(actor, multi, split, temperature=1.0),
                               compute_log_prob(actor, single, MicroBatching(), temperature=1.0), rtol=1e-5, atol=1e-5)


def _squeezed(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's kept positions moved to the front (the conversation without its replies)."""
    out = torch.zeros_like(x)
    for row in range(len(x)):
        values = x[row][keep[row]]
        out[row, : len(values)] = values
    return out


def test_advantages_skip_the_replies_as_if_they_were_not_there():
    """GAE and REINFORCE++ over a response with replies equal them over the policy's tokens alone."""
    torch.manual_seed(0)
    rows, width = 5, 12
    lengths = torch.tensor([12, 9, 7, 12, 4])
    attention = torch.arange(width)[None, :] < lengths[:, None]
    policy = attention & ~((torch.arange(width)[None, :] % 4 == 2) & (torch.rand(rows, width) < 0.8))
    rewards = torch.randn(rows, width) * policy
    values = torch.randn(rows, width)
    kept = policy.sum(-1)
    dense = torch.arange(width)[None, :] < kept[:, None]
    for compute in (lambda r, m, v: compute_gae_advantage_return(r, v, m, gamma=0.9, lam=0.8),
                    lambda r, m, v: compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=0.9)):
        advantages, returns = compute(rewards, policy, values)
        alone_adv, alone_ret = compute(_squeezed(rewards, policy), dense, _squeezed(values, policy))
        torch.testing.assert_close(_squeezed(advantages, policy), alone_adv)
        torch.testing.assert_close(_squeezed(returns, policy), alone_ret)
        assert bool((advantages[~policy] == 0).all())


def _tool_task(task_dir, path):
    """The arithmetic prompts with verl's tools_kwargs: the gsm8k tool knows each ground truth."""
    table = pq.read_table(task_dir / "train.parquet").to_pylist()
    for row in table:
        truth = row["reward_model"]["ground_truth"]
        row["extra_info"] = {**row["extra_info"], "need_tools_kwargs": True,
                             "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}}
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def shortened(real_turns):
    """Hugging Face's turn generator with every turn at most 6 sampled tokens, then EOS (a random tiny
    model seldom writes one)."""

    def short(model, tokenizer, params, device, synced_gpus):
        generate = real_turns(model, tokenizer, params, device, synced_gpus)
        eos = tokenizer.eos_token_id

        def turn(rows, contexts, budgets):
            said = generate(rows, contexts, [min(b, 6) for b in budgets])
            return [Turn((t.tokens if t.tokens[-1:] == [eos] else t.tokens + [eos])[:b]) for t, b in zip(said, budgets)]
        return turn

    return short


@pytest.fixture
def short_turns(monkeypatch):
    monkeypatch.setattr(hf_rollout_module, "_turn_generator", shortened(hf_rollout_module._turn_generator))


def test_a_run_calls_its_tools_and_trains_on_the_policys_turns(ppo_overrides, task_dir, tmp_path, monkeypatch,
                                                                short_turns):
    """Nor does it write tool calls: every turn here asks the gsm8k tool about its last characters."""
    monkeypatch.setitem(multi_turn_module.TOOL_CALL_PARSERS, "hermes",
                        lambda text: [ToolCall("calc_gsm8k_reward", json.dumps({"answer": text[-3:]}))])
    tools = tmp_path / "tools.yaml"
    tools.write_text(SHORT_GSM8K_TOOL_CONFIG)
    data = _tool_task(task_dir, tmp_path / "train.parquet")
    records = run_ppo(None, ppo_overrides(**{
        **turns_reward(tmp_path),
        "data.train_files": data, "data.val_files": data, "data.val_max_samples": 4,
        "data.max_prompt_length": PROMPT_TOKENS,  # the tools' schemas come first in every prompt
        "actor_rollout_ref.rollout.name": "sglang", "actor_rollout_ref.rollout.response_length": 128,
        "actor_rollout_ref.rollout.multi_turn.enable": "true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": tools,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": 24,
        "algorithm.adv_estimator": "gae", "trainer.test_freq": 2,
        "trainer.rollout_data_dir": tmp_path / "rollouts"}), print_fn=lambda *a, **k: None)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["num_turns/max"] == 6  # 3 turns of the policy, 2 replies, the prompt
        assert all(torch.isfinite(torch.tensor(float(v))) for k, v in metrics.items()
                   if k.startswith(("actor/", "critic/")) and isinstance(v, (int, float)))
    logged = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert all("Current pars" in line["output"] for line in logged)  # replies are part of what is scored and logged
    assert all(line["score"] == turns_score(line["output"]) for line in logged)
    assert any(k.startswith("val-core/") for r in records for k in r)


# A reward that reads what verl's reward managers add to extra_info about a conversation.
TURNS_REWARD = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return extra_info["num_turns"] + 10 * len(extra_info["tool_rewards"]) + 100 * len(extra_info["turn_scores"])
"""


def turns_reward(folder) -> dict:
    """The overrides that score each response with ``TURNS_REWARD``."""
    path = folder / "turns_reward.py"
    path.write_text(TURNS_REWARD)
    return {"custom_reward_function.path": path, "custom_reward_function.name": "compute_score"}


def turns_score(output: str) -> int:
    """``TURNS_REWARD`` of a logged conversation whose every reply is the gsm8k tool's (cut to 24 characters)."""
    calls = output.count("Current pars")
    return 2 + 2 * calls + 10 * calls  # the prompt and the last turn, then each call's turn and reply


def test_a_run_with_verls_gsm8k_interaction_answers_every_wrong_turn(ppo_overrides, task_dir, tmp_path, short_turns):
    table = pq.read_table(task_dir / "train.parquet").to_pylist()
    for row in table:
        row["extra_info"] = {**row["extra_info"], "interaction_kwargs": {
            "name": "gsm8k", "query": row["extra_info"]["question"], "ground_truth": row["reward_model"]["ground_truth"]}}
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "train.parquet")
    config = tmp_path / "interactions.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG)
    records = run_ppo(None, ppo_overrides(**{
        "data.train_files": tmp_path / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
        "actor_rollout_ref.rollout.response_length": 192, "actor_rollout_ref.rollout.multi_turn.enable": "true",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path": config,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3, "algorithm.adv_estimator": "grpo",
        "trainer.rollout_data_dir": tmp_path / "rollouts"}), print_fn=lambda *a, **k: None)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [m["num_turns/min"] for m in steps] == [6, 6]  # the random model is never right: 3 turns, 2 answers
    logged = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert all(line["output"].count("Your response is incorrect!") == 2 for line in logged)


def _harmony_model(tiny_model_dir, out):
    """The tiny model as a gpt-oss folder: harmony's special tokens and chat template, and <|call|> among
    the EOS ids of its generation config, as gpt-oss's generation_config.json lists it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([*HARMONY_TOKENS, "<|constrain|>", "<|return|>"], special_tokens=True)
    tokenizer.chat_template = HARMONY_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|call|>")]
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def test_a_gpt_oss_run_answers_its_calls_in_harmonys_format(ppo_overrides, task_dir, tiny_model_dir, tmp_path,
                                                           monkeypatch, short_turns):
    monkeypatch.setitem(multi_turn_module.TOOL_CALL_PARSERS, "gpt-oss",
                        lambda text: [ToolCall("calc_gsm8k_reward", json.dumps({"answer": text[-3:]}))])
    tools = tmp_path / "tools.yaml"
    tools.write_text(SHORT_GSM8K_TOOL_CONFIG)
    settings = {"data.train_files": _tool_task(task_dir, tmp_path / "train.parquet"), "data.max_prompt_length": PROMPT_TOKENS,
                "actor_rollout_ref.model.path": _harmony_model(tiny_model_dir, tmp_path / "gpt-oss"),
                "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.response_length": 96,
                "actor_rollout_ref.rollout.multi_turn.enable": "true",
                "actor_rollout_ref.rollout.multi_turn.format": "gpt-oss",
                "actor_rollout_ref.rollout.multi_turn.tool_config_path": tools,
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
                "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 1,
                "trainer.rollout_data_dir": tmp_path / "rollouts"}
    records = run_ppo(None, ppo_overrides(**settings), print_fn=lambda *a, **k: None)
    assert [r["num_turns/max"] for r in records if "actor/pg_loss" in r] == [4]  # 2 turns, 1 reply, the prompt
    logged = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert all("functions.calc_gsm8k_reward to=assistant" in line["output"] for line in logged)
    with pytest.raises(UserError, match="it is not a gpt-oss tokenizer"):  # the tiny model's own tokenizer
        run_ppo(None, ppo_overrides(**{**settings, "actor_rollout_ref.model.path": tiny_model_dir}),
                print_fn=lambda *a, **k: None)
