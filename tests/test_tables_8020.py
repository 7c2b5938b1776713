"""The 80/20 paper's numbers and tables: stages.core.report.reported's Acc@16 and token statistics, the
main_8020 table built from fixture results, and the overlap table, with hand-computed cells."""

from __future__ import annotations

import polars as pl
import pytest

from stages.config import validate
from stages.core.report import reported
from stages.core.report.render import markdown
from stages.tables import output_names
from stages.tables.main_8020 import REPORTED_LABEL, main_8020_table, qwen3_size
from stages.tables.overlap import overlap_table
from tests.test_tables import config

SIZES = {"qwen3-8b": "Qwen/Qwen3-8B-Base", "qwen3-14b": "Qwen/Qwen3-14B-Base",
         "qwen3-32b": "Qwen/Qwen3-32B-Base"}
BENCHES = {"aime24": "AIME'24", "aime25": "AIME'25", "amc23": "AMC'23", "math500": "MATH-500",
           "minerva": "Minerva", "olympiad": "OlympiadBench"}
# avg@16 of qwen3-8b per benchmark (in BENCHES order); the larger sizes add 0.10 per step up
ACC = {"base": [0.10, 0.05, 0.40, 0.50, 0.20, 0.30],
       "dapo": [0.30, 0.20, 0.60, 0.70, 0.30, 0.40],
       "entropy20": [0.35, 0.28, 0.62, 0.72, 0.30, 0.41]}
MISSING_CELL = ("qwen3-32b", "entropy20", "minerva")


def config_8020(default_raw, seeds=(0,)) -> dict:
    """Three Qwen3 hub sizes, DAPO and 20-Entropy with the 80/20 paper's rows, six benchmarks with
    reported_as, headline avg@16."""
    raw = config(default_raw, ablations=False)
    raw["models"].update({s: {"source": "hub", "label": f"{m.split('/')[1]}", "hub": {"model_id": m}}
                          for s, m in SIZES.items()})
    arith = raw["datasets"]["arith-easy"]
    raw["datasets"].update({b: {**arith, "label": name, "reported_as": name} for b, name in BENCHES.items()})
    raw["methods"]["dapo"] = {"selector": "all", "label": "DAPO", "paper_row": "80/20: DAPO"}
    raw["methods"]["entropy20"] = {"selector": "entropy_top", "rho": 0.2, "label": "20-Entropy",
                                   "paper_row": "80/20: top-20% entropy"}
    raw["experiment"].update(sizes=list(SIZES), methods=["dapo", "entropy20"], benchmarks=list(BENCHES),
                             seeds=list(seeds))
    raw["evaluate"].update(n=16, k=[1, 4], headline="avg@16", main_methods=["dapo", "entropy20"])
    return raw


def value(size: str, method: str, bench: str, seed: int = 0) -> float:
    """avg@16 of a cell; seed 1 is 2 points above seed 0."""
    return ACC[method][list(BENCHES).index(bench)] + 0.1 * list(SIZES).index(size) + 0.02 * seed


def metrics_8020(seeds=(0,)) -> pl.DataFrame:
    rows = [{"size": s, "method": m, "seed": k, "bench": b, "metric": "avg@16",
             "value": value(s, m, b, k), "ci_low": value(s, m, b, k) - 0.05,
             "ci_high": value(s, m, b, k) + 0.05, "source": f"{s}/{m}/{k}/{b}/metrics.parquet"}
            for s in SIZES for m in ACC for b in BENCHES for k in seeds if (s, m, b) != MISSING_CELL]
    # a pass@4 row that the table must not read
    rows.append({**rows[0], "metric": "pass@4", "value": 0.99})
    return pl.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# A: the reported numbers
