"""Shared fixtures: the repository root, configs as dicts, and a helper to run stage CLIs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# The tests compute as the workflow's jobs do under the shipped configs (numerics.cpu_isa 'avx2'):
# set before torch or MKL start in this process, and inherited by every subprocess, so
# that a stage started by a test needs no second start (stages.core.common.numerics.apply).
os.environ.update({"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"})


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


# An untrained Qwen2 small enough to build, save and sample in well under a second.
TINY_ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=128)


def save_scratch_model(folder: Path, model, tokenizer) -> Path:
    """Save `model` and `tokenizer` to folder/checkpoint and write folder/base.json pointing there."""
    model.save_pretrained(folder / "checkpoint")
    tokenizer.save_pretrained(folder / "checkpoint")
    ref = folder / "base.json"
    ref.write_text(json.dumps({"kind": "scratch", "path": "checkpoint"}))
    return ref


def tiny_model(folder: Path, arch=TINY_ARCH, seed: int = 0):
    """(tokenizer, model) of an untrained tiny model, saved with save_scratch_model."""
    from stages.core.models.modeling import build_scratch_model, build_tokenizer

    tok = build_tokenizer()
    model = build_scratch_model(arch, len(tok), tok.eos_token_id, seed=seed)
    save_scratch_model(folder, model, tok)
    return tok, model


def write_problems(path: Path, problems) -> Path:
    """A prepared-problems Parquet file of `problems` (Problem objects; prompts are rendered
    with the arithmetic template when they have none)."""
    from stages.core.common.io import provenance, write_parquet
    from stages.core.data.problems import PROBLEM_SCHEMA, render_prompt

    rows = []
    for p in problems:
        row = p.row()
        row["prompt"] = row["prompt"] or render_prompt("Q: {question} A:", p)
        rows.append({k: row[k] for k in PROBLEM_SCHEMA.names})
    write_parquet(rows, path, PROBLEM_SCHEMA, provenance("test", "1", "h", 0))
    return path


SITE_VARIABLES = ("SBATCH_PARTITION", "SBATCH_ACCOUNT", "SBATCH_QOS", "ICT_GPU_PARTITION")
NUMERICS_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")
"""Left out of a workflow run's environment: the workflow sets them for its jobs itself."""


def workflow_env(**extra: str) -> dict[str, str]:
    """The environment a workflow run gets in the tests: offline, no site settings of the caller,
    and none of the numerics settings, which the workflow gives its jobs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    for var in SITE_VARIABLES + NUMERICS_VARIABLES:
        env.pop(var, None)
    return {**env, **extra}


@pytest.fixture(scope="session")
def local_test_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """config/test.yaml run once per session with the local executor (`--cores 2`): (its working
    folder, the finished process). The workflow tests check its outputs, and the SLURM test
    compares its own run with it, so the ~80 s run is paid once."""
    wd = tmp_path_factory.mktemp("local-run")
    proc = subprocess.run(
        ["timeout", "-k", "10", "600", sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"),
         "--directory", str(wd), "--cores", "2", "--configfile", str(ROOT / "config" / "test.yaml")],
        capture_output=True, text=True, env=workflow_env(), cwd=wd,
    )
    return wd, proc
