"""Stage 6: the tables and figures of the run, from every evaluation, training and token-statistics file.

    python -m stages.tables --config CFG \
        --eval results/<run>/eval/size=S/method=M/seed=K/bench=B ... \
        --train results/<run>/train/size=S/method=M/seed=K ... \
        --token-stats results/<run>/token_stats/size=S ... \
        --tables-dir results/<run>/tables --figures-dir results/<run>/figures

Each folder is named by its hive keys (size=, method=, seed=, bench=), which is all the stage
needs to place its numbers; a cell of the grid without a folder shows "—". Tables are written as
Markdown, LaTeX (booktabs) and CSV (unformatted numbers and the file each came from), plus one
HTML page for the Snakemake report; `sources.csv` lists every file read with its provenance.
The papers' numbers (stages.core.reported) stand in their own labelled columns beside ours
(main_total, ablation, the ICT-gain summary), never in our cells.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from . import cli
from .config import Config
from .core import render, reported
from .core.io import ArtifactError, atomic_path, read_parquet, read_provenance
from .core.metrics import bootstrap_ci
from .core.render import MISSING, Table, bold_best, glob_of, mean_or_none, pct
from .evaluate import METRIC_SCHEMA

STAGE_VERSION = "1"
HEADLINE_K = 4  # ICT reports pass@4

# What the papers report (METHODS §7, stages.core.reported), printed beside our numbers and never
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
PAPER_TOKENS = ("20-Entropy paper (Qwen3-8B chains of thought): over 50% of tokens have H < 0.01 and "
                "only 20% exceed H = 0.672 (its 80th percentile). STAPO paper: about 0.01% of tokens "
                "silenced. Different models and data from ours: a reference point, not a target.")
PAPER_ABLATION = ("20-Entropy paper (Qwen3, DAPO): ρ = 10% and 50%/100% both do worse than 20%; training "
                  "only on the bottom 80% degrades sharply.")
TABLE1_LABEL = "reported (summaries of ICT Table 1)"
RATIO_LABEL = "reported: ICT ratio ablation (Qwen2.5-1.5B, GSM8K)"
RATIO_SCOPE = "Qwen2.5-1.5B trained and tested on GSM8K, as reported by summaries of the ICT paper"
CURVES = [("reward_mean", "reward (mean)", False), ("entropy_mean", "entropy H (nats)", True),
          ("renyi2_mean", "Rényi-2 entropy H₂ (nats)", True),
          ("selected_fraction", "fraction of tokens selected", False),
          ("clip_fraction", "clip fraction", False),
          ("response_length_mean", "response length (tokens)", False)]
SELECTOR_PAIRS = [("entropy20", "stapo"), ("entropy20", "ict"), ("stapo", "ict")]


# ---------------------------------------------------------------------------------------------
# Names, labels and the method groups
# ---------------------------------------------------------------------------------------------
NOT_ICT = "not ICT"
READINGS = {"token_id": "JSD token-id reading", "scope_position": "JSD scope-position reading"}
"""ICT variants that are our earlier readings, contradicted by the recovered text (METHODS §3):
labelled as ours and never as ICT."""


def _non_default(selector: str, params: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """`params` that differ from the selector's defaults, printed (ρ=0.2, part=frequent)."""
    from .core.selectors import spec_of

    default = spec_of(selector).validate({}).model_dump()
    return [_param_text(k, v) for k, v in params.items()
            if k not in skip and k != "seed" and v != default.get(k)]


def _param_text(key: str, value) -> str:
    name = {"rho": "ρ", "tau_p": "τ_p"}.get(key, key)
    return f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"


def is_reading(cfg: Config, name: str) -> bool:
    """An `ict`-selector method with one of our earlier readings (token_id, scope_position)."""
    m = cfg.methods.get(name)
    return m is not None and m.selector == "ict" and m.selector_params()["variant"] in READINGS


def is_ict(cfg: Config, name: str) -> bool:
    """ICT's rule as the paper defines it: variant paper, the top ρ (not the 'frequent' complement)."""
    m = cfg.methods.get(name)
    if m is None or m.selector != "ict":
        return False
    p = m.selector_params()
    return p["variant"] == "paper" and p["part"] == "unique"


