"""pass@k against k = 1..n per size, one panel per benchmark and their average
(pass_at_k_<size>.png)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from .labels import bench_label, line_styles, method_label, size_label
from .load import Loaded
from .registry import register_figure


def pass_at_k_curves(counts: pl.DataFrame) -> pl.DataFrame:
    """Mean pass@k over problems for k = 1..n, per size x method x seed x bench."""
    from ..core.report import figures
    keys = ["size", "method", "seed", "bench"]
    if counts.is_empty():
        return pl.DataFrame(schema={"size": pl.String, "method": pl.String, "seed": pl.Int64,
                                    "bench": pl.String, "k": pl.Int64, "value": pl.Float64})
    return figures.pass_at_k_table(counts, keys)


def pass_at_k_figure(cfg: Config, size: str, curves: pl.DataFrame, path: Path) -> None:
    from ..core.report import figures
    methods = ["base", *cfg.experiment.methods]
    benches = list(cfg.experiment.benchmarks)
    panels = [(b, bench_label(cfg, b)) for b in benches]
    if len(benches) > 1:
        panels.append((None, "average"))
    # mean over the configured seeds; a method missing a seed on a benchmark is not drawn there
    seeds = sorted(set(cfg.experiment.seeds))
    data = (curves.filter((pl.col("size") == size) & pl.col("seed").is_in(seeds))
            .group_by("method", "bench", "k").agg(pl.col("value").mean(), pl.col("seed").n_unique())
            .filter(pl.col("seed") == len(seeds)).drop("seed"))
    figures.pass_at_k_panels(
        data, panels, methods, {m: method_label(cfg, m) for m in methods}, line_styles(cfg, methods),
        cfg.evaluate.n, f"pass@k against k, {size_label(cfg, size)} (unbiased, n = {cfg.evaluate.n})",
        path)


@register_figure("pass_at_k", order=20,
                 files=lambda cfg: [f"pass_at_k_{s}.png" for s in cfg.experiment.sizes])
def write_pass_at_k(cfg: Config, data: Loaded, folder: Path) -> None:
    curves = pass_at_k_curves(data.counts)
    for size in cfg.experiment.sizes:
        pass_at_k_figure(cfg, size, curves, folder / f"pass_at_k_{size}.png")
