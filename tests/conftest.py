"""Shared fixtures: the repository root, configs as dicts, and a helper to run stage CLIs."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture
def default_raw() -> dict:
    return copy.deepcopy(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))


@pytest.fixture
def test_raw() -> dict:
    return copy.deepcopy(yaml.safe_load((ROOT / "config" / "test.yaml").read_text()))


def write_yaml(path: Path, obj) -> Path:
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


def run_stage(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m stages.<module> ...` as Snakemake would; returns the finished process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", f"stages.{module}", *args],
        capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=600,
    )