# ---------------------------------------------------------------------------------------------
def test_reported_8020_numbers_as_methods_gives_them():
    t = reported.TABLE_8020
    assert (t["8B", "80/20: DAPO"].aime24, t["8B", "80/20: top-20% entropy"].aime24) == (33.3, 34.6)
    assert (t["14B", "80/20: DAPO"].mean6, t["14B", "80/20: top-20% entropy"].mean6) == (61.40, 64.39)
    assert (t["32B", "80/20: DAPO"].aime25, t["32B", "80/20: top-20% entropy"].aime25) == (45.63, 56.67)
    assert (t["8B", "80/20: DAPO"].amc23, t["8B", "80/20: top-20% entropy"].amc23) == (77.81, 77.19)
    assert t["32B", "80/20: top-20% entropy, 29k"] == reported.Acc16(68.1, None, None)
    # METHODS §7's gains of the top 20% over all tokens follow from the cells
    for size, bench, gain in [("32B", "aime25", 11.04), ("32B", "aime24", 7.71),
                              ("14B", "aime25", 4.79), ("14B", "aime24", 5.21)]:
        got = getattr(t[size, "80/20: top-20% entropy"], bench) - getattr(t[size, "80/20: DAPO"], bench)
        assert got == pytest.approx(gain, abs=0.011)
    assert {s for s, _ in t} == set(reported.PAPER_8020_SIZES)
    assert set(reported.ROWS_8020) <= set(reported.REPORTED_ROWS)
    assert "2506.01939" in reported.PAPER_8020_SOURCE and "Figure 1" in reported.PAPER_8020_SOURCE
    assert (reported.ENTROPY_BELOW_001_PCT_8020, reported.ENTROPY_P80, reported.OVERLAP_MIN_PCT_8020) == (
        50.64, 0.672, 86.67)
    # two sets of m positions sharing 0.8667·m: |A ∪ B| = (2 − 0.8667)·m
    assert reported.jaccard_of_overlap(0.8667) == pytest.approx(0.8667 / 1.1333)
    assert round(reported.jaccard_of_overlap(0.8667), 2) == 0.76
    assert reported.jaccard_of_overlap(1.0) == 1.0 and reported.jaccard_of_overlap(0.0) == 0.0
    with pytest.raises(ValueError):
        reported.jaccard_of_overlap(86.67)


def test_a_method_may_claim_an_8020_row_and_an_unknown_row_is_refused(default_raw):
    cfg = validate(config_8020(default_raw), "test")
    assert cfg.methods["dapo"].paper_row == "80/20: DAPO"
    raw = config_8020(default_raw)
    raw["methods"]["dapo"]["paper_row"] = "DAPO"
    with pytest.raises(Exception, match="unknown reported row 'DAPO'"):
        validate(raw, "test")


def test_qwen3_sizes_of_hub_models(default_raw):
    raw = config_8020(default_raw)
    hub = lambda model_id: {"source": "hub", "hub": {"model_id": model_id}}  # noqa: E731
    raw["models"].update({
        "local-qwen3-14b": hub("/models/ckpt"),  # the size key names it
        "qwen2.5-7b": hub("Qwen/Qwen2.5-7B"),  # not Qwen3
        "moe": hub("Qwen/Qwen3-30B-A3B-Base"),  # no 80/20 size
        "plain": hub("org/model-8b"),  # no 'qwen3'
    })
    cfg = validate(raw, "test")
    assert {s: qwen3_size(cfg, s) for s in SIZES} == {"qwen3-8b": "8B", "qwen3-14b": "14B",
                                                      "qwen3-32b": "32B"}
    assert qwen3_size(cfg, "local-qwen3-14b") == "14B"
    for size in ("qwen2.5-7b", "moe", "plain", "tiny-s"):
        assert qwen3_size(cfg, size) is None, size


# ---------------------------------------------------------------------------------------------
# B: the 80/20 main table
# ---------------------------------------------------------------------------------------------
OURS = slice(2, 6)  # AIME'24, AIME'25, Mean of 6, Δ
REP = slice(6, 10)  # the reported block


