"""Token-budget micro-batches, balanced ranks and packing: pure functions, hand-checked cases."""

import random

import pytest
import torch

from klppo.data.batching import (
    RowSpans,
    balance_across_ranks,
    karmarkar_karp,
    pack,
    row_spans,
    restore_order,
    seqlen_balance_metrics,
    token_budget_micro_batches,
    unpack,
)
from klppo.errors import UserError


def _sums(costs, parts):
    return [sum(costs[i] for i in part) for part in parts]


def test_karmarkar_karp_gives_the_textbook_two_way_split():
    # Korf's example {8, 7, 6, 5, 4}: differencing 8-7 = 1, 6-5 = 1, 4-1 = 3, 3-1 = 2, so the
    # parts differ by 2 (the optimum, {8, 7} vs {6, 5, 4}, is 15/15; differencing misses it).
    costs = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(costs, 2)
    assert sorted(_sums(costs, parts)) == [14, 16]
    assert sorted(i for part in parts for i in part) == list(range(5))


def test_karmarkar_karp_balances_better_than_consecutive_chunks():
    rng = random.Random(0)
    costs = [int(rng.lognormvariate(4, 1)) + 1 for _ in range(64)]
    parts = karmarkar_karp(costs, 4)
    sums = _sums(costs, parts)
    chunk_sums = [sum(costs[i : i + 16]) for i in range(0, 64, 16)]
    assert max(sums) - min(sums) <= max(costs)  # within one item of perfect
    assert max(sums) - min(sums) < max(chunk_sums) - min(chunk_sums)


def test_karmarkar_karp_is_deterministic_and_orders_parts_heaviest_first():
    costs = [3, 3, 3, 3, 2, 2, 1]
    first, second = karmarkar_karp(costs, 3), karmarkar_karp(list(costs), 3)
    assert first == second
    sums = _sums(costs, first)
    assert sums == sorted(sums, reverse=True)
    assert all(part == sorted(part) for part in first)


def test_karmarkar_karp_with_equal_size_gives_every_part_the_same_count():
    costs = [100, 1, 1, 1, 50, 50, 2, 2]
    parts = karmarkar_karp(costs, 2, equal_size=True)
    assert [len(p) for p in parts] == [4, 4]
    # Best equal-size split: {100, 1, 1, 2} = 104 vs {50, 50, 1, 2} = 103.
    assert sorted(_sums(costs, parts)) == [103, 104]
    with pytest.raises(ValueError, match="multiple of k"):
        karmarkar_karp(costs, 3, equal_size=True)


