"""How a step's sequences are grouped: the forwards a rank runs, and the released 80/20 code's
micro-batches, which rank tokens and average the loss.

- :func:`micro_batches` / :func:`forward_plan`: the physical forwards of one rank (consecutive
  sequences within a sequence count and a token budget; every rank making equally many calls).
- :func:`balanced_partitions`: verl's ``get_seqlen_balanced_partitions`` (the largest
  differencing method of Karmarkar and Karp), giving the same partitions in the same order, ties
  included (tests/test_batching.py checks it against partitions computed by the study's fork).
- :func:`virtual_step`: the micro-batches that verl builds in a layout of ranks that need not be
  ours (the study ran 128 GPUs with sequence parallelism 8). ``_balance_batch`` splits the step's
  sequences into `world_size` equal-size balanced partitions, and each group of
  `sequence_parallel` consecutive partitions is one data-parallel group's data. Each group cuts its
  data into consecutive mini-batches. For each mini-batch index, the micro-batch count is the
  largest over the groups of min(B, ceil(Σ tokens / budget)), and each group splits its mini-batch
  into that many balanced partitions (``rearrange_micro_batches`` with use_dynamic_bsz).

Pure Python on lengths: nothing here imports torch or another module of the package.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stages.core.models.parallel import sequence_parallel_misfit

RankMax = Callable[[int], int]
"""The largest of a number over the ranks of the job (None: one process)."""


# ---------------------------------------------------------------------------------------------
# Physical forwards
# ---------------------------------------------------------------------------------------------
def micro_batches(total_lengths: Sequence[int], max_sequences: int,
                  max_tokens: int | None = None, padding_free: bool = False) -> list[range]:
    """Consecutive sequences per forward: at most max_sequences, and while their cost stays
    within max_tokens (a sequence longer than the budget goes alone). The cost of padded rows is
    sequences × longest (prompt + response); of a padding-free row, the sum of the lengths."""
    out, start, cost, longest = [], 0, 0, 0
    for i, n in enumerate(total_lengths):
        wider = max(longest, n)
        grown = cost + n if padding_free else wider * (i - start + 1)
        full = i - start >= max_sequences or (
            max_tokens is not None and i > start and grown > max_tokens)
        if full:
            out.append(range(start, i))
            start, wider, grown = i, n, n
        longest, cost = wider, grown
    if start < len(total_lengths):
        out.append(range(start, len(total_lengths)))
    return out


def forward_plan(micro: list, rank_max: RankMax | None) -> list:
    """The micro-batches of each forward call of this rank, padded with None (a forward of a
    stand-in whose result is discarded) up to the most any rank makes, so every rank makes
    equally many: ZeRO-3 gathers parameters collectively in every forward, ZeRO-2 reduces
    gradients in every backward, and a rank that stops early leaves the others waiting forever."""
    calls = rank_max(len(micro)) if rank_max is not None else len(micro)
    return [micro[j] if j < len(micro) else None for j in range(calls)]


# ---------------------------------------------------------------------------------------------
# verl's balancing (Karmarkar–Karp)
# ---------------------------------------------------------------------------------------------
class _Bin:
    """One partition under construction: its (index, length) items in the order they came, and
    their sum. Bins order by (sum, item count, items), as verl's do: the items settle ties."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []
        self.total = 0

    def key(self) -> tuple:
        return self.total, len(self.items), self.items


