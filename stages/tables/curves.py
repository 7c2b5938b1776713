"""Curves over training steps: the headline metric of the checkpoints saved every train.save_every
steps, step 0 being the base model and the last point the final model (curves_<size>.png and the
points in curves.csv; only when some method saves checkpoints)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report.render import Table
from .labels import (
    bench_label,
    curve_benchmarks,
    curve_methods,
    headline,
    line_styles,
    method_label,
    size_label,
)
from .load import Loaded
from .registry import register_figure, register_table
from .write import write_csv

POINT_SCHEMA = {"size": pl.String, "method": pl.String, "seed": pl.Int64, "step": pl.Int64,
                "bench": pl.String, "metric": pl.String, "value": pl.Float64, "source": pl.String}


def applies(cfg: Config) -> bool:
    return bool(curve_methods(cfg))


def curve_points(cfg: Config, data: Loaded) -> pl.DataFrame:
    """One row per size x method x seed x step x curve benchmark: the headline metric (a fraction,
    as in metrics.parquet)
    and the file it came from. Step 0 is the base model's evaluation (the same for every method),
    the steps between are the checkpoints' (eval_steps), and the last is the final model's, at
    step train_for(method, size).steps."""
    hl, benches, seeds = headline(cfg), curve_benchmarks(cfg), cfg.experiment.seeds

    def pick(frame: pl.DataFrame) -> pl.DataFrame:
        if frame.is_empty():
            return pl.DataFrame(schema={k: v for k, v in POINT_SCHEMA.items() if k != "step"})
        return frame.filter((pl.col("metric") == hl) & pl.col("bench").is_in(benches)
                            & pl.col("seed").is_in(seeds))

    final, steps = pick(data.metrics), pick(data.steps)
    parts = []
    for size in cfg.experiment.sizes:
        here = pl.col("size") == size
        for method in curve_methods(cfg):
            last = cfg.train_for(method, size).steps
            parts.append(final.filter(here & (pl.col("method") == "base")).with_columns(
                method=pl.lit(method), step=pl.lit(0, pl.Int64)))
            if "step" in steps.columns:
                parts.append(steps.filter(here & (pl.col("method") == method) & (pl.col("step") > 0)
                                          & (pl.col("step") < last)))
            parts.append(final.filter(here & (pl.col("method") == method)).with_columns(
                step=pl.lit(last, pl.Int64)))
    parts = [p.select(list(POINT_SCHEMA)).cast(POINT_SCHEMA) for p in parts if not p.is_empty()]
    if not parts:
        return pl.DataFrame(schema=POINT_SCHEMA)
    return pl.concat(parts).sort("size", "method", "seed", "step", "bench")


def curves_figure(cfg: Config, size: str, points: pl.DataFrame, path: Path) -> None:
    """Mean over the curve benchmarks (all present), then over seeds (all present), against the
    step; a panel per benchmark beside it when there are several."""
    from ..core.report import figures
    hl, benches = headline(cfg), curve_benchmarks(cfg)
    methods = curve_methods(cfg)
    need = {m: len(set(cfg.experiment.seeds)) for m in methods}
    mine = points.filter(pl.col("size") == size).with_columns(pl.col("value") * 100)
    mean = (mine.group_by("method", "seed", "step")
            .agg(pl.col("value").mean(), n=pl.col("bench").n_unique())
            .filter(pl.col("n") == len(benches)))
    panels = [figures.BandPanel(
        f"mean over {', '.join(bench_label(cfg, b) for b in benches)}" if len(benches) > 1
        else bench_label(cfg, benches[0]),
        figures.seed_bands(mean, "value", need=need), ylabel=f"{hl} (%)", empty="no evaluations")]
    if len(benches) > 1:
        panels += [figures.BandPanel(bench_label(cfg, b),
                                     figures.seed_bands(mine.filter(pl.col("bench") == b), "value", need=need),
                                     ylabel=f"{hl} (%)", empty="no evaluations") for b in benches]
    seeds = len(set(cfg.experiment.seeds))
    figures.band_panels(
        panels, methods, {m: method_label(cfg, m) for m in methods}, line_styles(cfg, methods),
        "rollout step (0: the base model)",
        f"{hl} over training, {size_label(cfg, size)}: mean over seeds"
        + (" (band: range over seeds)" if seeds > 1 else ""), path, cols=min(3, len(panels)))


@register_figure("curves", order=15, files=lambda cfg: [f"curves_{s}.png" for s in cfg.experiment.sizes],
                 applies=applies)
def write_curves_figures(cfg: Config, data: Loaded, folder: Path) -> None:
    points = curve_points(cfg, data)
    for size in cfg.experiment.sizes:
        curves_figure(cfg, size, points, folder / f"curves_{size}.png")


@register_table("curve_points", order=85, files=lambda cfg: ["curves.csv"], applies=applies)
def write_curves_csv(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    write_csv(curve_points(cfg, data), folder / "curves.csv")
    return []
