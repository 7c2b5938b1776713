"""The evaluation stage: metric arithmetic by hand, and the stage on a tiny untrained model."""

from __future__ import annotations

import random
import types

import polars as pl
import pytest
import yaml

from stages.core.common.io import read_provenance
from stages.core.data.problems import generate_arithmetic
from stages.core.reward.registry import grade_many
from stages.evaluate import METRIC_SCHEMA, SAMPLE_SCHEMA, config_keys, metric_rows
from stages.keys import result_hash
from tests.conftest import ROOT, run_stage, tiny_model, write_problems, write_yaml


def frame(correct: dict[str, list[bool]], answered=None, truncated=None) -> pl.DataFrame:
    rows = []
    for pid, flags in correct.items():
        for j, ok in enumerate(flags):
            has = answered[pid][j] if answered else True
            cut = truncated[pid][j] if truncated else False
            rows.append({"problem_id": pid, "correct": ok, "extracted": "1" if has else None,
                         "finish_reason": "length" if cut else "stop"})
    return pl.DataFrame(rows)


def by_metric(rows):
    return {r["metric"]: r for r in rows}


def test_metric_rows_by_hand():
    # n = 4 samples; c = 0, 1 and 4 correct
    samples = frame({"a": [False] * 4, "b": [False, True, False, False], "c": [True] * 4},
                    answered={"a": [False, False, True, True], "b": [True] * 4, "c": [True] * 4},
                    truncated={"a": [True, False, False, False], "b": [False] * 4, "c": [False] * 4})
    m = by_metric(metric_rows(samples, [1, 2, 4], resamples=200, seed=0))
    assert m["pass@1"]["value"] == pytest.approx((0 + 1 / 4 + 1) / 3)
    # pass@2 with c = 1 of n = 4: 1 - C(3, 2) / C(4, 2) = 1/2
    assert m["pass@2"]["value"] == pytest.approx((0 + 0.5 + 1) / 3)
    assert m["pass@4"]["value"] == pytest.approx(2 / 3)  # any correct among all four
    assert m["avg@n"]["value"] == pytest.approx(m["pass@1"]["value"])
    assert m["answered"]["value"] == pytest.approx((0.5 + 1 + 1) / 3)
    assert m["truncated"]["value"] == pytest.approx(0.25 / 3)
    assert [m[k]["k"] for k in ("pass@1", "pass@2", "pass@4", "avg@n")] == [1, 2, 4, None]
    for r in m.values():
        assert r["n_problems"] == 3 and r["n_samples"] == 4
        assert 0.0 <= r["ci_low"] <= r["value"] <= r["ci_high"] <= 1.0


def test_metric_rows_bootstrap_is_seeded_and_paired():
    rng = random.Random(1)
    samples = frame({f"p{i}": [rng.random() < 0.3 for _ in range(8)] for i in range(40)})
    a = metric_rows(samples, [1, 4], resamples=300, seed=7)
    b = metric_rows(samples, [1, 4], resamples=300, seed=7)
    c = metric_rows(samples, [1, 4], resamples=300, seed=8)
    assert a == b
    assert by_metric(a)["pass@4"]["ci_low"] != by_metric(c)["pass@4"]["ci_low"]
    # same draws for every metric: avg@n and pass@1 are the same numbers per problem
    m = by_metric(a)
    assert m["avg@n"]["ci_low"] == pytest.approx(m["pass@1"]["ci_low"], abs=1e-12)
    assert m["avg@n"]["ci_high"] == pytest.approx(m["pass@1"]["ci_high"], abs=1e-12)
    assert m["pass@4"]["ci_high"] - m["pass@4"]["ci_low"] > 0


def test_metric_rows_rejects_uneven_samples_and_small_n():
    with pytest.raises(ValueError, match="different sample counts"):
        metric_rows(frame({"a": [True, False], "b": [True]}), [1], 10, 0)
    with pytest.raises(ValueError, match="pass@4 needs at least 4"):
        metric_rows(frame({"a": [True, False]}), [1, 4], 10, 0)


# ---------------------------------------------------------------------------------------------
# The stage on a tiny untrained model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaluate")
    tiny_model(d)
    write_problems(d / "problems.parquet", generate_arithmetic(5, seed=3, max_terms=3))
    raw = yaml.safe_load((ROOT / "config" / "test.yaml").read_text())
    raw["evaluate"].update(n=4, k=[1, 2, 4], max_new_tokens=10, bootstrap=50)
    cfg = write_yaml(d / "cfg.yaml", raw)
    return d, cfg


