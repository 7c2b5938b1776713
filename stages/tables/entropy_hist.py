"""The token-entropy histogram of the base models' rollouts, one series per size (entropy_hist.png)."""

from __future__ import annotations

import math
from pathlib import Path

from ..config import Config
from .labels import size_label
from .load import Loaded
from .registry import register_figure


def entropy_figure(cfg: Config, entropy: dict, path: Path) -> None:
    from ..core.report import figures, plots
    series = {size_label(cfg, s): entropy[s] for s in cfg.experiment.sizes if s in entropy}
    if not series:
        figures.message_figure("no token statistics", path)
        return
    top = max(float(v.max()) for v in series.values())
    # the histogram's last bin edge is ln(vocab size); any vocabulary whose log bounds the
    # largest entropy seen draws the same picture
    vocab = max(2, math.ceil(math.exp(min(top, 50.0) * 1.05)))
    plots.entropy_histogram(series, path, vocab,
                            title="Token entropy of base-model rollouts (H = 0.01 and each 80th pct marked)")


@register_figure("entropy_hist", order=30, files=lambda cfg: ["entropy_hist.png"])
def write_entropy_hist(cfg: Config, data: Loaded, folder: Path) -> None:
    entropy_figure(cfg, data.entropy, folder / "entropy_hist.png")
