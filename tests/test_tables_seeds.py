"""Seeds in the tables: the two-level bootstrap that resamples seeds and problems together (float64
reference, hand-computed cases, bounds), and the main tables' cells with the seeds' spread."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stages.config import validate
from stages.core.common.metrics import bootstrap_ci
from stages.tables import main_table
from stages.tables.ablation import ablation_table
from stages.tables.main_total import main_total_table
from stages.tables.seeds import Problems, pooled_bootstrap_ci, seed_sd, spread_text
from tests.test_tables import config


def reference(blocks: list[np.ndarray], resamples: int, seed: int) -> tuple[float, float]:
    """The same draws, one resample at a time in plain loops: per resample, each block's problems,
    then the seeds; the statistic is the mean over blocks of the drawn (seed, problem) values."""
    rng = np.random.default_rng(seed)
    s = blocks[0].shape[0]
    stats = []
    problems = [rng.integers(0, b.shape[1], size=(resamples, b.shape[1])) for b in blocks]
    seeds = rng.integers(0, s, size=(resamples, s))
    for r in range(resamples):
        per_block = []
        for b, idx in zip(blocks, problems, strict=True):
            total = 0.0
            for i in seeds[r]:
                for j in idx[r]:
                    total += float(b[i, j])
            per_block.append(total / (s * b.shape[1]))
        stats.append(sum(per_block) / len(per_block))
    low, high = np.quantile(np.array(stats, dtype=np.float64), [0.025, 0.975])
    return float(low), float(high)


def test_pooled_interval_float64_reference():
    x = np.array([[0.0, 0.25, 1.0], [0.5, 0.75, 0.125]], dtype=np.float64)  # 2 seeds x 3 problems
    y = np.array([[0.5, 0.0], [1.0, 0.25]], dtype=np.float64)  # a second benchmark, 2 problems
    assert pooled_bootstrap_ci([x], 300, 7) == pytest.approx(reference([x], 300, 7), abs=1e-15)
    assert pooled_bootstrap_ci([x, y], 300, 7) == pytest.approx(reference([x, y], 300, 7), abs=1e-15)
    # deterministic: the same inputs and seed, the same interval; another seed, other draws
    z = np.random.default_rng(1).random((3, 40))
    assert pooled_bootstrap_ci([z], 300, 7) == pooled_bootstrap_ci([z], 300, 7)
    assert pooled_bootstrap_ci([z], 300, 7) != pooled_bootstrap_ci([z], 300, 8)


def test_one_seed_is_the_bootstrap_over_problems():
    values = np.random.default_rng(0).random(37)
    assert pooled_bootstrap_ci([values[None, :]], 2500, 5) == bootstrap_ci(values, 2500, 5)


def test_seeds_alone_by_hand():
    """Every problem alike within a seed: a resample's mean is that of the two seeds drawn, 0.2
    (both seed 0, p = 1/4), 0.4 (one of each) or 0.6 (both seed 1): the interval is [0.2, 0.6],
    where a bootstrap over problems alone of the seed-averaged accuracies gives [0.4, 0.4]."""
    x = np.array([[0.2] * 5, [0.6] * 5])
    assert pooled_bootstrap_ci([x], 2000, 0) == pytest.approx((0.2, 0.6))
    assert bootstrap_ci(x.mean(axis=0), 2000, 0) == pytest.approx((0.4, 0.4))


@pytest.mark.filterwarnings("ignore")
def test_pooled_interval_contains_the_mean_and_stays_in_range():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    acc = st.integers(0, 8).map(lambda c: c / 8)

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 4), st.integers(1, 12), st.data(), st.integers(0, 2**16))
    def check(seeds, problems, data, seed):
        x = np.array(data.draw(st.lists(acc, min_size=seeds * problems, max_size=seeds * problems)),
                     dtype=np.float64).reshape(seeds, problems)
        low, high = pooled_bootstrap_ci([x], 400, seed)
        assert x.min() - 1e-12 <= low <= high <= x.max() + 1e-12
        assert low - 1e-12 <= x.mean() <= high + 1e-12

    check()


def test_pooled_interval_refuses_bad_blocks():
    with pytest.raises(ValueError, match="different numbers of seeds"):
        pooled_bootstrap_ci([np.zeros((2, 3)), np.zeros((3, 3))], 10, 0)
    with pytest.raises(ValueError, match="non-empty"):
        pooled_bootstrap_ci([np.zeros((2, 0))], 10, 0)


def test_spread_text_and_sd():
    assert spread_text(0.628, (0.62, 0.636)) == f"62.8 ±{100 * np.std([0.62, 0.636], ddof=1):.1f}"
    assert spread_text(0.628, (0.628,)) == "62.8" and spread_text(None, (0.1, 0.2)) == "—"
    assert spread_text(0.05, (0.04, 0.06), signed=True) == "+5.0 ±1.4"
    assert seed_sd((0.1,)) is None and seed_sd((0.1, 0.3)) == pytest.approx(0.1 * 2 ** 0.5)


# ---------------------------------------------------------------------------------------------
# The main tables with two seeds
# ---------------------------------------------------------------------------------------------
BENCH = ["arith-easy", "arith-mid"]


def two_seed_data(default_raw):
    """tiny-s, GRPO and ICT, two benchmarks of four problems with 8 samples each; ICT's seeds
    differ (easy: 4 and 6 correct of 8 on every problem), GRPO's do not."""
    raw = config(default_raw, ablations=False)
    raw["experiment"].update(sizes=["tiny-s"], benchmarks=BENCH, seeds=[0, 1])
    raw["evaluate"]["bootstrap"] = 500
    cfg = validate(raw, "test")
    correct = {("grpo", 0): 4, ("grpo", 1): 4, ("ict", 0): 4, ("ict", 1): 6,
               ("base", 0): 2, ("base", 1): 2}
    counts, metrics = [], []
    for (method, seed), c in correct.items():
        for bench in BENCH:
            src = f"{method}/{seed}/{bench}"
            counts += [{"size": "tiny-s", "method": method, "seed": seed, "bench": bench,
                        "problem_id": f"p{i}", "n": 8, "c": c if bench == "arith-easy" else 2,
                        "source": src} for i in range(4)]
            acc = (c if bench == "arith-easy" else 2) / 8
            metrics += [{"size": "tiny-s", "method": method, "seed": seed, "bench": bench,
                         "metric": "pass@1", "value": acc, "ci_low": acc, "ci_high": acc, "source": src}]
    return cfg, pl.DataFrame(metrics), Problems(pl.DataFrame(counts), cfg.evaluate.bootstrap, cfg.seed)


