"""scripts/seed_tables.py: the per-seed tables of docs/results.md from runs' eval_long.csv."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "seed_tables.py"


def load():
    spec = importlib.util.spec_from_file_location("seed_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(root: Path, rows: list[tuple[str, str, int, str, float]], config: str | None) -> Path:
    tables = root / "tables"
    tables.mkdir(parents=True)
    frame = pl.DataFrame(rows, schema=["metric", "method", "seed", "bench", "value"], orient="row")
    frame.write_csv(tables / "eval_long.csv")
    if config is not None:
        (root / "resolved_config.yaml").write_text(config)
    return tables / "eval_long.csv"


def test_gains_are_per_seed_differences_in_the_configs_order_with_its_labels(tmp_path, capsys):
    rows = []
    for bench, base1, grpo1 in (("b-mid", (0.50, 0.60), (0.53, 0.61)), ("a-easy", (0.80, 0.70), (0.80, 0.75))):
        for seed in (0, 1):
            rows += [("pass@1", "base", seed, bench, base1[seed]), ("pass@1", "grpo", seed, bench, grpo1[seed]),
                     ("pass@4", "base", seed, bench, base1[seed] + 0.1),
                     ("pass@4", "grpo", seed, bench, grpo1[seed] + 0.1),
                     ("avg@4", "grpo", seed, bench, 0.0)]  # other metrics are left out
    config = ("experiment: {benchmarks: [b-mid, a-easy], methods: [grpo]}\n"
              "datasets: {b-mid: {label: Mid}, a-easy: {label: Easy}}\n"
              "methods: {grpo: {label: GRPO}}\n")
    csv = write_run(tmp_path / "r", rows, config)
    load().main([f"run X={csv}"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    # the config's order (Mid before Easy), not the CSV's or the alphabet's
    assert lines.index("| Mid | 50.0, 60.0 (mean 55.00) |") < lines.index("| Easy | 80.0, 70.0 (mean 75.00) |")
    # gains per seed: Mid +3.0 and +1.0 (mean +2.00, sd √2 = 1.41); Easy +0.0 and +5.0
    assert "| Mid | GRPO | +3.0, +1.0 (mean +2.00, sd 1.41) |" in lines
    assert "| Easy | GRPO | +0.0, +5.0 (mean +2.50, sd 3.54) |" in lines
    # pass@4 averaged over the benchmarks per seed: base (0.6 + 0.9) / 2, (0.7 + 0.8) / 2
    assert "| Base model | 75.0, 75.0 (mean 75.00) |" in lines
    assert "| GRPO | 76.5, 78.0 (mean 77.25) |" in lines


def test_two_runs_stand_side_by_side_and_a_run_without_a_config_keeps_its_ids(tmp_path, capsys):
    rows = [("pass@1", m, s, "x", v) for m, s, v in
            (("base", 0, 0.5), ("grpo", 0, 0.6), ("base", 1, 0.5), ("grpo", 1, 0.4))]
    rows += [("pass@4", m, s, "x", v) for m, s, v in (("base", 0, 0.5), ("grpo", 0, 0.7))]
    one = write_run(tmp_path / "one", rows, None)
    two = write_run(tmp_path / "two", [r[:4] + (r[4] / 2,) for r in rows], None)
    load().main([f"A={one}", f"B={two}"])
    lines = capsys.readouterr().out.splitlines()
    assert "| benchmark | method | A | B |" in lines
    assert "| x | grpo | +10.0, -10.0 (mean +0.00, sd 14.14) | +5.0, -5.0 (mean +0.00, sd 7.07) |" in lines


@pytest.mark.parametrize("spec, message", [
    ("no-label", "expected LABEL=PATH"),
    ("A=missing/eval_long.csv", "missing/eval_long.csv: no such file"),
])
def test_bad_arguments_name_what_is_wrong(spec, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        load().main([spec])


def test_a_csv_without_the_columns_is_refused_by_name(tmp_path):
    bad = tmp_path / "eval_long.csv"
    pl.DataFrame({"metric": ["pass@1"], "value": [0.5]}).write_csv(bad)
    with pytest.raises(SystemExit, match=r"eval_long.csv: columns \['bench', 'method', 'seed'\] missing"):
        load().main([f"A={bad}"])
