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
# The labels are τ(b) per prompt and temperature: no machine in them. The policy learns τ(b); where it serves, each
# request's width is priced by that machine's calibrated costs, so one policy serves CPUs and GPUs alike.
hf-blockpilot train-policy $MODEL_ARGS --labels "$OUT/labels" --output "$OUT/policy"
# A classifier of the best width for one machine instead (the older objective): time the costs into the labels
# (`collect --cost-model`, or `measure-cost` on the serving device) and train with --objective throughput; to label
# the composed system, relabel with every round cut by AdaptiveVerify and the first policy's acceptance model:
#   hf-blockpilot collect $MODEL_ARGS --output-dir "$OUT/labels-adaptive" --adaptive --acceptance-model "$OUT/policy" ...
#   hf-blockpilot train-policy $MODEL_ARGS --labels "$OUT/labels-adaptive" --objective throughput ...
hf-blockpilot evaluate-policy $MODEL_ARGS --policy "$OUT/policy" --datasets humaneval mtbench --limit "${LIMIT:-20}" \
    --output "$OUT/evaluation.json"
if [ -n "$REPO" ]; then
    python -c "import sys; from hf_blockpilot import BlockPilotPolicy; BlockPilotPolicy.from_pretrained(sys.argv[1]).push_to_hub(sys.argv[2])" \
        "$OUT/policy" "$REPO"
fi
