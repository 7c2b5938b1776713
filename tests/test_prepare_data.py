"""The prepare-data stage as a command: normalised Parquet, provenance, clean failures."""

from __future__ import annotations

import json

import polars as pl
import pytest

from stages.core.common.io import read_provenance
from stages.core.data.problems import PROBLEM_SCHEMA
from tests.conftest import run_stage, write_yaml


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_generated_dataset(tmp_path, test_raw):
    cfg = write_yaml(tmp_path / "c.yaml", test_raw)
    out = tmp_path / "data" / "dataset=rl" / "problems.parquet"
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "rl", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    frame = pl.read_parquet(out)
    assert frame.columns == PROBLEM_SCHEMA.names and frame.height == 64
    row = frame.row(0, named=True)
    assert row["prompt"] == f"Q: {row['question']} A:"
    assert row["answer_type"] == "math" and row["solution"].endswith(f"#### {row['answer']}")
    prov = read_provenance(out)
    assert prov["stage"] == "prepare_data" and prov["dataset"] == "rl" and prov["seed"] == 2
    # same config, same bytes
    again = tmp_path / "again.parquet"
    run_stage("prepare_data", "--config", str(cfg), "--dataset", "rl", "--out", str(again))
    assert again.read_bytes() == out.read_bytes()


def test_local_source_with_choices(tmp_path, test_raw):
    src = tmp_path / "csqa.jsonl"
    rec = {"id": "q1", "question": "Where do fish live?",
           "choices": {"label": ["A", "B"], "text": ["sea", "tree"]}, "answerKey": "A"}
    src.write_text(json.dumps(rec) + "\n")
    test_raw["templates"]["mc"] = "{question}\nAnswer:"
    test_raw["datasets"]["csqa"] = {"role": "benchmark", "template": "mc",
                                    "source": {"kind": "local", "path": str(src), "adapter": "csqa"}}
    cfg = write_yaml(tmp_path / "c.yaml", test_raw)
    out = tmp_path / "o.parquet"
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "csqa", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    row = pl.read_parquet(out).row(0, named=True)
    assert row["choices"] == ["sea", "tree"] and row["answer"] == "A"
    assert row["prompt"] == "Where do fish live?\nA. sea\nB. tree\nAnswer:"


def test_malformed_record_names_file_and_line_and_writes_nothing(tmp_path, test_raw):
    src = tmp_path / "gsm.jsonl"
    good = {"question": "1+1?", "answer": "1+1=2\n#### 2"}
    src.write_text(json.dumps(good) + "\n" + json.dumps({"question": "no answer"}) + "\n")
    test_raw["datasets"]["gsm"] = {"role": "benchmark", "template": "arith",
                                   "source": {"kind": "local", "path": str(src), "adapter": "gsm8k"}}
    cfg = write_yaml(tmp_path / "c.yaml", test_raw)
    out = tmp_path / "out" / "o.parquet"
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "gsm", "--out", str(out))
    assert proc.returncode == 2
    assert f"{src}:2" in proc.stderr and "answer" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temporary left


@pytest.mark.slow  # a stage or Snakemake in a subprocess: the full tier
def test_unknown_dataset_and_missing_file(tmp_path, test_raw):
    test_raw["datasets"]["gone"] = {"role": "benchmark", "template": "arith",
                                    "source": {"kind": "local", "path": str(tmp_path / "x.jsonl"),
                                               "adapter": "gsm8k"}}
    cfg = write_yaml(tmp_path / "c.yaml", test_raw)
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "nope", "--out", "o.parquet")
    assert proc.returncode == 2 and "--dataset 'nope'" in proc.stderr
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "gone", "--out",
                     str(tmp_path / "o.parquet"))
    assert proc.returncode == 2 and "x.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.parquet").exists()


def test_bad_config_is_refused_by_the_stage(tmp_path, test_raw):
    test_raw["rollout"]["temprature"] = 1.0
    cfg = write_yaml(tmp_path / "c.yaml", test_raw)
    proc = run_stage("prepare_data", "--config", str(cfg), "--dataset", "rl", "--out", "o.parquet")
    assert proc.returncode == 2
    assert f"{cfg}: rollout.temprature: unknown key" in proc.stderr
