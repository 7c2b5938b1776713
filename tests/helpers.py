"""Helpers that several test modules share: a job of several processes as torchrun starts them
(each rank a Python process with torchrun's variables; the tests' workers join gloo), the
actor's view of a training engine without DeepSpeed, and a finished run's files and a moved
copy of the checkout (the rerun tests)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages.launch import free_port
from tests.conftest import ROOT


def worker_argv(module: str, worker: str, *args) -> list[str]:
    """Python's arguments that call `worker(*args)` of `module` (args as strings)."""
    code = f"import sys; from {module} import {worker}; {worker}(*sys.argv[1:])"
    return ["-c", code, *map(str, args)]


def start_ranks(world: int, argv: list[str], *, python: str = sys.executable,
                env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start `python *argv` in the repository root as the `world` ranks of one job: RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT of the job's own, on top of `env`
    (default: this environment with the repository on PYTHONPATH). Each rank's output is piped,
    its stderr into its stdout."""
    port = str(free_port())
    base = {**os.environ, "PYTHONPATH": str(ROOT)} if env is None else env
    return [subprocess.Popen([python, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True,
                             env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                  "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": port})
            for rank in range(world)]


def wait_ranks(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    """Wait for every rank; a rank that fails fails the test with the end of its output. A rank
    left waiting in a collective never returns: the timeout ends the test."""
    for p in procs:
        log, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, log[-6000:]


def run_ranks(world: int, argv: list[str], *, timeout: float = 600, **start) -> None:
    """start_ranks(world, argv, **start), then wait_ranks."""
    wait_ranks(start_ranks(world, argv, **start), timeout)


class FakeEngine:
    """The actor's view of an engine without DeepSpeed: calling it calls the module; backward
    accumulates; step reduces each gradient (`reduce`, the subclass's), keeps them in `reduced`
    and clears them."""

    def __init__(self, module):
        self.module, self.reduced = module, {}

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_gradient_accumulation_boundary(self, flag):
        pass

    def backward(self, loss):
        loss.backward()

    def get_global_grad_norm(self):
        return 0.0

    def step(self):
        self.reduced = {n: self.reduce(p.grad) for n, p in self.module.lm.named_parameters()
                        if p.grad is not None}
        self.module.zero_grad()

    def reduce(self, grad):
        raise NotImplementedError


def snapshot(results: Path) -> dict[str, tuple[int, str]]:
    """Every file under `results` with its modification time and content hash."""
    return {str(p.relative_to(results)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(results.rglob("*")) if p.is_file()}


def contents(snap: dict) -> dict[str, str]:
    return {path: digest for path, (_, digest) in snap.items()}


def copy_checkout(dest: Path) -> Path:
    """The checkout's tracked and unignored files copied to `dest`, as a user moving it would."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def move_run(run: Path, checkout: Path, copy: bool = False) -> None:
    """Move (or copy, keeping modification times) a run's results/ and .snakemake/ into a
    checkout, whose results/ holds its README."""
    def place(src: Path, dest: Path) -> None:
        if not copy:
            shutil.move(src, dest)
        elif src.is_dir():
            shutil.copytree(src, dest, symlinks=True)
        else:
            shutil.copy2(src, dest)

    (checkout / "results").mkdir(exist_ok=True)
    for entry in (run / "results").iterdir():
        place(entry, checkout / "results" / entry.name)
    place(run / ".snakemake", checkout / ".snakemake")
