"""Token statistics of the base models' rollouts per size, beside the papers' reference points
(token_stats .md/.tex/.csv)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report.render import MISSING, Table, pct
from .labels import size_label
from .load import Loaded
from .registry import register_table
from .write import sources_note, table_files, write_table

SELECTOR_PAIRS = [("entropy20", "stapo"), ("entropy20", "ict"), ("stapo", "ict")]
PAPER_TOKENS = ("20-Entropy paper (Qwen3-8B chains of thought): over 50% of tokens have H < 0.01 and "
                "only 20% exceed H = 0.672 (its 80th percentile). STAPO paper: about 0.01% of tokens "
                "silenced. Different models and data from ours: a reference point, not a target.")


def token_table(cfg: Config, stats: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    by_size = {r["size"]: r for r in stats.iter_rows(named=True)} if not stats.is_empty() else {}
    columns = ["Size", "tokens", "H < 0.01 (%)", "80th pct H (nats)", "mean H (nats)",
               "selected 20-Entropy (%)", "kept STAPO (%)", "selected ICT (%)",
               "J(20-Ent., STAPO)", "J(20-Ent., ICT)", "J(STAPO, ICT)"]

    def num(r, key, fmt):
        return MISSING if r is None or r.get(key) is None else fmt(r[key])

    rows, used = [], []
    for size in cfg.experiment.sizes:
        r = by_size.get(size)
        rows.append([
            size_label(cfg, size), num(r, "tokens", lambda v: f"{v:,}"),
            num(r, "frac_entropy_below_0.01", pct), num(r, "entropy_p80", lambda v: f"{v:.3f}"),
            num(r, "entropy_mean", lambda v: f"{v:.3f}"),
            num(r, "selected_fraction_entropy20", pct), num(r, "selected_fraction_stapo", lambda v: f"{100 * v:.2f}"),
            num(r, "selected_fraction_ict", pct),
            *(num(r, f"jaccard_{a}_{b}", lambda v: f"{v:.2f}") for a, b in SELECTOR_PAIRS),
        ])
        if r:
            used.append(r["source"])
    paper_row = ["paper: Qwen3-8B (20-Entropy) / STAPO", MISSING, "> 50", "0.672", MISSING, MISSING,
                 "≈ 99.99", MISSING, MISSING, MISSING, MISSING]
    rows.append(paper_row)
    notes = [
        "Ours: base-model rollouts on training prompts (the token-statistics stage), entropies in nats "
        f"at the rollout temperature T = {cfg.rollout.temperature:g}; one selection scope per size. "
        "Selected: the share of tokens each selector would update (STAPO: the share it keeps); "
        "J: Jaccard overlap of two selectors' picks.",
        "Paper row: " + PAPER_TOKENS,
        sources_note(used, "token_stats.csv"),
    ]
    t = Table("Token statistics of the base models", columns, rows, None, [len(rows) - 1], notes)
    frame = stats.join(pl.DataFrame({"size": cfg.experiment.sizes}), on="size", how="right") \
        if not stats.is_empty() else pl.DataFrame({"size": cfg.experiment.sizes})
    return t, frame


@register_table("token_stats", order=40, files=lambda cfg: table_files("token_stats"))
def write_token_stats(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = token_table(cfg, data.token_stats)
    write_table([(table, "tab:token-stats")], frame, folder / "token_stats")
    return [table]