def test_main_8020_by_hand(default_raw):
    cfg = validate(config_8020(default_raw), "test")
    assert "main_8020.md" in output_names(cfg)["tables"]
    assert output_names(cfg)["tables"][:3] == ["main_avg16.md", "main_avg16.tex", "main_avg16.csv"]
    table, frame = main_8020_table(cfg, metrics_8020())
    assert table.columns == ["Size", "Method", "AIME'24 (ours)", "AIME'25 (ours)", "Mean of 6 (ours)",
                             "Δ mean vs DAPO", REPORTED_LABEL, "AIME'24 (rep.)", "AIME'25 (rep.)",
                             "mean of 6 (rep.)"]
    rows = table.rows
    assert [r[0] for r in rows] == ["Qwen3-8B-Base", "", "", "Qwen3-14B-Base", "", "", "Qwen3-32B-Base", "", ""]
    assert [r[1] for r in rows[:3]] == ["Base model", "DAPO", "20-Entropy"]
    # 8B: means 1.55/6, 2.50/6, 2.68/6; Δ against DAPO's 41.67
    assert rows[0][OURS] == ["10.0", "5.0", "25.8", "-15.8"]
    assert rows[1][OURS] == ["30.0", "20.0", "41.7", "ref."]
    assert rows[2][OURS] == ["35.0", "28.0", "44.7", "+3.0"]
    # 14B: every cell 10 points up, the Δ the same
    assert rows[4][OURS] == ["40.0", "30.0", "51.7", "ref."] and rows[5][OURS][3] == "+3.0"
    # 32B 20-Entropy misses Minerva: its AIME cells stand, its mean and Δ do not
    assert rows[8][OURS] == ["55.0", "48.0", "—", "—"]
    # the reported block: the method's paper_row at the matching Qwen3 size, as printed
    assert rows[0][REP] == ["—"] * 4  # the paper reports no base-model numbers
    assert rows[1][REP] == ["Qwen3-8B-Base, 80/20: DAPO", "33.3", "25.4", "53.71"]
    assert rows[2][REP] == ["Qwen3-8B-Base, 80/20: top-20% entropy", "34.6", "26.2", "54.23"]
    assert rows[4][REP] == ["Qwen3-14B-Base, 80/20: DAPO", "45.2", "38.1", "61.4"]
    assert rows[8][REP] == ["Qwen3-32B-Base, 80/20: top-20% entropy", "63.54", "56.67", "70.69"]
    # bold: the best of ours per size, never a reported cell
    assert table.bold[2][2:5] == [True, True, True] and not any(table.bold[2][6:])
    row = frame.filter((pl.col("size") == "qwen3-8b") & (pl.col("method") == "entropy20")).row(0, named=True)
    assert (row["aime24"], row["aime25"], row["mean"], row["mean_delta_vs_dapo"]) == pytest.approx(
        (35.0, 28.0, 268 / 6, 3.0))
    assert (row["aime24_bench"], row["aime24_ci_low"], row["aime24_ci_high"]) == ("aime24", 30.0, 40.0)
    assert (row["reported_aime24"], row["reported_mean6"], row["reported_amc23"]) == (34.6, 54.23, 77.19)
    assert row["metric"] == "avg@16" and row["best_in_size"] == "aime24;aime25;mean"
    assert len(row["sources"].split(";")) == 6
    text = markdown(table)
    assert "Acc@16 = avg@16: the mean accuracy over 16 samples per problem, not pass@16" in text
    assert "Our metric is the same." in text and "2506.01939" in text
    assert "AMC'23 77.81 (DAPO) and 77.19 (top 20%)" in text and "68.1 on AIME'24" in text
    assert "never in them" in text


def test_main_8020_never_prints_a_reported_number_in_our_cells(default_raw):
    cfg = validate(config_8020(default_raw), "test")
    empty, _ = main_8020_table(cfg, pl.DataFrame())
    assert all(r[OURS] == ["—"] * 3 + [r[OURS][3]] for r in empty.rows)
    assert sum(r[REP] != ["—"] * 4 for r in empty.rows) == 6
    printed = {f"{v:g}" for rep in reported.TABLE_8020.values()
               for v in (rep.aime24, rep.aime25, rep.mean6) if v is not None}
    filled, _ = main_8020_table(cfg, metrics_8020())
    for row in filled.rows:
        assert not set(row[OURS]) & printed, row


def test_main_8020_with_the_29k_row_and_a_pass_headline(default_raw):
    raw = config_8020(default_raw)
    raw["methods"]["late"] = {"selector": "entropy_top", "rho": 0.2, "label": "20-Entropy, 29k",
                              "paper_row": "80/20: top-20% entropy, 29k"}
    raw["experiment"]["methods"].append("late")
    raw["evaluate"]["main_methods"].append("late")
    raw["evaluate"]["headline"] = "pass@4"
    cfg = validate(raw, "test")
    table, _ = main_8020_table(cfg, pl.DataFrame())
    late = [r for r in table.rows if r[1] == "20-Entropy, 29k"]
    assert [r[REP] for r in late] == [["—"] * 4, ["—"] * 4,
                                      ["Qwen3-32B-Base, 80/20: top-20% entropy, 29k", "68.1", "—", "—"]]
    assert "Ours is pass@4 (evaluate.headline; n = 16): not the same metric" in markdown(table)
    assert table.title.startswith("The 80/20 paper's main results: pass@4")


def test_main_8020_applies_only_with_an_8020_row(default_raw):
    cfg = validate(config(default_raw), "test")
    assert "main_8020.md" not in output_names(cfg)["tables"]


