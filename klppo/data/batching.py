"""Token-budget micro-batches, balanced ranks and sequence packing (pure: torch + stdlib).

Legend: B sequences, L padded sequence length, N real tokens of a packed batch, k parts.

RLHF batches mix short and long sequences, so a fixed number of rows per micro-batch either
pads most of the compute away or runs out of memory on the long ones. Here:

- ``karmarkar_karp`` splits costs into k parts with near-equal sums (the largest differencing
  method of Karmarkar and Karp 1982, extended to k parts as in Korf 2009 and verl's
  ``seqlen_balancing.py``).
- ``token_budget_micro_batches`` picks the fewest such parts that each stay within a token
  budget (verl's ``rearrange_micro_batches``); ``restore_order`` undoes the reordering.
- ``balance_across_ranks`` gives each data-parallel rank the same number of sequences with
  near-equal token counts (verl's ``trainer.balance_batch``); ``seqlen_balance_metrics``
  reports how uneven the ranks were before and after.
- ``MicroBatching`` says how one pass over a batch (a no-grad forward, or an update's mini-batch)
  is split; ``micro_batch_plan`` turns it into the row indices of each micro-batch.
- ``pack`` / ``unpack`` move a padded (B, L) batch to one (1, N) row without padding and back;
  ``RowSpans`` (``row_spans``) is where each row's real tokens lie, read on the host once per
  batch, so that packing a micro-batch is host arithmetic rather than host-device syncs.

Everything is deterministic: ties are broken by position, never by hashing or randomness.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from klppo.errors import UserError


# ---- balanced partitions ----


def karmarkar_karp(costs: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``costs`` split into ``k`` parts whose cost sums are close to equal.

    Largest differencing method: every item starts as a k-part state (the item in one part,
    the others empty); the two states with the largest spread (max - min part sum) are merged
    by pairing the heaviest part of one with the lightest of the other, until one state is
    left. With ``equal_size`` every part gets ``len(costs) / k`` items (the items are taken k at
    a time in sorted order, one per part, as verl does), which needs ``len(costs) % k == 0``.
    Each part lists its indices in ascending order; parts are ordered heaviest first.
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"k = {k}: need at least one part")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(costs) = {n} to be a multiple of k = {k}")
    order = sorted(range(n), key=lambda i: (costs[i], i))
    if equal_size:
        groups = [order[start : start + k] for start in range(0, n, k)]
    else:
        groups = [[i] for i in order]
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for tie, group in enumerate(groups):
        parts = [(float(costs[i]), [i]) for i in group] + [(0.0, []) for _ in range(k - len(group))]
        heapq.heappush(heap, _kk_entry(parts, tie))
    tie = len(groups)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a is sorted heaviest first, b lightest first after reversing: heavy meets light.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        heapq.heappush(heap, _kk_entry(merged, tie))
        tie += 1
    parts = heap[0][2] if heap else [(0.0, []) for _ in range(k)]
    return [sorted(items) for _, items in parts]


def _kk_entry(parts: list[tuple[float, list[int]]], tie: int):
    """Heap entry of a partial partition: largest spread pops first, then the oldest."""
    parts = sorted(parts, key=lambda p: (-p[0], min(p[1], default=-1)))
    return (-(parts[0][0] - parts[-1][0]), tie, parts)


def token_budget_micro_batches(
    seq_lens: Sequence[int],
    max_tokens: int,
    *,
    min_num_micro_batches: int = 1,
    budget_key: str = "ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """The fewest micro-batches (index lists) whose tokens each stay within ``max_tokens``.

    Sequences are spread by ``karmarkar_karp`` so micro-batches cost about the same. At least
    ``min_num_micro_batches`` come back: a distributed caller passes the largest count any
    rank needs (an all-reduce of ``len(result)``) so every rank runs the same number of
    forwards and its collectives line up. A sequence longer than the budget is a
    ``UserError`` naming ``budget_key``. Heaviest micro-batch first, so a budget that does
    not fit in memory fails on the first one.
    """
    lens = [int(x) for x in seq_lens]
    if not lens:
        return []
    longest = max(lens)
    if longest > max_tokens:
        raise UserError(
            f"{budget_key} = {max_tokens} is smaller than a sequence of {longest} tokens (prompt + response), "
            f"so no micro-batch can hold it; raise {budget_key} to at least {longest} (usually a multiple of "
            "data.max_prompt_length + data.max_response_length)"
        )
    if min_num_micro_batches > len(lens):
        raise ValueError(f"min_num_micro_batches = {min_num_micro_batches} exceeds the {len(lens)} sequences")
    # Lower bounds: the total must fit, and two sequences over half the budget never share.
    k = max(min_num_micro_batches, math.ceil(sum(lens) / max_tokens), sum(x > max_tokens / 2 for x in lens))
    while True:  # ends at k = len(lens) at the latest: one sequence each always fits
        parts = karmarkar_karp(lens, k)
        if all(sum(lens[i] for i in part) <= max_tokens for part in parts):
            return parts
        k += 1


def restore_order(outputs: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """Rows of ``outputs`` (computed for rows ``order`` of a batch) back in the batch's order.

    ``outputs[j]`` belongs to batch row ``order[j]``; the result's row ``i`` is batch row ``i``.
    ``order`` is checked on the host and copied to the device without waiting for it.
    """
    order = [int(i) for i in order]
    if len(order) != outputs.shape[0] or sorted(order) != list(range(len(order))):
        raise ValueError("order must be a permutation of the rows of outputs")
    index = torch.tensor(order, dtype=torch.long).to(outputs.device, non_blocking=True)
    restored = torch.empty_like(outputs)
    restored[index] = outputs
    return restored


def balance_across_ranks(seq_lens: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices for each of ``world_size`` ranks: equal sequence counts, near-equal token counts.

    The trainer reorders the global batch to ``sum(parts, [])`` before sharding it into equal
    contiguous chunks, so rank r gets ``parts[r]`` (verl's ``_balance_batch``). Needs
    ``len(seq_lens) % world_size == 0``, as sharding already does.
    """
    parts = karmarkar_karp([int(x) for x in seq_lens], world_size, equal_size=True)
    return sorted(parts, key=lambda p: min(p, default=-1))


