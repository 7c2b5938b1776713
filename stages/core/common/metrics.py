"""Evaluation metrics (METHODS §6): unbiased pass@k, avg@n and percentile-bootstrap intervals.

pass@k of one problem with n samples of which c are correct is 1 − C(n−c, k)/C(n, k)
(Chen et al. 2021), computed as the product 1 − Π_{i=n−c+1}^{n} (1 − k/i) in float64, which
never forms the huge binomials. A benchmark's pass@k is the mean over its problems, and its
interval is a percentile bootstrap over problems (samples of one problem are not independent
draws of the benchmark, problems are).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_LEVEL = 0.95
_BOOTSTRAP_CHUNK = 1024  # resamples drawn at once: bounds memory at chunk × problems indices


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: n samples, c of them correct, k ≥ 1 drawn.

    >>> round(pass_at_k(10, 3, 1), 12)
    0.3
    """
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if k < 1 or c < 0 or n < 0:
        raise ValueError(f"need k ≥ 1 and n, c ≥ 0, got n={n}, c={c}, k={k}")
    if c > n:
        raise ValueError(f"c={c} correct out of n={n} samples")
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def bootstrap_ci(
    values: Sequence[float], resamples: int, seed: int, level: float = DEFAULT_LEVEL
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of `values` (one value per problem).

    The same (values length, resamples, seed) always draws the same resamples, so intervals of
    several metrics over the same problems are paired.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"need a non-empty 1-D sequence of values, got shape {x.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be ≥ 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, _BOOTSTRAP_CHUNK):
        size = min(_BOOTSTRAP_CHUNK, resamples - start)
        idx = rng.integers(0, x.size, size=(size, x.size))  # (size, problems)
        means[start : start + size] = x[idx].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Estimate:
    """A benchmark-level metric: the mean over problems and its bootstrap interval."""

    mean: float
    low: float
    high: float
    n_problems: int


def summarise(
    per_problem_counts: Iterable[tuple[int, int]],
    k_list: Sequence[int],
    resamples: int,
    seed: int,
    level: float = DEFAULT_LEVEL,
) -> dict[str, Estimate]:
    """pass@k for each k of `k_list`, and avg@n, from (n samples, c correct) per problem.

    Keys are "pass@{k}" and "avg@n". avg@n, the mean accuracy over each problem's samples, is
    the same number as pass@1 (c/n per problem); both are reported, as METHODS asks. Raises if a
    problem has fewer than k samples.
    """
    counts = [(operator.index(n), operator.index(c)) for n, c in per_problem_counts]
    if not counts:
        raise ValueError("no problems to summarise")
    for n, c in counts:
        if n < 1 or not 0 <= c <= n:
            raise ValueError(f"need 0 ≤ c ≤ n and n ≥ 1, got n={n}, c={c}")
    per_metric = {f"pass@{k}": [pass_at_k(n, c, k) for n, c in counts] for k in k_list}
    per_metric["avg@n"] = [c / n for n, c in counts]
    summary = {}
    for name, values in per_metric.items():
        low, high = bootstrap_ci(values, resamples, seed, level)
        summary[name] = Estimate(float(np.mean(values)), low, high, len(values))
    return summary