def evaluate(d, cfg, out, method="base", bench="arith-easy", model=None):
    return run_stage("evaluate", "--config", str(cfg), "--size", "tiny-s", "--method", method,
                     "--seed", "0", "--model", str(model or d / "base.json"), "--bench", bench,
                     "--data", str(d / "problems.parquet"), "--out-dir", str(out))


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_stage_writes_consistent_samples_and_metrics(stage):
    d, cfg = stage
    out = d / "eval" / "size=tiny-s" / "method=base" / "seed=0" / "bench=arith-easy"
    proc = evaluate(d, cfg, out)
    assert proc.returncode == 0, proc.stderr
    samples = pl.read_parquet(out / "samples.parquet")
    assert samples.columns == SAMPLE_SCHEMA.names
    assert samples.height == 5 * 4
    assert samples.group_by("problem_id").agg(pl.col("sample_idx").sort()).sort("problem_id")[
        "sample_idx"].to_list() == [[0, 1, 2, 3]] * 5
    assert set(samples["benchmark"]) == {"arith-easy"}
    assert int(samples["response_tokens"].max()) <= 10
    assert set(samples["finish_reason"]) <= {"stop", "length"}
    # the stored verdicts are the grader's verdicts on the stored responses
    regraded = grade_many(samples["response"].to_list(), samples["answer"].to_list(),
                          samples["answer_type"].to_list())
    assert samples["correct"].to_list() == [g.correct for g in regraded]
    assert samples["grade_error"].to_list() == [g.error for g in regraded]
    assert samples["extracted"].to_list() == [g.extracted for g in regraded]
    # the metrics are those of the samples, recomputed
    metrics = pl.read_parquet(out / "metrics.parquet")
    assert metrics.columns == METRIC_SCHEMA.names
    expected = metric_rows(samples, [1, 2, 4], resamples=50, seed=0, grader="verify")
    assert metrics.to_dicts() == expected
    assert set(samples["grader"]) == {"verify"} and samples["other_grades"].null_count() == samples.height
    prov = read_provenance(out / "metrics.parquet")
    assert (prov["stage"], prov["size"], prov["method"], prov["bench"]) == ("evaluate", "tiny-s", "base", "arith-easy")
    assert prov["model_ref"] == {"kind": "scratch", "path": "checkpoint"}
    from stages.config import load_config

    assert prov["config_hash"] == result_hash(load_config(cfg), *config_keys(load_config(cfg), "tiny-s", "arith-easy"))
    # the hive keys come from the path: one scan reads every evaluation as one table
    table = pl.scan_parquet(d / "eval" / "**" / "metrics.parquet", hive_partitioning=True).collect()
    assert {"size", "method", "seed", "bench", "metric", "value"} <= set(table.columns)
    assert table["method"].unique().to_list() == ["base"]
    # seeded: a second run (in this process) gives the same samples
    in_process(d, cfg, d / "again")
    assert pl.read_parquet(d / "again" / "samples.parquet").equals(samples)


def test_extra_graders_side_by_side(stage, tmp_path):
    """evaluate.graders: each sample's verdict under every grader, and one set of metrics each;
    math_dapo reads only an "Answer:" line, which the arithmetic responses never write."""
    d, cfg = stage
    raw = yaml.safe_load(cfg.read_text())
    raw["evaluate"]["graders"] = ["math_dapo", "verify"]  # the benchmark's own is not repeated
    both = write_yaml(tmp_path / "both.yaml", raw)
    in_process(d, both, tmp_path / "out")
    samples = pl.read_parquet(tmp_path / "out" / "samples.parquet")
    others = samples["other_grades"].to_list()
    assert all([g["grader"] for g in o] == ["math_dapo"] for o in others)
    assert all(o[0]["extracted"] == "[INVALID]" and o[0]["score"] == -1.0 and not o[0]["correct"]
               for o in others)
    metrics = pl.read_parquet(tmp_path / "out" / "metrics.parquet")
    assert metrics["grader"].unique(maintain_order=True).to_list() == ["verify", "math_dapo"]
    dapo = {r["metric"]: r["value"] for r in metrics.filter(pl.col("grader") == "math_dapo").to_dicts()}
    assert dapo["pass@1"] == 0.0 and dapo["answered"] == 0.0
    # the samples and the benchmark's own verdicts do not depend on the extra graders
    in_process(d, cfg, tmp_path / "alone")
    alone = pl.read_parquet(tmp_path / "alone" / "samples.parquet")
    assert samples.drop("other_grades").equals(alone.drop("other_grades"))


