"""Dynamic sampling's loop keeps the rows verl's DAPO recipe keeps, for the same rewards, over several draws."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from klppo.data.sampler import PromptBatches
from klppo.errors import UserError
from klppo.monitoring.timer import PhaseTimer
from klppo.rollout.batch import RolloutBatch, concat_batches
from klppo.rollout.vllm import request_seed
from klppo.trainer import dynamic_sampling
from klppo.trainer.responses import engine_seeds
from klppo.run.settings import FilterGroupsSettings


def verl_dapo_rows(draws: list[list[float]], n: int, train_batch_size: int, max_num_gen_batches: int):
    """verl's recipe/dapo/dapo_ray_trainer.py, written out: per generation batch, the std (np.std) of the
    metric over each uid's trajectories; uids with std > 0 or one trajectory kept, their rows in order;
    kept rows concatenated over batches until num_prompt_in_batch >= train_batch_size (an error once
    max_num_gen_batches > 0 batches were drawn without), then cut to train_batch_size * n rows.
    Returns the (batch, row) of each trained row and the number of batches drawn."""
    rows, num_prompt_in_batch = [], 0
    for num_gen_batches, metric in enumerate(draws, start=1):
        uids = [f"{num_gen_batches}-{i // n}" for i in range(len(metric))]
        values: dict[str, list[float]] = {}
        for uid, value in zip(uids, metric):
            values.setdefault(uid, []).append(value)
        kept = [u for u, v in values.items() if np.std(v) > 0 or len(v) == 1]
        num_prompt_in_batch += len(kept)
        rows += [(num_gen_batches - 1, i) for i, uid in enumerate(uids) if uid in kept]
        if num_prompt_in_batch >= train_batch_size:
            return rows[: train_batch_size * n], num_gen_batches
        if 0 < max_num_gen_batches <= num_gen_batches:
            raise ValueError("Generated too many")
    raise AssertionError("the test drew too few batches")


def fake_parts(draws: list[list[float]], n: int, prompts: int, gen: int, limit):
    """Parts whose responses are nothing and whose draw d's rewards are ``draws[d]``; each row remembers (draw, row)."""
    def responses(parts, records, timer, step, draw=0):
        rows, width = len(records) * n, 1 + draw % 2  # prompts of two widths: concatenation pads them
        return RolloutBatch(
            prompt_ids=torch.ones(rows, width, dtype=torch.long), prompt_mask=torch.ones(rows, width, dtype=torch.bool),
            response_ids=torch.ones(rows, 2, dtype=torch.long), response_mask=torch.ones(rows, 2, dtype=torch.bool),
            group_index=torch.arange(len(records)).repeat_interleave(n), data_sources=["s"] * rows,
            ground_truths=[None] * rows, extra_infos=[{"draw": draw, "row": i} for i in range(rows)])

    def rewards(parts, batch, shards, timer, places=None):
        draw = batch.extra_infos[0]["draw"]
        batch.token_level_scores = torch.zeros(len(batch), 2)
        batch.token_level_scores[:, -1] = torch.tensor(draws[draw])

    settings = SimpleNamespace(filter_groups=FilterGroupsSettings(prompts, gen, limit), n=n, rollout="hf")
    records = [SimpleNamespace(where=f"row {i}", index=i) for i in range(1000)]
    parts = SimpleNamespace(settings=settings, batches=PromptBatches(1000, gen, shuffle=False, seed=0),
                            train_records=records, tokenizer=SimpleNamespace(pad_token_id=0),
                            env=SimpleNamespace(world_size=1, rank=0), device=torch.device("cpu"))
    return parts, responses, rewards


