#!/usr/bin/env bash
# Installs everything (once) and runs the embedded default end to end on this machine's CPUs.
# Extra arguments go to Snakemake, e.g. `bash scripts/run_default.sh -n` for a dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/snakemake --cores "${CORES:-2}" "$@"
