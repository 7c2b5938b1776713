"""The curves over training steps (curves.csv, curves_<size>.png) and the training figure's
running mean, reward gap and seed bands, on synthetic evaluations and training metrics."""

from __future__ import annotations

import math
import types
from pathlib import Path

import polars as pl
import pytest

from stages.config import validate
from stages.core.common.io import provenance, write_parquet
from stages.evaluate import METRIC_SCHEMA, SAMPLE_SCHEMA
from stages.tables import main, output_names
from stages.tables.curves import curve_points
from stages.tables.load import load
from stages.tables.training import reward_gap, window
from tests.test_tables import batch_swing, config, write_train

PNG = b"\x89PNG\r\n\x1a\n"
CURVE_BENCHES = ["arith-easy", "arith-mid"]


def curves_config(default_raw, seeds=(0, 1)) -> dict:
    raw = config(default_raw, ablations=False)
    raw["experiment"].update(sizes=["tiny-s"], methods=["grpo", "ict"], seeds=list(seeds))
    raw["evaluate"]["main_methods"] = ["grpo", "ict"]
    raw["evaluate"]["curve_benchmarks"] = CURVE_BENCHES
    raw["train"].update(steps=60, save_every=20)
    return raw


def pass4(method: str, seed: int, step: int, bench: str) -> float:
    """pass@4 of a checkpoint: the base model's 0.2, then 0.004 (GRPO) or 0.006 (ICT) a step;
    mid is 0.1 below easy; seed 1 is 0.02 above seed 0."""
    slope = {"grpo": 0.004, "ict": 0.006, "base": 0.0}[method]
    return 0.2 + slope * step - (0.1 if bench == "arith-mid" else 0.0) + 0.02 * seed


def write_metrics(d: Path, value: float) -> str:
    """metrics.parquet with pass@1 and pass@4 = `value`, and samples.parquet (its counts are not
    what the curves read)."""
    prov = provenance("evaluate", "2", "h", 0)
    rows = [{"metric": f"pass@{k}", "k": k, "value": value, "ci_low": value, "ci_high": value,
             "n_problems": 2, "n_samples": 8, "grader": None} for k in (1, 4)]
    write_parquet(rows, d / "metrics.parquet", METRIC_SCHEMA, prov)
    samples = [{"benchmark": "b", "problem_id": f"p{i}", "sample_idx": j, "response": "1",
                "extracted": "1", "correct": j < 2, "grade_error": None, "answer": "1",
                "answer_type": "math", "finish_reason": "stop", "response_tokens": 1, "grader": "verify"}
               for i in range(2) for j in range(8)]
    write_parquet(samples, d / "samples.parquet", SAMPLE_SCHEMA, prov)
    return str(d)


def write_curve_run(root: Path, seeds=(0, 1)):
    """Final and base evaluations (metrics only) and checkpoints at 20 and 40 (and one at 60,
    which the final model's evaluation replaces)."""
    evals, steps = [], []
    for seed in seeds:
        for bench in ["arith-easy", "arith-mid", "arith-hard"]:
            evals.append(write_metrics(root / "eval" / "size=tiny-s" / "method=base" / f"seed={seed}"
                                       / f"bench={bench}", pass4("base", seed, 0, bench)))
            for method in ("grpo", "ict"):
                evals.append(write_metrics(root / "eval" / "size=tiny-s" / f"method={method}" / f"seed={seed}"
                                           / f"bench={bench}", pass4(method, seed, 60, bench)))
        for method in ("grpo", "ict"):
            for step in (20, 40, 60):
                for bench in CURVE_BENCHES:
                    d = (root / "eval_steps" / "size=tiny-s" / f"method={method}" / f"seed={seed}"
                         / f"step={step}" / f"bench={bench}")
                    steps.append(write_metrics(d, 0.99 if step == 60 else pass4(method, seed, step, bench)))
    return evals, steps