def method_label(cfg: Config, name: str) -> str:
    """The printed name. ICT's rule without a label is 'ICT' (with its parameters where they
    differ from the defaults); our earlier readings never read as ICT: without a label they are
    'JSD token-id reading (ours, not ICT)' and so on, and a label that does not say 'not ICT'
    is put after the reading's name."""
    if name == "base":
        return "Base model"
    m = cfg.methods[name]
    if m.selector != "ict":
        return m.label or name
    params = m.selector_params()
    variant = params["variant"]
    if variant == "paper":
        if m.label:
            return m.label
        if params["part"] == "frequent":  # the paper's "90%-frequent" control
            extra = _non_default("ict", params, skip=("rho", "part"))
            return (f"{round(100 * (1 - params['rho']), 6):g}%-frequent (complement of ICT)"
                    + (f" ({', '.join(extra)})" if extra else ""))
        extra = _non_default("ict", params)
        return "ICT" + (f" ({', '.join(extra)})" if extra else "")
    if m.label:
        return m.label if NOT_ICT.lower() in m.label.lower() else (
            f"{READINGS[variant]} (ours, {NOT_ICT}): {m.label}")
    extra = _non_default("ict", params, skip=("variant",))
    return f"{READINGS[variant]}{''.join(' ' + e for e in extra)} (ours, {NOT_ICT})"


def method_params(cfg: Config, name: str) -> str:
    """The selector and its parameters (all of them, defaults included), and the warm-up Θ."""
    m = cfg.methods[name]
    parts = [m.selector]
    for key, value in m.selector_params().items():
        if key == "seed" or (key, value) in (("variant", "paper"), ("part", "unique")):
            continue  # the trainer's generator replaces the seed; paper/unique: ICT's rule
        if key == "variant":
            parts.append(f"{value} reading (ours, {NOT_ICT})")
        else:
            parts.append(_param_text(key, value))
    parts += [f"Θ={m.warmup_steps}"] if m.warmup_steps else []
    return ", ".join(parts)


def size_label(cfg: Config, size: str) -> str:
    return cfg.models[size].label or size


def bench_label(cfg: Config, bench: str) -> str:
    return cfg.datasets[bench].label or bench


def method_groups(cfg: Config) -> tuple[list[str], list[str]]:
    """(methods of the main table, methods only in the ablation table), in experiment order."""
    main = cfg.evaluate.main_methods
    if main is None:
        return list(cfg.experiment.methods), []
    main = [m for m in cfg.experiment.methods if m in main]
    return main, [m for m in cfg.experiment.methods if m not in main]


def grpo_method(cfg: Config, methods: list[str]) -> str | None:
    """The full-token baseline that Δ columns compare with: the first method training on all tokens."""
    return next((m for m in methods if cfg.methods[m].selector == "all"), None)


def headline_k(cfg: Config) -> int:
    return HEADLINE_K if HEADLINE_K in cfg.evaluate.k else max(cfg.evaluate.k)


def output_names(cfg: Config) -> dict[str, list[str]]:
    """File names the stage writes, relative to the tables and figures folders (for the rules)."""
    _, ablation = method_groups(cfg)
    tables = [f"main_pass{k}.{ext}" for k in cfg.evaluate.k for ext in ("md", "tex", "csv")]
    tables += [f"ict_gains_pass{k}.csv" for k in cfg.evaluate.k]
    if has_total(cfg):
        tables += [f"main_total.{ext}" for ext in ("md", "tex", "csv")]
    tables += [f"base_gains.{ext}" for ext in ("md", "tex", "csv")]
    tables += [f"token_stats.{ext}" for ext in ("md", "tex", "csv")]
    if ablation:
        tables += [f"ablation.{ext}" for ext in ("md", "tex", "csv")]
    tables += ["eval_long.csv", "sources.csv", "tables.md", "tables.html"]
    figures = [f"training_{s}.png" for s in cfg.experiment.sizes]
    figures += [f"pass_at_k_{s}.png" for s in cfg.experiment.sizes]
    figures += ["entropy_hist.png"]
    return {"tables": tables, "figures": figures}


# ---------------------------------------------------------------------------------------------
# Loading: each folder's hive keys become columns
# ---------------------------------------------------------------------------------------------
def hive_keys(path: str | Path, keys: tuple[str, ...]) -> dict[str, str]:
    found = dict(part.split("=", 1) for part in Path(path).parts if "=" in part)
    missing = [k for k in keys if k not in found]
    if missing:
        raise ArtifactError(f"{path}: the path names no {', '.join(k + '=' for k in missing)} "
                            f"(expected .../{'/'.join(k + '=...' for k in keys)})")
    return {k: found[k] for k in keys}