class _Partial:
    """k bins of a partial solution, largest first. The heap pops the partial with the widest
    spread (largest − smallest bin) first; between equal spreads, the one whose largest bin is
    larger."""

    __slots__ = ("bins",)

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.bins = [_Bin() for _ in range(k)]
        for b, (index, length) in zip(self.bins, items, strict=False):  # 1 or k items
            b.items.append((index, length))
            b.total += length
        self._order()

    def _order(self) -> None:
        # a stable sort, descending: equal bins (empty ones) keep their places, as in verl
        self.bins.sort(key=_Bin.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.bins[0].total - self.bins[-1].total

    def absorb(self, other: _Partial) -> None:
        """Differencing: the largest bin takes the other's smallest, and so on down."""
        k = len(self.bins)
        for i, b in enumerate(self.bins):
            add = other.bins[k - 1 - i]
            b.items.extend(add.items)
            b.total += add.total
        self._order()

    def __lt__(self, other: _Partial) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.bins[0].key() < self.bins[0].key()


def balanced_partitions(lengths: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's get_seqlen_balanced_partitions: k partitions of the indices of `lengths` whose
    sums are balanced, by the largest differencing method (Karmarkar–Karp), each partition's
    indices sorted, the partitions in verl's order (largest sum first; its ties as verl breaks
    them). equal_size: every partition holds len(lengths) / k indices (which must divide).

    The items enter sorted by (length, index). With equal_size each run of k consecutive items
    starts one partial solution (one item per bin), else each item does; the two partials of
    widest spread are merged (largest bin with smallest) until one is left."""
    n = len(lengths)
    if k < 1 or n < k:
        raise ValueError(f"{n} sequences cannot fill {k} partitions")
    if equal_size and n % k:
        raise ValueError(f"{n} sequences do not split into {k} partitions of equal size")
    ordered = sorted((int(length), i) for i, length in enumerate(lengths))
    items = [(i, length) for length, i in ordered]
    step = k if equal_size else 1
    heap = [_Partial(items[a:a + step], k) for a in range(0, n, step)]
    heapq.heapify(heap)  # the order is strict, so the pops do not depend on how the heap was built
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    parts = [sorted(i for i, _ in b.items) for b in heap[0].bins]
    if any(not p for p in parts):
        raise ValueError(f"balancing {n} sequences left a partition of {k} empty")
    return parts


def balance_stats(lengths: Sequence[int], partitions: list[list[int]]) -> dict[str, float]:
    """verl's global_seqlen/* metrics (log_seqlen_unbalance): the min, max and their difference
    of the token sums of the k consecutive equal chunks the ranks would get unbalanced, the
    min and max of the balanced partitions' sums, and the mean sum per partition."""
    k = len(partitions)
    size = len(lengths) // k
    chunks = [sum(lengths[a:a + size]) for a in range(0, len(lengths), size)] if size else [0]
    balanced = [sum(lengths[i] for i in p) for p in partitions]
    return {"min": float(min(chunks)), "max": float(max(chunks)),
            "minmax_diff": float(max(chunks) - min(chunks)),
            "balanced_min": float(min(balanced)), "balanced_max": float(max(balanced)),
            "mean": float(sum(lengths)) / k}


# ---------------------------------------------------------------------------------------------
# verl's micro-batches in a virtual layout
# ---------------------------------------------------------------------------------------------
def micro_count(lengths: Sequence[int], budget: int) -> int:
    """verl's micro-batch count of one rank's mini-batch: min(B, ceil(Σ tokens / budget))."""
    return min(len(lengths), -(-sum(lengths) // budget))


@dataclass(frozen=True)
class VirtualStep:
    """A step's sequences (indices into the step's list) as verl holds them in a layout of
    `groups` data-parallel groups.

    order[g]: group g's sequences in its order; micro[j][g]: the micro-batches of group g's
    mini-batch j, each a list of sequence indices; counts[j]: the micro-batches per group of
    mini-batch j; stats: verl's global_seqlen/* of the balancing (None without it)."""

    order: list[list[int]]
    micro: list[list[list[list[int]]]]
    counts: list[int]
    stats: dict[str, float] | None

    @property
    def groups(self) -> int:
        return len(self.order)


def virtual_step(lengths: Sequence[int], *, world_size: int, sequence_parallel: int,
                 group_batch: int, budget: int, balance: bool = True) -> VirtualStep:
    """verl's micro-batches of a step of sequences with prompt + response `lengths` (unpadded
    tokens, in verl's batch order: the kept groups in stream order, a group's responses together),
    trained on `world_size` ranks in data-parallel groups of `sequence_parallel` ranks.

    group_batch: sequences of one group's mini-batch (ppo_mini_batch_size × n / groups); budget:
    unpadded tokens of one micro-batch (ppo_max_token_len_per_gpu × sequence_parallel); balance:
    trainer.balance_batch (the ranks' chunks are the step's order cut in equal parts otherwise)."""
    n = len(lengths)
    if why := sequence_parallel_misfit(sequence_parallel, world_size, f"{world_size} ranks"):
        raise ValueError(f"sequence parallelism {why}")
    groups = world_size // sequence_parallel
    if n % world_size or (n // groups) % group_batch:
        raise ValueError(f"{n} sequences do not split into {world_size} ranks' equal chunks and "
                         f"mini-batches of {group_batch} per data-parallel group")
    if max(lengths, default=0) > budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget of "
                         f"{budget} tokens (verl asserts max_token_len >= the longest sequence)")
    if balance:
        parts = balanced_partitions(lengths, world_size, equal_size=True)
        ranked = [i for p in parts for i in p]
        stats = balance_stats(lengths, parts)
    else:
        ranked, stats = list(range(n)), None
    per_group = n // groups
    order = [ranked[g * per_group:(g + 1) * per_group] for g in range(groups)]
    micro, counts = [], []
    for a in range(0, per_group, group_batch):
        batches = [o[a:a + group_batch] for o in order]
        count = max(micro_count([lengths[i] for i in b], budget) for b in batches)
        counts.append(count)
        micro.append([[[b[i] for i in p] for p in balanced_partitions([lengths[i] for i in b],
                                                                       count, equal_size=False)]
                      for b in batches])
    return VirtualStep(order, micro, counts, stats)


def group_owner(group: int, groups: int, ranks: int) -> int:
    """The physical data-parallel rank that computes virtual group `group` of `groups`: ranks hold
    consecutive blocks of groups/ranks groups each (ranks must divide groups)."""
    if groups % ranks:
        raise ValueError(f"{groups} virtual data-parallel groups do not split over {ranks} ranks")
    return group // (groups // ranks)


@dataclass(frozen=True)
class MicroScope:
    """One rank's part of a mini-batch in verl's layout: its virtual micro-batches (each a list of
    indices into the rank's sequences of the mini-batch), the sequences of one data-parallel
    group's mini-batch, and the number of groups (the loss is their mean)."""

    micro: list[list[int]]
    group_batch: int
    groups: int