def test_main_table_with_two_seeds(default_raw):
    cfg, metrics, problems = two_seed_data(default_raw)
    table, frame = main_table(cfg, metrics, 1, problems)
    rows = {r[1]: r[2:] for r in table.rows}
    # ICT easy: 50% and 75% -> 62.5 ±17.7; Avg.: (62.5 + 25) / 2 = 43.75, per seed 37.5 and 50
    assert rows["ICT"] == ["62.5 ±17.7", "25.0 ±0.0", "43.8 ±8.8", "+6.2"]
    assert rows["GRPO"] == ["50.0 ±0.0", "25.0 ±0.0", "37.5 ±0.0", "ref."]
    ict = frame.filter(pl.col("method") == "ict").row(0, named=True)
    assert (ict["arith-easy_seed_min"], ict["arith-easy_seed_max"]) == (50.0, 75.0)
    assert ict["arith-easy_seed_sd"] == pytest.approx(25 / 2 ** 0.5)
    # the interval resamples the seeds: [50, 75] (every problem alike within a seed)
    assert (ict["arith-easy_ci_low"], ict["arith-easy_ci_high"]) == pytest.approx((50.0, 75.0))
    assert (ict["avg_ci_low"], ict["avg_ci_high"]) == pytest.approx((37.5, 50.0))
    assert ict["avg_seed_sd"] == pytest.approx(12.5 / 2 ** 0.5)
    notes = " ".join(table.notes)
    assert "±: the sample standard deviation over the 2 seeds' values" in notes
    assert "resample seeds and problems together" in notes


def test_main_total_and_ablation_with_two_seeds(default_raw):
    cfg, metrics, problems = two_seed_data(default_raw)
    four = metrics.with_columns(metric=pl.lit("pass@4"))
    table, frame = main_total_table(cfg, pl.concat([metrics, four]), problems)
    ict = [r for r in table.rows if r[1] == "ICT"][0]
    assert ict[2:5] == ["43.8 ±8.8", "43.8 ±8.8", "43.8 ±8.8"]
    row = frame.filter(pl.col("method") == "ict").row(0, named=True)
    assert row["total_seed_sd"] == pytest.approx(12.5 / 2 ** 0.5)
    assert row["pass1_avg_ci_low"] <= row["pass1_avg"] <= row["pass1_avg_ci_high"]
    raw = config(default_raw)
    raw["experiment"].update(sizes=["tiny-s"], benchmarks=BENCH, seeds=[0, 1])
    abl, abl_frame = ablation_table(validate(raw, "test"), pl.concat([metrics, four]), problems)
    assert [r[3:6] for r in abl.rows if r[1] == "ICT"] == [["43.8 ±8.8", "43.8 ±8.8", "+6.2"]]
    assert "tiny-s_pass4_avg_seed_sd" in abl_frame.columns


def test_one_seed_tables_keep_their_columns(default_raw):
    cfg, metrics, problems = two_seed_data(default_raw)
    raw = config(default_raw, ablations=False)
    raw["experiment"].update(sizes=["tiny-s"], benchmarks=BENCH, seeds=[0])
    one = validate(raw, "test")
    _, frame = main_table(one, metrics, 1, problems)
    assert not [c for c in frame.columns if "seed" in c] and "avg_ci_low" not in frame.columns
