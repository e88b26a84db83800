#!/usr/bin/env bash
# Run the decoding-loop tests against the oldest supported Transformers (5.17, the GPU image's), whose
# assisted-decoding loop differs from the newest one (stop handling, hidden-state selection), and the batched
# loop, which drives its caches and masks directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-oldest/bin/python ] || "$PYTHON" -m venv .venv-oldest
. .venv-oldest/bin/activate
python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
python -m pip install -q "transformers==5.17.0" safetensors huggingface-hub evaluate tqdm pytest "pytest-xdist>=3.2" "pytest-timeout>=2.2" filelock 2>&1 | grep -v '^WARNING: Location' || true
python -m pip install -q --no-deps -e . 2>&1 | grep -v '^WARNING: Location' || true
export HF_HUB_OFFLINE=1
python -m pytest -q -p no:cacheprovider -n auto --dist worksteal tests/test_greedy_equivalence.py tests/test_context.py tests/test_sampling.py \
    tests/test_generate_features.py tests/test_errors_and_routing.py tests/test_zlab_format.py tests/test_oracle.py \
    tests/test_policy.py tests/test_attention.py tests/test_exact_verify.py tests/test_prompt_lookup.py \
    tests/test_controllers.py tests/test_calibration.py tests/test_layout.py tests/test_batched.py tests/test_compile.py