def test_a_method_may_lengthen_its_evaluations(stage, tmp_path):
    """methods.<m>.evaluate.max_new_tokens (the 80/20 paper's 29k run) reaches its evaluations
    and their config hash, not the base model's."""
    from stages.config import validate
    from stages.evaluate import max_new_tokens

    d, cfg = stage
    raw = yaml.safe_load(cfg.read_text())
    base = validate(raw, "x")
    raw["methods"]["grpo"]["evaluate"] = {"max_new_tokens": 3}
    longer = validate(raw, "x")
    assert (max_new_tokens(longer, "grpo"), max_new_tokens(longer, "base")) == (3, 10)
    assert result_hash(longer, *config_keys(longer, "tiny-s", "arith-easy", "grpo")) != \
        result_hash(base, *config_keys(base, "tiny-s", "arith-easy", "grpo"))
    assert result_hash(longer, *config_keys(longer, "tiny-s", "arith-easy")) == \
        result_hash(base, *config_keys(base, "tiny-s", "arith-easy"))
    in_process(d, write_yaml(tmp_path / "m.yaml", raw), tmp_path / "out", method="grpo",
               model=d / "base.json")
    assert pl.read_parquet(tmp_path / "out" / "samples.parquet")["response_tokens"].max() <= 3


def test_config_keys_ignore_the_table_layout(stage):
    from stages.config import load_config, validate

    d, cfg = stage
    raw = yaml.safe_load(cfg.read_text())
    base_cfg = load_config(cfg)
    base = result_hash(base_cfg, *config_keys(base_cfg, "tiny-s", "arith-easy"))
    raw["evaluate"]["main_methods"] = ["grpo"]  # table layout
    raw["methods"]["ict"]["rho"] = 0.2  # reaches the evaluation through the trained model file
    raw["datasets"]["arith-easy"]["label"] = "Easy"
    raw["train"]["lr"] = 1.0
    assert result_hash(validate(raw, "x"), *config_keys(base_cfg, "tiny-s", "arith-easy")) == base
    raw["evaluate"]["temperature"] = 0.7
    assert result_hash(validate(raw, "x"), *config_keys(base_cfg, "tiny-s", "arith-easy")) != base


def in_process(d, cfg, out, method="base", bench="arith-easy", model=None, data=None):
    """The stage on one or more benchmarks (bench, out and data: one each, or lists)."""
    from stages.config import load_config
    from stages.evaluate import main

    benches = bench if isinstance(bench, list) else [bench]
    outs = out if isinstance(out, list) else [out]
    data = data or [d / "problems.parquet"] * len(benches)
    args = types.SimpleNamespace(size="tiny-s", method=method, seed=0, bench=benches,
                                 model=str(model or d / "base.json"),
                                 data=[str(x) for x in data], out_dir=[str(o) for o in outs])
    main(args, load_config(cfg))


def test_several_benchmarks_in_one_process_equal_one_process_each(stage, tmp_path):
    """One job per model: each benchmark's samples are those a process of its own draws."""
    d, cfg = stage
    write_problems(tmp_path / "hard.parquet", generate_arithmetic(4, seed=9, min_terms=3, max_terms=4))
    in_process(d, cfg, [tmp_path / "a", tmp_path / "b"], bench=["arith-easy", "arith-easy"],
               data=[d / "problems.parquet", tmp_path / "hard.parquet"])
    in_process(d, cfg, tmp_path / "b-alone", data=[tmp_path / "hard.parquet"])
    in_process(d, cfg, tmp_path / "a-alone")
    for both, alone in (("a", "a-alone"), ("b", "b-alone")):
        for name in ("samples.parquet", "metrics.parquet"):
            assert pl.read_parquet(tmp_path / both / name).equals(pl.read_parquet(tmp_path / alone / name))
    assert not pl.read_parquet(tmp_path / "a" / "samples.parquet").equals(
        pl.read_parquet(tmp_path / "b" / "samples.parquet"))
    with pytest.raises(Exception, match="give one of each per benchmark"):
        in_process(d, cfg, [tmp_path / "c"], bench=["arith-easy", "arith-easy"])


@pytest.mark.parametrize(
    "method, bench, model, expect",
    [
        ("ppo", "arith-easy", None, "--method 'ppo': neither 'base' nor a key of 'methods'"),
        ("base", "rl", None, "--bench 'rl': not a dataset with role 'benchmark'"),
        ("base", "arith-easy", "missing.json", "missing.json: model reference not found"),
        ("base", ["arith-easy", "rl"], None, "--bench 'rl': not a dataset with role 'benchmark'"),
    ],
)
def test_stage_bad_inputs(stage, tmp_path, method, bench, model, expect):
    from stages.cli import USER_ERRORS

    d, cfg = stage
    outs = [tmp_path / f"out{i}" for i in range(len(bench))] if isinstance(bench, list) else tmp_path / "out"
    with pytest.raises(USER_ERRORS) as err:
        in_process(d, cfg, outs, method=method, bench=bench,
                   model=tmp_path / model if model else None)
    assert expect in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written, not even the good benchmark's


def test_cli_reports_a_bad_argument_in_one_line(stage, tmp_path):
    d, cfg = stage
    proc = evaluate(d, cfg, tmp_path / "out", method="ppo")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --method 'ppo': neither 'base' nor a key of 'methods' ({sorted(yaml.safe_load(cfg.read_text())['methods'])})"
    ]
