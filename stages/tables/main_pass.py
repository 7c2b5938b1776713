"""The main table, pass@k per size x method x benchmark, and ICT's gains over the baselines beside
the paper's headline (one main_pass<k> .md/.tex/.csv and one ict_gains_pass<k>.csv per k; and
main_avg<n> .md/.tex/.csv when evaluate.headline is avg@n, the 80/20 paper's Acc@n)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table, bold_best, pct
from .labels import (
    HEADLINE_K,
    NOT_ICT,
    bench_label,
    grpo_method,
    has_total,
    headline,
    is_ict,
    method_groups,
    method_label,
    metric_key,
    metric_note,
    size_label,
)
from .load import Loaded, avg_cell, cell_sources, cells, problems_of
from .registry import register_table
from .seeds import Problems, interval_columns, seed_columns, spread_note, spread_text
from .write import sources_note, table_files, write_csv, write_table

# What the papers report (METHODS §7, stages.core.report.reported), printed beside our numbers and never
# mixed with them.
PAPER_ICT_AVG = f"+{reported.HEADLINE_AVG_GAIN_P4:g}%"
PAPER_ICT_MAX = f"+{reported.HEADLINE_MAX_GAIN_P4:g}%"
PAPER_ICT = (
    f"ICT abstract (Qwen2.5 0.5B/1.5B/7B, seven benchmarks): top 10% of unique tokens gives "
    f"{PAPER_ICT_AVG} average and {PAPER_ICT_MAX} maximum pass@4 over GRPO, 20-Entropy and STAPO. "
    f"The {reported.HEADLINE_AVG_GAIN_P4:g} is the mean of the per-size average gains ("
    + ", ".join(f"{s} +{g:g}" for s, g in reported.PER_SIZE_AVG_GAIN_P4.items())
    + "); which baseline each gain is taken against is unclear, and the maximum's cell is unknown. "
    f"Source: {reported.ICT_SOURCE}.")


def main_table(cfg: Config, metrics: pl.DataFrame, metric: str | int,
               problems: Problems | None = None) -> tuple[Table, pl.DataFrame]:
    """The main table of one metric (pass@k, or k alone; avg@n): per size x method x benchmark,
    the mean over seeds (± their sd with several), the average and Δ against the full-token
    baseline; `problems` gives the CSV's intervals over seeds and problems with several seeds."""
    metric = f"pass@{metric}" if isinstance(metric, int) else metric
    stem = f"main_{metric_key(metric)}"
    exp = cfg.experiment
    main, _ = method_groups(cfg)
    methods = ["base", *main]
    grpo = grpo_method(cfg, main)
    seeds = sorted(set(exp.seeds))
    table = cells(metrics, metric, exp.seeds, problems)
    benches = list(exp.benchmarks)
    columns = ["Size", "Method", *(bench_label(cfg, b) for b in benches), "Avg."]
    if grpo:
        columns.append(f"Δ Avg. vs {method_label(cfg, grpo)}")
    rows, bold, starts, csv_rows, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        block, spreads = [], []
        for method in methods:
            values = [table[size, method, b].value if (size, method, b) in table else None
                      for b in benches]
            avg, avg_seeds = avg_cell(table, size, method, benches)
            block.append([*values, avg])
            spreads.append([*(table[size, method, b].per_seed if (size, method, b) in table else ()
                              for b in benches), avg_seeds or ()])
        grpo_avg = block[methods.index(grpo)][-1] if grpo else None
        marks = bold_best(block)
        for i, (method, values) in enumerate(zip(methods, block, strict=True)):
            avg = values[-1]
            delta = (avg - grpo_avg) if grpo and method != grpo and None not in (avg, grpo_avg) else None
            row = [size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                   *(spread_text(v, sp) for v, sp in zip(values, spreads[i], strict=True))]
            if grpo:
                row.append("ref." if method == grpo else pct(delta, signed=True))
            rows.append(row)
            bold.append([False, False, *marks[i]] + ([False] if grpo else []))
            record = {"size": size, "method": method, "label": method_label(cfg, method),
                      "metric": metric}
            for b in benches:
                c = table.get((size, method, b))
                record[f"{b}"] = 100 * c.value if c else None
                record[f"{b}_ci_low"] = 100 * c.ci_low if c and c.ci_low is not None else None
                record[f"{b}_ci_high"] = 100 * c.ci_high if c and c.ci_high is not None else None
                record.update(seed_columns(b, c.per_seed if c else None, len(seeds)))
                if grpo and c and (size, grpo, b) in table and method != grpo:
                    record[f"{b}_delta_vs_grpo"] = 100 * (c.value - table[size, grpo, b].value)
                else:
                    record[f"{b}_delta_vs_grpo"] = None
            record["avg"] = None if avg is None else 100 * avg
            if len(seeds) > 1:
                record.update(seed_columns("avg", spreads[i][-1], len(seeds)))
                record.update(interval_columns("avg", problems.interval(
                    size, method, benches, [metric], seeds) if problems and avg is not None else None))
            record["avg_delta_vs_grpo"] = None if delta is None else 100 * delta
            record["best_in_size"] = ";".join(
                col for col, m in zip([*benches, "avg"], marks[i], strict=True) if m)
            files = cell_sources(table, size, method, benches)
            record["sources"] = ";".join(files)
            used += files
            csv_rows.append(record)
    ev = cfg.evaluate
    notes = [
        metric_note(cfg, metric) + ", mean over problems"
        + (f", then over seeds {', '.join(map(str, seeds))} (— unless all are present)"
           if len(seeds) > 1 else "")
        + ". Bold: best per size. Avg.: unweighted mean over the benchmarks (— if one is missing)."
        + (f" Δ: Avg. minus {method_label(cfg, grpo)}'s Avg., in points." if grpo else "")
        + spread_note(seeds),
        (f"95% bootstrap intervals over problems ({ev.bootstrap} resamples): {stem}.csv." if len(seeds) < 2
         else f"95% bootstrap intervals that resample seeds and problems together ({ev.bootstrap} "
              f"resamples; seeds, then problems, with replacement): {stem}.csv."),
        "ICT rows follow the paper's rule as summaries of its text give it (METHODS §3); rows "
        f"marked '{NOT_ICT}' are our earlier readings. Every cell is ours"
        + (": the paper's numbers stand beside ours in main_total, never in these cells."
           if has_total(cfg) else "."),
        sources_note(used, f"{stem}.csv"),
    ]
    title = f"Main results: {metric} (%) per size, method and benchmark"
    out = Table(title, columns, rows, bold, starts, notes, left_columns=2)
    frame = pl.DataFrame(csv_rows, infer_schema_length=None)
    return out, frame