def test_curve_points_by_hand(tmp_path, default_raw):
    cfg = validate(curves_config(default_raw), "test")
    assert "curves.csv" in output_names(cfg)["tables"] and "curves_tiny-s.png" in output_names(cfg)["figures"]
    evals, steps = write_curve_run(tmp_path)
    points = curve_points(cfg, load([], [], [], steps))  # no final or base evaluations yet
    assert sorted(set(points["step"])) == [20, 40]  # the step-60 checkpoint is the final model's
    data = load([e for e in evals], [], [], steps)
    points = curve_points(cfg, data)
    grpo = points.filter((pl.col("method") == "grpo") & (pl.col("seed") == 1) & (pl.col("bench") == "arith-easy"))
    assert grpo["step"].to_list() == [0, 20, 40, 60]
    assert grpo["value"].to_list() == pytest.approx([0.22, 0.30, 0.38, 0.46])
    assert grpo["source"][0].endswith("method=base/seed=1/bench=arith-easy/metrics.parquet")
    assert "eval_steps" in grpo["source"][1] and "/eval/" in grpo["source"][3]
    assert set(points["bench"]) == set(CURVE_BENCHES)  # arith-hard is not a curve benchmark
    assert set(points["metric"]) == {"pass@4"} and points.height == 2 * 2 * 4 * 2
    assert points.columns == ["size", "method", "seed", "step", "bench", "metric", "value", "source"]


def test_curves_and_training_figures_are_written(tmp_path, default_raw):
    cfg = validate(curves_config(default_raw), "test")
    evals, steps = write_curve_run(tmp_path)
    train = [str(write_train(tmp_path, "tiny-s", m, seed=k, steps=40)) for m in ("grpo", "ict") for k in (0, 1)]
    args = types.SimpleNamespace(eval=evals, train=train, token_stats=[], eval_steps=steps, overlap=[],
                                 tables_dir=str(tmp_path / "tables"), figures_dir=str(tmp_path / "figures"))
    main(args, cfg)
    for name in ("curves_tiny-s.png", "training_tiny-s.png"):
        assert (tmp_path / "figures" / name).read_bytes()[:8] == PNG
    assert pl.read_csv(tmp_path / "tables" / "curves.csv").height == 32


def test_no_checkpoints_no_curves(default_raw):
    cfg = validate(config(default_raw), "test")
    assert "curves.csv" not in output_names(cfg)["tables"]
    assert not [n for n in output_names(cfg)["figures"] if n.startswith("curves")]


def test_running_mean_window_and_the_reward_gap(tmp_path):
    runs = load([], [str(write_train(tmp_path, "tiny-s", m, seed=k, steps=40))
                     for m in ("grpo", "ict") for k in (0, 1)], []).train
    assert window(runs) == 5  # 10% of 40 steps, 4, rounded to an odd (centred) window
    assert window(runs.filter(pl.col("step") < 20)) == 3 and window(runs.filter(pl.col("step") < 5)) == 1
    gap = reward_gap(runs, "grpo").sort("seed", "step")
    # the batch's swing is the same for both methods at a step and cancels: 0.004 a step and the
    # runs' own noise remain
    assert gap["method"].unique().to_list() == ["ict"]
    noise = [0.04 * (math.sin(0.8 * s + len("ict")) - math.sin(0.8 * s + len("grpo"))) for s in range(40)]
    assert gap.filter(pl.col("seed") == 0)["reward_gap"].to_list() == pytest.approx(
        [0.004 * s + e for s, e in zip(range(40), noise, strict=True)], abs=1e-12)
    assert batch_swing(3) != batch_swing(4)  # the raw rewards do swing


def test_seed_bands_by_hand():
    from stages.core.report import figures

    frame = pl.DataFrame({"method": ["a"] * 6, "seed": [0, 0, 0, 1, 1, 1], "step": [0, 1, 2] * 2,
                          "x": [1.0, 2.0, 6.0, 3.0, 4.0, None]})
    smooth = figures.running_mean(frame, "x", 3, ["method", "seed"]).sort("seed", "step")
    # centred, shrinking at the ends: seed 0 (1+2)/2, (1+2+6)/3, (2+6)/2; seed 1 has no step 2
    assert smooth["x"].to_list() == pytest.approx([1.5, 3.0, 4.0, 3.5, 3.5])
    bands = figures.seed_bands(smooth, "x")
    assert bands.select("step", "mean", "low", "high", "seeds").rows() == [
        (0, 2.5, 1.5, 3.5, 2), (1, 3.25, 3.0, 3.5, 2), (2, 4.0, 4.0, 4.0, 1)]
    assert figures.seed_bands(smooth, "x", need={"a": 2})["step"].to_list() == [0, 1]
