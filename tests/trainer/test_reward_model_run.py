"""PPO scored by a reward model: raw scores, or each prompt's responses ranked by the reward model
and the ranking distilled into rewards."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from klppo.rewards.distill import group_ranking_rewards
from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def _reward_model_folder(tiny_model_dir, out, seed: int):
    """A one-label sequence-classification model on the tiny backbone (with the same tokenizer)."""
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    return _reward_model_folder(tiny_model_dir, tmp_path_factory.mktemp("rm"), seed=0)


def test_group_ranking_rewards_rank_within_each_prompt():
    scores = torch.tensor([0.3, 2.0, -1.0, 5.0, 5.0, 1.0])
    rewards = group_ranking_rewards(scores, torch.tensor([0, 0, 0, 1, 1, 1]), "bradley_terry")
    assert rewards[1] > rewards[0] > rewards[2]  # group 0 ranked 1 > 0 > 2
    assert rewards[3] == pytest.approx(rewards[4].item()) and rewards[3] > rewards[5]  # a tie stays a tie
    assert rewards[:3].sum() == pytest.approx(0.0, abs=1e-5) and rewards[3:].sum() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("rank", [False, True])
def test_hf_run_scored_by_a_reward_model(ppo_overrides, task_dir, reward_model_dir, rank):
    overrides = ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
        "reward_model.enable": "true", "reward_model.model.path": reward_model_dir,
        "reward_model.rank_responses": str(rank).lower(), "trainer.total_training_steps": 1,
    })
    record = run_ppo(None, overrides, print_fn=quiet)[-1]
    assert record["critic/score/max"] > record["critic/score/min"]  # the reward model tells responses apart
    if rank:  # distilled within each prompt: rewards are centred per group
        assert record["critic/score/mean"] == pytest.approx(0.0, abs=1e-5)


def test_several_reward_models_rank_as_several_annotators():
    scores = torch.tensor([[3.0, 3.0], [2.0, 1.0], [1.0, 2.0]])  # model A: 0 > 1 > 2, model B: 0 > 2 > 1
    group = torch.tensor([0, 0, 0])
    both = group_ranking_rewards(scores, group, "bradley_terry")
    assert both[0] > both[1] and both[1] == pytest.approx(both[2].item())  # their disagreement cancels
    only_a = group_ranking_rewards(scores[:, 0], group, "bradley_terry")
    assert only_a[1] > only_a[2]


@pytest.fixture(scope="module")
def second_reward_model_dir(tiny_model_dir, tmp_path_factory):
    return _reward_model_folder(tiny_model_dir, tmp_path_factory.mktemp("rm2"), seed=1)


def test_raw_scores_of_several_reward_models_are_averaged(ppo_overrides, task_dir, reward_model_dir,
                                                          second_reward_model_dir, tmp_path):
    def first_step_score(name: str, path, extra: str) -> float:
        overrides = ppo_overrides(tmp_path / name, **{
            "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
            "reward_model.enable": "true", "reward_model.model.path": path,
            "reward_model.model.extra_paths": extra, "trainer.total_training_steps": 1,
        })
        return run_ppo(None, overrides, print_fn=quiet)[-1]["critic/score/mean"]

    # The same seed samples the same responses in each run, so only the scoring differs.
    a = first_step_score("a", reward_model_dir, "[]")
    b = first_step_score("b", second_reward_model_dir, "[]")
    both = first_step_score("both", reward_model_dir, f"[{second_reward_model_dir}]")
    assert a != pytest.approx(b)
    assert both == pytest.approx((a + b) / 2, rel=1e-5)


def _rm_batch(tiny_model_dir, answer_batch):
    from klppo.models.load import load_reward_model
    from klppo.models.forward import use_packed_attention

    model = load_reward_model(str(_reward_model_folder(tiny_model_dir, tiny_model_dir.parent / "rm_scores", 3)),
                              key="reward_model.model.path", device=torch.device("cpu"))
    use_packed_attention(model)
    return model, answer_batch()


def test_packed_reward_model_scores_equal_padded_ones(tiny_model_dir, answer_batch):
    from klppo.data.batching import MicroBatching
    from klppo.trainer.forwards import compute_rm_scores
    from klppo.run.settings import RewardModelForward

    model, batch = _rm_batch(tiny_model_dir, answer_batch)
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    padded = compute_rm_scores(model, batch, RewardModelForward(MicroBatching(rows=2), width, width))
    packed = compute_rm_scores(model, batch, RewardModelForward(MicroBatching(packed=True), width, width))
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_the_reward_model_reads_only_its_prompt_and_response_lengths(tiny_model_dir, answer_batch):
    """reward_model.rollout.prompt_length / response_length: the prompt's last and the response's first tokens."""
    from klppo.data.batching import MicroBatching
    from klppo.models.forward import sequence_scores
    from klppo.trainer.forwards import compute_rm_scores
    from klppo.run.settings import RewardModelForward

    model, batch = _rm_batch(tiny_model_dir, answer_batch)
    cut = compute_rm_scores(model, batch, RewardModelForward(MicroBatching(), prompt_length=6, response_length=4))
    by_hand = sequence_scores(model, torch.cat([batch.prompt_ids[:, -6:], batch.response_ids[:, :4]], 1),
                              torch.cat([batch.prompt_mask[:, -6:], batch.response_mask[:, :4]], 1))
    torch.testing.assert_close(cut, by_hand)
    whole = compute_rm_scores(model, batch, RewardModelForward(MicroBatching(), 10_000, 10_000))
    assert not torch.allclose(cut, whole)


def test_reward_models_run_packed_with_their_own_fsdp_options(ppo_overrides, task_dir, reward_model_dir):
    overrides = ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
        "reward_model.enable": "true", "reward_model.model.path": reward_model_dir,
        "reward_model.model.use_remove_padding": "true", "reward_model.model.fsdp_config.param_offload": "true",
        "trainer.total_training_steps": 1,
    })
    record = run_ppo(None, overrides, print_fn=quiet)[-1]
    assert record["critic/score/max"] > record["critic/score/min"]


def test_a_gold_reward_model_scores_the_held_out_responses_as_the_same_model_as_reward_would(
        ppo_overrides, task_dir, reward_model_dir, tmp_path):
    """At step 0 both runs validate the same model with the same greedy responses: the gold reward
    model's mean is the reward model's (its score at validation), and the gold run trains on the rule."""
    common = {"data.val_files": task_dir / "val.parquet", "trainer.total_training_steps": 1}
    gold = run_ppo(None, ppo_overrides(tmp_path / "gold", **common, **{
        "trainer.gold_reward.model_path": reward_model_dir}), print_fn=quiet)
    scored = run_ppo(None, ppo_overrides(tmp_path / "rm", **common, **{
        "reward_model.enable": "true", "reward_model.model.path": reward_model_dir}), print_fn=quiet)
    assert gold[0]["step"] == scored[0]["step"] == 0
    assert gold[0]["val-gold/reward/mean"] == pytest.approx(scored[0]["val-core/openai/gsm8k/reward/mean@1"], abs=1e-6)
    assert gold[0]["val-core/reward/mean"] == gold[0]["val-core/openai/gsm8k/reward/mean@1"]  # the rule's
