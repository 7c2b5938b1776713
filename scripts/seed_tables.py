"""Print the per-seed tables of docs/results.md from one or more runs' eval_long.csv, a column
per run, so that a run on another machine can be set beside ours:

    python scripts/seed_tables.py "run A=results/default/tables/eval_long.csv" [LABEL=CSV ...]

Three Markdown tables: the base model's pass@1 per benchmark (one value per seed), each method's
pass@1 gain over the base model of the same seed (points; the seeds' mean and sample sd), and
each model's pass@4 averaged over the benchmarks. Benchmarks and methods keep the CSV's order of
first appearance, or the order of the first run's resolved_config.yaml (beside tables/), whose
labels they take. The values are the tables stage's own (metrics.parquet per evaluation), so nothing here
re-estimates anything."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import polars as pl
import yaml

from stages.core.report.render import MISSING, Table, markdown


def read_run(spec: str) -> tuple[str, pl.DataFrame, dict[str, str]]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"{spec!r}: expected LABEL=PATH/eval_long.csv")
    csv = Path(path)
    if not csv.is_file():
        raise SystemExit(f"{csv}: no such file (the tables stage writes tables/eval_long.csv)")
    rows = pl.read_csv(csv)
    missing = {"metric", "value", "method", "seed", "bench"} - set(rows.columns)
    if missing:
        raise SystemExit(f"{csv}: columns {sorted(missing)} missing; is it an eval_long.csv?")
    rows = rows.filter(pl.col("metric").is_in(["pass@1", "pass@4"]))
    names: dict[str, str] = {"base": "Base model"}
    order: list[str] = []
    resolved = csv.parent.parent / "resolved_config.yaml"
    if resolved.is_file():
        cfg = yaml.safe_load(resolved.read_text()) or {}
        exp = cfg.get("experiment") or {}
        order = [*(exp.get("benchmarks") or []), *(exp.get("methods") or [])]
        for section in ("datasets", "methods"):
            for key, entry in (cfg.get(section) or {}).items():
                if isinstance(entry, dict) and entry.get("label"):
                    names[key] = entry["label"]
    rank = {key: i for i, key in enumerate(order)}
    return label, rows.sort(pl.col("bench").replace_strict(rank, default=len(rank)),
                            pl.col("method").replace_strict(rank, default=len(rank)),
                            maintain_order=True), names


def values(rows: pl.DataFrame, metric: str, method: str, bench: str | None = None) -> dict[int, float]:
    """{seed: value in %} of one metric, one method, one benchmark (or the benchmarks' mean)."""
    sel = rows.filter((pl.col("metric") == metric) & (pl.col("method") == method))
    if bench is not None:
        sel = sel.filter(pl.col("bench") == bench)
    per_seed = sel.group_by("seed").agg(pl.col("value").mean()).sort("seed")
    return {int(s): 100 * float(v) for s, v in per_seed.iter_rows()}


def cell(points: list[float], signed: bool, sd: bool) -> str:
    if not points:
        return MISSING
    fmt = "{:+.1f}" if signed else "{:.1f}"
    text = ", ".join(fmt.format(p) for p in points)
    mean = statistics.fmean(points)
    mean_text = f"{mean:+.2f}" if signed else f"{mean:.2f}"
    spread = f", sd {statistics.stdev(points):.2f}" if sd and len(points) > 1 else ""
    return f"{text} (mean {mean_text}{spread})"


def main(specs: list[str]) -> None:
    if not specs:
        raise SystemExit(__doc__)
    runs = [read_run(s) for s in specs]
    names: dict[str, str] = {}
    for _, _, n in runs:
        names.update(n)
    first = runs[0][1]
    benches = list(dict.fromkeys(first["bench"].to_list()))
    methods = [m for m in dict.fromkeys(first["method"].to_list()) if m != "base"]
    labels = [label for label, _, _ in runs]

    def name(key: str) -> str:
        return names.get(key, key)

    # the base model's pass@1 per run and benchmark: its own row, and what each gain subtracts
    before = [{b: values(r, "pass@1", "base", b) for b in benches} for _, r, _ in runs]
    base = [[name(b)] + [cell(list(run[b].values()), False, False) for run in before] for b in benches]
    gains = []
    for b in benches:
        for m in methods:
            row = [name(b), name(m)]
            for (_, r, _), run in zip(runs, before, strict=True):
                trained = values(r, "pass@1", m, b)
                row.append(cell([trained[s] - run[b][s] for s in trained if s in run[b]], True, True))
            gains.append(row)
    avg = [[name(m)] + [cell(list(values(r, "pass@4", m).values()), False, False) for _, r, _ in runs]
           for m in ["base", *methods]]
    print(markdown(Table("Base model pass@1 (%), evaluated with each seed", ["benchmark", *labels], base)))
    print(markdown(Table("pass@1 gain over the base model of the same seed (points)",
                         ["benchmark", "method", *labels], gains, left_columns=2)))
    print(markdown(Table(f"pass@4, average of the {len(benches)} benchmarks (%)", ["method", *labels], avg)))


if __name__ == "__main__":
    main(sys.argv[1:])
