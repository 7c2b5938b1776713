"""Graders side by side, and that every other table reads the benchmark's own grader only: real
evaluation files (metrics with a `grader` column, samples with `other_grades`), old files without
them, hand-computed accuracies and disagreement."""

from __future__ import annotations

import polars as pl
import pytest

from stages.config import validate
from stages.core.common.io import provenance, write_parquet
from stages.evaluate import METRIC_SCHEMA, SAMPLE_SCHEMA
from stages.tables import load, main_table, output_names
from stages.tables.graders import graders_table
from tests.test_tables import config

# one benchmark, two problems of four samples; the own grader (verify) and math_dapo
OWN = [True, True, False, False, True, False, False, False]  # p0: 2/4, p1: 1/4 -> 37.5
DAPO = [True, False, False, False, True, False, False, True]  # p0: 1/4, p1: 2/4 -> 37.5; 2 differ


def grader_config(default_raw) -> dict:
    raw = config(default_raw, ablations=False)
    raw["experiment"].update(sizes=["tiny-s"], methods=["grpo"], benchmarks=["arith-easy"])
    raw["evaluate"].update(n=4, k=[1, 4], graders=["math_dapo"], main_methods=["grpo"])
    return raw


def metric_rows(own_value: float, dapo_value: float | None, name: str = "avg@4") -> list[dict]:
    rows = [{"metric": name, "k": None, "value": own_value, "ci_low": 0.0, "ci_high": 1.0,
             "n_problems": 2, "n_samples": 4, "grader": "verify"},
            {"metric": "pass@1", "k": 1, "value": own_value, "ci_low": 0.0, "ci_high": 1.0,
             "n_problems": 2, "n_samples": 4, "grader": "verify"}]
    if dapo_value is not None:
        rows += [{**r, "value": dapo_value, "grader": "math_dapo"} for r in rows]
    return rows


def write_eval(root, method, own, other, own_value, dapo_value, old=False):
    d = root / "eval" / "size=tiny-s" / f"method={method}" / "seed=0" / "bench=arith-easy"
    prov = provenance("evaluate", "2", "h", 0)
    samples = [{"benchmark": "arith-easy", "problem_id": f"p{i // 4}", "sample_idx": i % 4,
                "response": "Answer: 1", "extracted": "1", "correct": c, "grade_error": None,
                "answer": "1", "answer_type": "math", "finish_reason": "stop", "response_tokens": 3,
                "grader": "verify", "score": None,
                "other_grades": None if other is None else [
                    {"grader": "math_dapo", "correct": o, "extracted": "1", "error": None,
                     "score": 1.0 if o else -1.0}]}
               for i, (c, o) in enumerate(zip(own, other or own, strict=True))]
    write_parquet(samples, d / "samples.parquet", SAMPLE_SCHEMA, prov)
    if old:  # an evaluation from before graders: no grader column, avg@n by its old name
        import pyarrow as pa

        schema = pa.schema([f for f in METRIC_SCHEMA if f.name != "grader"])
        rows = [{k: v for k, v in r.items() if k != "grader"} for r in metric_rows(own_value, None, "avg@n")]
        write_parquet(rows, d / "metrics.parquet", schema, prov)
    else:
        write_parquet(metric_rows(own_value, dapo_value), d / "metrics.parquet", METRIC_SCHEMA, prov)
    return str(d)


@pytest.fixture
def graded(tmp_path, default_raw):
    cfg = validate(grader_config(default_raw), "test")
    dirs = [write_eval(tmp_path, "base", OWN, None, 0.25, None, old=True),
            write_eval(tmp_path, "grpo", OWN, DAPO, 0.375, 0.40)]
    data = load(dirs, [], [], own_graders={b: d.grader for b, d in cfg.datasets.items()})
    return cfg, data


def test_the_other_tables_read_the_own_grader_only(graded):
    cfg, data = graded
    # the math_dapo rows are in graded, not in metrics; the old file's avg@n is avg@4
    assert data.metrics.filter(pl.col("method") == "grpo")["value"].to_list() == [0.375, 0.375]
    assert sorted(data.metrics["metric"].unique()) == ["avg@4", "pass@1"]
    assert data.graded.filter(pl.col("grader") == "math_dapo")["value"].to_list() == [0.40, 0.40]
    assert data.graded.filter(pl.col("method") == "base")["grader"].to_list() == ["verify", "verify"]
    assert "grader" not in data.metrics.columns
    table, _ = main_table(cfg, data.metrics, 1)
    assert [r[2] for r in table.rows] == ["25.0", "37.5"]  # verify's, never math_dapo's 40.0


def test_graders_table_by_hand(graded):
    cfg, data = graded
    assert "graders.md" in output_names(cfg)["tables"]
    table, frame = graders_table(cfg, data)
    assert table.columns == ["Size", "Method", "Benchmark", "own grader", "own avg@4",
                             "math_dapo avg@4", "math_dapo ≠ own (%)"]
    base, grpo = table.rows
    # base: an old file, no extra grader: its own accuracy only
    assert base == ["Tiny-S", "Base model", "Easy", "verify", "25.0", "—", "—"]
    # grpo: own 37.5 (metrics), math_dapo 40.0 (its metric rows), 2 of 8 samples differ
    assert grpo == ["", "GRPO", "Easy", "verify", "37.5", "40.0", "25.0"]
    row = frame.filter(pl.col("method") == "grpo").row(0, named=True)
    assert (row["own"], row["math_dapo"], row["math_dapo_disagree"], row["math_dapo_samples_compared"]) == (
        37.5, 40.0, 25.0, 8)
    assert row["own_grader"] == "verify" and row["sources"].count("samples.parquet") == 1
    notes = " ".join(table.notes)
    assert "A disagreement is information" in notes and "'Answer:' line" in notes


def test_a_grader_that_is_the_benchmarks_own_reads_own(graded, default_raw):
    raw = grader_config(default_raw)
    raw["evaluate"]["graders"] = ["verify"]
    cfg = validate(raw, "test")
    _, data = graded
    table, _ = graders_table(cfg, data)
    assert table.rows[1][4:] == ["37.5", "37.5", "(own)"]


def test_no_extra_graders_no_table_and_eval_long_keeps_its_columns(default_raw):
    cfg = validate(config(default_raw), "test")
    assert "graders.md" not in output_names(cfg)["tables"]


def test_eval_long_lists_every_grader(graded, tmp_path):
    from stages.tables.eval_long import write_eval_long

    cfg, data = graded
    write_eval_long(cfg, data, tmp_path)
    long = pl.read_csv(tmp_path / "eval_long.csv")
    assert long.height == 6 and sorted(set(long["grader"])) == ["math_dapo", "verify"]
