"""The 80/20 paper's main table: our headline metric on AIME'24, AIME'25 and the mean over our
benchmarks per size x method, beside the Acc@16 the paper reports for the Qwen3 base models
(main_8020 .md/.tex/.csv; only when some experiment method's paper_row is one of its runs)."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report import reported
from ..core.report.render import MISSING, Table, bold_best, pct
from .labels import (
    bench_label,
    grpo_method,
    headline,
    hub_size,
    method_groups,
    method_label,
    metric_note,
    reference_row,
    size_label,
)
from .load import Loaded, avg_cell, cell_sources, cells, problems_of
from .registry import register_table
from .seeds import Problems, interval_columns, seed_columns, spread_note, spread_text
from .write import sources_note, table_files, write_table

REPORTED_LABEL = "reported (80/20 paper, Figure 1 and summaries)"
AIME = (("AIME'24", "aime24"), ("AIME'25", "aime25"))  # (reported_as, CSV column)
_QWEN3_SIZE = re.compile(r"(?<![0-9.])(8|14|32)b(?![a-z0-9])")


def qwen3_size(cfg: Config, size: str) -> str | None:
    """The Qwen3 size of the 80/20 paper a hub model stands for ('8B', '14B', '32B'): 'qwen3' and
    one of '8b', '14b', '32b' in its model id, else in its size key (case-insensitive)."""
    return hub_size(cfg, size, _QWEN3_SIZE, family="qwen3")


def _reported(v: float | None) -> str:
    """A reported number with the digits the paper gives (33.3, 55.83), not padded to two."""
    return MISSING if v is None else f"{v:g}"


def applies(cfg: Config) -> bool:
    return any(cfg.methods[m].paper_row in reported.ROWS_8020 for m in cfg.experiment.methods)


def benchmark_named(cfg: Config, name: str) -> str | None:
    """The experiment benchmark whose datasets.<b>.reported_as is `name` (the first), or None."""
    return next((b for b in cfg.experiment.benchmarks if cfg.datasets[b].reported_as == name), None)


def main_8020_table(cfg: Config, metrics: pl.DataFrame,
                    problems: Problems | None = None) -> tuple[Table, pl.DataFrame]:
    """Per size x method (base model, the full-token DAPO row, the others): our headline metric on
    the benchmarks reported as AIME'24 and AIME'25 and its mean over all our benchmarks, Δ of that
    mean against DAPO; beside them, in their own columns, the paper's Acc@16 of the method's
    paper_row at the matching Qwen3 size (reported.TABLE_8020)."""
    exp = cfg.experiment
    hl = headline(cfg)
    seeds = sorted(set(exp.seeds))
    main, _ = method_groups(cfg)
    methods = ["base", *reference_row(cfg, main)]
    dapo = grpo_method(cfg, main)
    table = cells(metrics, hl, exp.seeds, problems)
    benches = list(exp.benchmarks)
    aime = [(name, key, benchmark_named(cfg, name)) for name, key in AIME]
    mean_name = f"Mean of {len(benches)}"
    columns = ["Size", "Method", *(f"{name} (ours)" for name, _, _ in aime), f"{mean_name} (ours)"]
    if dapo:
        columns.append(f"Δ mean vs {method_label(cfg, dapo)}")
    columns += [REPORTED_LABEL, "AIME'24 (rep.)", "AIME'25 (rep.)", "mean of 6 (rep.)"]
    ours = len(aime) + 1
    rows, bold, starts, records, used = [], [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        qsize = qwen3_size(cfg, size)
        block, spreads = [], []
        for method in methods:
            got = [table.get((size, method, b)) if b else None for _, _, b in aime]
            avg, avg_seeds = avg_cell(table, size, method, benches)
            block.append([*(c.value if c else None for c in got), avg])
            spreads.append([*(c.per_seed if c else () for c in got), avg_seeds or ()])
        dapo_mean = block[methods.index(dapo)][-1] if dapo else None
        marks = bold_best(block)
        for i, method in enumerate(methods):
            mean = block[i][-1]
            delta = (mean - dapo_mean if dapo and method != dapo and None not in (mean, dapo_mean)
                     else None)
            row_name = None if method == "base" else cfg.methods[method].paper_row
            rep = reported.TABLE_8020.get((qsize, row_name)) if qsize and row_name else None
            row = [size_label(cfg, size) if i == 0 else "", method_label(cfg, method),
                   *(spread_text(v, sp) for v, sp in zip(block[i], spreads[i], strict=True))]
            if dapo:
                row.append("ref." if method == dapo else pct(delta, signed=True))
            row += [f"Qwen3-{qsize}-Base, {row_name}" if rep else MISSING,
                    *(_reported(getattr(rep, f) if rep else None) for f in ("aime24", "aime25", "mean6"))]
            rows.append(row)
            bold.append([False, False, *marks[i]] + [False] * (len(row) - 2 - ours))
            record = {"size": size, "method": method, "label": method_label(cfg, method),
                      "metric": hl}
            for (_, key, bench), value, per_seed in zip(aime, block[i][:-1], spreads[i][:-1], strict=True):
                c = table.get((size, method, bench)) if bench else None
                record |= {f"{key}_bench": bench, key: None if value is None else 100 * value,
                           f"{key}_ci_low": 100 * c.ci_low if c and c.ci_low is not None else None,
                           f"{key}_ci_high": 100 * c.ci_high if c and c.ci_high is not None else None,
                           **seed_columns(key, per_seed, len(seeds))}
            record["mean"] = None if mean is None else 100 * mean
            record |= interval_columns("mean", problems.interval(size, method, benches, [hl], seeds)
                                       if problems and mean is not None else None)
            record |= seed_columns("mean", spreads[i][-1], len(seeds))
            record["mean_delta_vs_dapo"] = None if delta is None else 100 * delta
            record["best_in_size"] = ";".join(
                col for col, m in zip([k for _, k in AIME] + ["mean"], marks[i], strict=True) if m)
            record |= {"reported_size": f"Qwen3-{qsize}-Base" if rep else None,
                       "reported_row": row_name if rep else None,
                       "reported_aime24": rep.aime24 if rep else None,
                       "reported_aime25": rep.aime25 if rep else None,
                       "reported_mean6": rep.mean6 if rep else None,
                       "reported_amc23": rep.amc23 if rep else None,
                       "reported_source": reported.PAPER_8020_SOURCE if rep else None}
            files = cell_sources(table, size, method, benches)
            record["sources"] = ";".join(files)
            used += files
            records.append(record)
    notes = _notes(cfg, hl, seeds, aime, dapo, used)
    t = Table(f"The 80/20 paper's main results: {hl} (%), ours beside the reported Acc@16",
              columns, rows, bold, starts, notes,
              align="ll" + "r" * (ours + (1 if dapo else 0)) + "lrrr")
    return t, pl.DataFrame(records, infer_schema_length=None)


def _notes(cfg: Config, hl: str, seeds: list[int], aime, dapo: str | None, used: list[str]) -> list[str]:
    exp, n = cfg.experiment, cfg.evaluate.n
    named = "; ".join(f"{name}: our benchmark {b} (its datasets.{b}.reported_as)" if b else
                      f"{name}: no benchmark of ours is reported as it (datasets.<name>.reported_as), —"
                      for name, _, b in aime)
    same = hl == "avg@16"
    amc = {r: reported.TABLE_8020["8B", r].amc23 for r in ("80/20: DAPO", "80/20: top-20% entropy")}
    late = reported.TABLE_8020["32B", "80/20: top-20% entropy, 29k"]
    return [
        "Ours: " + metric_note(cfg, hl) + ", mean over problems"
        + (f", then over seeds {', '.join(map(str, seeds))} (— unless all are present)" if len(seeds) > 1
           else f" (seed {seeds[0]})")
        + f". {named}. Mean of {len(exp.benchmarks)}: the unweighted mean over our benchmarks "
        f"({', '.join(bench_label(cfg, b) for b in exp.benchmarks)}; — if one is missing). "
        "Bold: best of ours per size."
        + (f" Δ: our mean minus {method_label(cfg, dapo)}'s, in points." if dapo else "")
        + spread_note(seeds)
        + (f" 95% intervals{' over seeds and problems' if len(seeds) > 1 else ''}: main_8020.csv."),
        "Acc@16 = avg@16: the mean accuracy over 16 samples per problem, not pass@16. "
        + ("Our metric is the same." if same else
           f"Ours is {hl} (evaluate.headline; n = {n}): not the same metric as the reported numbers."),
        f"{REPORTED_LABEL[0].upper() + REPORTED_LABEL[1:]}: Acc@16 in % of Qwen3-8B/14B/32B-Base trained "
        "with DAPO on DAPO-Math-17k, on all tokens (80/20: DAPO) or on the top-20% entropy tokens, for "
        "the method's paper_row at the Qwen3 size matching ours ('qwen3' and '8b', '14b' or '32b' in "
        "the hub model id or the size name; — where not known, and for the base model, whose numbers "
        f"are not reported); mean of 6: {', '.join(reported.PAPER_8020_BENCHMARKS)}. Also reported: "
        f"Qwen3-8B-Base AMC'23 {amc['80/20: DAPO']:.2f} (DAPO) and {amc['80/20: top-20% entropy']:.2f} "
        f"(top 20%); Qwen3-32B-Base top 20% at a 29k response length: {late.aime24:g} on AIME'24 (row "
        "'80/20: top-20% entropy, 29k'; its other settings are not known). The paper's models, data "
        "and benchmarks, not ours: printed beside our cells, never in them. "
        f"Source: {reported.PAPER_8020_SOURCE}.",
        sources_note(used, "main_8020.csv"),
    ]


@register_table("main_8020", order=15, files=lambda cfg: table_files("main_8020"), applies=applies)
def write_main_8020(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = main_8020_table(cfg, data.metrics, problems_of(cfg, data))
    write_table([(table, "tab:main-8020")], frame, folder / "main_8020")
    return [table]
