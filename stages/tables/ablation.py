"""Ablations: ρ, warm-up Θ, controls and our earlier JSD readings, grouped by family, beside the
reported ICT ratio ablation (ablation .md/.tex/.csv; only when some methods are not in the main table)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core import reported
from ..core.render import MISSING, Table, bold_best, mean_or_none, pct
from .labels import (
    NOT_ICT,
    bench_label,
    grpo_method,
    headline_k,
    is_reading,
    method_groups,
    method_label,
    method_params,
    reported_text,
    size_label,
)
from .load import Loaded, cells
from .registry import register_table
from .write import sources_note, table_files, write_table

PAPER_ABLATION = ("20-Entropy paper (Qwen3, DAPO): ρ = 10% and 50%/100% both do worse than 20%; training "
                  "only on the bottom 80% degrades sharply.")
RATIO_LABEL = "reported: ICT ratio ablation (Qwen2.5-1.5B, GSM8K)"
RATIO_SCOPE = "Qwen2.5-1.5B trained and tested on GSM8K, as reported by summaries of the ICT paper"
FAMILIES = ("ICT", f"JSD readings (ours, {NOT_ICT})", "20-Entropy", "controls", "other")


def family(cfg: Config, name: str) -> str:
    """The ablation table's group of a method (one of FAMILIES)."""
    selector = cfg.methods[name].selector
    if selector == "ict":
        return FAMILIES[1] if is_reading(cfg, name) else "ICT"
    if selector == "entropy_top":
        return "20-Entropy"
    return "controls" if selector in ("entropy_bottom", "random") else "other"


def ratio_row(cfg: Config, name: str) -> str | None:
    """The row of ICT's ratio ablation (reported.RATIO_ABLATION) a method stands for: its
    paper_row, where ICT is the ablation's 10%-unique."""
    row = cfg.methods[name].paper_row
    row = "10%-unique" if row == "ICT" else row
    return row if row in reported.RATIO_ABLATION and row != "Base" else None


def ablation_table(cfg: Config, metrics: pl.DataFrame) -> tuple[Table, pl.DataFrame] | None:
    main, ablation = method_groups(cfg)
    if not ablation:
        return None
    grpo = grpo_method(cfg, main)
    touched = {family(cfg, m) for m in ablation}
    refs = [m for m in main if family(cfg, m) in touched and m != grpo]
    ks = sorted(cfg.evaluate.k, reverse=True)
    hk = headline_k(cfg)
    by_k = {k: cells(metrics, f"pass@{k}", cfg.experiment.seeds) for k in ks}

    def avg(size, method, k):
        return mean_or_none([by_k[k][size, method, b].value if (size, method, b) in by_k[k] else None
                             for b in cfg.experiment.benchmarks])

    def order(m):
        p = cfg.methods[m].selector_params()
        return (str(p.get("variant", "")), str(p.get("part", "")), p.get("rho", 0.0),
                cfg.methods[m].warmup_steps, m)

    ordered = [("reference", grpo)] if grpo else []
    for fam in FAMILIES:
        ordered += [(fam, m) for m in sorted((m for m in refs + ablation if family(cfg, m) == fam),
                                            key=order)]
    columns = ["Family", "Method", "Selector"]
    for size in cfg.experiment.sizes:
        columns += [f"{size_label(cfg, size)} pass@{k}" for k in ks]
        if grpo:
            columns.append(f"{size_label(cfg, size)} Δ@{hk}")
    columns += [RATIO_LABEL, "P@1 (rep.)", "P@4 (rep.)"]
    values, records = [], []
    for fam, method in ordered:
        row, record = [], {"family": fam, "method": method, "label": method_label(cfg, method),
                           "params": method_params(cfg, method), "in_main_table": method in main}
        for size in cfg.experiment.sizes:
            for k in ks:
                v = avg(size, method, k)
                row.append(v)
                record[f"{size}_pass{k}_avg"] = None if v is None else 100 * v
            if grpo:
                v, g = avg(size, method, hk), avg(size, grpo, hk)
                d = None if method == grpo or None in (v, g) else v - g
                row.append(d)
                record[f"{size}_delta{hk}_vs_grpo"] = None if d is None else 100 * d
        rrow = ratio_row(cfg, method)
        rep = reported.RATIO_ABLATION.get(rrow) if rrow else None
        record.update(reported_row=rrow, reported_p1=rep.p1 if rep else None,
                      reported_p4=rep.p4 if rep else None,
                      reported_scope=RATIO_SCOPE if rep else None)
        record["sources"] = ";".join(s for size in cfg.experiment.sizes for k in ks
                                     for b in cfg.experiment.benchmarks
                                     for s in (by_k[k][size, method, b].sources
                                               if (size, method, b) in by_k[k] else ()))
        values.append(row)
        records.append(record)
    # bold the best pass@k per column of ours; not the Δ columns, never the reported ones
    marks = bold_best(values)
    per_size = len(ks) + (1 if grpo else 0)
    rows, bold, starts = [], [], []
    for i, ((fam, method), row, record) in enumerate(zip(ordered, values, records, strict=True)):
        if i == 0 or ordered[i - 1][0] != fam:
            starts.append(i)
        cells_ = [pct(v, signed=grpo is not None and j % per_size == per_size - 1)
                  for j, v in enumerate(row)]
        rep = [record["reported_row"] or MISSING, reported_text(record["reported_p1"]),
               reported_text(record["reported_p4"])]
        rows.append([fam if i in starts else "", method_label(cfg, method),
                     method_params(cfg, method), *cells_, *rep])
        bold.append([False] * 3 + [m and not (grpo and j % per_size == per_size - 1)
                                   for j, m in enumerate(marks[i])] + [False] * 3)
    used = [s for r in records for s in r["sources"].split(";") if s]
    base = reported.RATIO_ABLATION["Base"]
    notes = [
        f"Ours: average pass@k in % over our benchmarks ({', '.join(bench_label(cfg, b) for b in cfg.experiment.benchmarks)}) "
        "for our sizes; — if a benchmark is missing. Bold: best of ours per column."
        + (f" Δ@{hk}: minus {method_label(cfg, grpo)}, in points." if grpo else ""),
        f"Reported (the last three columns): {RATIO_SCOPE}, P@1 / P@4 in % (base model "
        f"{reported_text(base.p1)} / {reported_text(base.p4)}), for the methods whose paper_row is "
        "one of its rows (ICT: 10%-unique). They are on GSM8K with Qwen2.5-1.5B, ours on our "
        "benchmarks and sizes: beside our cells, not comparable with them cell by cell, and never "
        f"in them. Source: {reported.ICT_SOURCE}.",
        "Paper: " + PAPER_ABLATION,
        sources_note(used, "ablation.csv"),
    ]
    t = Table("Ablations: selected fraction ρ, warm-up Θ, controls and our earlier JSD readings",
              columns, rows, bold, starts, notes,
              align="lll" + "r" * (len(columns) - 6) + "lrr")
    return t, pl.DataFrame(records, infer_schema_length=None)


@register_table("ablation", order=50, files=lambda cfg: table_files("ablation"),
                applies=lambda cfg: bool(method_groups(cfg)[1]))
def write_ablation(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = ablation_table(cfg, data.metrics)
    write_table([(table, "tab:ablation")], frame, folder / "ablation")
    return [table]
