"""Seeds in the tables: the spread of our numbers over training seeds, and a 95% interval that
resamples seeds and problems together (a two-level bootstrap).

With one seed nothing here changes a table: a cell is that seed's number and its interval the
evaluation's own bootstrap over problems. With several, a cell is the mean over seeds, printed
with the sample standard deviation over seeds (`62.8 ±1.1`), and its interval resamples the seeds
with replacement, then the problems with replacement, from the per-problem numbers of each seed's
samples (the problems are the same for every seed, so a problem drawn counts for every seed drawn).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from ..core.common.metrics import DEFAULT_LEVEL, pass_at_k
from ..core.report.render import MISSING, pct

_CHUNK = 1024  # resamples drawn at once, as stages.core.common.metrics.bootstrap_ci draws them


def seed_sd(per_seed: tuple[float, ...]) -> float | None:
    """The sample standard deviation (ddof 1) over seeds; None with fewer than two."""
    if len(per_seed) < 2:
        return None
    return float(np.std(np.asarray(per_seed, dtype=np.float64), ddof=1))


def spread_text(value: float | None, per_seed: tuple[float, ...], signed: bool = False) -> str:
    """`62.8 ±1.1` (percent; ± the sd over seeds) with two or more seeds, else as pct prints it."""
    sd = seed_sd(per_seed)
    if value is None or sd is None:
        return pct(value, signed=signed)
    return f"{pct(value, signed=signed)} ±{100 * sd:.1f}"


def seed_columns(prefix: str, per_seed: tuple[float, ...] | None, seeds: int) -> dict:
    """{prefix_seed_sd, prefix_seed_min, prefix_seed_max} in points, for a run of `seeds` seeds
    (no columns with one seed, so that one-seed CSVs keep their columns)."""
    if seeds < 2:
        return {}
    have = bool(per_seed) and len(per_seed) >= 2
    sd = seed_sd(per_seed) if have else None
    return {f"{prefix}_seed_sd": None if sd is None else 100 * sd,
            f"{prefix}_seed_min": 100 * min(per_seed) if have else None,
            f"{prefix}_seed_max": 100 * max(per_seed) if have else None}


def mean_per_seed(parts: list[tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """Per seed, the mean over `parts` (each one number per seed, in the same seed order); None
    when a part is missing (an average over part of the benchmarks misleads)."""
    if not parts or any(not p for p in parts) or len({len(p) for p in parts}) != 1:
        return None
    return tuple(float(np.mean(column)) for column in zip(*parts, strict=True))


def spread_note(seeds: list[int]) -> str:
    """The notes' sentence on ± and the pooled interval (empty with one seed)."""
    if len(set(seeds)) < 2:
        return ""
    return (f" ±: the sample standard deviation over the {len(set(seeds))} seeds' values (CSV: "
            "_seed_sd, _seed_min, _seed_max).")


# ---------------------------------------------------------------------------------------------
# The two-level bootstrap
# ---------------------------------------------------------------------------------------------
def problem_values(metric: str, n: list[int], c: list[int]) -> np.ndarray | None:
    """The per-problem number behind a benchmark's `metric` (pass@k: unbiased pass@k; avg@n: c/n)
    from each problem's samples n and correct c; None for other metrics."""
    kind, _, number = metric.partition("@")
    if kind == "pass":
        return np.array([pass_at_k(a, b, int(number)) for a, b in zip(n, c, strict=True)],
                        dtype=np.float64)
    if kind == "avg":
        return np.asarray(c, dtype=np.float64) / np.asarray(n, dtype=np.float64)
    return None


