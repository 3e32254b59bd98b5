"""PromptBatches: deterministic epochs and exact resume."""

import pytest

from klppo.data.sampler import PromptBatches
from klppo.errors import UserError


def take(batches, k):
    return [batches.next_batch() for _ in range(k)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_is_used_once_per_epoch(shuffle):
    batches = PromptBatches(10, 3, shuffle=shuffle, seed=7)
    assert batches.steps_per_epoch == 3
    for epoch in range(3):
        seen = sum(take(batches, 3), [])
        assert batches.epoch == epoch
        assert len(seen) == len(set(seen)) == 9 and set(seen) <= set(range(10))


def test_without_drop_last_the_last_partial_batch_is_kept():
    batches = PromptBatches(10, 3, shuffle=True, seed=0, drop_last=False)
    assert batches.steps_per_epoch == 4
    epoch0 = take(batches, 4)
    assert [len(b) for b in epoch0] == [3, 3, 3, 1] and sorted(sum(epoch0, [])) == list(range(10))


def test_epochs_are_reshuffled_and_reproducible_from_the_seed():
    a, b = PromptBatches(20, 5, shuffle=True, seed=3), PromptBatches(20, 5, shuffle=True, seed=3)
    seq_a, seq_b = take(a, 12), take(b, 12)
    assert seq_a == seq_b
    assert sum(seq_a[:4], []) != sum(seq_a[4:8], [])  # epoch 1 is a new permutation
    assert take(PromptBatches(20, 5, shuffle=True, seed=4), 4) != seq_a[:4]


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 9])
def test_resume_after_k_batches_equals_the_uninterrupted_sequence(k):
    uninterrupted = take(PromptBatches(13, 4, shuffle=True, seed=11), 10)
    first = PromptBatches(13, 4, shuffle=True, seed=11)
    head = take(first, k)
    resumed = PromptBatches(13, 4, shuffle=True, seed=11)
    resumed.load_state_dict(dict(first.state_dict()))
    assert resumed.epoch == first.epoch
    assert head + take(resumed, 10 - k) == uninterrupted


def test_state_dict_counts_epoch_and_position():
    batches = PromptBatches(6, 2, shuffle=False, seed=0)
    assert batches.state_dict() == {"epoch": 0, "position": 0}
    assert take(batches, 4) == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert batches.state_dict() == {"epoch": 1, "position": 1}


def test_batch_larger_than_the_dataset_is_a_user_error():
    with pytest.raises(UserError, match=r"data.train_batch_size=8 is larger than the dataset \(5 prompts"):
        PromptBatches(5, 8, shuffle=True, seed=0)


def test_state_from_another_batch_size_is_rejected():
    batches = PromptBatches(10, 5, shuffle=True, seed=0)
    with pytest.raises(UserError, match="does not fit 2 batches per epoch"):
        batches.load_state_dict({"epoch": 0, "position": 5})