@pytest.mark.parametrize("trial", range(40))
def test_the_kept_rows_and_the_draws_are_verls(trial, monkeypatch):
    rng = random.Random(trial)
    n, gen, prompts = rng.choice([2, 3]), rng.randint(1, 5), rng.randint(1, 6)
    limit = rng.choice([None, 2, 4])
    draws = [[rng.choice([0.0, 1.0]) if rng.random() < 0.4 else 1.0 for _ in range(gen * n)] for _ in range(60)]
    parts, responses, rewards = fake_parts(draws, n, prompts, gen, limit)
    monkeypatch.setattr(dynamic_sampling, "step_responses", responses)
    monkeypatch.setattr(dynamic_sampling, "score_rewards", rewards)
    try:
        expected, drawn = verl_dapo_rows(draws, n, prompts, limit or 0)
    except ValueError:
        with pytest.raises(UserError, match="generated too many"):
            dynamic_sampling.groups_with_spread(parts, PhaseTimer(), step=1)
        return
    records, batch, metrics = dynamic_sampling.groups_with_spread(parts, PhaseTimer(), step=1)
    assert [(info["draw"], info["row"]) for info in batch.extra_infos] == expected
    assert metrics["training/filter_groups/gen_batches"] == drawn
    assert torch.equal(batch.group_index, torch.arange(prompts).repeat_interleave(n))
    # the prompts drawn, in order: draw d's group g is prompt d * gen + g
    assert [r.index for r in records] == [d * gen + row // n for d, row in expected[::n]]


def test_concatenated_batches_pad_prompts_left_and_responses_right_and_keep_groups_apart():
    a = RolloutBatch(prompt_ids=torch.tensor([[5], [6]]), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                     response_ids=torch.tensor([[7, 8], [9, 1]]), response_mask=torch.ones(2, 2, dtype=torch.bool),
                     group_index=torch.tensor([0, 0]), data_sources=["a", "a"], ground_truths=[1, 1],
                     extra_infos=[{}, {}], token_level_scores=torch.tensor([[0.0, 1.0], [0.0, 2.0]]))
    b = RolloutBatch(prompt_ids=torch.tensor([[3, 4]]), prompt_mask=torch.ones(1, 2, dtype=torch.bool),
                     response_ids=torch.tensor([[2]]), response_mask=torch.ones(1, 1, dtype=torch.bool),
                     group_index=torch.tensor([3]), data_sources=["b"], ground_truths=[2], extra_infos=[{}],
                     token_level_scores=torch.tensor([[4.0]]),
                     rollout_log_probs=torch.tensor([[-0.5]]), has_rollout_log_probs=torch.tensor([True]))
    joined = concat_batches([a, b], pad_token_id=0)
    assert torch.equal(joined.prompt_ids, torch.tensor([[0, 5], [0, 6], [3, 4]]))
    assert torch.equal(joined.prompt_mask, torch.tensor([[False, True], [False, True], [True, True]]))
    assert torch.equal(joined.response_ids, torch.tensor([[7, 8], [9, 1], [2, 0]]))
    assert torch.equal(joined.response_mask, torch.tensor([[True, True], [True, True], [True, False]]))
    assert torch.equal(joined.token_level_scores, torch.tensor([[0.0, 1.0], [0.0, 2.0], [4.0, 0.0]]))
    assert torch.equal(joined.group_index, torch.tensor([0, 0, 1]))
    # a has no behaviour log-probs: its rows say so
    assert torch.equal(joined.has_rollout_log_probs, torch.tensor([False, False, True]))
    assert torch.equal(joined.rollout_log_probs, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-0.5, 0.0]]))
    assert joined.data_sources == ["a", "a", "b"] and joined.old_log_prob is None


def test_each_draw_of_a_step_samples_with_seeds_of_its_own_and_the_first_keeps_the_plain_seeds():
    parts = SimpleNamespace(settings=SimpleNamespace(engine=SimpleNamespace(seed=7)))
    records = [SimpleNamespace(index=i) for i in (3, 5)]
    first, second, third = (engine_seeds(parts, records, 2, step=4, draw=d) for d in range(3))
    assert first == [request_seed(7, 4, i, k) for i in (3, 5) for k in range(2)] == engine_seeds(parts, records, 2, 4)
    assert len(set(first) | set(second) | set(third)) == 12  # a prompt drawn twice in a step is sampled afresh
