"""Gain over the base model: every trained model's pass@1 minus its base model's, per benchmark,
paired over problems with a bootstrap interval (base_gains .md/.tex/.csv). With several seeds the
gain is the mean over seeds (± their sd), paired per seed and problem, and its interval resamples
seeds and problems together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from ..config import Config
from ..core.common.io import ArtifactError
from ..core.common.metrics import bootstrap_ci
from ..core.report.render import MISSING, Table, mean_or_none
from .labels import bench_label, method_label, size_label
from .load import Loaded
from .registry import register_table
from .seeds import (
    interval_text,
    mean_per_seed,
    pooled_bootstrap_ci,
    seed_columns,
    spread_note,
    spread_text,
)
from .write import sources_note, table_files, write_table


@dataclass(frozen=True)
class Gain:
    delta: float  # mean over problems (and seeds) of (trained accuracy − base accuracy), a fraction
    ci_low: float  # 95% percentile bootstrap over problems (and seeds) of that mean
    ci_high: float
    n_problems: int
    per_seed: tuple[float, ...] = ()  # the gain of each seed, with several


def problem_accuracy(counts: pl.DataFrame, seeds: list[int]) -> dict[tuple[str, str, str], dict[int, dict[str, float]]]:
    """size x method x bench -> {seed: {problem_id: accuracy c/n}} for each of `seeds`; an
    evaluation missing any seed is left out."""
    if counts.is_empty():
        return {}
    need = set(seeds)
    rows = counts.filter(pl.col("seed").is_in(seeds)).with_columns(acc=pl.col("c") / pl.col("n"))
    out: dict[tuple[str, str, str], dict[int, dict[str, float]]] = {}
    for (size, method, bench), part in rows.group_by("size", "method", "bench"):
        by_seed = {seed: dict(zip(one["problem_id"].to_list(), one["acc"].to_list(), strict=True))
                   for (seed,), one in part.group_by("seed")}
        if set(by_seed) == need:
            out[size, method, bench] = by_seed
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


def pooled_gain(base: dict[int, dict[str, float]], trained: dict[int, dict[str, float]],
                resamples: int, seed: int, where: str) -> Gain:
    """The mean over seeds and problems of trained − base, paired per seed and problem (the base
    model's evaluation of seed K beside the model trained with seed K), with the interval that
    resamples seeds and problems together (seeds.pooled_bootstrap_ci); one seed: paired_gain."""
    if len(base) == 1:
        (k,) = base
        return paired_gain(base[k], trained[k], resamples, seed, where)
    ids = sorted(next(iter(base.values())))
    for k in sorted(base):
        if set(base[k]) != set(ids) or set(trained[k]) != set(ids):
            raise ArtifactError(f"{where}: the seeds' evaluations are not on the same problems")
    diff = np.array([[trained[k][i] - base[k][i] for i in ids] for k in sorted(base)],
                    dtype=np.float64)  # (seeds, problems)
    low, high = pooled_bootstrap_ci([diff], resamples, seed)
    return Gain(float(diff.mean()), low, high, len(ids), tuple(diff.mean(axis=1).tolist()))


def gain_text(g: Gain | None) -> str:
    if g is None:
        return MISSING
    return f"{spread_text(g.delta, g.per_seed, signed=True)} {interval_text((g.ci_low, g.ci_high), signed=True)}"


def base_gain_table(cfg: Config, counts: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    """pass@1 of every trained model minus its base model's, per benchmark, paired over problems."""
    exp, ev = cfg.experiment, cfg.evaluate
    acc = problem_accuracy(counts, exp.seeds)
    seeds = sorted(set(exp.seeds))
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
                    g = pooled_gain(base, trained, ev.bootstrap, cfg.seed, " and ".join(files))
                    used += files
                    records.append({"size": size, "method": method, "label": method_label(cfg, method),
                                    "bench": b, "metric": "pass@1", "delta": 100 * g.delta,
                                    "ci_low": 100 * g.ci_low, "ci_high": 100 * g.ci_high,
                                    **seed_columns("delta", g.per_seed, len(seeds)),
                                    "n_problems": g.n_problems, "sources": ";".join(files)})
                gains.append(g)
            avg = mean_or_none([g.delta if g else None for g in gains])
            avg_seeds = mean_per_seed([g.per_seed if g else None for g in gains]) or ()
            rows.append([size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                         *(gain_text(g) for g in gains), spread_text(avg, avg_seeds, signed=True)])
            # bold: the interval excludes zero (a gain or a loss the evaluation can tell apart)
            bold.append([False, False, *(g is not None and (g.ci_low > 0 or g.ci_high < 0) for g in gains),
                         False])
    pooled = len(seeds) > 1
    notes = [
        f"Trained model's pass@1 minus its base model's, in points, on the same problems (n = {ev.n} "
        f"samples each, T = {ev.temperature:g})"
        + (f", paired per seed (the base model's evaluation with seed K beside the model trained "
           f"with seed K) and averaged over seeds {', '.join(map(str, seeds))}" if pooled else "")
        + (f"; [95% percentile bootstrap of the paired difference resampling seeds and problems "
           f"together (seeds, then problems, with replacement), {ev.bootstrap} resamples]. "
           if pooled else
           f"; [95% percentile bootstrap over problems of the paired difference, {ev.bootstrap} resamples]. ")
        + "Bold: the interval excludes 0. Avg. Δ: unweighted mean over the benchmarks (— if one is missing). "
        + ("Seed-to-seed variation of training is in the interval." + spread_note(seeds) if pooled
           else "Seed-to-seed variation of training is not in the interval."),
        sources_note(used, "base_gains.csv"),
    ]
    t = Table("Gain over the base model: pass@1, paired over problems", columns, rows, bold, starts, notes,
              left_columns=2)
    frame = pl.DataFrame(records, schema={
        "size": pl.String, "method": pl.String, "label": pl.String, "bench": pl.String,
        "metric": pl.String, "delta": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
        **{c: pl.Float64 for c in seed_columns("delta", (), len(seeds))},
        "n_problems": pl.Int64, "sources": pl.String})
    return t, frame


@register_table("base_gains", order=30, files=lambda cfg: table_files("base_gains"))
def write_base_gains(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = base_gain_table(cfg, data.counts)
    write_table([(table, "tab:base-gains")], frame, folder / "base_gains")
    return [table]