@dataclass
class Loaded:
    metrics: pl.DataFrame  # size, method, seed, bench, metric, k, value, ci_low, ci_high, ..., source
    counts: pl.DataFrame  # size, method, seed, bench, problem_id, n, c, source
    train: pl.DataFrame  # size, method, seed, step, <training metrics>, source
    token_stats: pl.DataFrame  # one row per size: summary.parquet columns + source
    entropy: dict[str, object]  # size -> numpy array of per-token entropies
    sources: list[str]


EVAL_KEYS = ("size", "method", "seed", "bench")
TRAIN_KEYS = ("size", "method", "seed")


def _with_keys(frame: pl.DataFrame, keys: dict[str, str], source: Path) -> pl.DataFrame:
    cols = {k: pl.lit(int(v) if k == "seed" else v) for k, v in keys.items()}
    return frame.with_columns(**cols, source=pl.lit(str(source)))


def _scan(path: Path, *columns: str) -> pl.LazyFrame:
    if not path.exists():
        raise ArtifactError(f"{path}: file not found")
    return pl.scan_parquet(path).select(*columns)


def load(eval_dirs: list[str], train_dirs: list[str], token_dirs: list[str]) -> Loaded:
    metrics, counts, train, stats, sources = [], [], [], [], []
    entropy = {}
    for d in map(Path, eval_dirs):
        keys = hive_keys(d, EVAL_KEYS)
        m = read_parquet(d / "metrics.parquet", METRIC_SCHEMA).select(METRIC_SCHEMA.names)
        metrics.append(_with_keys(m, keys, d / "metrics.parquet"))
        s = _scan(d / "samples.parquet", "problem_id", "correct")
        per_problem = (s.group_by("problem_id", maintain_order=True)
                       .agg(n=pl.len(), c=pl.col("correct").sum()).collect())
        counts.append(_with_keys(per_problem, keys, d / "samples.parquet"))
        sources += [d / "metrics.parquet", d / "samples.parquet"]
    for d in map(Path, train_dirs):
        keys = hive_keys(d, TRAIN_KEYS)
        t = read_parquet(d / "metrics.parquet")
        if "step" not in t.columns:
            raise ArtifactError(f"{d / 'metrics.parquet'}: no 'step' column")
        keep = ["step", *(c for c, _, _ in CURVES if c in t.columns)]
        train.append(_with_keys(t.select(keep).cast({c: pl.Float64 for c in keep[1:]}),
                                keys, d / "metrics.parquet"))
        sources.append(d / "metrics.parquet")
    for d in map(Path, token_dirs):
        size = hive_keys(d, ("size",))["size"]
        summary = read_parquet(d / "summary.parquet")
        stats.append(summary.with_columns(source=pl.lit(str(d / "summary.parquet"))))
        entropy[size] = _scan(d / "tokens.parquet", "entropy").collect()["entropy"].to_numpy()
        sources += [d / "summary.parquet", d / "tokens.parquet"]
    return Loaded(
        metrics=pl.concat(metrics, how="diagonal_relaxed") if metrics else pl.DataFrame(),
        counts=pl.concat(counts) if counts else pl.DataFrame(),
        train=pl.concat(train, how="diagonal_relaxed") if train else pl.DataFrame(),
        token_stats=pl.concat(stats, how="diagonal_relaxed") if stats else pl.DataFrame(),
        entropy=entropy,
        sources=[str(p) for p in sources],
    )


# ---------------------------------------------------------------------------------------------
# Cells: one number per size x method x benchmark (mean over seeds)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    value: float  # a fraction in [0, 1]
    ci_low: float | None  # 95% bootstrap over problems; None when averaged over seeds
    ci_high: float | None
    seeds: int
    sources: tuple[str, ...]


