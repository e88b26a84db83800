#!/usr/bin/env bash
# Benchmark the embedded default on this machine (plain vs fixed b vs BlockPilot vs per-prompt oracle):
#   bash examples/benchmark.sh [OUT_DIR] [LIMIT]
# Writes OUT_DIR/results.json (with machine info), results.md and PNG plots. Add --device cuda on a GPU.
set -euo pipefail
OUT="${1:-bench-results}"
LIMIT="${2:-20}"
hf-blockpilot bench --datasets humaneval mtbench gsm8k --limit "$LIMIT" --block-sizes 2 4 8 16 \
    --temperatures 0 1 --repeats 3 --max-new-tokens 128 --output-dir "$OUT"
