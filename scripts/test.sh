#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m pytest -q --durations=15 "$@"