def cells(metrics: pl.DataFrame, metric: str, seeds: list[int]) -> dict[tuple[str, str, str], Cell]:
    """The mean over `seeds` per size x method x benchmark; a cell missing any seed is left out."""
    if metrics.is_empty():
        return {}
    rows = (metrics.filter((pl.col("metric") == metric) & pl.col("seed").is_in(seeds))
            .group_by("size", "method", "bench")
            .agg(value=pl.col("value").mean(), ci_low=pl.col("ci_low").first(),
                 ci_high=pl.col("ci_high").first(), seeds=pl.col("seed").n_unique(),
                 sources=pl.col("source").sort()))
    out = {}
    for r in rows.iter_rows(named=True):
        if r["seeds"] != len(set(seeds)):
            continue
        single = r["seeds"] == 1
        out[r["size"], r["method"], r["bench"]] = Cell(
            r["value"], r["ci_low"] if single else None, r["ci_high"] if single else None,
            r["seeds"], tuple(r["sources"]))
    return out


def sources_note(paths: list[str], csv_name: str) -> str:
    files = sorted(set(paths))
    if not files:
        return "Sources: none yet (no input files)."
    return (f"Sources: {glob_of(files)} ({len(files)} file{'s' if len(files) > 1 else ''}; the file "
            f"of each number is in {csv_name}, their provenance in sources.csv).")


# ---------------------------------------------------------------------------------------------
# 1. Main table
# ---------------------------------------------------------------------------------------------
def main_table(cfg: Config, metrics: pl.DataFrame, k: int) -> tuple[Table, pl.DataFrame]:
    exp = cfg.experiment
    main, _ = method_groups(cfg)
    methods = ["base", *main]
    grpo = grpo_method(cfg, main)
    table = cells(metrics, f"pass@{k}", cfg.experiment.seeds)
    benches = list(exp.benchmarks)
    columns = ["Size", "Method", *(bench_label(cfg, b) for b in benches), "Avg."]
    if grpo:
        columns.append(f"Δ Avg. vs {method_label(cfg, grpo)}")
    rows, bold, starts, csv_rows, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        block = []
        for method in methods:
            values = [table[size, method, b].value if (size, method, b) in table else None
                      for b in benches]
            block.append([*values, mean_or_none(values)])
        grpo_avg = block[methods.index(grpo)][-1] if grpo else None
        marks = bold_best(block)
        for i, (method, values) in enumerate(zip(methods, block, strict=True)):
            avg = values[-1]
            delta = (avg - grpo_avg) if grpo and method != grpo and None not in (avg, grpo_avg) else None
            row = [size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                   *(pct(v) for v in values)]
            if grpo:
                row.append("ref." if method == grpo else pct(delta, signed=True))
            rows.append(row)
            bold.append([False, False, *marks[i]] + ([False] if grpo else []))
            record = {"size": size, "method": method, "label": method_label(cfg, method),
                      "metric": f"pass@{k}"}
            for b in benches:
                c = table.get((size, method, b))
                record[f"{b}"] = 100 * c.value if c else None
                record[f"{b}_ci_low"] = 100 * c.ci_low if c and c.ci_low is not None else None
                record[f"{b}_ci_high"] = 100 * c.ci_high if c and c.ci_high is not None else None
                if grpo and c and (size, grpo, b) in table and method != grpo:
                    record[f"{b}_delta_vs_grpo"] = 100 * (c.value - table[size, grpo, b].value)
                else:
                    record[f"{b}_delta_vs_grpo"] = None
            record["avg"] = None if avg is None else 100 * avg
            record["avg_delta_vs_grpo"] = None if delta is None else 100 * delta
            record["best_in_size"] = ";".join(
                col for col, m in zip([*benches, "avg"], marks[i], strict=True) if m)
            files = [s for b in benches if (size, method, b) in table for s in table[size, method, b].sources]
            record["sources"] = ";".join(files)
            used += files
            csv_rows.append(record)
    seeds = sorted(set(cfg.experiment.seeds))
    ev = cfg.evaluate
    notes = [
        f"pass@{k} in %: unbiased estimator from n = {ev.n} samples per problem (T = {ev.temperature:g}, "
        f"top-p = {ev.top_p:g}, at most {ev.max_new_tokens} new tokens), mean over problems"
        + (f", then over seeds {', '.join(map(str, seeds))} (— unless all are present)"
           if len(seeds) > 1 else "")
        + ". Bold: best per size. Avg.: unweighted mean over the benchmarks (— if one is missing)."
        + (f" Δ: Avg. minus {method_label(cfg, grpo)}'s Avg., in points." if grpo else ""),
        f"95% bootstrap intervals over problems ({ev.bootstrap} resamples): main_pass{k}.csv.",
        "ICT rows follow the paper's rule as summaries of its text give it (METHODS §3); rows "
        f"marked '{NOT_ICT}' are our earlier readings. Every cell is ours"
        + (": the paper's numbers stand beside ours in main_total, never in these cells."
           if has_total(cfg) else "."),
        sources_note(used, f"main_pass{k}.csv"),
    ]
    title = f"Main results: pass@{k} (%) per size, method and benchmark"
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


