"""Training curves per size: every CURVES metric against the step, one line per method and seed
(training_<size>.png)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from .labels import line_styles, method_label, size_label
from .load import CURVES, Loaded
from .registry import register_figure


def training_figure(cfg: Config, size: str, train: pl.DataFrame, path: Path) -> None:
    from ..core import figures

    methods = list(cfg.experiment.methods)
    runs = train.filter(pl.col("size") == size) if not train.is_empty() else train
    figures.training_curves(
        runs, CURVES, methods, {m: method_label(cfg, m) for m in methods}, line_styles(cfg, methods),
        f"Training curves, {size_label(cfg, size)} (one line per method and seed)", path)


@register_figure("training", order=10,
                 files=lambda cfg: [f"training_{s}.png" for s in cfg.experiment.sizes])
def write_training(cfg: Config, data: Loaded, folder: Path) -> None:
    for size in cfg.experiment.sizes:
        training_figure(cfg, size, data.train, folder / f"training_{size}.png")
