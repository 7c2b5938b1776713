"""ICT's readings table from readings.parquet files, the labels of the new ICT variants, and that
the fixtures' readings columns are the token-statistics stage's."""

from __future__ import annotations

import polars as pl
import pytest

from stages.config import validate
from stages.core.report.render import markdown
from stages.tables import is_reading, load, method_label, method_params, output_names
from stages.tables.ict_readings import reading_label, readings_table, reference_table
from tests.test_tables import (
    READINGS_ROWS,
    READINGS_TYPES,
    config,
    write_readings,
    write_token_stats,
)


def test_the_fixture_columns_are_the_stages():
    from stages.token_stats import READINGS_SCHEMA

    assert list(READINGS_TYPES) == READINGS_SCHEMA.names
    assert [READINGS_TYPES[n] for n in READINGS_SCHEMA.names] == [f.type for f in READINGS_SCHEMA]


def test_readings_table_by_hand(tmp_path, default_raw):
    cfg = validate(config(default_raw), "test")
    assert "ict_readings.md" in output_names(cfg)["tables"]
    d = write_token_stats(tmp_path, "tiny-s", 0.5)
    write_readings(tmp_path, "tiny-s")
    data = load([], [], [str(d)])
    assert str(d / "readings.parquet") in data.sources
    table, frame = readings_table(cfg, data.readings)
    assert table.columns[8] == "first 4 positions (%)"  # token_stats.early_positions
    rows = table.rows
    assert [r[0] for r in rows] == ["Tiny-S", "", "", "", "", "", "", "", "Tiny-M"]
    assert [r[1] for r in rows[:8]] == LABELS
    paper = rows[0]
    assert paper[2:10] == ["1,235 (10.0%)", "0.91 ± 0.12", "0.94", "0.200", "1.05", "40.0", "8.0", "2.0"]
    assert paper[10:] == ["ICT's picks, Qwen2.5 (GSM8K; MATH)", "0.18 ± 0.09", "1.03 (GSM8K); 0.99 (MATH)"]
    for row in rows[1:8]:  # the reported numbers stand on the paper rule's row only
        assert row[10:] == ["—", "—", "—"]
    assert rows[4][2] == "2,010 (16.3%)"
    assert rows[7][2:4] == ["12,345 (100.0%)", "0.83 ± 0.21"]
    assert rows[8] == ["Tiny-M"] + ["—"] * 12  # no readings.parquet
    text = markdown(table)
    assert "Read as the response's own probability of the token (p here)" in text
    assert "A random 10% per response also gives a high/low ratio near 1 under a median split" in text
    assert "first 4 tokens (token_stats.early_positions)" in text
    assert frame.filter(pl.col("size") == "tiny-s").height == len(READINGS_ROWS)


LABELS = ["ICT (paper's rule)", "response-mean reading (ours, not ICT)",
          "group-pooled reading (ours, not ICT)", "group leave-one-out reading (ours, not ICT)",
          "JSD token-id reading (ours, not ICT)", "JSD scope-position reading (ours, not ICT)",
          "random 10% per response (control; ours, not ICT)", "all tokens (for scale; ours, not ICT)"]


def test_reference_table_by_hand(tmp_path, default_raw):
    """The second table: each reading's picks seen from its reference (the paper rule's for the
    readings without one), the diverged picks, the paper's figure beside ICT's row only; a file
    without the reference columns (an older stage) shows dashes."""
    cfg = validate(config(default_raw), "test")
    d = write_token_stats(tmp_path, "tiny-s", 0.5)
    write_readings(tmp_path, "tiny-s")
    table = reference_table(cfg, load([], [], [str(d)]).readings)
    rows = table.rows
    assert [r[1] for r in rows[:8]] == LABELS
    assert [r[2] for r in rows[:8]] == ["ICT's P̄_t"] + ["its own"] * 3 + ["ICT's P̄_t"] * 4
    # paper: p 0.912 (median 0.962); P̄(y) 0.456 ± 0.2 (0.406); without the response 0.356 ±
    # 0.15 (0.336); β 0.6 (0.65); 30% above β; 1235 // 3 = 411 diverged picks
    assert rows[0][3:] == ["0.91; 0.96", "0.46 ± 0.20 (0.41)", "0.36 ± 0.15 (0.34)", "0.60 (0.65)",
                           "30.0", "411 (33.3%)", "0.86 ± 0.20 (0.91)", "0.15 ± 0.10 (0.12)",
                           "0.03 ± 0.05 (0.00)", "0.30 ± 0.10", "0.18 ± 0.09"]
    assert rows[1][5] == "—"  # the response's own mean: nothing left without the response
    assert all(r[13] == "—" for r in rows[1:8])
    assert rows[8] == ["Tiny-M"] + ["—"] * 13
    text = markdown(table)
    assert "P̄_t(y) = p(y)/n_t, 1/8 of its own p with n_t = 8" in text and "reference_of" in text
    old = load([], [], [str(d)]).readings.drop("reference_of")
    assert reference_table(cfg, old).rows[0] == ["Tiny-S"] + ["—"] * 13


def test_reading_labels_always_say_ours():
    assert reading_label("paper", "ICT (paper's rule)") == "ICT (paper's rule)"
    assert reading_label("group_pooled", "pooled") == "pooled (ours, not ICT)"
    assert reading_label("x", None) == "x reading (ours, not ICT)"
    assert reading_label("random10_response", None) == "random 10% per response (control; ours, not ICT)"


def test_readings_table_applies_with_ict_readings(default_raw):
    raw = config(default_raw)
    raw.setdefault("token_stats", {})["ict_readings"] = False
    assert "ict_readings.md" not in output_names(validate(raw, "test"))["tables"]


@pytest.mark.parametrize("variant, label", [("response_mean", "response-mean reading"),
                                            ("group_pooled", "group-pooled reading"),
                                            ("group_leave_one_out", "group leave-one-out reading")])
def test_the_new_ict_readings_are_labelled_as_ours(default_raw, variant, label):
    raw = config(default_raw)
    raw["methods"].update({"r": {"selector": "ict", "variant": variant},
                           "r-labelled": {"selector": "ict", "variant": variant, "label": "ICT"},
                           "r-rho": {"selector": "ict", "variant": variant, "rho": 0.2}})
    cfg = validate(raw, "test")
    assert method_label(cfg, "r") == f"{label} (ours, not ICT)"
    assert method_label(cfg, "r-labelled") == f"{label} (ours, not ICT): ICT"
    assert method_label(cfg, "r-rho") == f"{label} ρ=0.2 (ours, not ICT)"
    assert all(is_reading(cfg, m) for m in ("r", "r-labelled", "r-rho"))
    assert not is_reading(cfg, "ict")
    assert f"{variant} reading (ours, not ICT)" in method_params(cfg, "r")