def rank_shards(seq_lens: Sequence[int], world_size: int, chunk_rows: int, balance: bool) -> list[list[int]]:
    """Rows of the global batch each rank scores and trains on, mini-batch by mini-batch.

    The batch is cut into consecutive chunks of ``chunk_rows`` (a mini-batch, or the common
    divisor of the actor's and critic's mini-batch rows) and every chunk is split evenly over
    the ranks, contiguously or, with ``balance``, by ``balance_across_ranks``. Rank r's rows
    are its share of chunk 0, then of chunk 1, ...; so its k-th local mini-batch holds exactly
    its share of the global k-th mini-batch, and the ranks together train on the same
    mini-batches as one process would.
    """
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, len(seq_lens), chunk_rows):
        chunk = list(range(start, min(start + chunk_rows, len(seq_lens))))
        if len(chunk) % world_size:
            raise ValueError(f"a mini-batch of {len(chunk)} rows does not split evenly over {world_size} ranks")
        if balance:
            parts = [[chunk[i] for i in part] for part in balance_across_ranks([seq_lens[i] for i in chunk], world_size)]
        else:
            size = len(chunk) // world_size
            parts = [chunk[r * size : (r + 1) * size] for r in range(world_size)]
        for shard, part in zip(shards, parts):
            shard.extend(part)
    return shards


