"""The tables stage on small synthetic metric files with hand-computed expectations."""

from __future__ import annotations

import copy
import math
import types
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from stages.config import validate
from stages.core.common.io import provenance, write_parquet
from stages.core.report import render, reported
from stages.evaluate import METRIC_SCHEMA, SAMPLE_SCHEMA
from stages.tables import (
    RATIO_LABEL,
    TABLE1_LABEL,
    ablation_table,
    ict_gains,
    main,
    main_total_table,
    method_groups,
    method_label,
    method_params,
    output_names,
    paper_size,
    pass_at_k_curves,
)
from tests.conftest import ROOT, run_stage, write_yaml

BENCHES = ["arith-easy", "arith-mid", "arith-hard"]
# pass@4 of tiny-s; tiny-m adds 0.10 (ICT 0.12); pass@1 is half of pass@4
PASS4 = {
    "base": [0.20, 0.10, 0.00],
    "grpo": [0.50, 0.40, 0.10],
    "entropy20": [0.55, 0.35, 0.12],
    "stapo": [0.45, 0.42, 0.08],
    "ict": [0.60, 0.38, 0.15],
    "ict-rho0.2": [0.52, 0.30, 0.05],
    "jsd-token-id": [0.40, 0.33, 0.06],
    "random10": [0.30, 0.20, 0.02],
}
MISSING_CELL = ("tiny-m", "stapo", "arith-hard")  # no evaluation: "—" and no average


def value(size, method, bench, k):
    v = PASS4[method][BENCHES.index(bench)]
    if size == "tiny-m":
        v += 0.12 if method == "ict" else 0.10
    return v if k == 4 else v / 2


def config(default_raw, ablations=True):
    raw = copy.deepcopy(default_raw)
    raw["experiment"].update(sizes=["tiny-s", "tiny-m"], seeds=[0])  # the fixture's grid
    raw["token_stats"]["overlap_top"] = 0.2
    raw["experiment"]["methods"] = ["grpo", "entropy20", "stapo", "ict"] + (
        ["ict-rho0.2", "jsd-token-id", "random10"] if ablations else [])
    raw["evaluate"]["main_methods"] = ["grpo", "entropy20", "stapo", "ict"]
    # the printed names, fixed here so that the expectations do not follow the default config
    raw["models"]["tiny-s"]["label"], raw["models"]["tiny-m"]["label"] = "Tiny-S", "Tiny-M"
    for bench, label in zip(BENCHES, ["Easy", "Mid", "Hard"], strict=True):
        raw["datasets"][bench]["label"] = label
    for method, label in [("grpo", "GRPO"), ("entropy20", "20-Entropy"), ("stapo", "STAPO"),
                          ("ict", "ICT")]:
        raw["methods"][method]["label"] = label
    for method in ("ict-rho0.2", "jsd-token-id"):  # their labels come from method_label
        raw["methods"][method].pop("label", None)
    return raw


def write_eval(root: Path, size, method, bench) -> Path:
    d = root / "eval" / f"size={size}" / f"method={method}" / "seed=0" / f"bench={bench}"
    prov = provenance("evaluate", "1", f"hash-{size}-{method}-{bench}", 0)
    rows = [{"metric": f"pass@{k}", "k": k, "value": value(size, method, bench, k),
             "ci_low": value(size, method, bench, k) - 0.05, "ci_high": value(size, method, bench, k) + 0.05,
             "n_problems": 2, "n_samples": 8} for k in (1, 4)]
    write_parquet(rows, d / "metrics.parquet", METRIC_SCHEMA, prov)
    # two problems with 8 samples: 2 and 0 correct
    samples = [{"benchmark": bench, "problem_id": f"p{i}", "sample_idx": j, "response": "#### 1",
                "extracted": "1", "correct": i == 0 and j < 2, "grade_error": None, "answer": "1",
                "answer_type": "math", "finish_reason": "stop", "response_tokens": 3,
                "grader": "verify", "score": None, "other_grades": None}
               for i in range(2) for j in range(8)]
    write_parquet(samples, d / "samples.parquet", SAMPLE_SCHEMA, prov)
    return d


TRAIN_COLUMNS = ("reward_mean", "entropy_mean", "renyi2_mean", "selected_fraction",
                 "rollout_logprob_diff_max", "rollout_kl")
REWARD_SLOPE = {"grpo": 0.010, "ict": 0.014}  # reward gained per step beyond the batch's swing


def batch_swing(step: int) -> float:
    """The reward every method sees at a step from its batch of prompts (the same prompts for all)."""
    return 0.15 * math.sin(1.7 * step) + 0.1 * math.cos(0.9 * step)


def write_train(root: Path, size, method, seed=0, steps=20) -> Path:
    d = root / "train" / f"size={size}" / f"method={method}" / f"seed={seed}"
    schema = pa.schema([pa.field("step", pa.int64())] + [(c, pa.float64()) for c in TRAIN_COLUMNS])
    slope = REWARD_SLOPE.get(method, 0.012)
    # each run's own noise: the same prompts, but other samples per method and seed
    rows = [{"step": s, "reward_mean": 0.2 + slope * s + batch_swing(s)
             + 0.04 * math.sin(0.8 * s + 2 * seed + len(method)),
             "entropy_mean": 0.5 / (s + 1) * (1.2 if method == "ict" else 1.0),
             "renyi2_mean": 0.3 / (s + 1), "selected_fraction": 1.0 if method == "grpo" else 0.1,
             "rollout_logprob_diff_max": 0.05 * (1 + s % 3),
             "rollout_kl": 1e-5 * (s + 1) ** 1.6 if method == "ict" else None} for s in range(steps)]
    write_parquet(rows, d / "metrics.parquet", schema, provenance("train", "1", f"t-{size}-{method}", seed))
    return d


SPREAD = ("mean", "sd", "median")
READINGS_TYPES = {  # token_stats.READINGS_SCHEMA, as the stage writes it
    "reading": pa.string(), "label": pa.string(), "rho": pa.float64(), "picks": pa.int64(),
    "picks_share": pa.float64(), "prob_mean": pa.float64(), "prob_sd": pa.float64(),
    "prob_median": pa.float64(), "max_prob_mean": pa.float64(), "entropy_mean": pa.float64(),
    "high_low_ratio": pa.float64(), "high_share": pa.float64(), "ceiling_of": pa.string(),
    "ceiling_share": pa.float64(), "early_share": pa.float64(), "eot_share": pa.float64(),
    "reference_of": pa.string(),
    **{f"{v}_{s}": pa.float64() for v in ("ref_prob", "ref_prob_out", "beta") for s in SPREAD},
    "ref_prob_out_picks": pa.int64(), "above_beta_share": pa.float64(),
    "diverged_picks": pa.int64(), "diverged_share": pa.float64(),
    **{f"diverged_{v}_{s}": pa.float64() for v in ("prob", "ref_prob", "ref_prob_out", "beta")
       for s in SPREAD},
    "reported_prob_mean": pa.float64(), "reported_prob_sd": pa.float64(),
    "reported_high_low_ratio": pa.float64(), "reported_high_low_ratio_math": pa.float64(),
    "reported_source": pa.string()}
