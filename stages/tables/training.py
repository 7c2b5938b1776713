"""Training curves per size: every CURVES metric against the rollout step, one line per method
(the mean over seeds, the range over seeds shaded), each a running mean over about 10% of the
steps; and each method's reward minus the reference method's at the same step and seed
(training_<size>.png)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from .labels import grpo_method, line_styles, method_label, size_label
from .load import CURVES, Loaded
from .registry import register_figure

SMOOTHING = 0.1
"""The running mean's window as a share of the run's steps. Every method draws the same prompts
at a step, so per-step reward swings with the batch and the methods' raw curves lie on top of
each other; the running mean (and the difference against the reference) shows what differs."""


def window(runs: pl.DataFrame) -> int:
    """Steps of the running mean: SMOOTHING of the longest run's steps, rounded to an odd number
    (a centred window), at least 1."""
    if runs.is_empty():
        return 1
    w = max(1, round(SMOOTHING * (int(runs["step"].max()) + 1)))
    return w if w % 2 else w + 1


def reward_gap(runs: pl.DataFrame, reference: str) -> pl.DataFrame:
    """Each other method's reward_mean minus `reference`'s at the same step and seed (column
    `reward_gap`; the steps both ran)."""
    ref = runs.filter(pl.col("method") == reference).select("seed", "step", ref=pl.col("reward_mean"))
    return (runs.filter(pl.col("method") != reference).join(ref, on=["seed", "step"])
            .select("method", "seed", "step", reward_gap=pl.col("reward_mean") - pl.col("ref")))


def training_panels(cfg: Config, runs: pl.DataFrame, w: int) -> list:
    from ..core.report import figures
    panels = []
    for column, title, log in CURVES:
        bands = None
        if not runs.is_empty() and column in runs.columns and runs[column].drop_nulls().len():
            bands = figures.seed_bands(figures.running_mean(runs, column, w, ["method", "seed"]), column)
        panels.append(figures.BandPanel(title, bands, log,
                                        empty="no training metrics" if runs.is_empty() else "not recorded"))
    ref = grpo_method(cfg, list(cfg.experiment.methods))
    if ref is None:
        return panels + [figures.BandPanel("reward minus the reference", None,
                                           empty="no full-token (selector all) method")]
    gap = None
    if not runs.is_empty() and "reward_mean" in runs.columns:
        diff = reward_gap(runs, ref)
        if not diff.is_empty():
            gap = figures.seed_bands(figures.running_mean(diff, "reward_gap", w, ["method", "seed"]),
                                     "reward_gap")
    return panels + [figures.BandPanel(f"reward minus {method_label(cfg, ref)} (same step and seed)",
                                       gap, zero=True, empty="no reference run")]


def training_figure(cfg: Config, size: str, train: pl.DataFrame, path: Path) -> None:
    from ..core.report import figures
    methods = list(cfg.experiment.methods)
    runs = train.filter(pl.col("size") == size) if not train.is_empty() else train
    w = window(runs)
    seeds = "" if runs.is_empty() or runs["seed"].n_unique() < 2 else "; band: range over seeds"
    figures.band_panels(
        training_panels(cfg, runs, w), methods, {m: method_label(cfg, m) for m in methods},
        line_styles(cfg, methods), "rollout step",
        f"Training curves, {size_label(cfg, size)}: running mean over {w} step{'s' * (w > 1)} "
        f"(~{100 * SMOOTHING:g}% of the run), mean over seeds{seeds}", path)


@register_figure("training", order=10,
                 files=lambda cfg: [f"training_{s}.png" for s in cfg.experiment.sizes])
def write_training(cfg: Config, data: Loaded, folder: Path) -> None:
    for size in cfg.experiment.sizes:
        training_figure(cfg, size, data.train, folder / f"training_{size}.png")
