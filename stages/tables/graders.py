"""Graders side by side: per size x method x benchmark, avg@n under the benchmark's own grader and
under each grader of evaluate.graders, and how often they disagree on the same samples
(graders .md/.tex/.csv; only when evaluate.graders is set)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ..config import Config
from ..core.report.render import MISSING, Table, pct
from .labels import bench_label, method_label, size_label
from .load import Cell, Loaded, cells
from .registry import register_table
from .seeds import seed_columns, spread_note, spread_text
from .write import sources_note, table_files, write_table

GRADER_NOTE = (
    "A disagreement is information, not an error: math_dapo (verl's DAPO reward) reads only the "
    "last 'Answer:' line of a response's last 300 characters and compares normalised strings "
    "exactly (a \\boxed{} answer without that line is '[INVALID]'); verify reads the last \\boxed{} "
    "(or the text after an answer marker) and compares with our equivalence rules and math-verify. "
    "A large share says the accuracy depends on the answer format the prompt asks for as much as on "
    "the model.")


def disagreement(grades: pl.DataFrame, grader: str,
                 seeds: list[int]) -> dict[tuple[str, str, str], tuple[int, int, list[str]]]:
    """size x method x bench -> (samples where `grader` and the own grader differ, samples, the
    samples files), over problems and `seeds`; an evaluation missing any seed is left out."""
    if grades.is_empty():
        return {}
    rows = (grades.filter((pl.col("grader") == grader) & pl.col("seed").is_in(seeds))
            .group_by("size", "method", "bench")
            .agg(pl.col("disagree").sum(), pl.col("n").sum(), seeds=pl.col("seed").n_unique(),
                 sources=pl.col("source").unique().sort()))
    return {(r["size"], r["method"], r["bench"]): (r["disagree"], r["n"], r["sources"])
            for r in rows.iter_rows(named=True) if r["seeds"] == len(set(seeds))}


def graders_table(cfg: Config, data: Loaded) -> tuple[Table, pl.DataFrame]:
    exp = cfg.experiment
    metric = f"avg@{cfg.evaluate.n}"
    seeds = sorted(set(exp.seeds))
    extras = list(dict.fromkeys(cfg.evaluate.graders))
    own = cells(data.metrics, metric, exp.seeds)
    graded = data.graded if not data.graded.is_empty() else pl.DataFrame(
        schema={"grader": pl.String, "metric": pl.String, "seed": pl.Int64})
    by_grader = {g: cells(graded.filter(pl.col("grader") == g), metric, exp.seeds) for g in extras}
    differ = {g: disagreement(data.grades, g, exp.seeds) for g in extras}
    columns = ["Size", "Method", "Benchmark", "own grader", f"own {metric}"]
    for g in extras:
        columns += [f"{g} {metric}", f"{g} ≠ own (%)"]
    rows, starts, records, used = [], [], [], []
    for size in exp.sizes:
        starts.append(len(rows))
        for i, method in enumerate(["base", *exp.methods]):
            for j, bench in enumerate(exp.benchmarks):
                mine = cfg.datasets[bench].grader
                key = (size, method, bench)
                c = own.get(key)
                row = [size_label(cfg, size) if i == j == 0 else "",
                       method_label(cfg, method) if j == 0 else "", bench_label(cfg, bench), mine,
                       _text(c)]
                record = {"size": size, "method": method, "label": method_label(cfg, method),
                          "bench": bench, "metric": metric, "own_grader": mine,
                          "own": None if c is None else 100 * c.value,
                          **seed_columns("own", c.per_seed if c else None, len(seeds))}
                files = list(c.sources) if c else []
                for g in extras:
                    other = c if g == mine else by_grader[g].get(key)
                    split = differ[g].get(key)
                    share = None if split is None or not split[1] else split[0] / split[1]
                    row += [_text(other), "(own)" if g == mine else pct(share)]
                    record |= {g: None if other is None else 100 * other.value,
                               **seed_columns(g, other.per_seed if other else None, len(seeds)),
                               f"{g}_disagree": None if share is None else 100 * share,
                               f"{g}_samples_compared": None if split is None else split[1]}
                    files += (list(other.sources) if other and g != mine else []) + (split[2] if split else [])
                files = sorted(set(files))
                record["sources"] = ";".join(files)
                used += files
                rows.append(row)
                records.append(record)
    notes = [
        f"Ours: {metric} in % (the mean accuracy over the n = {cfg.evaluate.n} samples of each "
        "problem, mean over problems"
        + (f", then over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else "")
        + ") of the same samples under the benchmark's own grader (datasets.<name>.grader, the one "
        "every other table uses) and under each grader of evaluate.graders. ≠ own: the share of "
        "samples, pooled over problems" + (" and seeds" if len(seeds) > 1 else "")
        + ", whose correctness the two graders judge differently (samples.parquet: correct beside "
        "other_grades); (own): the benchmark's own grader." + spread_note(seeds),
        GRADER_NOTE,
        sources_note(used, "graders.csv"),
    ]
    t = Table(f"Graders side by side: {metric} (%) and disagreement per benchmark", columns, rows,
              None, starts, notes, align="llll" + "r" * (len(columns) - 4))
    return t, pl.DataFrame(records, infer_schema_length=None)


def _text(c: Cell | None) -> str:
    return MISSING if c is None else spread_text(c.value, c.per_seed)


@register_table("graders", order=60, files=lambda cfg: table_files("graders"),
                applies=lambda cfg: bool(cfg.evaluate.graders))
def write_graders(cfg: Config, data: Loaded, folder: Path) -> list[Table]:
    table, frame = graders_table(cfg, data)
    write_table([(table, "tab:graders")], frame, folder / "graders")
    return [table]