def test_micro_batches_stay_within_the_token_budget_and_use_the_fewest_parts():
    rng = random.Random(1)
    lens = [rng.randint(20, 300) for _ in range(40)]
    parts = token_budget_micro_batches(lens, 1000)
    assert all(s <= 1000 for s in _sums(lens, parts))
    assert sorted(i for p in parts for i in p) == list(range(40))
    assert len(parts) >= -(-sum(lens) // 1000)
    # One fewer micro-batch would overflow on average, or KK could not find a fitting split.
    fewer = karmarkar_karp(lens, len(parts) - 1)
    assert max(_sums(lens, fewer)) > 1000


def test_sequences_over_half_the_budget_get_a_micro_batch_each():
    # The two 600s cannot share a budget of 1000: {600} and {600, 100}.
    assert sorted(map(sorted, token_budget_micro_batches([600, 600, 100], 1000))) == [[0], [1, 2]]


def test_every_rank_gets_the_same_number_of_micro_batches():
    # Rank 0 needs 1 micro-batch, rank 1 needs 3; the all-reduced max is passed to both.
    ranks = [[100, 120, 90, 80], [900, 950, 800, 100]]
    counts = [len(token_budget_micro_batches(lens, 1000)) for lens in ranks]
    assert counts == [1, 3]
    shared = max(counts)
    parts = [token_budget_micro_batches(lens, 1000, min_num_micro_batches=shared) for lens in ranks]
    assert [len(p) for p in parts] == [3, 3]
    assert all(p for rank in parts for p in rank)  # no empty micro-batch


def test_a_sequence_over_the_budget_names_the_key_and_the_fix():
    with pytest.raises(UserError, match=r"critic.ppo_max_token_len_per_gpu = 100 is smaller than a sequence of 150 tokens.*raise critic.ppo_max_token_len_per_gpu to at least 150"):
        token_budget_micro_batches([50, 150], 100, budget_key="critic.ppo_max_token_len_per_gpu")


def test_restore_order_undoes_the_micro_batch_order():
    parts = [[2, 0], [3], [1]]
    order = [i for p in parts for i in p]  # [2, 0, 3, 1]
    computed = torch.tensor([[20.0], [0.0], [30.0], [10.0]])  # row j computed for batch row order[j]
    assert restore_order(computed, order).flatten().tolist() == [0.0, 10.0, 20.0, 30.0]
    with pytest.raises(ValueError, match="permutation"):
        restore_order(computed, [0, 0, 1, 2])


@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_ranks_get_equal_counts_and_similar_tokens(world_size):
    rng = random.Random(world_size)
    # Long sequences first: contiguous shards would be badly unbalanced.
    lens = sorted((int(rng.lognormvariate(5, 1)) + 16 for _ in range(32)), reverse=True)
    parts = balance_across_ranks(lens, world_size)
    assert [len(p) for p in parts] == [32 // world_size] * world_size
    assert sorted(i for p in parts for i in p) == list(range(32))
    metrics = seqlen_balance_metrics(lens, parts)
    spread = metrics["global_seqlen/balanced_max"] - metrics["global_seqlen/balanced_min"]
    assert spread <= max(lens) and spread < metrics["global_seqlen/minmax_diff"] / 2
    assert metrics["global_seqlen/mean"] == sum(lens) / world_size


def test_seqlen_balance_metrics_by_hand():
    # Contiguous shards [10, 1] and [1, 10]... here [10, 9] = 19 and [1, 2] = 3: min 3, max 19, diff 16.
    lens = [10, 9, 1, 2]
    metrics = seqlen_balance_metrics(lens, balance_across_ranks(lens, 2))
    assert metrics == {
        "global_seqlen/min": 3.0, "global_seqlen/max": 19.0, "global_seqlen/minmax_diff": 16.0,
        "global_seqlen/balanced_min": 11.0, "global_seqlen/balanced_max": 11.0, "global_seqlen/mean": 11.0,
    }


def test_balancing_one_rank_keeps_everything_on_it():
    assert balance_across_ranks([5, 3, 9], 1) == [[0, 1, 2]]


def test_pack_concatenates_real_tokens_with_positions_restarting_per_sequence():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 1, 2, 0, 0], [0, 3, 4, 0, 0, 0]])
    mask = ids != 0
    packed = pack(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 9] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 4
    values = packed.input_ids.float().unsqueeze(-1) * 10  # (1, N, 1)
    assert unpack(values, packed, fill=-1.0)[..., 0].tolist() == torch.where(mask, ids * 10.0, -1.0).tolist()


def test_pack_of_an_empty_row_is_an_empty_sequence():
    ids = torch.tensor([[4, 5], [0, 0]])
    packed = pack(ids, ids != 0)
    assert packed.cu_seqlens.tolist() == [0, 2, 2]
    assert unpack(packed.input_ids.unsqueeze(-1), packed)[..., 0].tolist() == [[4, 5], [0, 0]]


def test_row_spans_give_each_rows_first_real_column_and_count_and_see_gaps():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]]).bool()
    spans = row_spans(mask)
    assert (spans.starts, spans.lengths, spans.contiguous) == ((2, 0, 0, 5), (3, 4, 0, 1), True)
    assert spans.ends == (5, 4, 0, 6)
    assert spans.select([3, 0]) == RowSpans((5, 2), (1, 3), True)
    assert spans.select(slice(1, 3)) == RowSpans((0, 0), (4, 0), True)
    assert not row_spans(torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]]).bool()).contiguous  # a gap in row 0


def test_packing_from_the_spans_gives_what_packing_from_the_mask_gives():
    """Contiguous rows pack by host arithmetic; RowSpans(contiguous=False) makes pack read the mask."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 1, 2, 0, 0], [0, 0, 0, 0, 0, 0], [0, 3, 4, 0, 0, 0]])
    mask = ids != 0
    spans = row_spans(mask)
    by_spans, by_mask = pack(ids, mask), pack(ids, mask, RowSpans(spans.starts, spans.lengths, contiguous=False))
    for field in ("input_ids", "position_ids", "cu_seqlens", "rows", "cols"):
        a, b = getattr(by_spans, field), getattr(by_mask, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert (by_spans.max_seqlen, by_spans.lengths, by_spans.shape) == (by_mask.max_seqlen, by_mask.lengths, by_mask.shape)


def test_rows_with_gaps_still_pack_every_real_token():
    ids = torch.tensor([[5, 0, 6, 7], [0, 8, 9, 0]])
    packed = pack(ids, ids != 0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9]] and packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
