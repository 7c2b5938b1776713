"""pass@k against the binomial formula, its bounds and monotonicity, and bootstrap intervals."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.core.common.metrics import Estimate, bootstrap_ci, pass_at_k, summarise


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 − C(n−c, k)/C(n, k) in exact rationals (math.comb is 0 when n − c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------
def test_methods_checks():
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)
    assert pass_at_k(20, 5, 4) == pytest.approx(1 - math.comb(15, 4) / math.comb(20, 4), abs=1e-15)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (8, 0, 1, 0.0),
        (8, 0, 4, 0.0),
        (8, 8, 4, 1.0),
        (8, 5, 4, 1.0),  # n − c = 3 < k: every 4-subset holds a correct sample
        (8, 1, 1, 1 / 8),
        (8, 1, 4, 0.5),  # one correct of 8, draw 4: half the subsets contain it
        (2, 1, 2, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)/C(5,2) = 3/10
    ],
)
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


@given(st.integers(1, 200), st.data())
@settings(max_examples=200, deadline=None)
def test_matches_the_binomial_formula(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12)


def test_large_n_does_not_overflow():
    # C(10000, 5000) overflows float64; the product form stays exact to rounding
    value = pass_at_k(10_000, 37, 64)
    assert value == pytest.approx(float(exact_pass_at_k(10_000, 37, 64)), rel=1e-12)
    assert 0.0 < value < 1.0


@given(st.integers(1, 100), st.data())
@settings(max_examples=200, deadline=None)
def test_bounded_and_monotone(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if c < n:  # one more correct sample never lowers pass@k
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    if k < n:  # drawing more samples never lowers pass@k
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    assert (value == 0.0) == (c == 0)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(3, 1, 4), (0, 0, 1), (4, 5, 1), (4, -1, 1), (-1, 0, 1), (4, 1, 0)]
)
def test_invalid_counts_raise(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_rejects_non_integers():
    with pytest.raises(TypeError):
        pass_at_k(4.0, 1, 1)
    assert pass_at_k(np.int64(10), np.int64(3), np.int64(1)) == pytest.approx(0.3)


# ---------------------------------------------------------------------------------------------
# Bootstrap
# ---------------------------------------------------------------------------------------------
def test_bootstrap_is_deterministic_and_contains_the_mean():
    rng = np.random.default_rng(0)
    values = rng.binomial(8, 0.3, size=200) / 8
    first = bootstrap_ci(values, resamples=2000, seed=7)
    assert first == bootstrap_ci(values, resamples=2000, seed=7)
    assert first != bootstrap_ci(values, resamples=2000, seed=8)
    low, high = first
    assert low < values.mean() < high
    # a 95% interval of a mean of 200 values is about ±1.96·sd/√200 wide
    half_width = 1.96 * values.std() / math.sqrt(values.size)
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.15)


def test_bootstrap_levels_nest():
    values = np.linspace(0, 1, 50)
    narrow = bootstrap_ci(values, 2000, seed=1, level=0.5)
    wide = bootstrap_ci(values, 2000, seed=1, level=0.99)
    assert wide[0] <= narrow[0] <= narrow[1] <= wide[1]


def test_bootstrap_of_constant_values_is_a_point():
    assert bootstrap_ci([0.25] * 30, 500, seed=0) == (0.25, 0.25)
    assert bootstrap_ci([1.0], 10, seed=0) == (1.0, 1.0)


def test_bootstrap_is_the_percentile_of_resampled_means():
    values = np.arange(10, dtype=float)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 10, size=(1024, 10))
    means = np.sort(values[idx].mean(axis=1))
    low, high = bootstrap_ci(values, 1024, seed=3)
    assert low == pytest.approx(np.quantile(means, 0.025))
    assert high == pytest.approx(np.quantile(means, 0.975))


@pytest.mark.parametrize(
    ("values", "resamples", "level"), [([], 10, 0.95), ([1.0], 0, 0.95), ([1.0], 10, 1.0)]
)
def test_bootstrap_rejects_bad_arguments(values, resamples, level):
    with pytest.raises(ValueError):
        bootstrap_ci(values, resamples, seed=0, level=level)


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def test_summarise_hand_computed():
    counts = [(8, 3), (8, 0), (8, 8), (8, 1)]
    summary = summarise(counts, k_list=[1, 4], resamples=500, seed=0)
    assert set(summary) == {"pass@1", "pass@4", "avg@n"}
    assert summary["pass@1"].mean == pytest.approx((3 + 0 + 8 + 1) / 32)
    assert summary["avg@n"].mean == summary["pass@1"].mean
    expected_pass4 = np.mean([float(exact_pass_at_k(8, c, 4)) for _, c in counts])
    assert summary["pass@4"].mean == pytest.approx(expected_pass4)
    for estimate in summary.values():
        assert isinstance(estimate, Estimate)
        assert estimate.n_problems == 4
        assert estimate.low <= estimate.mean <= estimate.high
    assert summary["pass@4"].mean >= summary["pass@1"].mean
    assert summarise(counts, [1, 4], 500, seed=0) == summary


def test_summarise_raises_when_a_problem_has_too_few_samples():
    with pytest.raises(ValueError, match="pass@4"):
        summarise([(8, 1), (3, 1)], k_list=[4], resamples=10, seed=0)
    with pytest.raises(ValueError):
        summarise([], k_list=[1], resamples=10, seed=0)
    with pytest.raises(ValueError):
        summarise([(0, 0)], k_list=[], resamples=10, seed=0)


@given(st.lists(st.tuples(st.integers(4, 16), st.floats(0, 1)), min_size=1, max_size=30))
@settings(max_examples=40, deadline=None)
def test_summary_bounds(rows):
    counts = [(n, round(p * n)) for n, p in rows]
    summary = summarise(counts, [1, 2, 4], resamples=200, seed=0)
    for estimate in summary.values():
        assert 0.0 <= estimate.low <= estimate.high <= 1.0
    assert summary["pass@1"].mean <= summary["pass@2"].mean <= summary["pass@4"].mean + 1e-12