def test_main_8020_with_seeds_prints_the_spread(default_raw):
    from stages.tables.seeds import Problems

    cfg = validate(config_8020(default_raw, seeds=(0, 1)), "test")
    counts = []
    for s in SIZES:
        for m in ACC:
            for b in BENCHES:
                for k in (0, 1):
                    c = round(16 * value(s, m, b, k))
                    counts += [{"size": s, "method": m, "seed": k, "bench": b, "problem_id": f"p{i}",
                                "n": 16, "c": c, "source": "x"} for i in range(3)]
    table, frame = main_8020_table(cfg, metrics_8020(seeds=(0, 1)), Problems(pl.DataFrame(counts), 200, 0))
    # seeds 0 and 1 differ by 2 points: mean +1, sample sd √2 = 1.4
    assert table.rows[1][2:5] == ["31.0 ±1.4", "21.0 ±1.4", "42.7 ±1.4"]
    row = frame.filter((pl.col("size") == "qwen3-8b") & (pl.col("method") == "dapo")).row(0, named=True)
    assert (row["aime24_seed_min"], row["aime24_seed_max"]) == pytest.approx((30.0, 32.0))
    assert row["mean_ci_low"] <= row["mean"] <= row["mean_ci_high"]


# ---------------------------------------------------------------------------------------------
# E: the overlap table
# ---------------------------------------------------------------------------------------------
def overlap_frame(rows) -> pl.DataFrame:
    return pl.DataFrame([{"size": s, "method": m, "seed": k, "top": 0.2, "tokens": 1000, "positions": 200,
                          "overlap": o, "jaccard": o / (2 - o), "entropy_mean_base": 0.5,
                          "entropy_mean_trained": 0.4, "source": f"overlap/{s}/{m}/{k}/overlap.parquet"}
                         for s, m, k, o in rows])


def test_overlap_table_by_hand(default_raw):
    raw = config(default_raw, ablations=False)
    raw["experiment"]["seeds"] = [0, 1]
    cfg = validate(raw, "test")
    table, frame = overlap_table(cfg, overlap_frame([
        ("tiny-s", "grpo", 0, 0.86), ("tiny-s", "grpo", 1, 0.88), ("tiny-s", "ict", 0, 0.90)]))
    rows = {(r[0] or "Tiny-S", r[1]): r for r in table.rows[:4]}
    # mean of 86 and 88, sd √2 = 1.4; Jaccard mean of 0.86/1.14 and 0.88/1.12
    assert rows["Tiny-S", "GRPO"][2:] == ["87.0 ±1.4", "86.0, 88.0",
                                          f"{(0.86 / 1.14 + 0.88 / 1.12) / 2:.3f}", "0.500", "0.400",
                                          "200 / 1,000"]
    # ICT has seed 0 only: no mean, the seed it has
    assert rows["Tiny-S", "ICT"][2:4] == ["—", "90.0, —"]
    assert table.columns[3] == "per seed 0, 1 (%)"
    paper = table.rows[-1]
    assert paper[0].startswith("reported: 80/20 paper, Table 1") and paper[2] == "≥ 86.67"
    assert paper[4] == "≥ 0.76 (derived)" and table.group_starts[-1] == len(table.rows) - 1
    text = markdown(table)
    assert "50.64% of tokens have H < 0.01" in text and "H = 0.672" in text
    assert "overlap = |A ∩ B| / |A|" in text
    grpo = frame.filter((pl.col("size") == "tiny-s") & (pl.col("method") == "grpo")).row(0, named=True)
    assert (grpo["overlap"], grpo["overlap_seed0"], grpo["overlap_seed1"]) == pytest.approx((87.0, 86.0, 88.0))
    assert grpo["overlap_seed_sd"] == pytest.approx(2 ** 0.5)
    assert grpo["sources"].count("overlap.parquet") == 2


def test_overlap_table_applies_with_overlap_top(default_raw):
    raw = config(default_raw)
    raw.setdefault("token_stats", {})["overlap_top"] = None
    assert "overlap.md" not in output_names(validate(raw, "test"))["tables"]
    raw["token_stats"]["overlap_top"] = 0.2
    assert "overlap.md" in output_names(validate(raw, "test"))["tables"]


def test_main_avg16_table_is_the_headline(default_raw):
    from stages.tables import main_table
    from stages.tables.main_pass import main_metrics

    cfg = validate(config_8020(default_raw), "test")
    assert main_metrics(cfg) == ["avg@16", "pass@1", "pass@4"]
    table, frame = main_table(cfg, metrics_8020(), "avg@16")
    assert table.title == "Main results: avg@16 (%) per size, method and benchmark"
    assert [r[1] for r in table.rows[:3]] == ["Base model", "DAPO", "20-Entropy"]
    assert table.rows[2][2:] == ["35.0", "28.0", "62.0", "72.0", "30.0", "41.0", "44.7", "+3.0"]
    assert "the mean accuracy over the n = 16 samples of each problem, not pass@16" in table.notes[0]
    assert "main_avg16.csv" in table.notes[1] and set(frame["metric"]) == {"avg@16"}