# ---------------------------------------------------------------------------------------------
# 1b. Total (mean of pass@1 and pass@4), ours beside ICT's Table 1
# ---------------------------------------------------------------------------------------------
TOTAL_KS = (1, 4)  # ICT's Total is the mean of P@1 and P@4
_PAPER_SIZE = re.compile(r"(?<![0-9.])(0\.5|1\.5|7)b(?![a-z0-9])")


def paper_size(cfg: Config, size: str) -> str | None:
    """The size of ICT's Table 1 a hub model stands for ('0.5B', '1.5B', '7B'), from '0.5b',
    '1.5b' or '7b' in its model id or else its size key (case-insensitive); None for scratch
    models and for names with none of them (or with two different ones)."""
    model = cfg.models[size]
    if model.source != "hub":
        return None
    for name in (model.hub.model_id, size):
        found = {m.group(1) for m in _PAPER_SIZE.finditer(name.lower())}
        if len(found) == 1:
            return f"{found.pop()}B"
        if found:
            return None
    return None


def has_total(cfg: Config) -> bool:
    return set(TOTAL_KS) <= set(cfg.evaluate.k)


def reported_text(v: float | None) -> str:
    return MISSING if v is None else f"{v:.2f}"  # as printed: two decimals


def main_total_table(cfg: Config, metrics: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    """Per size x method: our P@1, P@4 and Total (their mean), each averaged over our benchmarks;
    beside them, in their own columns, the reported P@1 / P@4 / Total of the method's paper_row
    at the matching paper size (reported.TABLE1)."""
    exp = cfg.experiment
    main, _ = method_groups(cfg)
    methods = ["base", *main]
    by_k = {k: cells(metrics, f"pass@{k}", exp.seeds) for k in TOTAL_KS}
    columns = ["Size", "Method", "P@1 (ours)", "P@4 (ours)", "Total (ours)", TABLE1_LABEL,
               "P@1 (rep.)", "P@4 (rep.)", "Total (rep.)"]
    rows, bold, starts, records, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        psize = paper_size(cfg, size)
        block, files = [], []
        for method in methods:
            avgs = [mean_or_none([by_k[k][size, method, b].value if (size, method, b) in by_k[k]
                                  else None for b in exp.benchmarks]) for k in TOTAL_KS]
            block.append([*avgs, mean_or_none(avgs)])
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
                         pct(p1), pct(p4), pct(total), where,
                         *(reported_text(getattr(rep, f) if rep else None) for f in ("p1", "p4", "total"))])
            bold.append([False, False, *marks[i], False, False, False, False])
            records.append({
                "size": size, "method": method, "label": method_label(cfg, method),
                "pass1_avg": None if p1 is None else 100 * p1,
                "pass4_avg": None if p4 is None else 100 * p4,
                "total": None if total is None else 100 * total,
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
        "Bold: best of ours per size. Per-benchmark cells: main_pass1, main_pass4.",
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
    frame = pl.DataFrame(records, schema={
        "size": pl.String, "method": pl.String, "label": pl.String, "pass1_avg": pl.Float64,
        "pass4_avg": pl.Float64, "total": pl.Float64, "best_in_size": pl.String,
        "reported_size": pl.String, "reported_row": pl.String, "reported_p1": pl.Float64,
        "reported_p4": pl.Float64, "reported_total": pl.Float64, "reported_source": pl.String,
        "sources": pl.String})
    return t, frame


# ---------------------------------------------------------------------------------------------
# 2. Gains over the base model, paired over problems
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gain:
    delta: float  # mean over problems of (trained accuracy − base accuracy), a fraction
    ci_low: float  # 95% percentile bootstrap over problems of that mean
    ci_high: float
    n_problems: int


def problem_accuracy(counts: pl.DataFrame, seeds: list[int]) -> dict[tuple[str, str, str], dict[str, float]]:
    """size x method x bench -> {problem_id: accuracy c/n, averaged over `seeds`}; an evaluation
    missing any seed is left out."""
    if counts.is_empty():
        return {}
    need = len(set(seeds))
    rows = (counts.filter(pl.col("seed").is_in(seeds))
            .with_columns(acc=pl.col("c") / pl.col("n"))
            .group_by("size", "method", "bench", "problem_id")
            .agg(acc=pl.col("acc").mean(), seeds=pl.col("seed").n_unique()))
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for (size, method, bench), part in rows.group_by("size", "method", "bench"):
        if part["seeds"].min() == need:
            out[size, method, bench] = dict(zip(part["problem_id"].to_list(), part["acc"].to_list(),
                                                strict=True))
    return out


def paired_gain(base: dict[str, float], trained: dict[str, float], resamples: int, seed: int,
                where: str) -> Gain:
    """Mean per-problem difference trained − base and its percentile-bootstrap interval.

    Resampling problems (not the two models separately) keeps each problem's pair together, so
    the interval is that of the difference, much narrower than the two accuracies' intervals."""
    if set(base) != set(trained):
        raise ArtifactError(f"{where}: the trained model and the base model were evaluated on different "
                            f"problems ({len(set(base) ^ set(trained))} problem ids in only one)")
    ids = sorted(base)
    diff = np.array([trained[i] - base[i] for i in ids], dtype=np.float64)  # (problems,)
    low, high = bootstrap_ci(diff, resamples, seed)
    return Gain(float(diff.mean()), low, high, len(ids))


def gain_text(g: Gain | None) -> str:
    if g is None:
        return MISSING
    return f"{pct(g.delta, signed=True)} [{pct(g.ci_low, signed=True)}, {pct(g.ci_high, signed=True)}]"


def base_gain_table(cfg: Config, counts: pl.DataFrame) -> tuple[Table, pl.DataFrame]:
    """pass@1 of every trained model minus its base model's, per benchmark, paired over problems."""
    exp, ev = cfg.experiment, cfg.evaluate
    acc = problem_accuracy(counts, exp.seeds)
    sources = {} if counts.is_empty() else {
        key: sorted(part["source"].unique().to_list())
        for key, part in counts.filter(pl.col("seed").is_in(exp.seeds)).group_by("size", "method", "bench")}
    benches = list(exp.benchmarks)
    columns = ["Size", "Method", *(bench_label(cfg, b) for b in benches), "Avg. Δ"]
    rows, bold, starts, records, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        for i, method in enumerate(exp.methods):
            gains = []
            for b in benches:
                base, trained = acc.get((size, "base", b)), acc.get((size, method, b))
                g = None
                if base is not None and trained is not None:
                    files = sources[size, "base", b] + sources[size, method, b]
                    g = paired_gain(base, trained, ev.bootstrap, cfg.seed, " and ".join(files))
                    used += files
                    records.append({"size": size, "method": method, "label": method_label(cfg, method),
                                    "bench": b, "metric": "pass@1", "delta": 100 * g.delta,
                                    "ci_low": 100 * g.ci_low, "ci_high": 100 * g.ci_high,
                                    "n_problems": g.n_problems, "sources": ";".join(files)})
                gains.append(g)
            avg = mean_or_none([g.delta if g else None for g in gains])
            rows.append([size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                         *(gain_text(g) for g in gains), pct(avg, signed=True)])
            # bold: the interval excludes zero (a gain or a loss the evaluation can tell apart)
            bold.append([False, False, *(g is not None and (g.ci_low > 0 or g.ci_high < 0) for g in gains),
                         False])
    seeds = sorted(set(exp.seeds))
    notes = [
        f"Trained model's pass@1 minus its base model's, in points, on the same problems (n = {ev.n} "
        f"samples each, T = {ev.temperature:g})"
        + (f", accuracies averaged over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else "")
        + f"; [95% percentile bootstrap over problems of the paired difference, {ev.bootstrap} resamples]. "
        "Bold: the interval excludes 0. Avg. Δ: unweighted mean over the benchmarks (— if one is missing). "
        "Seed-to-seed variation of training is not in the interval.",
        sources_note(used, "base_gains.csv"),
    ]
    t = Table("Gain over the base model: pass@1, paired over problems", columns, rows, bold, starts, notes,
              left_columns=2)
    frame = pl.DataFrame(records, schema={
        "size": pl.String, "method": pl.String, "label": pl.String, "bench": pl.String,
        "metric": pl.String, "delta": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
        "n_problems": pl.Int64, "sources": pl.String})
    return t, frame


# ---------------------------------------------------------------------------------------------
# 3. Token statistics
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# 4. Ablations
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# 5. Figures
# ---------------------------------------------------------------------------------------------
def _styles(cfg: Config, methods: list[str]) -> dict[str, dict]:
    """Line style per method: the base model dotted black, ablations dashed."""
    main, _ = method_groups(cfg)
    styles, colour = {}, 0
    for m in methods:
        if m == "base":
            styles[m] = {"color": "black", "linestyle": ":"}
        else:
            styles[m] = {"color": f"C{colour % 10}", "linestyle": "-" if m in main else "--"}
            colour += 1
    return styles


def training_figure(cfg: Config, size: str, train: pl.DataFrame, path: Path) -> None:
    from .core import figures

    methods = list(cfg.experiment.methods)
    runs = train.filter(pl.col("size") == size) if not train.is_empty() else train
    figures.training_curves(
        runs, CURVES, methods, {m: method_label(cfg, m) for m in methods}, _styles(cfg, methods),
        f"Training curves, {size_label(cfg, size)} (one line per method and seed)", path)


def pass_at_k_curves(counts: pl.DataFrame) -> pl.DataFrame:
    """Mean pass@k over problems for k = 1..n, per size x method x seed x bench."""
    from .core import figures

    keys = ["size", "method", "seed", "bench"]
    if counts.is_empty():
        return pl.DataFrame(schema={"size": pl.String, "method": pl.String, "seed": pl.Int64,
                                    "bench": pl.String, "k": pl.Int64, "value": pl.Float64})
    return figures.pass_at_k_table(counts, keys)


def pass_at_k_figure(cfg: Config, size: str, curves: pl.DataFrame, path: Path) -> None:
    from .core import figures

    methods = ["base", *cfg.experiment.methods]
    benches = list(cfg.experiment.benchmarks)
    panels = [(b, bench_label(cfg, b)) for b in benches]
    if len(benches) > 1:
        panels.append((None, "average"))
    # mean over the configured seeds; a method missing a seed on a benchmark is not drawn there
    seeds = sorted(set(cfg.experiment.seeds))
    data = (curves.filter((pl.col("size") == size) & pl.col("seed").is_in(seeds))
            .group_by("method", "bench", "k").agg(pl.col("value").mean(), pl.col("seed").n_unique())
            .filter(pl.col("seed") == len(seeds)).drop("seed"))
    figures.pass_at_k_panels(
        data, panels, methods, {m: method_label(cfg, m) for m in methods}, _styles(cfg, methods),
        cfg.evaluate.n, f"pass@k against k, {size_label(cfg, size)} (unbiased, n = {cfg.evaluate.n})",
        path)


def entropy_figure(cfg: Config, entropy: dict, path: Path) -> None:
    from .core import figures, plots

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


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def write_csv(frame: pl.DataFrame, path: Path) -> None:
    frame = frame.with_columns(pl.col(c).cast(pl.List(pl.String)).list.join(";")
                               for c, t in frame.schema.items()
                               if isinstance(t, pl.List))
    with atomic_path(path, ".csv") as tmp:
        frame.write_csv(tmp)


def write_table(tables: list[tuple[Table, str]], frame: pl.DataFrame, stem: Path) -> None:
    render.write_text(stem.with_suffix(".md"), "\n".join(render.markdown(t) for t, _ in tables))
    render.write_text(stem.with_suffix(".tex"), "\n".join(render.latex(t, label) for t, label in tables))
    write_csv(frame, stem.with_suffix(".csv"))


def sources_frame(paths: list[str]) -> pl.DataFrame:
    rows = []
    for p in sorted(set(paths)):
        prov = read_provenance(p)
        rows.append({"file": p, "stage": prov.get("stage"), "stage_version": prov.get("stage_version"),
                     "config_hash": prov.get("config_hash"), "seed": prov.get("seed"),
                     "git_commit": prov.get("git_commit")})
    return pl.DataFrame(rows, schema={"file": pl.String, "stage": pl.String, "stage_version": pl.String,
                                      "config_hash": pl.String, "seed": pl.Int64, "git_commit": pl.String})


def check_grid(cfg: Config, data: Loaded) -> None:
    """Warn about folders outside the configured grid (they are left out of the tables)."""
    if data.metrics.is_empty():
        cli.log.warning("no evaluations given: every cell of the main table is '—'")
        return
    grid_methods = {"base", *cfg.experiment.methods}
    outside = data.metrics.filter(~pl.col("size").is_in(cfg.experiment.sizes)
                                  | ~pl.col("method").is_in(grid_methods)
                                  | ~pl.col("bench").is_in(cfg.experiment.benchmarks))
    for source in outside["source"].unique().sort().to_list():
        cli.log.warning("%s is outside the configured grid; not in the tables", source)


def main(args, cfg: Config) -> None:
    data = load(args.eval or [], args.train or [], args.token_stats or [])
    check_grid(cfg, data)
    tables_dir, figures_dir = Path(args.tables_dir), Path(args.figures_dir)
    everything: list[Table] = []
    hk = headline_k(cfg)
    for k in sorted(cfg.evaluate.k, key=lambda k: (k != hk, k)):
        table, frame = main_table(cfg, data.metrics, k)
        gains, gain_frame = ict_gains(cfg, data.metrics, k)
        parts = [(table, f"tab:main-pass{k}")] + ([(gains, f"tab:ict-gains-pass{k}")] if gains else [])
        write_table(parts, frame, tables_dir / f"main_pass{k}")
        write_csv(gain_frame, tables_dir / f"ict_gains_pass{k}.csv")
        everything += [t for t, _ in parts]
    if has_total(cfg):
        table, frame = main_total_table(cfg, data.metrics)
        write_table([(table, "tab:main-total")], frame, tables_dir / "main_total")
        everything.append(table)
    table, frame = base_gain_table(cfg, data.counts)
    write_table([(table, "tab:base-gains")], frame, tables_dir / "base_gains")
    everything.append(table)
    table, frame = token_table(cfg, data.token_stats)
    write_table([(table, "tab:token-stats")], frame, tables_dir / "token_stats")
    everything.append(table)
    ablation = ablation_table(cfg, data.metrics)
    if ablation:
        table, frame = ablation
        write_table([(table, "tab:ablation")], frame, tables_dir / "ablation")
        everything.append(table)
    long = data.metrics.sort("size", "method", "seed", "bench", "metric") \
        if not data.metrics.is_empty() else data.metrics
    write_csv(long, tables_dir / "eval_long.csv")
    write_csv(sources_frame(data.sources), tables_dir / "sources.csv")
    title = f"ict-rlvr: tables of run '{cfg.run}'"
    render.write_text(tables_dir / "tables.md",
                      f"# {title}\n\n" + "\n".join(render.markdown(t) for t in everything))
    render.write_text(tables_dir / "tables.html", render.html_page(everything, title))

    curves = pass_at_k_curves(data.counts)
    for size in cfg.experiment.sizes:
        training_figure(cfg, size, data.train, figures_dir / f"training_{size}.png")
        pass_at_k_figure(cfg, size, curves, figures_dir / f"pass_at_k_{size}.png")
    entropy_figure(cfg, data.entropy, figures_dir / "entropy_hist.png")
    cli.log.info("%d evaluations, %d training runs, %d token-statistics summaries -> %s, %s",
                 data.metrics.select("source").n_unique() if not data.metrics.is_empty() else 0,
                 data.train.select("source").n_unique() if not data.train.is_empty() else 0,
                 data.token_stats.height, tables_dir, figures_dir)


def _check_outputs(cfg: Config, tables_dir: Path, figures_dir: Path) -> None:
    missing = [str(tables_dir / n) for n in output_names(cfg)["tables"] if not (tables_dir / n).exists()]
    missing += [str(figures_dir / n) for n in output_names(cfg)["figures"] if not (figures_dir / n).exists()]
    if missing:
        raise RuntimeError(f"the stage did not write {missing}")


def _main(args, cfg: Config) -> None:
    main(args, cfg)
    _check_outputs(cfg, Path(args.tables_dir), Path(args.figures_dir))


if __name__ == "__main__":
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--eval", nargs="*", help="evaluation folders (.../size=/method=/seed=/bench=)")
    p.add_argument("--train", nargs="*", help="training folders (.../size=/method=/seed=)")
    p.add_argument("--token-stats", nargs="*", help="token-statistics folders (.../size=)")
    p.add_argument("--tables-dir", required=True)
    p.add_argument("--figures-dir", required=True)
    cli.run(_main, p)
