"""Loading: each input folder's hive keys (size=, method=, seed=, bench=, step=) become columns;
cells average them over seeds.

An evaluation's metrics.parquet holds one set of rows per grader (the `grader` column: the
benchmark's own, then each of evaluate.graders; a file without the column, or a null, is the
benchmark's own). Every table but the graders' reads the benchmark's own grader's rows only
(Loaded.metrics, with the columns of old files); Loaded.graded keeps every grader's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from .. import cli
from ..config import Config
from ..core.common.io import ArtifactError, read_parquet
from ..core.report.render import mean_or_none
from .seeds import Problems, mean_per_seed

EVAL_KEYS = ("size", "method", "seed", "bench")
STEP_KEYS = ("size", "method", "seed", "step", "bench")
TRAIN_KEYS = ("size", "method", "seed")
METRIC_COLUMNS = ("metric", "k", "value", "ci_low", "ci_high", "n_problems", "n_samples")
"""The columns of every metrics.parquet, old or new (the stage's METRIC_SCHEMA may add more)."""
CURVES = [("reward_mean", "reward (mean)", False), ("entropy_mean", "entropy H (nats)", True),
          ("renyi2_mean", "Rényi-2 entropy H₂ (nats)", True),
          ("selected_fraction", "fraction of tokens selected", False),
          ("clip_fraction", "clip fraction", False),
          ("response_length_mean", "response length (tokens)", False),
          ("rollout_logprob_diff_max", "sampler vs trainer: max |Δ log p| (nats)", True),
          ("rollout_kl", "sampler vs trainer: KL (k3, nats)", True)]
"""The training metrics kept and drawn: (column, axis label, log scale)."""


@dataclass
class Loaded:
    metrics: pl.DataFrame  # size, method, seed, bench, metric, k, value, ci_low, ci_high, ..., source
    counts: pl.DataFrame  # size, method, seed, bench, problem_id, n, c, source
    train: pl.DataFrame  # size, method, seed, step, <training metrics>, source
    token_stats: pl.DataFrame  # one row per size: summary.parquet columns + source
    entropy: dict[str, object]  # size -> numpy array of per-token entropies
    sources: list[str]
    graded: pl.DataFrame = field(default_factory=pl.DataFrame)  # metrics of every grader + grader
    grades: pl.DataFrame = field(default_factory=pl.DataFrame)  # per problem and extra grader:
    # size, method, seed, bench, grader, problem_id, n, c (correct by it), disagree, source
    steps: pl.DataFrame = field(default_factory=pl.DataFrame)  # metrics of checkpoints + step
    overlap: pl.DataFrame = field(default_factory=pl.DataFrame)  # size, method, seed, overlap.parquet
    readings: pl.DataFrame = field(default_factory=pl.DataFrame)  # size, readings.parquet, source


def hive_keys(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    found = dict(part.split("=", 1) for part in Path(path).parts if "=" in part)
    missing = [k for k in keys if k not in found]
    if missing:
        raise ArtifactError(f"{path}: the path names no {', '.join(k + '=' for k in missing)} "
                            f"(expected .../{'/'.join(k + '=...' for k in keys)})")
    return {k: found[k] for k in keys}


def _with_keys(frame: pl.DataFrame, keys: dict[str, str], source: Path) -> pl.DataFrame:
    cols = {k: pl.lit(int(v) if k in ("seed", "step") else v) for k, v in keys.items()}
    return frame.with_columns(**cols, source=pl.lit(str(source)))


def _scan(path: Path, *columns: str) -> pl.LazyFrame:
    if not path.exists():
        raise ArtifactError(f"{path}: file not found")
    return pl.scan_parquet(path).select(*columns)


def _concat(frames: list[pl.DataFrame], how: str = "diagonal_relaxed") -> pl.DataFrame:
    return pl.concat(frames, how=how) if frames else pl.DataFrame()


def read_metrics(path: Path, own: str | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the benchmark's own grader's rows with METRIC_COLUMNS, every row with `grader` filled).

    own: the benchmark's grader (datasets.<b>.grader); a null grader is the own one. Without
    `own`, the own rows are the null ones or, in a file where every row names one, the first's.
    The metric avg@n of older files is named avg@<n> by its samples per problem."""
    frame = read_parquet(path)
    missing = [c for c in METRIC_COLUMNS if c not in frame.columns]
    if missing:
        raise ArtifactError(f"{path}: missing columns {missing}")
    if "grader" not in frame.columns:
        frame = frame.with_columns(grader=pl.lit(None, pl.String))
    if own is None and frame["grader"].null_count() == 0 and frame.height:
        own = frame["grader"][0]
    frame = frame.with_columns(
        grader=pl.col("grader").fill_null(pl.lit(own, pl.String)),
        metric=pl.when(pl.col("metric") == "avg@n")
        .then(pl.concat_str(pl.lit("avg@"), pl.col("n_samples").cast(pl.String)))
        .otherwise(pl.col("metric")))
    mine = frame.filter(pl.col("grader").eq_missing(pl.lit(own, pl.String)))
    return mine.select(METRIC_COLUMNS), frame.select(*METRIC_COLUMNS, "grader")


def read_grades(path: Path) -> pl.DataFrame | None:
    """Per problem and extra grader of samples.parquet's `other_grades`: n, c (correct by that
    grader) and disagree (samples where it and the own grader differ); None without extras."""
    names = pl.scan_parquet(path).collect_schema().names()
    if "other_grades" not in names:
        return None
    other = (pl.scan_parquet(path).select("problem_id", "correct", "other_grades")
             .explode("other_grades").drop_nulls("other_grades")
             .select("problem_id", "correct", grader=pl.col("other_grades").struct.field("grader"),
                     other=pl.col("other_grades").struct.field("correct").fill_null(False))
             .group_by("grader", "problem_id", maintain_order=True)
             .agg(n=pl.len(), c=pl.col("other").sum(),
                  disagree=(pl.col("other") != pl.col("correct")).sum())
             .collect())
    return other if other.height else None


def load(eval_dirs: list[str], train_dirs: list[str], token_dirs: list[str],
         step_dirs: list[str] = (), overlap_dirs: list[str] = (),
         own_graders: dict[str, str] | None = None) -> Loaded:
    """Every input folder, read. own_graders: benchmark -> its own grader (datasets.<b>.grader)."""
    own_graders = own_graders or {}
    metrics, graded, grades, counts, train, stats, sources = [], [], [], [], [], [], []
    steps, overlap, readings = [], [], []
    entropy = {}
    for d in map(Path, eval_dirs):
        keys = hive_keys(d, EVAL_KEYS)
        mine, every = read_metrics(d / "metrics.parquet", own_graders.get(keys["bench"]))
        metrics.append(_with_keys(mine, keys, d / "metrics.parquet"))
        graded.append(_with_keys(every, keys, d / "metrics.parquet"))
        s = _scan(d / "samples.parquet", "problem_id", "correct")
        per_problem = (s.group_by("problem_id", maintain_order=True)
                       .agg(n=pl.len(), c=pl.col("correct").sum()).collect())
        counts.append(_with_keys(per_problem, keys, d / "samples.parquet"))
        other = read_grades(d / "samples.parquet")
        if other is not None:
            grades.append(_with_keys(other, keys, d / "samples.parquet"))
        sources += [d / "metrics.parquet", d / "samples.parquet"]
    for d in map(Path, step_dirs):
        keys = hive_keys(d, STEP_KEYS)
        mine, _ = read_metrics(d / "metrics.parquet", own_graders.get(keys["bench"]))
        steps.append(_with_keys(mine, keys, d / "metrics.parquet"))
        sources.append(d / "metrics.parquet")
    for d in map(Path, train_dirs):
        keys = hive_keys(d, TRAIN_KEYS)
        t = read_parquet(d / "metrics.parquet")
        if "step" not in t.columns:
            raise ArtifactError(f"{d / 'metrics.parquet'}: no 'step' column")
        keep = ["step", *(c for c, _, _ in CURVES if c in t.columns)]
        train.append(_with_keys(t.select(keep).cast({c: pl.Float64 for c in keep[1:]}),
                                keys, d / "metrics.parquet"))
        sources.append(d / "metrics.parquet")
    for d in map(Path, overlap_dirs):
        keys = hive_keys(d, TRAIN_KEYS)
        overlap.append(_with_keys(read_parquet(d / "overlap.parquet"), keys, d / "overlap.parquet"))
        sources.append(d / "overlap.parquet")
    for d in map(Path, token_dirs):
        size = hive_keys(d, ("size",))["size"]
        summary = read_parquet(d / "summary.parquet")
        stats.append(summary.with_columns(source=pl.lit(str(d / "summary.parquet"))))
        entropy[size] = _scan(d / "tokens.parquet", "entropy").collect()["entropy"].to_numpy()
        sources += [d / "summary.parquet", d / "tokens.parquet"]
        if (d / "readings.parquet").exists():  # written with token_stats.ict_readings
            readings.append(_with_keys(read_parquet(d / "readings.parquet"), {"size": size},
                                       d / "readings.parquet"))
            sources.append(d / "readings.parquet")
    return Loaded(
        metrics=_concat(metrics), counts=_concat(counts, "vertical"), train=_concat(train),
        token_stats=_concat(stats), entropy=entropy, sources=[str(p) for p in sources],
        graded=_concat(graded), grades=_concat(grades), steps=_concat(steps),
        overlap=_concat(overlap), readings=_concat(readings),
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
    value: float  # a fraction in [0, 1]: the mean over seeds
    ci_low: float | None  # 95%: the evaluation's bootstrap over problems with one seed; with
    ci_high: float | None  # several, seeds and problems resampled together (None: no counts)
    seeds: int
    sources: tuple[str, ...]
    per_seed: tuple[float, ...] = ()  # each seed's value, in seed order


def cells(metrics: pl.DataFrame, metric: str, seeds: list[int],
          problems: Problems | None = None) -> dict[tuple[str, str, str], Cell]:
    """The mean over `seeds` per size x method x benchmark; a cell missing any seed is left out.
    With several seeds and `problems`, the interval pools seeds and problems (seeds.py)."""
    if metrics.is_empty():
        return {}
    rows = (metrics.filter((pl.col("metric") == metric) & pl.col("seed").is_in(seeds))
            .sort("seed")
            .group_by("size", "method", "bench")
            .agg(value=pl.col("value").mean(), ci_low=pl.col("ci_low").first(),
                 ci_high=pl.col("ci_high").first(), seeds=pl.col("seed").n_unique(),
                 sources=pl.col("source").sort(), per_seed=pl.col("value")))
    out = {}
    for r in rows.iter_rows(named=True):
        if r["seeds"] != len(set(seeds)):
            continue
        single = r["seeds"] == 1
        ci = None
        if not single and problems is not None:
            ci = problems.interval(r["size"], r["method"], [r["bench"]], [metric], seeds)
        out[r["size"], r["method"], r["bench"]] = Cell(
            r["value"], r["ci_low"] if single else (ci[0] if ci else None),
            r["ci_high"] if single else (ci[1] if ci else None),
            r["seeds"], tuple(r["sources"]), tuple(r["per_seed"]))
    return out


def problems_of(cfg: Config, data: Loaded) -> Problems:
    """The per-problem counts of `data`, with the config's bootstrap settings."""
    return Problems(data.counts, cfg.evaluate.bootstrap, cfg.seed)


def avg_cell(table: dict[tuple[str, str, str], Cell], size: str, method: str,
             benches: list[str]) -> tuple[float | None, tuple[float, ...] | None]:
    """(mean over `benches`, its value per seed); None where a benchmark is missing."""
    got = [table.get((size, method, b)) for b in benches]
    return (mean_or_none([c.value if c else None for c in got]),
            mean_per_seed([c.per_seed if c else None for c in got]))


def cell_sources(table: dict[tuple[str, str, str], Cell], size: str, method: str,
                 benches: list[str]) -> list[str]:
    """The files behind a row's cells, benchmark by benchmark."""
    return [s for b in benches if (size, method, b) in table for s in table[size, method, b].sources]
