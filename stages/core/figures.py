"""Figures of the tables stage: training curves and pass@k against k (PNG, matplotlib Agg).

The functions take frames and the printed names and line styles of each series; which series and
names a run has is the stage's business (stages.tables).
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from . import plots  # sets the Agg backend before pyplot is used
from .metrics import pass_at_k

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


def training_curves(runs: pl.DataFrame, panels: list[tuple[str, str, bool]], series: list[str],
                    labels: dict[str, str], styles: dict[str, dict], title: str,
                    path: str | Path) -> None:
    """One panel per (column, title, log axis) against `step`, one line per method and seed.

    `runs` has columns `method`, `seed`, `step` and the panel columns (a missing column shows
    "not recorded"). A log axis is used when asked for and the values span a decade or more.
    """
    fig, axes = _grid(len(panels), 3, 13 / 3, 3.5)
    for ax, (column, panel_title, log) in zip(axes.flat, panels, strict=False):
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        drawn = False
        if not runs.is_empty() and column in runs.columns:
            for method in series:
                part = runs.filter(pl.col("method") == method).drop_nulls(column)
                for i, seed in enumerate(sorted(part["seed"].unique().to_list())):
                    run = part.filter(pl.col("seed") == seed).sort("step")
                    ax.plot(run["step"].to_list(), run[column].to_list(), linewidth=1.3,
                            label=labels[method] if i == 0 else None, **styles[method])
                    drawn = True
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not drawn:
            _message(ax, "no training metrics" if runs.is_empty() else "not recorded")
        elif log and _spans_decades(runs[column].drop_nulls().to_list()):
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
