"""The equality check of benchmarks/peer_trl.py on Tiny-S's architecture (untrained): our actor
step and TRL's GRPOTrainer loss give the same loss and gradient norm on one fixed batch, for GRPO
and for TRL's top_entropy_quantile, and the check fails once one of TRL's options is mapped
wrongly. No timings."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import yaml

from tests.conftest import ROOT, tiny_model, write_problems

pytest.importorskip("trl", reason="trl is not installed (the dev extra: pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """An untrained model of Tiny-S's architecture and 64 training prompts of the default's kind."""
    from stages.core.data.problems import generate_arithmetic

    folder = tmp_path_factory.mktemp("peer_trl")
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    tiny_model(folder / "model", types.SimpleNamespace(**raw["models"]["tiny-s"]["scratch"]))
    write_problems(folder / "data" / "dataset=rl" / "problems.parquet",
                   generate_arithmetic(64, seed=2, max_terms=4))
    return folder


def check(inputs, *extra: str) -> tuple[int, list[dict], str]:
    out = inputs / f"check{len(extra)}.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/peer_trl.py", "--check-only", "--models", "tiny-s",
         "--tiny-s-model", str(inputs / "model" / "base.json"), "--tiny-s-data", str(inputs / "data"),
         "--check-prompts", "2", "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.read_text())["models"]["tiny-s"]["check"]["rows"] if out.exists() else []
    return done.returncode, rows, done.stdout + done.stderr[-3000:]


def test_both_trainers_compute_the_same_loss_and_gradient(inputs):
    code, rows, log = check(inputs)
    assert code == 0, log
    by_case = {r["case"]: r for r in rows}
    assert set(by_case) == {"grpo", "entropy20"}
    for row in rows:
        assert row["agree"] and row["same_selection"], row
        assert abs(row["ours_loss"]) > 1e-4, row  # a batch that carries a gradient
        assert row["loss_diff"] <= 1e-6 + 1e-4 * abs(row["trl_loss"])
        assert row["grad_norm_rel_diff"] <= 1e-4
        assert row["logprob_max_diff"] < 1e-4 and row["entropy_max_diff"] < 1e-4
    assert by_case["grpo"]["selected"] == by_case["grpo"]["tokens"]
    # TRL keeps about a fifth of the tokens, the ones at or above the entropies' 0.8 quantile
    assert 0.2 <= by_case["entropy20"]["selected"] / by_case["entropy20"]["tokens"] < 0.3


def test_a_wrong_mapping_fails_the_check(inputs):
    # TRL's loss_type grpo averages each sequence first: not our denominator 'all'
    code, rows, log = check(inputs, "--trl-override", "loss_type=grpo")
    assert code == 1, log
    assert "FAILED" in log
    assert not {r["case"]: r for r in rows}["grpo"]["agree"]