def ict_gains(cfg: Config, metrics: pl.DataFrame, k: int) -> tuple[Table | None, pl.DataFrame]:
    """ICT minus each baseline, per size x benchmark, in points; the paper's headline beside it."""
    main, _ = method_groups(cfg)
    icts = [m for m in main if is_ict(cfg, m)]  # ICT's rule only: the headline is about it
    baselines = [m for m in main if cfg.methods[m].selector != "ict"]
    table = cells(metrics, f"pass@{k}", cfg.experiment.seeds)
    records = []
    for ict in icts:
        for base in baselines:
            for size in cfg.experiment.sizes:
                for bench in cfg.experiment.benchmarks:
                    a, b = table.get((size, ict, bench)), table.get((size, base, bench))
                    if a and b:
                        records.append({"ict": ict, "baseline": base, "size": size, "bench": bench,
                                        "ict_value": 100 * a.value, "baseline_value": 100 * b.value,
                                        "gain": 100 * (a.value - b.value),
                                        "sources": ";".join(a.sources + b.sources)})
    frame = pl.DataFrame(records, schema={
        "ict": pl.String, "baseline": pl.String, "size": pl.String, "bench": pl.String,
        "ict_value": pl.Float64, "baseline_value": pl.Float64, "gain": pl.Float64,
        "sources": pl.String})
    if not icts or not baselines:
        return None, frame
    paper = k == HEADLINE_K
    columns = ["ICT method", "vs", "comparisons", "average gain (points)", "maximum gain (points)",
               "where"] + (["paper (ICT abstract)"] if paper else [])
    rows, starts = [], []
    expected = len(cfg.experiment.sizes) * len(cfg.experiment.benchmarks)
    for ict in icts:
        starts.append(len(rows))
        for group in [[b] for b in baselines] + ([baselines] if len(baselines) > 1 else []):
            part = frame.filter((pl.col("ict") == ict) & pl.col("baseline").is_in(group))
            label = (", ".join(method_label(cfg, b) for b in group) if len(group) > 1
                     else method_label(cfg, group[0]))
            full = part.height == expected * len(group)
            if part.height and full:
                best = part.sort("gain", descending=True).row(0, named=True)
                avg, top = f"{part['gain'].mean():+.2f}", f"{best['gain']:+.1f}"
                where = (f"{size_label(cfg, best['size'])}, {bench_label(cfg, best['bench'])}"
                         + (f", vs {method_label(cfg, best['baseline'])}" if len(group) > 1 else ""))
            else:
                avg = top = where = MISSING
            row = [method_label(cfg, ict), label, f"{part.height}/{expected * len(group)}", avg, top, where]
            if paper:
                row.append(f"{PAPER_ICT_AVG} avg, {PAPER_ICT_MAX} max" if len(group) == len(baselines)
                           else MISSING)
            rows.append(row)
    notes = [
        f"Ours: ICT pass@{k} minus the baseline's, per size × benchmark (mean over seeds), in "
        "percentage points; average and maximum over those comparisons (— until all are present). "
        f"Per-comparison numbers: ict_gains_pass{k}.csv.",
    ]
    if paper:
        notes.append("Paper: " + PAPER_ICT)
    t = Table(f"ICT against the baselines, pass@{k}", columns, rows, None, starts, notes,
              align="llrrrl" + ("l" if paper else ""))
    return t, frame


