"""Loading: each input folder's hive keys (size=, method=, seed=, bench=) become columns; cells
average them over seeds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from .. import cli
from ..config import Config
from ..core.io import ArtifactError, read_parquet
from ..evaluate import METRIC_SCHEMA

EVAL_KEYS = ("size", "method", "seed", "bench")
TRAIN_KEYS = ("size", "method", "seed")
CURVES = [("reward_mean", "reward (mean)", False), ("entropy_mean", "entropy H (nats)", True),
          ("renyi2_mean", "Rényi-2 entropy H₂ (nats)", True),
          ("selected_fraction", "fraction of tokens selected", False),
          ("clip_fraction", "clip fraction", False),
          ("response_length_mean", "response length (tokens)", False)]
"""The training metrics kept and drawn: (column, axis label, log scale)."""


@dataclass
class Loaded:
    metrics: pl.DataFrame  # size, method, seed, bench, metric, k, value, ci_low, ci_high, ..., source
    counts: pl.DataFrame  # size, method, seed, bench, problem_id, n, c, source
    train: pl.DataFrame  # size, method, seed, step, <training metrics>, source
    token_stats: pl.DataFrame  # one row per size: summary.parquet columns + source
    entropy: dict[str, object]  # size -> numpy array of per-token entropies
    sources: list[str]


def hive_keys(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    found = dict(part.split("=", 1) for part in Path(path).parts if "=" in part)
    missing = [k for k in keys if k not in found]
    if missing:
        raise ArtifactError(f"{path}: the path names no {', '.join(k + '=' for k in missing)} "
                            f"(expected .../{'/'.join(k + '=...' for k in keys)})")
    return {k: found[k] for k in keys}


def _with_keys(frame: pl.DataFrame, keys: dict[str, str], source: Path) -> pl.DataFrame:
    cols = {k: pl.lit(int(v) if k == "seed" else v) for k, v in keys.items()}
    return frame.with_columns(**cols, source=pl.lit(str(source)))


def _scan(path: Path, *columns: str) -> pl.LazyFrame:
    if not path.exists():
        raise ArtifactError(f"{path}: file not found")
    return pl.scan_parquet(path).select(*columns)


def load(eval_dirs: list[str], train_dirs: list[str], token_dirs: list[str]) -> Loaded:
    metrics, counts, train, stats, sources = [], [], [], [], []
    entropy = {}
    for d in map(Path, eval_dirs):
        keys = hive_keys(d, EVAL_KEYS)
        m = read_parquet(d / "metrics.parquet", METRIC_SCHEMA).select(METRIC_SCHEMA.names)
        metrics.append(_with_keys(m, keys, d / "metrics.parquet"))
        s = _scan(d / "samples.parquet", "problem_id", "correct")
        per_problem = (s.group_by("problem_id", maintain_order=True)
                       .agg(n=pl.len(), c=pl.col("correct").sum()).collect())
        counts.append(_with_keys(per_problem, keys, d / "samples.parquet"))
        sources += [d / "metrics.parquet", d / "samples.parquet"]
    for d in map(Path, train_dirs):
        keys = hive_keys(d, TRAIN_KEYS)
        t = read_parquet(d / "metrics.parquet")
        if "step" not in t.columns:
            raise ArtifactError(f"{d / 'metrics.parquet'}: no 'step' column")
        keep = ["step", *(c for c, _, _ in CURVES if c in t.columns)]
        train.append(_with_keys(t.select(keep).cast({c: pl.Float64 for c in keep[1:]}),
                                keys, d / "metrics.parquet"))
        sources.append(d / "metrics.parquet")
    for d in map(Path, token_dirs):
        size = hive_keys(d, ("size",))["size"]
        summary = read_parquet(d / "summary.parquet")
        stats.append(summary.with_columns(source=pl.lit(str(d / "summary.parquet"))))
        entropy[size] = _scan(d / "tokens.parquet", "entropy").collect()["entropy"].to_numpy()
        sources += [d / "summary.parquet", d / "tokens.parquet"]
    return Loaded(
        metrics=pl.concat(metrics, how="diagonal_relaxed") if metrics else pl.DataFrame(),
        counts=pl.concat(counts) if counts else pl.DataFrame(),
        train=pl.concat(train, how="diagonal_relaxed") if train else pl.DataFrame(),
        token_stats=pl.concat(stats, how="diagonal_relaxed") if stats else pl.DataFrame(),
        entropy=entropy,
        sources=[str(p) for p in sources],
    )


def check_grid(cfg: Config, data: Loaded) -> None:
    """Warn about folders outside the configured grid (they are left out of the tables)."""
    if data.metrics.is_empty():
        cli.log.warning("no evaluations given: every cell of the main table is '—'")
        return
    grid_methods = {"base", *cfg.experiment.methods}
    outside = data.metrics.filter(~pl.col("size").is_in(cfg.experiment.sizes)
                                  | ~pl.col("method").is_in(grid_methods)
                                  | ~pl.col("bench").is_in(cfg.experiment.benchmarks))
    for source in outside["source"].unique().sort().to_list():
        cli.log.warning("%s is outside the configured grid; not in the tables", source)


# ---------------------------------------------------------------------------------------------
# Cells: one number per size x method x benchmark (mean over seeds)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    value: float  # a fraction in [0, 1]
    ci_low: float | None  # 95% bootstrap over problems; None when averaged over seeds
    ci_high: float | None
    seeds: int
    sources: tuple[str, ...]


def cells(metrics: pl.DataFrame, metric: str, seeds: list[int]) -> dict[tuple[str, str, str], Cell]:
    """The mean over `seeds` per size x method x benchmark; a cell missing any seed is left out."""
    if metrics.is_empty():
        return {}
    rows = (metrics.filter((pl.col("metric") == metric) & pl.col("seed").is_in(seeds))
            .group_by("size", "method", "bench")
            .agg(value=pl.col("value").mean(), ci_low=pl.col("ci_low").first(),
                 ci_high=pl.col("ci_high").first(), seeds=pl.col("seed").n_unique(),
                 sources=pl.col("source").sort()))
    out = {}
    for r in rows.iter_rows(named=True):
        if r["seeds"] != len(set(seeds)):
            continue
        single = r["seeds"] == 1
        out[r["size"], r["method"], r["bench"]] = Cell(
            r["value"], r["ci_low"] if single else None, r["ci_high"] if single else None,
            r["seeds"], tuple(r["sources"]))
    return out