def pooled_bootstrap_ci(blocks: list[np.ndarray], resamples: int, seed: int,
                        level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """Percentile interval of the mean over `blocks` of each block's mean over seeds and problems.

    blocks: one (S, P_b) float64 array per benchmark, the same S seeds (rows, in the same order)
    in each. Per resample: for each block, P_b problems drawn with replacement; then, with S > 1,
    S seeds drawn with replacement, shared by the blocks (a seed is one trained model); the
    statistic is the mean over blocks of the mean over the drawn seeds and problems. With one
    seed and one block the draws and the arithmetic are those of core.metrics.bootstrap_ci, so
    the interval is the same number.
    """
    if not blocks or any(b.ndim != 2 or b.size == 0 for b in blocks):
        raise ValueError("need one or more non-empty (seeds, problems) arrays")
    seeds = {b.shape[0] for b in blocks}
    if len(seeds) != 1:
        raise ValueError(f"the blocks have different numbers of seeds: {sorted(seeds)}")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need resamples ≥ 1 and a level in (0, 1), got {resamples}, {level}")
    s = seeds.pop()
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, _CHUNK):
        size = min(_CHUNK, resamples - start)
        problems = [rng.integers(0, b.shape[1], size=(size, b.shape[1])) for b in blocks]  # (size, P_b)
        total = np.zeros(size, dtype=np.float64)
        if s == 1:
            for b, idx in zip(blocks, problems, strict=True):
                total += b[0][idx].mean(axis=1)
        else:
            drawn = rng.integers(0, s, size=(size, s))  # (size, S)
            weights = np.stack([np.bincount(row, minlength=s) for row in drawn]) / s  # (size, S)
            for b, idx in zip(blocks, problems, strict=True):
                per_problem = weights @ b  # (size, P_b): the drawn seeds' mean, per problem
                total += np.take_along_axis(per_problem, idx, axis=1).mean(axis=1)
        stats[start:start + size] = total / len(blocks)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(low), float(high)


class Problems:
    """Each evaluation's per-problem counts (Loaded.counts), for intervals over seeds and problems."""

    def __init__(self, counts: pl.DataFrame, resamples: int, seed: int):
        self.resamples, self.seed = resamples, seed
        self._parts = {} if counts.is_empty() else counts.partition_by(
            "size", "method", "bench", as_dict=True, maintain_order=True)

    def matrix(self, size: str, method: str, bench: str, metrics: list[str],
               seeds: list[int]) -> np.ndarray | None:
        """(S, P) per-problem values, the mean over `metrics` (ICT's Total: pass@1 and pass@4),
        one row per seed of `seeds` (sorted) and one column per problem id (sorted); None when a
        seed is missing, a metric has no per-problem value, or the seeds' problems differ."""
        part = self._parts.get((size, method, bench))
        if part is None:
            return None
        rows = []
        ids = None
        for k in sorted(set(seeds)):
            one = part.filter(pl.col("seed") == k).sort("problem_id")
            if one.is_empty() or (ids is not None and one["problem_id"].to_list() != ids):
                return None
            ids = one["problem_id"].to_list()
            values = [problem_values(m, one["n"].to_list(), one["c"].to_list()) for m in metrics]
            if any(v is None for v in values):
                return None
            rows.append(np.mean(values, axis=0))
        return np.stack(rows)

    def interval(self, size: str, method: str, benches: list[str], metrics: list[str],
                 seeds: list[int]) -> tuple[float, float] | None:
        """The pooled 95% interval of the mean over `benches` of `metrics` (None: a matrix is missing)."""
        blocks = [self.matrix(size, method, b, metrics, seeds) for b in benches]
        if not blocks or any(b is None for b in blocks):
            return None
        return pooled_bootstrap_ci(blocks, self.resamples, self.seed)


def interval_columns(prefix: str, ci: tuple[float, float] | None) -> dict:
    """{prefix_ci_low, prefix_ci_high} in points."""
    return {f"{prefix}_ci_low": None if ci is None else 100 * ci[0],
            f"{prefix}_ci_high": None if ci is None else 100 * ci[1]}


def interval_text(ci: tuple[float, float] | None, signed: bool = False) -> str:
    """`[+1.0, +3.0]` in points."""
    if ci is None or any(math.isnan(v) for v in ci):
        return MISSING
    return f"[{pct(ci[0], signed=signed)}, {pct(ci[1], signed=signed)}]"