def main_metrics(cfg: Config) -> list[str]:
    """The main tables' metrics, the headline first: pass@k for each k, and the headline when it
    is avg@n."""
    hl = headline(cfg)
    ks = [f"pass@{k}" for k in cfg.evaluate.k]
    return [hl] + [m for m in sorted(ks, key=lambda m: int(m.split("@")[1])) if m != hl]


def main_files(cfg: Config) -> list[str]:
    ks = cfg.evaluate.k
    avg = [] if headline(cfg).startswith("pass@") else table_files(f"main_{metric_key(headline(cfg))}")
    return avg + [n for k in ks for n in table_files(f"main_pass{k}")] + [f"ict_gains_pass{k}.csv" for k in ks]


@register_table("main_pass", order=10, files=main_files)
def write_main_pass(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    """One main table per k, ICT's gains below it (and one of avg@n when it is the headline); on
    the pages the headline comes first."""
    shown = []
    problems = problems_of(cfg, data)
    for metric in main_metrics(cfg):
        key = metric_key(metric)
        table, frame = main_table(cfg, data.metrics, metric, problems)
        parts = [(table, f"tab:main-{key}")]
        if metric.startswith("pass@"):
            k = int(metric.split("@")[1])
            gains, gain_frame = ict_gains(cfg, data.metrics, k)
            parts += [(gains, f"tab:ict-gains-pass{k}")] if gains else []
            write_csv(gain_frame, folder / f"ict_gains_pass{k}.csv")
        write_table(parts, frame, folder / f"main_{key}")
        shown += [t for t, _ in parts]
    return shown