READINGS_ROWS = [  # reading, label, picks, prob mean, sd, ratio, ceiling share
    ("paper", "ICT (paper's rule)", 1235, 0.912, 0.121, 1.05, 0.40),
    ("response_mean", "response-mean reading (ours, not ICT)", 1235, 0.874, 0.150, 0.95, 0.10),
    ("group_pooled", "group-pooled reading (ours, not ICT)", 1235, 0.861, 0.160, 0.97, 0.12),
    ("group_leave_one_out", "group leave-one-out reading (ours, not ICT)", 1235, 0.905, 0.130, 1.01, 0.38),
    ("token_id", "JSD token-id reading (ours, not ICT)", 2010, 0.950, 0.080, 0.40, None),
    ("scope_position", "JSD scope-position reading (ours, not ICT)", 1235, 0.700, 0.250, 2.30, None),
    ("random10_response", "random 10% per response (control)", 1235, 0.820, 0.200, 0.99, 0.05),
    ("all_tokens", "all tokens (for scale)", 12345, 0.830, 0.210, 1.00, None),
]
OWN_REFERENCE = ("paper", "response_mean", "group_pooled", "group_leave_one_out")


def reference_columns(reading: str, picks: int, prob: float) -> dict:
    """Synthetic reference columns of a readings row: P̄(y) about half the own p, about a third
    of the picks diverged, P̄(y) there about 1/8 (G = 8); the response-mean reading has no
    reference without the response."""
    ref = round(prob / 2, 3)
    none = reading == "response_mean"
    values = {"ref_prob": (ref, 0.2, ref - 0.05), "beta": (0.6, 0.2, 0.65),
              "ref_prob_out": (None, None, None) if none else (ref - 0.1, 0.15, ref - 0.12),
              "diverged_prob": (prob - 0.05, 0.2, prob), "diverged_ref_prob": (0.15, 0.1, 0.125),
              "diverged_ref_prob_out": (None, None, None) if none else (0.03, 0.05, 0.0),
              "diverged_beta": (0.3, 0.1, 0.28)}
    return {"reference_of": reading if reading in OWN_REFERENCE else "paper",
            **{f"{v}_{s}": x for v, xs in values.items() for s, x in zip(SPREAD, xs, strict=True)},
            "ref_prob_out_picks": 0 if none else picks - 5, "above_beta_share": 0.3,
            "diverged_picks": picks // 3, "diverged_share": (picks // 3) / picks}


def write_readings(root: Path, size) -> Path:
    """token_stats/size=S/readings.parquet with the rows of READINGS_ROWS."""
    d = root / "token_stats" / f"size={size}"
    rows = []
    for reading, label, picks, prob, sd, ratio, ceiling in READINGS_ROWS:
        paper = reading == "paper"
        rows.append({"reading": reading, "label": label,
                     "rho": 1.0 if reading == "all_tokens" else 0.1, "picks": picks,
                     "picks_share": picks / 12345, "prob_mean": prob, "prob_sd": sd,
                     "prob_median": min(prob + 0.05, 1.0), "max_prob_mean": prob + 0.03, "entropy_mean": 0.2, "high_low_ratio": ratio,
                     "high_share": ratio / (1 + ratio), "ceiling_of": reading if ceiling is not None else "paper",
                     "ceiling_share": ceiling if ceiling is not None else 0.4, "early_share": 0.08,
                     "eot_share": 0.02, **reference_columns(reading, picks, prob),
                     "reported_prob_mean": 0.18 if paper else None,
                     "reported_prob_sd": 0.09 if paper else None,
                     "reported_high_low_ratio": 1.03 if paper else None,
                     "reported_high_low_ratio_math": 0.99 if paper else None,
                     "reported_source": "ICT (summaries)" if paper else None})
    schema = pa.schema([pa.field(k, t) for k, t in READINGS_TYPES.items()])
    write_parquet(rows, d / "readings.parquet", schema, provenance("token_stats", "3", f"ts-{size}", 0))
    return d


OVERLAP_TYPES = {"top": pa.float64(), "tokens": pa.int64(), "positions": pa.int64(),
                 "overlap": pa.float64(), "jaccard": pa.float64(),
                 "entropy_mean_base": pa.float64(), "entropy_mean_trained": pa.float64()}


def write_overlap(root: Path, size, method, seed, overlap) -> Path:
    """overlap/size=S/method=M/seed=K/overlap.parquet: 12,345 tokens, the top 20%."""
    d = root / "overlap" / f"size={size}" / f"method={method}" / f"seed={seed}"
    row = {"top": 0.2, "tokens": 12345, "positions": 2469, "overlap": overlap,
           "jaccard": overlap / (2 - overlap), "entropy_mean_base": 0.25,
           "entropy_mean_trained": 0.25 - 0.1 * (1 - overlap)}
    schema = pa.schema([pa.field(k, t) for k, t in OVERLAP_TYPES.items()])
    write_parquet([row], d / "overlap.parquet", schema, provenance("overlap", "1", f"o-{size}-{method}", seed))
    return d


def write_token_stats(root: Path, size, frac_low) -> Path:
    d = root / "token_stats" / f"size={size}"
    names = ["samples", "tokens", "rollout_accuracy", "temperature", "frac_entropy_below_0.01",
             "entropy_p80", "entropy_mean", "renyi2_mean", "jsd_mean", "logprob_mean",
             "selected_fraction_entropy20", "selected_fraction_stapo", "selected_fraction_ict",
             "jaccard_entropy20_stapo", "jaccard_entropy20_ict", "jaccard_stapo_ict"]
    schema = pa.schema([pa.field("size", pa.string())] + [
        pa.field(n, pa.int64() if n in ("samples", "tokens") else pa.float64()) for n in names])
    row = {"size": size, "samples": 64, "tokens": 12345, "rollout_accuracy": 0.3, "temperature": 1.0,
           "frac_entropy_below_0.01": frac_low, "entropy_p80": 0.5, "entropy_mean": 0.25,
           "renyi2_mean": 0.2, "jsd_mean": 0.1, "logprob_mean": -0.3,
           "selected_fraction_entropy20": 0.2, "selected_fraction_stapo": 0.9999,
           "selected_fraction_ict": 0.31, "jaccard_entropy20_stapo": 0.2,
           "jaccard_entropy20_ict": 0.4, "jaccard_stapo_ict": 0.3}
    prov = provenance("token_stats", "1", f"ts-{size}", 0)
    write_parquet([row], d / "summary.parquet", schema, prov)
    tokens = pa.schema([pa.field("entropy", pa.float32())])
    write_parquet([{"entropy": e} for e in (0.001, 0.005, 0.2, 0.9, 1.5, 0.0)], d / "tokens.parquet",
                  tokens, prov)
    return d


def build(root: Path, raw: dict):
    cfg = validate(raw, "test")
    evals = [write_eval(root, s, m, b) for s in cfg.experiment.sizes
             for m in ["base", *cfg.experiment.methods] for b in BENCHES
             if (s, m, b) != MISSING_CELL]
    train = [write_train(root, s, m) for s in cfg.experiment.sizes for m in ["grpo", "ict"]]
    stats = [write_token_stats(root, "tiny-s", 0.55)]  # tiny-m has none: its row is all "—"
    write_readings(root, "tiny-s")
    overlap = [write_overlap(root, "tiny-s", m, 0, v) for m, v in (("grpo", 0.88), ("ict", 0.91))]
    args = types.SimpleNamespace(eval=[str(d) for d in evals], train=[str(d) for d in train],
                                 token_stats=[str(d) for d in stats], overlap=[str(d) for d in overlap],
                                 eval_steps=[], tables_dir=str(root / "tables"),
                                 figures_dir=str(root / "figures"))
    return cfg, args


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    import yaml

    root = tmp_path_factory.mktemp("tables")
    raw = config(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    cfg, args = build(root, raw)
    main(args, cfg)
    return root, cfg


def md_rows(text: str, title_part: str) -> list[list[str]]:
    """The body rows of the Markdown table whose title contains `title_part`."""
    block = text.split("### ")
    table = next(b for b in block if b.strip() and title_part in b.splitlines()[0])
    lines = [ln for ln in table.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_every_declared_output_is_written(rendered):
    root, cfg = rendered
    names = output_names(cfg)
    for name in names["tables"]:
        assert (root / "tables" / name).stat().st_size > 0, name
    for name in names["figures"]:
        assert (root / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "ablation.md" in names["tables"] and "training_tiny-m.png" in names["figures"]


def test_main_table_values_bold_averages_and_delta(rendered):
    root, _ = rendered
    rows = md_rows((root / "tables" / "main_pass4.md").read_text(), "Main results: pass@4")
    assert [r[1] for r in rows[:5]] == ["Base model", "GRPO", "20-Entropy", "STAPO", "ICT"]
    assert rows[0][0] == "Tiny-S" and rows[1][0] == "" and rows[5][0] == "Tiny-M"
    tiny_s = {r[1]: r[2:] for r in rows[:5]}
    # bold: best per size and column (ICT on easy and hard and the average, STAPO on mid)
    assert tiny_s["ICT"] == ["**60.0**", "38.0", "**15.0**", "**37.7**", "+4.3"]
    assert tiny_s["STAPO"] == ["45.0", "**42.0**", "8.0", "31.7", "-1.7"]
    assert tiny_s["GRPO"] == ["50.0", "40.0", "10.0", "33.3", "ref."]
    assert tiny_s["Base model"] == ["20.0", "10.0", "0.0", "10.0", "-23.3"]
    tiny_m = {r[1]: r[2:] for r in rows[5:10]}
    # a missing evaluation: "—", no average, no Δ
    assert tiny_m["STAPO"] == ["55.0", "**52.0**", "—", "—", "—"]
    assert tiny_m["ICT"] == ["**72.0**", "50.0", "**27.0**", "**49.7**", "+6.3"]
    # ablation methods stay out of the main table
    assert not any("rho0.05" in r[1] or "random" in r[1] for r in rows)
    pass1 = md_rows((root / "tables" / "main_pass1.md").read_text(), "Main results: pass@1")
    assert pass1[4][2:] == ["**30.0**", "19.0", "**7.5**", "**18.8**", "+2.2"]


def test_ict_gains_beside_the_paper_headline(rendered):
    root, _ = rendered
    text = (root / "tables" / "main_pass4.md").read_text()
    rows = md_rows(text, "ICT against the baselines, pass@4")
    by_baseline = {r[1]: r for r in rows}
    # ICT - GRPO: tiny-s +10, -2, +5; tiny-m +12, 0, +7 -> mean 32/6, max 12 (Tiny-M, Easy)
    assert by_baseline["GRPO"][2:6] == ["6/6", "+5.33", "+12.0", "Tiny-M, Easy"]
    # STAPO misses one cell: no average over an incomplete set
    assert by_baseline["STAPO"][2:5] == ["5/6", "—", "—"]
    assert by_baseline["GRPO, 20-Entropy, STAPO"][-1] == "+4.58% avg, +14.9% max"
    assert "Paper: ICT abstract" in text and "0.5B +4.37, 1.5B +4.98, 7B +4.38" in text
    gains = pl.read_csv(root / "tables" / "ict_gains_pass4.csv")
    assert gains.height == 17
    grpo = gains.filter(pl.col("baseline") == "grpo")
    assert grpo["gain"].sum() == pytest.approx(32.0)
    # the pass@1 version has no paper column: the paper reports pass@4 only
    assert "+4.58%" not in (root / "tables" / "main_pass1.md").read_text()


def test_csv_keeps_numbers_intervals_and_their_files(rendered):
    root, _ = rendered
    csv = pl.read_csv(root / "tables" / "main_pass4.csv")
    row = csv.filter((pl.col("size") == "tiny-s") & (pl.col("method") == "ict")).row(0, named=True)
    assert row["arith-easy"] == pytest.approx(60.0)
    assert (row["arith-easy_ci_low"], row["arith-easy_ci_high"]) == pytest.approx((55.0, 65.0))
    assert row["arith-easy_delta_vs_grpo"] == pytest.approx(10.0)
    assert row["avg"] == pytest.approx(113 / 3)
    assert row["best_in_size"] == "arith-easy;arith-hard;avg"
    files = row["sources"].split(";")
    assert len(files) == 3 and all(Path(f).exists() for f in files)
    assert any("size=tiny-s/method=ict/seed=0/bench=arith-easy/metrics.parquet" in f for f in files)
    missing = csv.filter((pl.col("size") == "tiny-m") & (pl.col("method") == "stapo")).row(0, named=True)
    assert missing["arith-hard"] is None and missing["avg"] is None
    sources = pl.read_csv(root / "tables" / "sources.csv")
    hit = sources.filter(pl.col("file").str.contains("size=tiny-s/method=ict/seed=0/bench=arith-easy/metrics"))
    assert hit["config_hash"].to_list() == ["hash-tiny-s-ict-arith-easy"]
    assert set(sources["stage"]) == {"evaluate", "train", "token_stats", "overlap"}
    long = pl.read_csv(root / "tables" / "eval_long.csv")
    assert long.height == (2 * 8 * 3 - 1) * 2 and {"size", "method", "seed", "bench", "source"} <= set(long.columns)


def test_latex_is_booktabs_with_escapes(rendered):
    root, _ = rendered
    tex = (root / "tables" / "main_pass4.tex").read_text()
    assert tex.count(r"\toprule") == tex.count(r"\bottomrule") == 2  # main table and the gains
    assert r"\textbf{60.0}" in tex and r"in main\_total" in tex
    assert r"$\Delta$ Avg. vs GRPO" in tex and r"pass@4 (\%)" in tex
    body = tex.split(r"\begin{tabular}")[1].split(r"\end{tabular}")[0]
    assert body.count(r"\midrule") == 2  # under the header and between the sizes
    for line in body.splitlines()[2:]:
        if line.endswith(r"\\"):
            assert line.count(" & ") == 6


def test_token_statistics_table(rendered):
    root, _ = rendered
    rows = md_rows((root / "tables" / "token_stats.md").read_text(), "Token statistics")
    assert rows[0][:5] == ["Tiny-S", "12,345", "55.0", "0.500", "0.250"]
    assert rows[0][5:8] == ["20.0", "99.99", "31.0"]
    assert rows[1][1:] == ["—"] * 10  # no token statistics for tiny-m
    assert rows[2][2:4] == ["> 50", "0.672"] and rows[2][0].startswith("paper")


def test_ablation_table(rendered):
    root, cfg = rendered
    rows = md_rows((root / "tables" / "ablation.md").read_text(), "Ablations")
    methods = [r[1] for r in rows]
    # the ICT family in ρ order, the main ICT method among them; our readings apart from ICT
    assert methods == ["GRPO", "ICT", "ICT (ρ=0.2)", "JSD token-id reading (ours, not ICT)",
                       "Random 10% of the batch"]
    assert [r[0] for r in rows] == ["reference", "ICT", "", "JSD readings (ours, not ICT)", "controls"]
    rho = rows[2]
    assert rho[2] == "ict, ρ=0.2, Θ=6"
    assert rows[3][2] == "ict, ρ=0.1, token_id reading (ours, not ICT)"
    # tiny-s: pass@4 avg (0.52 + 0.30 + 0.05) / 3, pass@1 half of it, Δ@4 against GRPO's 33.3
    assert rho[3:6] == ["29.0", "14.5", "-4.3"]
    assert rows[1][3] == "**37.7**"  # best pass@4 of tiny-s among the ablation rows
    assert rows[0][5] == "ref." or rows[0][5] == "—"
    csv = pl.read_csv(root / "tables" / "ablation.csv")
    assert csv.filter(pl.col("method") == "random10")["in_main_table"].to_list() == [False]


def test_ablation_table_has_the_reported_ratio_ablation_beside_ours(rendered):
    root, cfg = rendered
    text = (root / "tables" / "ablation.md").read_text()
    header = next(ln for ln in text.splitlines() if ln.startswith("| Family"))
    columns = [c.strip() for c in header.strip("|").split(" | ")]
    assert columns[-3:] == [RATIO_LABEL, "P@1 (rep.)", "P@4 (rep.)"]
    assert columns[3:9] == ["Tiny-S pass@4", "Tiny-S pass@1", "Tiny-S Δ@4",
                            "Tiny-M pass@4", "Tiny-M pass@1", "Tiny-M Δ@4"]
    rows = {r[1]: r for r in md_rows(text, "Ablations")}
    ratio = reported.RATIO_ABLATION

    def rep(row):
        return [row, f"{ratio[row].p1:.2f}", f"{ratio[row].p4:.2f}"]

    # paper_row GRPO, ICT (the ablation's 10%-unique) and 20%-unique; none for the others
    assert rows["GRPO"][-3:] == rep("GRPO") == ["GRPO", "57.45", "78.45"]
    assert rows["ICT"][-3:] == rep("10%-unique")
    assert rows["ICT (ρ=0.2)"][-3:] == rep("20%-unique")
    assert rows["JSD token-id reading (ours, not ICT)"][-3:] == ["—", "—", "—"]
    assert rows["Random 10% of the batch"][-3:] == ["—", "—", "—"]
    # our cells stay ours: GRPO's tiny-s pass@4 average is 33.3, not a reported number
    assert rows["GRPO"][3:5] == ["33.3", "16.7"]
    notes = text.split("Ablations")[1]
    assert "Qwen2.5-1.5B trained and tested on GSM8K, as reported by summaries of the ICT paper" in notes
    assert "ours on our benchmarks and sizes" in notes and "Ours: average pass@k in % over our benchmarks (Easy, Mid, Hard)" in notes
    assert f"base model {ratio['Base'].p1:.2f} / {ratio['Base'].p4:.2f}" in notes
    csv = pl.read_csv(root / "tables" / "ablation.csv")
    ict = csv.filter(pl.col("method") == "ict").row(0, named=True)
    assert (ict["reported_row"], ict["reported_p1"], ict["reported_p4"]) == (
        "10%-unique", ratio["10%-unique"].p1, ratio["10%-unique"].p4)
    assert ict["tiny-s_pass4_avg"] == pytest.approx(113 / 3)


def test_ratio_rows_of_the_paper_controls(default_raw):
    """random 10% has no reported P@4; 90%-frequent and the response-level random control map."""
    raw = config(default_raw)
    raw["experiment"]["methods"] += ["ict-frequent90", "random10-response", "ict-rho0.3"]
    cfg = validate(raw, "test")
    table, _ = ablation_table(cfg, pl.DataFrame())
    rows = {r[1]: r for r in table.rows}
    ratio = reported.RATIO_ABLATION
    assert rows["ICT 90%-frequent"][-3:] == ["90%-frequent", f"{ratio['90%-frequent'].p1:.2f}",
                                             f"{ratio['90%-frequent'].p4:.2f}"]
    assert rows["Random 10% per response"][-3:] == ["random 10%", f"{ratio['random 10%'].p1:.2f}", "—"]
    assert rows["ICT ρ=0.3"][-3:-1] == ["30%-unique", f"{ratio['30%-unique'].p1:.2f}"]
    # no evaluations: every one of our cells is "—" while the reported ones are filled
    for row in table.rows:
        assert row[3:-3] == ["—"] * (len(row) - 6)


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_no_ablation_methods_no_ablation_table(tmp_path, default_raw):
    cfg, args = build(tmp_path, config(default_raw, ablations=False))
    main(args, cfg)
    assert "ablation.md" not in output_names(cfg)["tables"]
    assert not (tmp_path / "tables" / "ablation.md").exists()
    assert "Ablations" not in (tmp_path / "tables" / "tables.md").read_text()
    html = (tmp_path / "tables" / "tables.html").read_text()
    # 2 main, 2 ICT gains, total, base gains, token stats, overlap, ICT readings (two tables)
    assert "<b>60.0</b>" in html and html.count("<table>") == 10


def test_a_registered_table_is_declared_written_and_shown_in_its_order(tmp_path, monkeypatch, default_raw):
    """One decorated function adds a table: its files among the rule's outputs and on disk, its
    table on the pages, all at its order (41: after token_stats, before overlap)."""
    from stages.tables import registry
    from stages.tables.write import table_files, write_table

    # the tables only: the figures take seconds and are not what this test is about
    monkeypatch.setattr(registry, "OUTPUTS", {n: s for n, s in registry.OUTPUTS.items()
                                              if s.folder == "tables"})

    @registry.register_table("extra", order=41, files=lambda cfg: table_files("extra"))
    def write_extra(cfg, data, folder):
        table = render.Table("Extra table", ["Size"], [[s] for s in cfg.experiment.sizes])
        write_table([(table, "tab:extra")], pl.DataFrame({"size": cfg.experiment.sizes}), folder / "extra")
        return [table]

    cfg, args = build(tmp_path, config(default_raw))
    tables = output_names(cfg)["tables"]
    assert tables[tables.index("token_stats.csv") + 1:tables.index("overlap.md")] == [
        "extra.md", "extra.tex", "extra.csv"]
    main(args, cfg)
    assert (tmp_path / "tables" / "extra.csv").read_text() == "size\ntiny-s\ntiny-m\n"
    titles = [ln for ln in (tmp_path / "tables" / "tables.md").read_text().splitlines()
              if ln.startswith("### ")]
    assert titles[titles.index("### Extra table") - 1:][:3] == [
        "### Token statistics of the base models", "### Extra table",
        "### Top-20% entropy positions: base model against each trained model"]
    with pytest.raises(ValueError, match="'extra' is already registered"):
        registry.register_table("extra", order=99, files=lambda cfg: [])(write_extra)
    with pytest.raises(ValueError, match="order 41 of the tables is taken by 'extra'"):
        registry.register_table("other", order=41, files=lambda cfg: [])(write_extra)


def test_a_path_without_hive_keys_is_an_error(tmp_path, default_raw):
    cfg_file = write_yaml(tmp_path / "cfg.yaml", default_raw)
    (tmp_path / "flat").mkdir()
    proc = run_stage("tables", "--config", str(cfg_file), "--eval", str(tmp_path / "flat"),
                     "--tables-dir", str(tmp_path / "t"), "--figures-dir", str(tmp_path / "f"))
    assert proc.returncode == 2
    assert "the path names no size=, method=, seed=, bench=" in proc.stderr


def test_method_labels_and_groups(default_raw):
    cfg = validate(config(default_raw), "test")
    assert method_label(cfg, "base") == "Base model"
    assert method_label(cfg, "ict") == "ICT"
    assert method_label(cfg, "ict-rho0.2") == "ICT (ρ=0.2)"
    assert method_groups(cfg) == (["grpo", "entropy20", "stapo", "ict"],
                                  ["ict-rho0.2", "jsd-token-id", "random10"])
    raw = config(default_raw)
    raw["evaluate"]["main_methods"] = ["grpo", "ppo"]
    with pytest.raises(Exception, match=r"evaluate.main_methods.1: 'ppo' is not in experiment.methods"):
        validate(raw, "test")


def test_our_earlier_readings_never_read_as_ict(default_raw):
    raw = config(default_raw)
    raw["methods"]["jsd-scope-position"].pop("label")
    raw["methods"].update({
        "plain": {"selector": "ict"},  # ICT's rule, no label
        "token-rho": {"selector": "ict", "variant": "token_id", "rho": 0.2},
        "claims-ict": {"selector": "ict", "variant": "token_id", "label": "ICT"},
        "says-so": {"selector": "ict", "variant": "scope_position", "label": "pos (ours, not ICT)"},
        "frequent": {"selector": "ict", "part": "frequent"},
    })
    cfg = validate(raw, "test")
    assert method_label(cfg, "plain") == "ICT"
    assert method_label(cfg, "jsd-token-id") == "JSD token-id reading (ours, not ICT)"
    assert method_label(cfg, "jsd-scope-position") == "JSD scope-position reading (ours, not ICT)"
    assert method_label(cfg, "token-rho") == "JSD token-id reading ρ=0.2 (ours, not ICT)"
    # a label that calls a reading ICT comes after the reading's name and "not ICT"
    assert method_label(cfg, "claims-ict") == "JSD token-id reading (ours, not ICT): ICT"
    assert method_label(cfg, "says-so") == "pos (ours, not ICT)"
    assert method_label(cfg, "frequent") == "90%-frequent (complement of ICT)"
    for name in ("jsd-token-id", "jsd-scope-position", "token-rho", "claims-ict", "says-so"):
        assert "not ICT" in method_label(cfg, name) and not method_label(cfg, name).startswith("ICT")
        assert "reading (ours, not ICT)" in method_params(cfg, name)
    assert method_params(cfg, "ict") == "ict, ρ=0.1, Θ=6"
    assert method_params(cfg, "frequent") == "ict, ρ=0.1, part=frequent"
    assert method_params(cfg, "stapo") == "stapo, τ_p=0.002, q=0.75"
    assert method_params(cfg, "random10") == "random, ρ=0.1, scope=batch"
    assert method_params(cfg, "grpo") == "all"
    # the ICT-gain table compares ICT's rule only: a reading in the main table is not an ICT row
    raw["evaluate"]["main_methods"] = raw["experiment"]["methods"] = ["grpo", "jsd-token-id", "ict"]
    table, _ = ict_gains(validate(raw, "test"), pl.DataFrame(), 4)
    assert {r[0] for r in table.rows} == {"ICT"} and [r[1] for r in table.rows] == ["GRPO"]


def test_test_config_labels(test_raw):
    """config/test.yaml's methods have no labels: ICT's rule prints as ICT."""
    cfg = validate(test_raw, "test.yaml")
    assert method_label(cfg, "ict") == "ICT" and method_label(cfg, "grpo") == "grpo"
    assert "main_total.md" in output_names(cfg)["tables"]


def test_pass_at_k_curves_by_hand():
    counts = pl.DataFrame({"size": ["s", "s"], "method": ["m", "m"], "seed": [0, 0],
                           "bench": ["b", "b"], "problem_id": ["p", "q"], "n": [4, 4], "c": [1, 0]})
    curve = pass_at_k_curves(counts)
    assert curve["k"].to_list() == [1, 2, 3, 4]
    # one correct of four: pass@k = k/4 for that problem, 0 for the other
    assert curve["value"].to_list() == pytest.approx([0.125, 0.25, 0.375, 0.5])


def test_glob_and_latex_escape():
    paths = ["r/eval/size=a/method=x/seed=0/bench=e/metrics.parquet",
             "r/eval/size=b/method=x/seed=0/bench=f/metrics.parquet"]
    assert render.glob_of(paths) == "r/eval/size=*/method=x/seed=0/bench=*/metrics.parquet"
    assert render.latex_escape("a_b 50% Δ ρ=0.1 — #1 {x}") == r"a\_b 50\% $\Delta$ $\rho$=0.1 --- \#1 \{x\}"


@pytest.mark.skipif(not (ROOT / "workflow" / "rules" / "train.smk").exists(),
                    reason="the training rules (issue 4) are not in the workflow yet")
@pytest.mark.slow
@pytest.mark.parametrize("name, evaluations", [("test.yaml", 1 * 3 * 1), ("paper.yaml", 3 * 5 * 5)])
def test_dry_run_reaches_the_tables(tmp_path, monkeypatch, name, evaluations):
    """`rule all` ends at the tables: every size x (base + methods) x seed is evaluated, one job
    per model for all its benchmarks."""
    from tests.test_workflow import job_counts, snakemake

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dry run needs no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    proc = snakemake("-n", "-p", "--configfile", str(ROOT / "config" / name), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    counts = job_counts(proc.stdout)
    assert counts["evaluate"] == evaluations and counts["tables"] == 1 and counts["all"] == 1
    # each evaluation is the stage's CLI, printed so that it can be rerun by hand
    run = name.split(".")[0]
    for method, model in [("base", f"results/{run}/models/size={{s}}/base.json"),
                          ("ict", f"results/{run}/train/size={{s}}/method=ict/seed=0/model.json")]:
        size = "tiny-s" if run == "test" else "qwen2.5-7b"
        assert (f"-m stages.evaluate --config results/{run}/resolved_config.yaml --size {size} "
                f"--method {method} --seed 0") in proc.stdout
        assert f"--model {model.format(s=size)}" in proc.stdout


def test_cells_average_seeds_and_need_all_of_them():
    from stages.tables import cells

    rows = [("s", "m", 0, "b", 0.2), ("s", "m", 1, "b", 0.4), ("s", "m", 0, "c", 0.5),
            ("s", "m", 7, "c", 0.9)]  # seed 7 is not in the grid
    metrics = pl.DataFrame([{"size": a, "method": m, "seed": k, "bench": b, "metric": "pass@4",
                             "value": v, "ci_low": v - 0.1, "ci_high": v + 0.1, "source": f"{k}{b}"}
                            for a, m, k, b, v in rows])
    out = cells(metrics, "pass@4", [0, 1])
    assert out["s", "m", "b"].value == pytest.approx(0.3) and out["s", "m", "b"].seeds == 2
    assert out["s", "m", "b"].ci_low is None  # an interval of one seed does not hold for the mean
    assert ("s", "m", "c") not in out  # seed 1 missing
    single = cells(metrics, "pass@4", [0])
    assert single["s", "m", "c"].value == 0.5 and single["s", "m", "c"].ci_low == pytest.approx(0.4)


@pytest.mark.slow
def test_rule_tables_and_the_snakemake_report(tmp_path):
    """The rule runs on existing inputs, then reruns nothing, and the report holds its outputs."""
    import json
    import re

    from tests.test_workflow import snakemake

    root = tmp_path / "results" / "test"
    for method in ["base", "grpo", "ict"]:  # config/test.yaml: tiny-s, arith-easy, seed 0
        write_eval(root, "tiny-s", method, "arith-easy")
    for method in ["grpo", "ict"]:
        write_train(root, "tiny-s", method)
        write_overlap(root, "tiny-s", method, 0, 0.9)
    write_token_stats(root, "tiny-s", 0.4)
    write_readings(root, "tiny-s")
    cfg = str(ROOT / "config" / "test.yaml")
    # only the tables job: the files written above stand for the stages before it
    proc = snakemake("tables", "--cores", "1", "--allowed-rules", "tables", "--configfile", cfg, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "tables" / "main_pass4.md").exists() and (root / "figures" / "pass_at_k_tiny-s.png").exists()
    again = snakemake("tables", "-n", "--allowed-rules", "tables", "--configfile", cfg, cwd=tmp_path)
    assert "Nothing to be done" in again.stdout + again.stderr
    proc = snakemake("tables", "--report", "report.html", "--allowed-rules", "tables", "--configfile", cfg,
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "report.html").read_text()
    categories = json.loads(re.search(r"var categories = (\{.*?\});\n", page).group(1))
    assert set(categories) == {"Tables", "Figures"}
    assert "results/test/tables/tables.html" in categories["Tables"]["all tables"]
    assert categories["Figures"]["training curves"] == ["results/test/figures/training_tiny-s.png"]
    assert "against k (1 to n, unbiased estimator)" in page  # a caption (docutils escapes the @)


def test_bold_marks_every_tied_best_and_nothing_in_a_flat_column():
    block = [[0.5, 0.0, None, 0.30], [0.5, 0.0, 0.2, 0.2999], [0.4, 0.0, None, 0.1]]
    # column 0: a tie; 1: all equal; 2: a lone value; 3: equal once shown to 1 decimal (30.0)
    assert render.bold_best(block) == [[True, False, False, True], [True, False, False, True],
                                       [False, False, False, False]]


# ---------------------------------------------------------------------------------------------
# Gain over the base model, paired over problems
# ---------------------------------------------------------------------------------------------
def test_paired_gain_float64_reference():
    """The difference of means and the percentile bootstrap of per-problem differences, by hand."""
    import numpy as np

    from stages.tables import paired_gain

    rng = np.random.default_rng(3)
    ids = [f"p{i}" for i in range(40)]
    base = dict(zip(ids, rng.integers(0, 9, 40) / 8, strict=True))
    trained = dict(zip(ids, rng.integers(0, 9, 40) / 8, strict=True))
    g = paired_gain(base, trained, resamples=500, seed=11, where="x")
    diff = np.array([trained[i] - base[i] for i in sorted(ids)], dtype=np.float64)
    assert g.delta == pytest.approx(sum(trained.values()) / 40 - sum(base.values()) / 40, abs=1e-15)
    draws = np.random.default_rng(11).integers(0, 40, size=(500, 40))
    low, high = np.quantile(diff[draws].mean(axis=1), [0.025, 0.975])
    assert (g.ci_low, g.ci_high) == pytest.approx((low, high), abs=1e-15)
    assert g.n_problems == 40
    # the problems' order in the dicts does not matter: pairs go by id
    assert paired_gain(dict(reversed(base.items())), trained, 500, 11, "x") == g


@pytest.mark.filterwarnings("ignore")
def test_paired_gain_bounds():
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from stages.tables import paired_gain

    acc = st.integers(0, 8).map(lambda c: c / 8)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(acc, acc), min_size=1, max_size=30), st.integers(0, 2**16))
    def check(pairs, seed):
        base = {f"p{i}": a for i, (a, _) in enumerate(pairs)}
        trained = {f"p{i}": b for i, (_, b) in enumerate(pairs)}
        g = paired_gain(base, trained, 200, seed, "x")
        diff = np.array([b - a for a, b in pairs])
        # a mean of resampled differences lies between the smallest and the largest difference
        assert diff.min() - 1e-12 <= g.ci_low <= g.ci_high <= diff.max() + 1e-12
        assert -1.0 <= diff.min() and diff.max() <= 1.0 and -1.0 <= g.delta <= 1.0
        if (diff >= 0).all():  # never worse on any problem: no interval below zero
            assert g.ci_low >= 0.0
        same = paired_gain(base, base, 200, seed, "x")
        assert (same.delta, same.ci_low, same.ci_high) == (0.0, 0.0, 0.0)

    check()


def test_paired_gain_refuses_different_problems():
    from stages.core.common.io import ArtifactError
    from stages.tables import paired_gain

    with pytest.raises(ArtifactError, match=r"a/samples.parquet and b/samples.parquet: .*1 problem ids in only one"):
        paired_gain({"p": 0.5, "q": 0.0}, {"p": 1.0}, 100, 0, "a/samples.parquet and b/samples.parquet")


def test_base_gain_table_by_hand(default_raw):
    """Cells, bold where the interval excludes zero, means over seeds with their sd, the interval
    over seeds and problems, and missing cells."""
    from stages.tables import base_gain_table

    raw = config(default_raw, ablations=False)
    raw["experiment"]["sizes"] = ["tiny-s"]
    raw["experiment"]["seeds"] = [0, 1]
    cfg = validate(raw, "test")
    rows = []

    def add(method, seed, bench, correct):  # correct: samples correct (of 4) per problem
        rows.extend({"size": "tiny-s", "method": method, "seed": seed, "bench": bench,
                     "problem_id": f"p{i}", "n": 4, "c": c,
                     "source": f"{method}/{seed}/{bench}/samples.parquet"} for i, c in enumerate(correct))

    for seed in (0, 1):
        add("base", seed, "arith-easy", [0, 1, 2, 3] * 10)
        add("base", seed, "arith-mid", [2, 2, 2, 2] * 10)
        add("base", seed, "arith-hard", [0] * 40)
        # GRPO: one more correct sample on every easy problem; mid and hard unchanged
        add("grpo", seed, "arith-easy", [1, 2, 3, 4] * 10)
        add("grpo", seed, "arith-mid", [2, 2, 2, 2] * 10)
        add("grpo", seed, "arith-hard", [0] * 40)
    # ICT: seed 0 loses two samples on every mid problem, seed 1 loses none: −1/4 on average
    add("ict", 0, "arith-mid", [0, 0, 0, 0] * 10)
    add("ict", 1, "arith-mid", [2, 2, 2, 2] * 10)
    add("ict", 0, "arith-easy", [0, 1, 2, 3] * 10)  # seed 1 missing: no cell
    counts = pl.DataFrame(rows).with_columns(pl.col("n", "c").cast(pl.UInt32))
    table, frame = base_gain_table(cfg, counts)
    body = {r[1]: r[2:] for r in table.rows}
    assert body["GRPO"] == ["+25.0 ±0.0 [+25.0, +25.0]", "+0.0 ±0.0 [+0.0, +0.0]",
                            "+0.0 ±0.0 [+0.0, +0.0]", "+8.3 ±0.0"]
    # ICT on mid: −50 points with seed 0, 0 with seed 1; sd √(2·25²) = 35.4. Resampling the two
    # seeds gives −50 (both draws seed 0, p = 1/4), −25 or 0 (p = 1/4): the interval is [−50, 0]
    # and does not exclude 0, where pooling the seeds' accuracies first gave [−25, −25]
    assert body["ICT"] == ["—", "-25.0 ±35.4 [-50.0, +0.0]", "—", "—"]
    assert body["STAPO"] == ["—", "—", "—", "—"]
    bold = {table.rows[i][1]: table.bold[i][2:] for i in range(len(table.rows))}
    assert bold["GRPO"] == [True, False, False, False] and not bold["ICT"][1]
    assert table.rows[0][0] == "Tiny-S" and table.rows[1][0] == ""
    ict = frame.filter(pl.col("method") == "ict").row(0, named=True)
    assert (ict["bench"], ict["delta"], ict["n_problems"]) == ("arith-mid", pytest.approx(-25.0), 40)
    assert (ict["ci_low"], ict["ci_high"]) == pytest.approx((-50.0, 0.0))
    assert (ict["delta_seed_sd"], ict["delta_seed_min"], ict["delta_seed_max"]) == pytest.approx(
        (25 * 2 ** 0.5, -50.0, 0.0))
    assert "resampling seeds and problems together" in table.notes[0]
    assert ict["sources"].split(";") == ["base/0/arith-mid/samples.parquet", "base/1/arith-mid/samples.parquet",
                                         "ict/0/arith-mid/samples.parquet", "ict/1/arith-mid/samples.parquet"]


def test_base_gains_in_the_rendered_tables(rendered):
    root, _ = rendered
    rows = md_rows((root / "tables" / "base_gains.md").read_text(), "Gain over the base model")
    # every model's samples are the same in the fixture: zero gain with a zero-width interval
    assert rows[0][:3] == ["Tiny-S", "GRPO", "+0.0 [+0.0, +0.0]"]
    assert {r[1] for r in rows} >= {"GRPO", "20-Entropy", "STAPO", "ICT"}
    stapo_m = [r for r in rows[len(rows) // 2:] if r[1] == "STAPO"][0]
    assert stapo_m[4:] == ["—", "—"]  # the missing evaluation (tiny-m, STAPO, hard), no average
    assert [r[0] for r in rows if r[0]] == ["Tiny-S", "Tiny-M"]
    assert "Gain over the base model" in (root / "tables" / "tables.md").read_text()
    assert "tab:base-gains" in (root / "tables" / "base_gains.tex").read_text()


# ---------------------------------------------------------------------------------------------
# Total (mean of pass@1 and pass@4), ours beside the reported ICT Table 1
# ---------------------------------------------------------------------------------------------
def paper_models() -> dict:
    """config/paper.yaml's model sizes (its hub ids), read as they stand there."""
    import yaml

    raw = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
    return {k: v for k, v in raw["models"].items() if k.startswith("qwen2.5-")}


def total_config(default_raw):
    raw = config(default_raw, ablations=False)
    raw["models"]["qwen2.5-1.5b"] = paper_models()["qwen2.5-1.5b"]
    raw["experiment"]["sizes"] = ["tiny-s", "qwen2.5-1.5b"]
    raw["experiment"]["benchmarks"] = ["arith-easy", "arith-mid"]
    return validate(raw, "test")


def total_metrics():
    """pass@1 / pass@4 per benchmark (easy, mid); 20-Entropy of qwen2.5-1.5b and STAPO of every
    size have no evaluations."""
    cells = {  # (size, method): ((p1 easy, p1 mid), (p4 easy, p4 mid))
        ("tiny-s", "base"): ((0.00, 0.10), (0.10, 0.30)),
        ("tiny-s", "grpo"): ((0.10, 0.30), (0.40, 0.60)),
        ("tiny-s", "entropy20"): ((0.20, 0.20), (0.50, 0.50)),
        ("tiny-s", "ict"): ((0.25, 0.35), (0.60, 0.80)),
        ("qwen2.5-1.5b", "base"): ((0.50, 0.70), (0.75, 0.85)),
        ("qwen2.5-1.5b", "grpo"): ((0.60, 0.80), (0.80, 0.90)),
        ("qwen2.5-1.5b", "ict"): ((0.70, 0.90), (0.90, 1.00)),
    }
    rows = []
    for (size, method), by_k in cells.items():
        for k, values in zip((1, 4), by_k, strict=True):
            for bench, v in zip(("arith-easy", "arith-mid"), values, strict=True):
                rows.append({"size": size, "method": method, "seed": 0, "bench": bench,
                             "metric": f"pass@{k}", "value": v, "ci_low": None, "ci_high": None,
                             "source": f"{size}/{method}/{bench}/metrics.parquet"})
    return pl.DataFrame(rows, schema_overrides={"ci_low": pl.Float64, "ci_high": pl.Float64})


OURS = slice(2, 5)  # P@1 (ours), P@4 (ours), Total (ours)
REPORTED = slice(5, 9)  # the reported block


def test_main_total_by_hand(default_raw):
    cfg = total_config(default_raw)
    table, frame = main_total_table(cfg, total_metrics())
    assert table.columns == ["Size", "Method", "P@1 (ours)", "P@4 (ours)", "Total (ours)",
                             TABLE1_LABEL, "P@1 (rep.)", "P@4 (rep.)", "Total (rep.)"]
    assert TABLE1_LABEL == "reported (summaries of ICT Table 1)"
    rows = [[c for c in r] for r in table.rows]
    assert [r[0] for r in rows] == ["Tiny-S", "", "", "", "", "Qwen2.5-1.5B", "", "", "", ""]
    assert [r[1] for r in rows[:5]] == ["Base model", "GRPO", "20-Entropy", "STAPO", "ICT"]
    ours = {(r[0] or size, r[1]): r[OURS] for r, size in
            zip(rows, ["Tiny-S"] * 5 + ["Qwen2.5-1.5B"] * 5, strict=True)}
    # P@1 = mean over the two benchmarks, P@4 likewise, Total = (P@1 + P@4) / 2
    assert ours["Tiny-S", "Base model"] == ["5.0", "20.0", "12.5"]
    assert ours["Tiny-S", "GRPO"] == ["20.0", "50.0", "35.0"]
    assert ours["Tiny-S", "20-Entropy"] == ["20.0", "50.0", "35.0"]
    assert ours["Tiny-S", "ICT"] == ["30.0", "70.0", "50.0"]
    assert ours["Tiny-S", "STAPO"] == ["—", "—", "—"]
    assert ours["Qwen2.5-1.5B", "Base model"] == ["60.0", "80.0", "70.0"]
    assert ours["Qwen2.5-1.5B", "ICT"] == ["80.0", "95.0", "87.5"]
    assert ours["Qwen2.5-1.5B", "20-Entropy"] == ["—", "—", "—"]
    # bold: the best of ours per size (ICT), never a reported cell
    assert table.bold[4][OURS] == [True, True, True] and not any(table.bold[4][REPORTED])
    # the tiny default models map to no paper size: "—" in every reported cell
    for r in rows[:5]:
        assert r[REPORTED] == ["—"] * 4
    # qwen2.5-1.5b: Qwen2.5-1.5B's rows of Table 1, as printed (two decimals)
    for r, row_name in zip(rows[5:], ["Base", "GRPO", "20-Entropy", "STAPO", "ICT"], strict=True):
        rep = reported.TABLE1["1.5B", row_name]
        assert r[REPORTED] == [f"Qwen2.5-1.5B, {row_name}", f"{rep.p1:.2f}", f"{rep.p4:.2f}",
                               f"{rep.total:.2f}"]
    assert rows[5][REPORTED][1:] == ["16.41", "31.80", "24.11"]  # the formatting, by hand once
    # STAPO and 20-Entropy of qwen2.5-1.5b: no evaluation of ours, the reported numbers still beside
    assert rows[7][OURS] == ["—", "—", "—"] and rows[7][REPORTED][0] == "Qwen2.5-1.5B, 20-Entropy"
    # the CSV keeps ours and the reported numbers in separate, named columns
    row = frame.filter((pl.col("size") == "qwen2.5-1.5b") & (pl.col("method") == "ict")).row(0, named=True)
    assert (row["pass1_avg"], row["pass4_avg"], row["total"]) == pytest.approx((80.0, 95.0, 87.5))
    rep = reported.TABLE1["1.5B", "ICT"]
    assert (row["reported_p1"], row["reported_p4"], row["reported_total"]) == (rep.p1, rep.p4, rep.total)
    assert row["reported_size"] == "Qwen2.5-1.5B" and row["reported_row"] == "ICT"
    assert row["sources"].split(";") == ["qwen2.5-1.5b/ict/arith-easy/metrics.parquet",
                                         "qwen2.5-1.5b/ict/arith-mid/metrics.parquet"] * 2
    empty = frame.filter((pl.col("size") == "qwen2.5-1.5b") & (pl.col("method") == "entropy20"))
    assert empty.row(0, named=True)["total"] is None
    assert frame.filter(pl.col("size") == "tiny-s")["reported_p1"].null_count() == 5


def test_no_reported_number_in_our_cells(default_raw):
    """With no evaluations every one of our cells is '—' though the reported cells are filled;
    with evaluations ours are the hand-computed numbers above, whatever the reported ones are."""
    cfg = total_config(default_raw)
    table, frame = main_total_table(cfg, pl.DataFrame())
    assert all(r[OURS] == ["—"] * 3 for r in table.rows)
    assert frame["pass1_avg"].null_count() == frame["total"].null_count() == frame.height == 10
    assert sum(r[REPORTED] != ["—"] * 4 for r in table.rows) == 5
    printed = {f"{v:.{d}f}" for rep in [*reported.TABLE1.values(), *reported.RATIO_ABLATION.values()]
               for v in (rep.p1, rep.p4, rep.total) if v is not None for d in (1, 2)}
    filled, _ = main_total_table(cfg, total_metrics())
    for row in filled.rows:
        assert not set(row[OURS]) & printed, row
    text = render.markdown(filled)
    assert "never in them" in text and "The paper's benchmarks, training data" in text
    assert "Ours: pass@1 and pass@4 in %, each the unweighted mean over our benchmarks (Easy, Mid)" in text


def test_paper_sizes_of_hub_models(default_raw):
    raw = config(default_raw, ablations=False)
    raw["models"].update(paper_models())
    hub = lambda model_id: {"source": "hub", "hub": {"model_id": model_id}}  # noqa: E731
    raw["models"].update({
        "big": hub("Qwen/Qwen2.5-7B-Instruct"),  # the model id names the size
        "qwen2.5-0.5b-local": hub("/models/ckpt"),  # else the size key
        "other": hub("org/Model-17B"), "mixed": hub("org/a-0.5b-and-7b"), "plain": hub("org/m"),
    })
    raw["models"]["tiny-7b"] = copy.deepcopy(raw["models"]["tiny-s"])  # a scratch model: none
    cfg = validate(raw, "test")
    assert {s: paper_size(cfg, s) for s in paper_models()} == {
        "qwen2.5-0.5b": "0.5B", "qwen2.5-1.5b": "1.5B", "qwen2.5-7b": "7B"}
    assert paper_size(cfg, "big") == "7B" and paper_size(cfg, "qwen2.5-0.5b-local") == "0.5B"
    for size in ("other", "mixed", "plain", "tiny-7b", "tiny-s", "tiny-m"):
        assert paper_size(cfg, size) is None, size


def test_main_total_in_the_rendered_tables(rendered):
    root, cfg = rendered
    text = (root / "tables" / "main_total.md").read_text()
    rows = md_rows(text, "Main results: pass@1, pass@4 and Total")
    assert len(rows) == 10 and [r[1] for r in rows[:5]] == ["Base model", "GRPO", "20-Entropy", "STAPO", "ICT"]
    # tiny-s GRPO: pass@4 (0.5 + 0.4 + 0.1) / 3, pass@1 half of it, Total their mean
    assert rows[1][OURS] == ["16.7", "33.3", "25.0"]
    assert all(r[REPORTED] == ["—"] * 4 for r in rows)  # tiny models: no paper size
    assert rows[8][OURS] == ["—", "—", "—"]  # tiny-m STAPO misses a benchmark
    assert (root / "tables" / "main_total.tex").read_text().count(r"\toprule") == 1
    csv = pl.read_csv(root / "tables" / "main_total.csv")
    assert csv.height == 10 and {"reported_p1", "reported_total", "sources"} <= set(csv.columns)
    assert "Main results: pass@1, pass@4 and Total" in (root / "tables" / "tables.html").read_text()
    assert "main_total.md" in output_names(cfg)["tables"]
