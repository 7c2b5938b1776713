"""Every file the tables stage writes, byte for byte, against the goldens in tests/fixtures/tables_golden.

The inputs are test_tables.py's synthetic evaluations, training curves and token statistics,
written under a temporary folder and named by relative paths (the CSVs and notes print them), with
a fixed git commit and processor in their provenance (sources.csv prints them). The config is the frozen
tables_golden/config.yaml, so that edits to config/config.yaml do not move the goldens.

A change to a table that is meant regenerates them (then review `git diff tests/fixtures`):

    TABLES_GOLDEN=regenerate .venv/bin/python -m pytest -q tests/test_tables_golden.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from stages.core.common import io
from tests.conftest import ROOT, run_stage, write_yaml
from tests.test_tables import build, config

GOLDEN = ROOT / "tests" / "fixtures" / "tables_golden"
CONFIG = GOLDEN / "config.yaml"
OUTPUTS = ("tables", "figures")


def written(folder: Path) -> dict[str, bytes]:
    """Every file under the output folders, by its path relative to `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for sub in OUTPUTS for p in sorted((folder / sub).rglob("*")) if p.is_file()}


@pytest.fixture
def rendered(tmp_path, monkeypatch) -> Path:
    """The stage's CLI run in `tmp_path` on relative input paths; returns `tmp_path`."""
    if os.environ.get("TABLES_GOLDEN") == "regenerate":
        base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
        GOLDEN.mkdir(parents=True, exist_ok=True)
        write_yaml(CONFIG, config(base))
    monkeypatch.setattr(io, "git_commit", lambda: "golden")
    # the processor that wrote the inputs, whichever runs the test
    monkeypatch.setattr(io.numerics, "record", lambda: {
        "processor": {"model": "golden", "extensions": ["avx2"]},
        "settings": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"},
        "threads": 2})
    monkeypatch.setattr(io.environment, "record", lambda: {"lock": "locks/cpu.txt", "sha256": "0" * 64})
    monkeypatch.chdir(tmp_path)
    _, args = build(Path("."), yaml.safe_load(CONFIG.read_text()))
    proc = run_stage("tables", "--config", str(CONFIG), "--eval", *args.eval, "--train", *args.train,
                     "--token-stats", *args.token_stats, "--overlap", *args.overlap,
                     "--tables-dir", "tables", "--figures-dir", "figures", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if os.environ.get("TABLES_GOLDEN") == "regenerate":
        for sub in OUTPUTS:
            shutil.rmtree(GOLDEN / sub, ignore_errors=True)
            shutil.copytree(tmp_path / sub, GOLDEN / sub)
    return tmp_path


@pytest.mark.slow
def test_every_output_is_byte_identical_to_the_goldens(rendered):
    got, want = written(rendered), written(GOLDEN)
    assert sorted(got) == sorted(want), "the stage writes other files than the goldens"
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, (f"{differ} differ from tests/fixtures/tables_golden (PNGs also change with "
                        "matplotlib's version); if the change is meant, regenerate: see this file's docstring")
