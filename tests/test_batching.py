"""verl's balancing and micro-batches (stages.core.statistics.batching): the partitions of the study's fork,
ties included, a hand-worked case, and the layout's invariants for any lengths.

fixtures/seqlen_balancing.json: 60 cases of get_seqlen_balanced_partitions computed by the 80/20
study's released fork (Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR @ 6f5dda6f,
verl/utils/seqlen_balancing.py) on generated lengths, half with distinct lengths and half with
DAPO-like ties at the 20,480-token cap; each holds lengths, k, equal_size, the partitions as the
function returned them (indices sorted within each) and their sorted sums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.statistics.batching import (
    balance_stats,
    balanced_partitions,
    group_owner,
    micro_count,
    virtual_step,
)

CASES = json.loads((Path(__file__).parent / "fixtures" / "seqlen_balancing.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{len(c['lengths'])}-k{c['k']}-{c['equal_size']}")
def test_partitions_are_the_forks_ties_included(case):
    parts = balanced_partitions(case["lengths"], case["k"], case["equal_size"])
    assert parts == case["partitions"]  # the same partitions in the same order
    assert sorted(sum(case["lengths"][i] for i in p) for p in parts) == case["sums"]


def test_the_reference_cases_hold_ties_at_the_cap():
    tied = [c for c in CASES if len(set(c["lengths"])) < len(c["lengths"])]
    assert len(CASES) == 60 and len(tied) >= 10
    assert any(max(c["lengths"]) >= 20480 for c in tied)


def test_partitions_by_hand():
    """[1, 2, 3, 4] into 2 equal halves: the partials {2 | 1} and {4 | 3} (spread 1 each); the one
    with the larger largest bin, {4 | 3}, absorbs the other largest-with-smallest: {4, 1} and
    {3, 2}, both 5, and (5, 2 items) ties break on the items, (3, 4) before (2, 3)."""
    assert balanced_partitions([1, 2, 3, 4], 2, equal_size=True) == [[0, 3], [1, 2]]
    # free sizes: 10 alone against 1 + 2 + 3 + 4
    assert balanced_partitions([1, 2, 3, 4, 10], 2, equal_size=False) == [[0, 1, 2, 3], [4]]
    with pytest.raises(ValueError, match="equal size"):
        balanced_partitions([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_partitions([1], 2, equal_size=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 8), st.booleans())
def test_partitions_cover_every_index_once(lengths, k, equal):
    k = min(k, len(lengths))
    if equal:
        lengths = lengths[: len(lengths) // k * k]
    parts = balanced_partitions(lengths, k, equal)
    assert len(parts) == k and all(parts) and all(p == sorted(p) for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    if equal:
        assert {len(p) for p in parts} == {len(lengths) // k}
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert sums[0] == max(sums)  # the largest first, as verl returns them


def test_balance_stats_are_verls_global_seqlen():
    lengths = [1, 2, 3, 4]
    stats = balance_stats(lengths, [[0, 3], [1, 2]])
    # chunks before balancing: [1, 2] and [3, 4]
    assert stats == {"min": 3.0, "max": 7.0, "minmax_diff": 4.0, "balanced_min": 5.0,
                     "balanced_max": 5.0, "mean": 5.0}


def test_virtual_step_by_hand():
    """8 sequences on 4 ranks in data-parallel groups of 2, group mini-batches of 2, budget 10:
    _balance_batch's 4 pairs, 2 per group; per mini-batch index the count is the larger of the two
    groups' min(2, ceil(Σ / 10))."""
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    step = virtual_step(lengths, world_size=4, sequence_parallel=2, group_batch=2, budget=10)
    pairs = balanced_partitions(lengths, 4, equal_size=True)
    assert step.order == [pairs[0] + pairs[1], pairs[2] + pairs[3]]
    assert all(sum(lengths[i] for i in p) == 10 for p in pairs)  # 9+1, 8+2, 7+3, 6+4
    assert step.counts == [1, 1]  # every mini-batch is one pair of 10 tokens: ceil(10 / 10) = 1
    assert step.micro == [[[pairs[0]], [pairs[2]]], [[pairs[1]], [pairs[3]]]]
    tight = virtual_step(lengths, world_size=4, sequence_parallel=2, group_batch=2, budget=9)
    assert tight.counts == [2, 2] and all(len(m) == 1 for mb in tight.micro for g in mb for m in g)
    assert step.stats["balanced_min"] == step.stats["balanced_max"] == 10.0
    assert virtual_step(lengths, world_size=4, sequence_parallel=2, group_batch=2, budget=10,
                        balance=False).order == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        virtual_step(lengths, world_size=4, sequence_parallel=2, group_batch=2, budget=8)
    with pytest.raises(ValueError, match="equal chunks"):
        virtual_step(lengths, world_size=3, sequence_parallel=1, group_batch=1, budget=10)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 3),
       st.integers(20, 80), st.randoms(use_true_random=False))
def test_virtual_step_is_verls_rule_for_any_lengths(groups, sp, batches, group_batch, budget, rnd):
    world = groups * sp
    per_group = batches * group_batch
    n = groups * per_group
    if n % world:
        return
    lengths = [rnd.randint(1, 20) for _ in range(n)]
    step = virtual_step(lengths, world_size=world, sequence_parallel=sp, group_batch=group_batch,
                        budget=budget)
    assert sorted(i for o in step.order for i in o) == list(range(n))
    assert len(step.micro) == batches == len(step.counts)
    for j, per_g in enumerate(step.micro):
        expect = max(micro_count([lengths[i] for i in o[j * group_batch:(j + 1) * group_batch]], budget)
                     for o in step.order)
        assert step.counts[j] == expect
        for g, parts in enumerate(per_g):
            batch = step.order[g][j * group_batch:(j + 1) * group_batch]
            assert len(parts) == expect and all(parts)
            assert sorted(i for p in parts for i in p) == sorted(batch)
    assert step.stats["mean"] == pytest.approx(sum(lengths) / world)


def test_micro_count_and_group_owner():
    assert micro_count([5, 5, 5], 4) == 3 == micro_count([5, 5, 5], 1)  # at most one per sequence
    assert micro_count([5, 5, 5], 15) == 1 and micro_count([5, 5, 6], 15) == 2
    assert [group_owner(g, 16, 4) for g in range(16)] == [g // 4 for g in range(16)]
    with pytest.raises(ValueError, match="do not split"):
        group_owner(0, 16, 3)
