"""The benchmark scripts run and report what they claim: benchmarks/gpu.py --tiny on the CPU (the
same code paths as on a GPU) and benchmarks/train_step.py's agreement check at tiny sizes.

No timings are asserted: only that every row is there, its ratios are finite and the on-policy
log-prob difference is exactly 0."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# what a GPU machine with only torch and transformers lacks: importing any of them fails here
ABSENT = ("deepspeed", "vllm", "polars", "pyarrow", "snakemake", "pydantic", "scipy",
          "matplotlib", "pandas", "hypothesis")


@pytest.mark.slow
def test_gpu_benchmark_tiny_runs_without_the_workflow_packages(tmp_path):
    out = tmp_path / "out.json"
    # sys.modules[name] = None makes `import name` fail and find_spec(name) answer None, as if
    # the package were not installed
    runner = (
        "import runpy, sys\n"
        f"for name in {ABSENT!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        f"sys.argv = ['gpu.py', '--tiny', '--device', 'cpu', '--json', {str(out)!r}]\n"
        f"runpy.run_path({str(BENCH / 'gpu.py')!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())

    models = [m["name"] for m in result["meta"]["models"]]
    assert models == ["tiny-a", "tiny-b"]
    rows = {(r["model"], r["row"]): r for r in result["rows"]}
    expected = {(m, row) for m in models for row in ("token_statistics",
                                                    "token_statistics_to_matmul",
                                                    "selective_rho_0.1", "chunked_rho_1",
                                                    "gradient_checkpointing")}
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["baseline_status"] == row["candidate_status"] == "ok", key
        # the matmul alone may allocate too little to measure on a tiny CPU model
        fields = ("time_ratio",) if key[1].endswith("_to_matmul") else ("peak_mem_ratio",
                                                                         "time_ratio")
        for field in fields:
            assert row[field] is not None and math.isfinite(row[field]), (key, field)
            assert row[field] >= 0, (key, field)

    assert [n["model"] for n in result["numerics"]] == models
    for n in result["numerics"]:
        assert n["status"] == "ok"
        # old = score_scope without gradient, current = head_logprob with gradient: same rows,
        # same numerics, so the first ratio is exactly 1
        assert n["on_policy_max_abs"] == 0.0
        for scale in ("own_scale", "logit_std_3"):
            v = n[scale]
            assert math.isfinite(v["max_abs_dlogp"]) and v["max_abs_dlogp"] >= 0
            assert 0.0 <= v["share_ratio_off_1pct"] <= 1.0
        assert n["logit_std_3"]["logit_std"] == pytest.approx(3.0, rel=0.05)
    assert "memory:" in done.stdout and "on-policy" in done.stdout  # both tables were printed


def load_train_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports harness from beside itself
    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rho", [0.1, 1.0])
def test_train_step_paths_agree_at_tiny_sizes(monkeypatch, rho):
    """The full head and the trainer's chunked, selective head give the same loss and gradients
    (the check train_step.py runs before timing; it stops the script when they disagree)."""
    train_step = load_train_step(monkeypatch)
    dims = train_step.Dims(vocab=300, hidden=32, layers=1)
    err = train_step.check_agreement(dims, responses=2, response_tokens=12, rho=rho)
    assert err["loss_rel_err"] <= 1e-5
    assert err["grad_rel_err"] <= 1e-4
    assert 0.0 <= err["mask_jaccard"] <= 1.0
