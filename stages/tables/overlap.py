"""Where the forks are after training: the overlap of the top-entropy positions of the base model
and of each trained model on the same base-model rollouts, beside the 80/20 paper's Table 1
(overlap .md/.tex/.csv; only when token_stats.overlap_top is set). From
overlap/size=S/method=M/seed=K/overlap.parquet."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table
from .labels import method_label, size_label
from .load import Loaded
from .registry import register_table
from .seeds import seed_columns, spread_note, spread_text
from .write import sources_note, table_files, write_table

REPORTED_LABEL = "reported: 80/20 paper, Table 1 (Qwen3, base vs RLVR checkpoints)"


def _mean(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(values) / len(values)


def _fixed(v: float | None, digits: int, scale: float = 1.0) -> str:
    return MISSING if v is None else f"{scale * v:.{digits}f}"


def overlap_table(cfg: Config, overlap: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    exp = cfg.experiment
    seeds = sorted(set(exp.seeds))
    top = cfg.token_stats.overlap_top
    runs = {} if overlap.is_empty() else {
        (r["size"], r["method"], r["seed"]): r for r in overlap.iter_rows(named=True)}
    columns = ["Size", "Method", "overlap (%)", f"per seed {', '.join(map(str, seeds))} (%)",
               "Jaccard", "mean H base (nats)", "mean H trained (nats)", "positions / tokens"]
    rows, starts, records, used = [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        for i, method in enumerate(exp.methods):
            got = [runs.get((size, method, k)) for k in seeds]
            have = [r for r in got if r]
            values = {c: _mean([r[c] if r else None for r in got])
                      for c in ("overlap", "jaccard", "entropy_mean_base", "entropy_mean_trained")}
            per_seed = tuple(r["overlap"] for r in have) if len(have) == len(seeds) else None
            sd = seed_columns("overlap", per_seed, len(seeds))
            counts = {(r["positions"], r["tokens"]) for r in have}
            rows.append([
                size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                spread_text(values["overlap"], per_seed or ()),
                ", ".join(_fixed(r["overlap"] if r else None, 1, 100) for r in got),
                _fixed(values["jaccard"], 3), _fixed(values["entropy_mean_base"], 3),
                _fixed(values["entropy_mean_trained"], 3),
                f"{next(iter(counts))[0]:,} / {next(iter(counts))[1]:,}" if len(counts) == 1 else MISSING,
            ])
            files = [r["source"] for r in have]
            used += files
            records.append({
                "size": size, "method": method, "label": method_label(cfg, method),
                "top": have[0]["top"] if have else None,
                **{c: None if v is None else (100 * v if c == "overlap" else v) for c, v in values.items()},
                **sd,
                **{f"overlap_seed{k}": None if r is None else 100 * r["overlap"] for k, r in zip(seeds, got, strict=True)},
                "positions": next(iter(counts))[0] if len(counts) == 1 else None,
                "tokens": next(iter(counts))[1] if len(counts) == 1 else None,
                "sources": ";".join(files)})
    rows.append([REPORTED_LABEL, "", f"≥ {reported.OVERLAP_MIN_PCT_8020:.2f}", MISSING,
                 f"≥ {reported.jaccard_of_overlap(reported.OVERLAP_MIN_PCT_8020 / 100):.2f} (derived)",
                 MISSING, MISSING, f"top {100 * reported.OVERLAP_TOP_8020:g}%"])
    starts.append(len(rows) - 1)
    notes = [
        f"Ours: A = the top {100 * top:g}% of the base model's rollout positions by the base model's "
        f"entropy (token_stats.overlap_top = {top:g}), B = the top {100 * top:g}% of the same positions "
        "by the trained model's entropy (the base model's rollouts teacher-forced through it, at the "
        f"rollout temperature T = {cfg.rollout.temperature:g}); overlap = |A ∩ B| / |A| (|A| = |B|), "
        "the paper's measure, and Jaccard = |A ∩ B| / |A ∪ B| beside it (86.67% overlap is a Jaccard "
        "of 0.76). Mean over seeds"
        + (" (— unless all are present); per seed: each seed's trained model." if len(seeds) > 1 else ".")
        + spread_note(seeds),
        f"{REPORTED_LABEL[0].upper() + REPORTED_LABEL[1:]}: the top-20% entropy positions of Qwen3 base "
        f"models and of their RLVR (DAPO) checkpoints overlap by {reported.OVERLAP_MIN_PCT_8020}% or "
        "more; the Jaccard is derived from it (o / (2 − o)), not reported. The paper's token "
        f"statistics (Qwen3-8B, thinking mode, AIME, T = 1.0, 10^6 tokens): "
        f"{reported.ENTROPY_BELOW_001_PCT_8020}% of tokens have H < 0.01 and 20% exceed "
        f"H = {reported.ENTROPY_P80} (its 80th percentile); ours are in token_stats. Their models and "
        f"data, not ours: a reference point beside our cells, never in them. "
        f"Source: {reported.PAPER_8020_SOURCE}.",
        sources_note(used, "overlap.csv"),
    ]
    t = Table(f"Top-{100 * top:g}% entropy positions: base model against each trained model",
              columns, rows, None, starts, notes, left_columns=2)
    return t, pl.DataFrame(records, infer_schema_length=None)


@register_table("overlap", order=42, files=lambda cfg: table_files("overlap"),
                applies=lambda cfg: cfg.token_stats.overlap_top is not None)
def write_overlap(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = overlap_table(cfg, data.overlap)
    write_table([(table, "tab:overlap")], frame, folder / "overlap")
    return [table]
