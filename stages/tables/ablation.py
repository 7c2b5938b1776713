"""Ablations: ρ, warm-up Θ, controls and our earlier JSD readings, grouped by family, beside the
reported ICT ratio ablation (ablation .md/.tex/.csv; only when some methods are not in the main table)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table, bold_best
from .labels import (
    NOT_ICT,
    bench_label,
    delta_key,
    delta_label,
    grpo_method,
    headline,
    is_reading,
    method_groups,
    method_label,
    method_params,
    metric_key,
    reported_text,
    size_label,
)
from .load import Loaded, avg_cell, cells, problems_of
from .registry import register_table
from .seeds import Problems, interval_columns, seed_columns, spread_note, spread_text
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


def ablation_table(cfg: Config, metrics: pl.DataFrame,
                   problems: Problems | None = None) -> tuple[Table, pl.DataFrame] | None:
    main, ablation = method_groups(cfg)
    if not ablation:
        return None
    grpo = grpo_method(cfg, main)
    touched = {family(cfg, m) for m in ablation}
    refs = [m for m in main if family(cfg, m) in touched and m != grpo]
    hl = headline(cfg)
    # the headline first when it is avg@n, then pass@k for k from the largest down
    shown = ([] if hl.startswith("pass@") else [hl]) + [
        f"pass@{k}" for k in sorted(cfg.evaluate.k, reverse=True)]
    seeds = sorted(set(cfg.experiment.seeds))
    benches = list(cfg.experiment.benchmarks)
    by_metric = {m: cells(metrics, m, cfg.experiment.seeds) for m in shown}

    def avg(size, method, metric):
        return avg_cell(by_metric[metric], size, method, benches)

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
        columns += [f"{size_label(cfg, size)} {m}" for m in shown]
        if grpo:
            columns.append(f"{size_label(cfg, size)} {delta_label(hl)}")
    columns += [RATIO_LABEL, "P@1 (rep.)", "P@4 (rep.)"]
    values, spreads, records = [], [], []
    for fam, method in ordered:
        row, spread, record = [], [], {
            "family": fam, "method": method, "label": method_label(cfg, method),
            "params": method_params(cfg, method), "in_main_table": method in main}
        for size in cfg.experiment.sizes:
            for m in shown:
                v, per_seed = avg(size, method, m)
                row.append(v)
                spread.append(per_seed or ())
                key = f"{size}_{metric_key(m)}_avg"
                record[key] = None if v is None else 100 * v
                record.update(seed_columns(key, per_seed, len(seeds)))
                if len(seeds) > 1:
                    record.update(interval_columns(key, problems.interval(size, method, benches, [m], seeds)
                                                   if problems and v is not None else None))
            if grpo:
                v, g = avg(size, method, hl)[0], avg(size, grpo, hl)[0]
                d = None if method == grpo or None in (v, g) else v - g
                row.append(d)
                spread.append(())
                record[f"{size}_{delta_key(hl)}_vs_grpo"] = None if d is None else 100 * d
        rrow = ratio_row(cfg, method)
        rep = reported.RATIO_ABLATION.get(rrow) if rrow else None
        record.update(reported_row=rrow, reported_p1=rep.p1 if rep else None,
                      reported_p4=rep.p4 if rep else None,
                      reported_scope=RATIO_SCOPE if rep else None)
        record["sources"] = ";".join(s for size in cfg.experiment.sizes for m in shown
                                     for b in benches
                                     for s in (by_metric[m][size, method, b].sources
                                               if (size, method, b) in by_metric[m] else ()))
        values.append(row)
        spreads.append(spread)
        records.append(record)
    # bold the best pass@k per column of ours; not the Δ columns, never the reported ones
    marks = bold_best(values)
    per_size = len(shown) + (1 if grpo else 0)
    rows, bold, starts = [], [], []
    for i, ((fam, method), row, record) in enumerate(zip(ordered, values, records, strict=True)):
        if i == 0 or ordered[i - 1][0] != fam:
            starts.append(i)
        cells_ = [spread_text(v, sp, signed=grpo is not None and j % per_size == per_size - 1)
                  for j, (v, sp) in enumerate(zip(row, spreads[i], strict=True))]
        rep = [record["reported_row"] or MISSING, reported_text(record["reported_p1"]),
               reported_text(record["reported_p4"])]
        rows.append([fam if i in starts else "", method_label(cfg, method),
                     method_params(cfg, method), *cells_, *rep])
        bold.append([False] * 3 + [m and not (grpo and j % per_size == per_size - 1)
                                   for j, m in enumerate(marks[i])] + [False] * 3)
    used = [s for r in records for s in r["sources"].split(";") if s]
    base = reported.RATIO_ABLATION["Base"]
    notes = [
        f"Ours: average pass@k{'' if hl.startswith('pass@') else f' (and {hl})'} in % over our "
        f"benchmarks ({', '.join(bench_label(cfg, b) for b in benches)}) "
        "for our sizes; — if a benchmark is missing. Bold: best of ours per column."
        + (f" {delta_label(hl)}: minus {method_label(cfg, grpo)}, in points." if grpo else "")
        + spread_note(seeds),
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
    table, frame = ablation_table(cfg, data.metrics, problems_of(cfg, data))
    write_table([(table, "tab:ablation")], frame, folder / "ablation")
    return [table]
