"""Offline KL-PPO from rankings: distilled rewards order the responses, and training moves the
policy towards the better-ranked responses."""

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data.arithmetic import write_arithmetic_ranked_parquet
from klppo.data.chat_template import encode_chats
from klppo.rewards.distill import ranking_rewards
from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.mark.parametrize("method", ["bradley_terry", "plackett_luce"])
def test_distilled_rewards_follow_the_ranking_and_are_centred(method):
    rewards = ranking_rewards([[2, 0, 3, 1]], 4, method)
    assert sorted(range(4), key=lambda i: -rewards[i]) == [2, 0, 3, 1]
    assert sum(rewards) == pytest.approx(0.0, abs=1e-5)
    doubled = ranking_rewards([[2, 0, 3, 1]], 4, method, scale=2.0)
    assert doubled == pytest.approx([2 * r for r in rewards], rel=1e-5)


def _margin(model_dir, rows) -> float:
    """Mean over prompts of log p(best response) - log p(worst response) under the model."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    margins = []
    for row in rows:
        prompt = encode_chats(tokenizer, [row["prompt"]])[0]
        scores = []
        for index in (row["ranking"][0], row["ranking"][-1]):
            response = tokenizer(row["responses"][index], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1)
            scores.append(logp.gather(-1, ids[0, len(prompt):, None]).sum())
        margins.append(float(scores[0] - scores[1]))
    return sum(margins) / len(margins)


def test_offline_ppo_from_rankings_prefers_the_better_responses(ppo_overrides, tiny_model_dir, tmp_path):
    data = write_arithmetic_ranked_parquet(tmp_path / "ranked.parquet", 8, seed=5, n_responses=4)
    overrides = ppo_overrides(**{
        "data.train_files": data, "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": "false", "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.actor.optim.lr": 3e-3, "trainer.total_training_steps": 6,
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    assert records[-1]["critic/score/mean"] == pytest.approx(0.0, abs=1e-4)  # centred within each prompt
    assert records[-1]["critic/score/max"] > 0.5
    rows = pq.read_table(data).to_pylist()
    assert _margin(tmp_path / "run" / "actor_hf", rows) > _margin(tiny_model_dir, rows) + 1.0


WORDS = ["great", "good", "fine", "bad"]  # best first: a preference that generalises across prompts


def _word_ranked(path, n, seed):
    import random

    import pyarrow as pa

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        order = rng.sample(range(4), 4)
        rows.append({"prompt": [{"role": "user", "content": f"Rate {a} and {b}."}],
                     "responses": [f"{a} + {b} is {WORDS[k]}" for k in order],
                     "ranking": sorted(range(4), key=lambda j: order[j])})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_preference_agreement_on_held_out_rankings_rises(ppo_overrides, tmp_path):
    overrides = ppo_overrides(**{
        "data.train_files": _word_ranked(tmp_path / "train.parquet", 16, 0),
        "data.val_files": _word_ranked(tmp_path / "held_out.parquet", 8, 1),
        "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": "false",
        "actor_rollout_ref.actor.use_kl_loss": "true", "actor_rollout_ref.actor.optim.lr": 3e-3,
        "trainer.total_training_steps": 8, "trainer.test_freq": 8,
    })
    printed = []
    records = run_ppo(None, overrides, print_fn=printed.append)
    before, after = records[0]["val-core/preference_agreement"], records[-1]["val-core/preference_agreement"]
    assert after > before and after >= 0.8, (before, after)
    # Rows without a data_source cannot be scored by a rule, so validation only measures agreement.
    assert any("preference agreement only" in line for line in printed)
    assert not any(k.startswith("val-core/") and "reward" in k for k in records[-1])
