#!/usr/bin/env bash
# One command on a fresh machine: set up, then answer a prompt offline with the embedded default
# (SmolLM2-135M-Instruct + its trained DFlash drafter), streamed, with the speedup over plain generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
PROMPT="${1:-Write a Python function that checks whether a string is a palindrome.}"
hf-blockpilot generate "$PROMPT" --prompt-lookup --compare --repeats "${REPEATS:-5}" --max-new-tokens "${MAX_NEW_TOKENS:-128}"
