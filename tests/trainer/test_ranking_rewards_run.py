"""Offline KL-PPO from rankings: distilled rewards order the responses, and training moves the
policy towards the better-ranked responses."""

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data.arithmetic import write_arithmetic_ranked_parquet
from klppo.data.rl_dataset import encode_chats
from klppo.rewards.ranking import ranking_rewards
from klppo.trainer.main_ppo import run_ppo


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
