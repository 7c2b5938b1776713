"""Pinned CPU numerics (stages.core.common.numerics, config key numerics.cpu_isa): the settings,
their place in every job's environment and provenance, a stage by hand starting again with them,
and which jobs' hashes they enter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stages.config import validate
from stages.core.common import numerics
from stages.core.common.io import read_provenance
from stages.keys import job_hash_of, numerics_keys
from tests.conftest import ROOT

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}


def test_the_settings_of_each_choice():
    assert numerics.settings("avx2") == PINNED and numerics.settings("native") == {}
    env = {"PATH": "/bin", "MKL_CBWR": "AVX512"}
    assert numerics.environment("avx2", env) == {"PATH": "/bin", **PINNED}
    assert numerics.environment("native", {**env, **PINNED}) == {"PATH": "/bin"}
    assert numerics.in_effect({"MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}) == {
        "ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "AVX2,STRICT"}


def test_the_record_names_the_processor_and_what_ran():
    record = numerics.record()
    assert record["settings"] == PINNED  # the tests compute as the jobs do (conftest)
    if os.path.exists("/proc/cpuinfo"):
        assert record["processor"]["model"] and "avx2" in record["processor"]["extensions"]
    assert record["torch_cpu_capability"] == "AVX2" and record["threads"] >= 1


SCRIPT = ("import json, os, torch; from stages.core.common import numerics; numerics.apply({isa!r}); "
          "print(json.dumps([numerics.in_effect(), torch.backends.cpu.get_cpu_capability(), "
          "os.environ.get('ICT_RLVR_NUMERICS_APPLIED')]))")


@pytest.mark.parametrize("isa, start, capability", [
    ("avx2", {}, "AVX2"),  # by hand, without the settings: starts again with them
    ("native", PINNED, None),  # set in the shell but not asked for: starts again without them
    ("avx2", PINNED, "AVX2"),  # as a job of the workflow: goes on at once
])
def test_a_stage_starts_again_with_the_settings_it_lacks(isa, start, capability):
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(isa=isa)], capture_output=True,
                          text=True, env={**env, **start, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    effect, cpu, again = json.loads(proc.stdout)
    assert effect == {var: numerics.settings(isa).get(var) for var in PINNED}
    assert (again == "1") == (start != numerics.settings(isa)), proc.stderr
    if capability:
        assert cpu == capability
    else:  # the processor's own widest path
        assert cpu in ("AVX2", "AVX512", "DEFAULT", "ZVECTOR", "VSX")


def test_numerics_enter_the_hashes_of_cpu_jobs_only(test_raw):
    base = validate(test_raw, "t")
    test_raw["numerics"] = {"cpu_isa": "native"}
    native = validate(test_raw, "t")
    cpu_jobs = [("base_model", {"size": "tiny-s"}), ("rollout", {"size": "tiny-s"}),
                ("token_stats", {"size": "tiny-s"}), ("train", {"size": "tiny-s", "method": "ict"}),
                ("evaluate", {"size": "tiny-s", "method": "base"}),
                ("overlap", {"size": "tiny-s", "method": "ict"})]
    for rule, w in cpu_jobs:
        assert job_hash_of(native, rule, w) != job_hash_of(base, rule, w), rule
    for rule, w in [("prepare_data", {"dataset": "rl"}), ("tables", {})]:
        assert job_hash_of(native, rule, w) == job_hash_of(base, rule, w), rule
    # with GPUs for every rule, and a hub base model, no job reads them
    test_raw["models"]["tiny-s"].update(gpus={"rollout": 1, "token_stats": 1, "train": 1, "evaluate": 1})
    gpu = validate(test_raw, "t")
    assert all(numerics_keys(gpu, rule, "tiny-s") == () for rule, _ in cpu_jobs[1:])
    assert numerics_keys(gpu, "base_model", "tiny-s") == ("numerics",)  # a scratch model's SFT
    paper = validate(__import__("yaml").safe_load((ROOT / "config" / "paper.yaml").read_text()), "p")
    assert numerics_keys(paper, "base_model", "qwen2.5-0.5b") == ()


def test_a_bad_choice_names_the_key(test_raw):
    from stages.config import ConfigError

    test_raw["numerics"] = {"cpu_isa": "avx512"}
    with pytest.raises(ConfigError, match=r"t: numerics\.cpu_isa: Input should be 'avx2' or 'native'"):
        validate(test_raw, "t")


def test_the_workflows_jobs_computed_pinned(local_test_run):
    """The session's run of config/test.yaml: every artifact records the settings and PyTorch's
    AVX2 path, whatever the processor."""
    wd, proc = local_test_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted((wd / "results" / "test").rglob("*.parquet"))
    torch_stages = set()
    for path in found:
        record = read_provenance(path)["numerics"]
        assert record["settings"] == PINNED, path
        if "torch_cpu_capability" in record:
            assert record["torch_cpu_capability"] == "AVX2", path
            torch_stages.add(read_provenance(path)["stage"])
    assert {"rollout", "token_stats", "train", "evaluate"} <= torch_stages


BASE_MODEL_SHA256 = {
    # an Intel Xeon (AVX-512, AMX), 2026-12-06, numerics.cpu_isa avx2: MKL's AVX2 branch, strict,
    # which oneMKL documents as the same on every Intel processor with AVX2
    ("GenuineIntel", None): "eb3b302604f8019c3ad22e8171dc22d5477300cf350309ccb75b69d8809787cc",
    # an AMD EPYC Zen 4 (family 25, model 17; AVX-512), 2026-12-06, numerics.cpu_isa avx2, strict:
    # the same bits as this Zen 4's earlier run with MKL_CBWR=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2, not
    # strict (commit c085e4f), as MKL runs its own branch on AMD whatever MKL_CBWR says. Zen 4 only:
    # no other AMD processor has run it pinned
    ("AuthenticAMD", "25/17"): "f5fe4cc902e512f8c1c7df446d64d3655694c6c8b10430bee9e7bd49fec606de",
}
"""The embedded default's base model (config/config.yaml: its SFT on two threads), pinned, by the
processor: MKL honours MKL_CBWR=AVX2 on Intel processors only (stages.core.common.numerics), so
Intel and AMD compute different bits. For AMD, one model's (Zen 4): MKL's own choice of branch
there may differ between AMD generations, and no other has run it."""


def recorded_base_model() -> str | None:
    info = {}
    for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    vendor, model = info.get("vendor_id"), f"{info.get('cpu family')}/{info.get('model')}"
    return BASE_MODEL_SHA256.get((vendor, None)) or BASE_MODEL_SHA256.get((vendor, model))


@pytest.mark.slow  # the default's SFT, 1-2 minutes
def test_the_pinned_default_base_model_is_the_recorded_one_for_the_vendor(tmp_path):
    import hashlib

    from tests.conftest import workflow_env

    expected = recorded_base_model() if os.path.exists("/proc/cpuinfo") else None
    if expected is None:
        pytest.skip(f"no base model recorded for this processor ({numerics.processor()})")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--cores", "2",
         "results/default/models/size=tiny-s/base.json", "--configfile", str(ROOT / "config" / "config.yaml")],
        cwd=tmp_path, env=workflow_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = tmp_path / "results" / "default" / "models" / "size=tiny-s" / "checkpoint" / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == expected, (
        f"{numerics.processor()}: the pinned SFT gave other bits than the ones recorded for it")