def seqlen_balance_metrics(
    seq_lens: Sequence[int], partitions: list[list[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """verl's ``log_seqlen_unbalance``: token sums per rank before and after balancing.

    ``{prefix}/min``, ``/max``, ``/minmax_diff`` describe the contiguous equal shards the ranks
    would get without balancing; ``/balanced_min`` and ``/balanced_max`` those of
    ``partitions``; ``/mean`` the tokens per rank.
    """
    lens, k = [int(x) for x in seq_lens], len(partitions)
    shard = len(lens) // k
    before = [sum(lens[r * shard : (r + 1) * shard]) for r in range(k)]
    after = [sum(lens[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": sum(lens) / k,
    }


# ---- micro-batches of one pass ----


@dataclass(frozen=True)
class MicroBatching:
    """How one pass over a batch splits its rows: a no-grad forward, or an update's mini-batch."""

    rows: int | None = None  # rows per micro-batch (verl's *_micro_batch_size_per_gpu); None = all at once
    max_tokens: int | None = None  # token budget per micro-batch (use_dynamic_bsz); wins over rows
    packed: bool = False  # each micro-batch as one packed row without padding (use_remove_padding)
    budget_key: str = "ppo_max_token_len_per_gpu"  # the config key an over-long sequence error names


def row_chunks(n_rows: int, size: int) -> list[list[int]]:
    """Consecutive row-index chunks of at most ``size`` rows covering ``range(n_rows)``."""
    return [list(range(start, min(start + size, n_rows))) for start in range(0, n_rows, size)]


def micro_batch_plan(
    seq_lens: Sequence[int] | torch.Tensor, split: MicroBatching,
    max_over_ranks: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """Row indices of each micro-batch of a pass over rows of ``seq_lens`` real tokens.

    Fixed rows take consecutive rows; a token budget takes ``token_budget_micro_batches``'
    partition (the lengths are read only then: a tensor costs one host sync here).
    ``max_over_ranks`` (``klppo.distributed.all_reduce_max_int``) makes every rank split its
    shard into the largest count any rank needs, so FSDP's per-forward collectives line up.
    """
    n_rows = len(seq_lens)
    if split.max_tokens is None:
        return row_chunks(n_rows, split.rows or n_rows)
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)  # host-device sync
    plan = token_budget_micro_batches(lens, split.max_tokens, budget_key=split.budget_key)
    if max_over_ranks is not None and (n := max_over_ranks(len(plan))) > len(plan):
        plan = token_budget_micro_batches(lens, split.max_tokens, min_num_micro_batches=n, budget_key=split.budget_key)
    return plan


# ---- packing ----


@dataclass(frozen=True)
class PackedBatch:
    """A padded (B, L) batch as one row of its N real tokens, sequence after sequence.

    ``rows`` and ``cols`` give each packed token's place in the padded layout, so values
    computed on the packed row can be put back (``unpack``) or read at chosen positions.
    """

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long, restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # (B + 1,) int32, sequence b is packed[cu_seqlens[b]:cu_seqlens[b+1]]
    max_seqlen: int  # longest sequence
    rows: torch.Tensor  # (N,) long, padded row of each packed token
    cols: torch.Tensor  # (N,) long, padded column of each packed token
    shape: tuple[int, int]  # (B, L) of the padded batch
    lengths: tuple[int, ...] = ()  # (B,) real tokens of each sequence, on the host

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


@dataclass(frozen=True)
class RowSpans:
    """Where each row of a (B, L) mask has its real tokens, on the host: ``lengths[b]`` columns from
    ``starts[b]`` on, when ``contiguous`` (every row's real tokens are one run of columns, as a
    left-padded prompt followed by a right-padded response always is).

    Read once for a batch (``row_spans``: one host-device sync) and handed to each micro-batch's
    forward (``select``), it makes packing, the positions where log-probs are read and the padded
    path's trimming host arithmetic: on a GPU each of those read the mask (``nonzero``,
    ``tolist``), waiting for the device, several times per micro-batch. Where the rows are not
    contiguous the forwards read the mask as before.
    """

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    contiguous: bool

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        """(B,) one past each row's last real column (its start for an empty row)."""
        return tuple(s + n for s, n in zip(self.starts, self.lengths))

    def select(self, rows: Sequence[int] | slice) -> "RowSpans":
        """The spans of ``rows`` (indices or a slice), in that order."""
        picked = range(len(self))[rows] if isinstance(rows, slice) else rows
        return RowSpans(tuple(self.starts[i] for i in picked), tuple(self.lengths[i] for i in picked), self.contiguous)


def row_spans(attention_mask: torch.Tensor) -> RowSpans:
    """Each row's first real column and real-token count, and whether every row is one run of columns."""
    mask = attention_mask.bool()
    first = mask.to(torch.uint8).argmax(-1)  # the first True (0 for an empty row)
    last = mask.shape[1] - 1 - mask.flip(-1).to(torch.uint8).argmax(-1)
    starts, lengths, lasts = torch.stack([first, mask.sum(-1), last]).tolist()  # host sync: once per batch
    contiguous = all(n == 0 or e - s + 1 == n for s, n, e in zip(starts, lengths, lasts))
    return RowSpans(tuple(starts), tuple(lengths), contiguous)


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting for the device's queue: through pinned
    memory on CUDA (torch's pinned-block cache keeps it until the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def span_index(spans: RowSpans, first: Sequence[int] | None = None, last: Sequence[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n,) host tensors of every real token of contiguous ``spans``, row-major: its row, its column
    and its place in the row's run (= its position id). ``first`` / ``last``: each row's first column
    and one past its last to take instead of the whole run (a subset of it)."""
    lo = list(first if first is not None else spans.starts)
    counts = [max(0, h - low) for low, h in zip(lo, last if last is not None else spans.ends)]
    rows = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(counts, dtype=torch.long))
    within = torch.arange(sum(counts)) - torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.long)[rows]
    cols = torch.tensor(lo, dtype=torch.long)[rows] + within
    return rows, cols, cols - torch.tensor(spans.starts, dtype=torch.long)[rows]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, spans: RowSpans | None = None) -> PackedBatch:
    """(B, L) ids and bool mask -> one row of the real tokens, position ids restarting per row.

    Position ids count real tokens only, as the padded forward computes them, so a packed
    sequence sees the same positions as its padded row. A row without real tokens packs to
    an empty sequence (two equal ``cu_seqlens`` entries). ``spans``: the rows' ``RowSpans``, read
    here (one host-device sync) when not given; contiguous rows pack from them with no other.
    """
    mask = attention_mask.bool()
    spans = spans if spans is not None else row_spans(mask)
    lengths = spans.lengths
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if spans.contiguous:
        index = torch.stack(span_index(spans))  # (3, N): rows, columns, positions
        rows, cols, positions = host_to(index, input_ids.device).unbind()
        packed_positions = positions.unsqueeze(0)
    else:
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: each sequence's tokens in order; host-device sync
        packed_positions = (mask.long().cumsum(-1) - 1)[rows, cols].unsqueeze(0)
    return PackedBatch(
        input_ids=input_ids[rows, cols].unsqueeze(0),
        position_ids=packed_positions,
        cu_seqlens=host_to(cu_seqlens, input_ids.device),
        max_seqlen=max(lengths, default=0),
        rows=rows,
        cols=cols,
        shape=(mask.shape[0], mask.shape[1]),
        lengths=tuple(lengths),
    )


def unpack(values: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Per-token ``values`` of the packed row, (1, N, ...), in the padded (B, L, ...) layout.

    Padding positions get ``fill``.
    """
    assert values.shape[:2] == (1, packed.num_tokens), f"expected (1, {packed.num_tokens}, ...), got {tuple(values.shape)}"
    out = values.new_full((*packed.shape, *values.shape[2:]), fill)
    out[packed.rows, packed.cols] = values[0]
    return out
