#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
# one worker per core (the tests run torch on one thread each); idle workers take queued tests
python -m pytest -q -n auto --dist worksteal --durations=15 "$@"
