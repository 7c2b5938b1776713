"""Figures of the tables stage: training curves, curves over steps and pass@k against k (PNG,
matplotlib Agg).

The functions take frames and the printed names and line styles of each series; which series and
names a run has is the stage's business (stages.tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from stages.core.common.metrics import pass_at_k
from stages.core.report import plots  # sets the Agg backend before pyplot is used

plt = plots.plt
MaxNLocator = plots.matplotlib.ticker.MaxNLocator


def _message(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _legend_right(fig, axes) -> None:
    """One legend for the figure, from the panel that shows the most series."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        if len(lab) > len(labels):
            handles, labels = h, lab
    if labels:
        fig.legend(handles, labels, loc="center left", fontsize=9, bbox_to_anchor=(1.0, 0.5))


def _spans_decades(values: list[float]) -> bool:
    """Positive values spanning at least a factor of 10: worth a log axis."""
    return bool(values) and min(values) > 0 and max(values) >= 10 * min(values)


def running_mean(frame: pl.DataFrame, column: str, window: int, by: list[str],
                 x: str = "step") -> pl.DataFrame:
    """`column` replaced by its centred running mean over `window` consecutive rows of each group
    of `by` (ordered by `x`; fewer rows at the ends and around nulls). Unitless smoothing: the
    column keeps its units."""
    frame = frame.drop_nulls(column).sort(*by, x)
    return frame.with_columns(pl.col(column).rolling_mean(window, min_samples=1, center=True)
                              .over(by))


def seed_bands(frame: pl.DataFrame, column: str, by: str = "method", x: str = "step",
               need: dict[str, int] | None = None) -> pl.DataFrame:
    """Per `by` and `x`: the mean over seeds of `column`, its minimum and maximum (the band) and
    the number of seeds; with `need` (by -> seeds), only the x where all of them are present."""
    out = (frame.drop_nulls(column).group_by(by, x)
           .agg(mean=pl.col(column).mean(), low=pl.col(column).min(), high=pl.col(column).max(),
                seeds=pl.col("seed").n_unique())
           .sort(by, x))
    if need is not None:
        out = out.filter(pl.col("seeds") == pl.col(by).replace_strict(need, default=0))
    return out


@dataclass
class BandPanel:
    """One panel of band_panels: the bands of seed_bands against `step` (None: not recorded)."""

    title: str
    bands: pl.DataFrame | None
    log: bool = False  # a log axis, when the values span a decade or more
    ylabel: str | None = None
    zero: bool = False  # a horizontal line at 0 (a difference against a reference)
    empty: str = "not recorded"


def band_panels(panels: list[BandPanel], series: list[str], labels: dict[str, str],
                styles: dict[str, dict], xlabel: str, title: str, path: str | Path,
                cols: int = 3, size: tuple[float, float] = (13 / 3, 3.5)) -> None:
    """One line per method of `series` per panel (the mean over seeds against x), with the range
    over seeds shaded where a point has two or more seeds."""
    fig, axes = _grid(len(panels), min(cols, len(panels)), *size)
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(xlabel)
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        drawn, shown = False, []
        bands = panel.bands if panel.bands is not None else pl.DataFrame()
        for method in series:
            part = bands.filter(pl.col("method") == method) if not bands.is_empty() else bands
            if part.is_empty():
                continue
            x = part["step"].to_list()
            ax.plot(x, part["mean"].to_list(), linewidth=1.4, label=labels[method], **styles[method])
            if part["seeds"].max() > 1:
                ax.fill_between(x, part["low"].to_list(), part["high"].to_list(), linewidth=0,
                                alpha=0.2, color=styles[method].get("color"))
            shown += part["low"].to_list() + part["high"].to_list()
            drawn = True
        if panel.zero and drawn:
            ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not drawn:
            _message(ax, panel.empty)
        elif panel.log and _spans_decades(shown):
            ax.set_yscale("log")  # collapse and explosion both show on a log axis
    _finish(fig, axes, len(panels), title, path)


def pass_at_k_table(counts: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Mean pass@k over problems for k = 1..n per group of `keys`, from (n, c) per problem.

    `counts` has the `keys` columns, `n` (samples) and `c` (correct) per problem; the columns of
    the result are the keys, `k` and `value`.
    """
    records = []
    for group, part in counts.group_by(keys, maintain_order=True):
        pairs = list(zip(part["n"].to_list(), part["c"].to_list(), strict=True))
        for k in range(1, min(n for n, _ in pairs) + 1):
            value = sum(pass_at_k(n, c, k) for n, c in pairs) / len(pairs)
            records.append({**dict(zip(keys, group, strict=True)), "k": k, "value": value})
    schema = {**{key: counts.schema[key] for key in keys}, "k": pl.Int64, "value": pl.Float64}
    return pl.DataFrame(records, schema=schema)


def pass_at_k_panels(curves: pl.DataFrame, panels: list[tuple[str | None, str]], series: list[str],
                     labels: dict[str, str], styles: dict[str, dict], n: int, title: str,
                     path: str | Path) -> None:
    """pass@k (%) against k per benchmark panel, one line per method.

    `curves` has `method`, `bench`, `k`, `value`; a panel whose bench is None shows the mean over
    the other panels' benchmarks, drawn only for methods that have all of them.
    """
    benches = [b for b, _ in panels if b is not None]
    fig, axes = _grid(len(panels), min(len(panels), 4), 3.6, 3.2)
    ticks = [2**i for i in range(int(math.log2(n)) + 1)]
    for ax, (bench, panel_title) in zip(axes.flat, panels, strict=False):
        ax.set_title(panel_title, fontsize=10)
        drawn = False
        for method in series:
            part = curves.filter(pl.col("method") == method)
            if bench is None:
                part = (part.filter(pl.col("bench").is_in(benches))
                        .group_by("k").agg(pl.col("value").mean(), pl.len())
                        .filter(pl.col("len") == len(benches)))
            else:
                part = part.filter(pl.col("bench") == bench)
            if part.is_empty():
                continue
            part = part.sort("k")
            ax.plot(part["k"].to_list(), (100 * part["value"]).to_list(), marker="o", markersize=3,
                    label=labels[method], **styles[method])
            drawn = True
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        if not drawn:
            _message(ax, "no evaluations")
    _finish(fig, axes, len(panels), title, path)


def _grid(panels: int, cols: int, width: float, height: float):
    """(figure, axes (rows, cols)) with room for `panels` panels of width × height inches."""
    rows = math.ceil(panels / cols)
    return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def _finish(fig, axes, used: int, title: str, path: str | Path) -> None:
    """Blank the panels after the first `used`, put one legend at the right, title, save."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    _legend_right(fig, axes.flat)
    fig.suptitle(title)
    fig.tight_layout()
    plots.save(fig, path)


def message_figure(text: str, path: str | Path) -> None:
    """A figure that only says why there is nothing to draw (the output must still exist)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    _message(ax, text)
    ax.axis("off")
    plots.save(fig, path)
