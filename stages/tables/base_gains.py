"""Gain over the base model: every trained model's pass@1 minus its base model's, per benchmark,
paired over problems with a bootstrap interval (base_gains .md/.tex/.csv)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from ..config import Config
from ..core.io import ArtifactError
from ..core.metrics import bootstrap_ci
from ..core.render import MISSING, Table, mean_or_none, pct
from .labels import bench_label, method_label, size_label
from .load import Loaded
from .registry import register_table
from .write import sources_note, table_files, write_table


@dataclass(frozen=True)
class Gain:
    delta: float  # mean over problems of (trained accuracy − base accuracy), a fraction
    ci_low: float  # 95% percentile bootstrap over problems of that mean
    ci_high: float
    n_problems: int


def problem_accuracy(counts: pl.DataFrame, seeds: list[int]) -> dict[tuple[str, str, str], dict[str, float]]:
    """size x method x bench -> {problem_id: accuracy c/n, averaged over `seeds`}; an evaluation
    missing any seed is left out."""
    if counts.is_empty():
        return {}
    need = len(set(seeds))
    rows = (counts.filter(pl.col("seed").is_in(seeds))
            .with_columns(acc=pl.col("c") / pl.col("n"))
            .group_by("size", "method", "bench", "problem_id")
            .agg(acc=pl.col("acc").mean(), seeds=pl.col("seed").n_unique()))
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for (size, method, bench), part in rows.group_by("size", "method", "bench"):
        if part["seeds"].min() == need:
            out[size, method, bench] = dict(zip(part["problem_id"].to_list(), part["acc"].to_list(),
                                                strict=True))
    return out


def paired_gain(base: dict[str, float], trained: dict[str, float], resamples: int, seed: int,
                where: str) -> Gain:
    """Mean per-problem difference trained − base and its percentile-bootstrap interval.

    Resampling problems (not the two models separately) keeps each problem's pair together, so
    the interval is that of the difference, much narrower than the two accuracies' intervals."""
    if set(base) != set(trained):
        raise ArtifactError(f"{where}: the trained model and the base model were evaluated on different "
                            f"problems ({len(set(base) ^ set(trained))} problem ids in only one)")
    ids = sorted(base)
    diff = np.array([trained[i] - base[i] for i in ids], dtype=np.float64)  # (problems,)
    low, high = bootstrap_ci(diff, resamples, seed)
    return Gain(float(diff.mean()), low, high, len(ids))


def gain_text(g: Gain | None) -> str:
    if g is None:
        return MISSING
    return f"{pct(g.delta, signed=True)} [{pct(g.ci_low, signed=True)}, {pct(g.ci_high, signed=True)}]"


def base_gain_table(cfg: Config, counts: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    """pass@1 of every trained model minus its base model's, per benchmark, paired over problems."""
    exp, ev = cfg.experiment, cfg.evaluate
    acc = problem_accuracy(counts, exp.seeds)
    sources = {} if counts.is_empty() else {
        key: sorted(part["source"].unique().to_list())
        for key, part in counts.filter(pl.col("seed").is_in(exp.seeds)).group_by("size", "method", "bench")}
    benches = list(exp.benchmarks)
    columns = ["Size", "Method", *(bench_label(cfg, b) for b in benches), "Avg. Δ"]
    rows, bold, starts, records, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        for i, method in enumerate(exp.methods):
            gains = []
            for b in benches:
                base, trained = acc.get((size, "base", b)), acc.get((size, method, b))
                g = None
                if base is not None and trained is not None:
                    files = sources[size, "base", b] + sources[size, method, b]
                    g = paired_gain(base, trained, ev.bootstrap, cfg.seed, " and ".join(files))
                    used += files
                    records.append({"size": size, "method": method, "label": method_label(cfg, method),
                                    "bench": b, "metric": "pass@1", "delta": 100 * g.delta,
                                    "ci_low": 100 * g.ci_low, "ci_high": 100 * g.ci_high,
                                    "n_problems": g.n_problems, "sources": ";".join(files)})
                gains.append(g)
            avg = mean_or_none([g.delta if g else None for g in gains])
            rows.append([size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                         *(gain_text(g) for g in gains), pct(avg, signed=True)])
            # bold: the interval excludes zero (a gain or a loss the evaluation can tell apart)
            bold.append([False, False, *(g is not None and (g.ci_low > 0 or g.ci_high < 0) for g in gains),
                         False])
    seeds = sorted(set(exp.seeds))
    notes = [
        f"Trained model's pass@1 minus its base model's, in points, on the same problems (n = {ev.n} "
        f"samples each, T = {ev.temperature:g})"
        + (f", accuracies averaged over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else "")
        + f"; [95% percentile bootstrap over problems of the paired difference, {ev.bootstrap} resamples]. "
        "Bold: the interval excludes 0. Avg. Δ: unweighted mean over the benchmarks (— if one is missing). "
        "Seed-to-seed variation of training is not in the interval.",
        sources_note(used, "base_gains.csv"),
    ]
    t = Table("Gain over the base model: pass@1, paired over problems", columns, rows, bold, starts, notes,
              left_columns=2)
    frame = pl.DataFrame(records, schema={
        "size": pl.String, "method": pl.String, "label": pl.String, "bench": pl.String,
        "metric": pl.String, "delta": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
        "n_problems": pl.Int64, "sources": pl.String})
    return t, frame


@register_table("base_gains", order=30, files=lambda cfg: table_files("base_gains"))
def write_base_gains(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = base_gain_table(cfg, data.counts)
    write_table([(table, "tab:base-gains")], frame, folder / "base_gains")
    return [table]
