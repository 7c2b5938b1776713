"""The Total table: our pass@1, pass@4 and their mean per size x method, beside the reported numbers
of ICT's Table 1 (main_total .md/.tex/.csv; only when the run evaluates k = 1 and 4)."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table, bold_best, mean_or_none
from .labels import (
    TOTAL_KS,
    bench_label,
    has_total,
    hub_size,
    method_groups,
    method_label,
    reported_text,
    size_label,
)
from .load import Loaded, avg_cell, cells, problems_of
from .registry import register_table
from .seeds import Problems, interval_columns, mean_per_seed, seed_columns, spread_note, spread_text
from .write import sources_note, table_files, write_table

TABLE1_LABEL = "reported (summaries of ICT Table 1)"
_PAPER_SIZE = re.compile(r"(?<![0-9.])(0\.5|1\.5|7)b(?![a-z0-9])")


def paper_size(cfg: Config, size: str) -> str | None:
    """The size of ICT's Table 1 a hub model stands for ('0.5B', '1.5B', '7B'), from '0.5b',
    '1.5b' or '7b' in its model id or else its size key (case-insensitive); None for scratch
    models and for names with none of them (or with two different ones)."""
    return hub_size(cfg, size, _PAPER_SIZE)


def main_total_table(cfg: Config, metrics: pl.DataFrame,
                     problems: Problems | None = None) -> tuple[Table, pl.DataFrame]:
    """Per size x method: our P@1, P@4 and Total (their mean), each averaged over our benchmarks
    (and over seeds, ± their sd with several); beside them, in their own columns, the reported
    P@1 / P@4 / Total of the method's paper_row at the matching paper size (reported.TABLE1)."""
    exp = cfg.experiment
    main, _ = method_groups(cfg)
    methods = ["base", *main]
    seeds = sorted(set(exp.seeds))
    by_k = {k: cells(metrics, f"pass@{k}", exp.seeds) for k in TOTAL_KS}
    benches = list(exp.benchmarks)
    columns = ["Size", "Method", "P@1 (ours)", "P@4 (ours)", "Total (ours)", TABLE1_LABEL,
               "P@1 (rep.)", "P@4 (rep.)", "Total (rep.)"]
    rows, bold, starts, records, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        psize = paper_size(cfg, size)
        block, spreads, files = [], [], []
        for method in methods:
            avgs = [avg_cell(by_k[k], size, method, benches) for k in TOTAL_KS]
            values = [v for v, _ in avgs]
            block.append([*values, mean_or_none(values)])
            spreads.append([*(sp or () for _, sp in avgs), mean_per_seed([sp for _, sp in avgs]) or ()])
            files.append([s for k in TOTAL_KS for b in exp.benchmarks
                          for s in (by_k[k][size, method, b].sources
                                    if (size, method, b) in by_k[k] else ())])
        marks = bold_best(block)
        for i, method in enumerate(methods):
            row_name = "Base" if method == "base" else cfg.methods[method].paper_row
            rep = reported.TABLE1.get((psize, row_name)) if psize and row_name else None
            where = f"Qwen2.5-{psize}, {row_name}" if rep else MISSING
            p1, p4, total = block[i]
            rows.append([size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                         *(spread_text(v, sp) for v, sp in zip(block[i], spreads[i], strict=True)),
                         where,
                         *(reported_text(getattr(rep, f) if rep else None) for f in ("p1", "p4", "total"))])
            bold.append([False, False, *marks[i], False, False, False, False])
            spread = {}
            for name, metric, value, per_seed in zip(
                    ("pass1_avg", "pass4_avg", "total"), (["pass@1"], ["pass@4"], ["pass@1", "pass@4"]),
                    block[i], spreads[i], strict=True):
                spread |= seed_columns(name, per_seed, len(seeds))
                if len(seeds) > 1:
                    spread |= interval_columns(name, problems.interval(size, method, benches, metric, seeds)
                                               if problems and value is not None else None)
            records.append({
                "size": size, "method": method, "label": method_label(cfg, method),
                "pass1_avg": None if p1 is None else 100 * p1,
                "pass4_avg": None if p4 is None else 100 * p4,
                "total": None if total is None else 100 * total, **spread,
                "best_in_size": ";".join(c for c, m in zip(("pass1_avg", "pass4_avg", "total"),
                                                           marks[i], strict=True) if m),
                "reported_size": f"Qwen2.5-{psize}" if rep else None,
                "reported_row": row_name if rep else None,
                "reported_p1": rep.p1 if rep else None, "reported_p4": rep.p4 if rep else None,
                "reported_total": rep.total if rep else None,
                "reported_source": reported.ICT_SOURCE if rep else None,
                "sources": ";".join(files[i])})
            used += files[i]
    seeds = sorted(set(exp.seeds))
    benches = ", ".join(bench_label(cfg, b) for b in exp.benchmarks)
    notes = [
        f"Ours: pass@1 and pass@4 in %, each the unweighted mean over our benchmarks ({benches})"
        + (f" and over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else "")
        + "; Total = (P@1 + P@4) / 2, as ICT's Table 1 defines it; — if a benchmark is missing. "
        "Bold: best of ours per size. Per-benchmark cells: main_pass1, main_pass4."
        + spread_note(seeds)
        + (" 95% intervals resampling seeds and problems together: main_total.csv." if len(seeds) > 1 else ""),
        f"{TABLE1_LABEL[0].upper() + TABLE1_LABEL[1:]}: Qwen2.5 at the paper size that matches ours "
        "('0.5b', '1.5b' or '7b' in the hub model id or the size name; — for sizes that match none, "
        "and for methods without a Table 1 row), averaged over the paper's seven benchmarks "
        "(MATH-500, GSM8K, MMLU-STEM, GPQA, AIME 2023/2024/2025), mean of 5 seeds. Totals as printed "
        "(7B GRPO and 20-Entropy: not the mean of their P@1 and P@4). The paper's benchmarks, "
        "training data and Qwen2.5 models, not ours: printed beside our cells, never in them. "
        f"Source: {reported.ICT_SOURCE}.",
        sources_note(used, "main_total.csv"),
    ]
    t = Table("Main results: pass@1, pass@4 and Total (%), ours beside the reported numbers",
              columns, rows, bold, starts, notes, align="llrrrlrrr")
    extra = {c: pl.Float64 for c in records[0] if c.endswith(("_seed_sd", "_seed_min", "_seed_max",
                                                              "_ci_low", "_ci_high"))} if records else {}
    frame = pl.DataFrame(records, schema={
        "size": pl.String, "method": pl.String, "label": pl.String, "pass1_avg": pl.Float64,
        "pass4_avg": pl.Float64, "total": pl.Float64, **extra, "best_in_size": pl.String,
        "reported_size": pl.String, "reported_row": pl.String, "reported_p1": pl.Float64,
        "reported_p4": pl.Float64, "reported_total": pl.Float64, "reported_source": pl.String,
        "sources": pl.String})
    return t, frame


@register_table("main_total", order=20, files=lambda cfg: table_files("main_total"), applies=has_total)
def write_main_total(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = main_total_table(cfg, data.metrics, problems_of(cfg, data))
    write_table([(table, "tab:main-total")], frame, folder / "main_total")
    return [table]
