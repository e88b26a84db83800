#!/usr/bin/env bash
# collect -> train-policy -> evaluate-policy -> (optionally) push, on the embedded default or any pair.
#   bash examples/policy_end_to_end.sh [OUT_DIR] [HUB_REPO]
# Pass --target/--drafter through MODEL_ARGS for another pair, e.g.
#   MODEL_ARGS="--target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16 --dtype bfloat16" bash examples/policy_end_to_end.sh
# Sizes: NUM_PROMPTS (label prompts, default 200), CANDIDATES (block sizes, default "1 4 8 12 16 20"),
# LIMIT (evaluation prompts per dataset, default 20).
set -euo pipefail
OUT="${1:-runs/policy}"
REPO="${2:-}"
MODEL_ARGS="${MODEL_ARGS:-}"
# Oracle labels on training prompts (never the evaluation sets); add more processes with
#   torchrun --nproc_per_node 2 -m hf_blockpilot collect ...   (or accelerate launch --multi_gpu on GPUs)
hf-blockpilot collect $MODEL_ARGS --output-dir "$OUT/labels" --dataset stdlib --num-prompts "${NUM_PROMPTS:-200}" \
    --candidates ${CANDIDATES:-1 4 8 12 16 20} --max-new-tokens 128
# collect timed the cost model on this device; to serve on another one, time it there and pass it on:
#   hf-blockpilot measure-cost $MODEL_ARGS --device cuda --output cost_cuda.json --candidates $CANDIDATES
#   hf-blockpilot train-policy ... --cost-model cost_cuda.json
hf-blockpilot train-policy $MODEL_ARGS --labels "$OUT/labels" --output "$OUT/policy" --loss regret --objective throughput
# A policy that serves under the per-round controller (as the embedded ones do) learns from the composed system:
# relabel with every round cut by AdaptiveVerify, using the first policy's acceptance model, and train again
#   hf-blockpilot collect $MODEL_ARGS --output-dir "$OUT/labels-adaptive" --adaptive --acceptance-model "$OUT/policy" ...
#   hf-blockpilot train-policy $MODEL_ARGS --labels "$OUT/labels-adaptive" --acceptance-model "$OUT/policy" ...
# (it then runs under AdaptiveVerify by default: its card says "labels' rounds: cut by the per-round controller")
hf-blockpilot evaluate-policy $MODEL_ARGS --policy "$OUT/policy" --datasets humaneval mtbench --limit "${LIMIT:-20}" \
    --output "$OUT/evaluation.json"
if [ -n "$REPO" ]; then
    python -c "import sys; from hf_blockpilot import BlockPilotPolicy; BlockPilotPolicy.from_pretrained(sys.argv[1]).push_to_hub(sys.argv[2])" \
        "$OUT/policy" "$REPO"
fi
