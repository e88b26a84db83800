"""A/B of prompt lookup on this machine: plain `generate`, the default with prompt lookup, the default without it,
in one process, interleaved prompt by prompt, every output checked identical to plain (greedy).

    .venv/bin/python scripts/lookup_ab_bench.py --out runs/lookup-ab.json   # ~12 min on 2 cores

The embedded pair in one dtype, each side with its own embedded policy (`resolve_policy(prompt_lookup=...)`). The
first repeat warms up and is not timed; the figure is tokens/s over all timed runs (new tokens / seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.device_calibration import describe_device
from hf_blockpilot.tools.loading import resolve_drafter, resolve_policy, resolve_target

SIDES = ("plain", "lookup", "no lookup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mtbench"])
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (after one warm-up)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    target, tokenizer = resolve_target(None, dtype=args.dtype)
    drafter = resolve_drafter(None, dtype=args.dtype)
    policies = {lookup: resolve_policy(None, prompt_lookup=lookup) for lookup in (True, False)}
    prompts = [r.prompt for dataset in args.datasets for r in load_prompts(dataset, args.limit)]
    tokens = dict.fromkeys(SIDES, 0)
    seconds = dict.fromkeys(SIDES, 0.0)
    taus, mismatches = [], 0
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):
            for prompt in prompts:
                ids = chat_inputs(tokenizer, prompt, target.device)
                outputs = {}
                for side in SIDES:
                    extra = {}
                    if side != "plain":
                        drafter.prompt_lookup = side == "lookup"
                        drafter.set_policy(policies[drafter.prompt_lookup])
                        extra = dict(assistant_model=drafter)
                    start = time.perf_counter()
                    outputs[side] = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
                    if repeat:
                        seconds[side] += time.perf_counter() - start
                        tokens[side] += outputs[side].shape[1] - ids.shape[1]
                    if side == "lookup" and repeat == 1:
                        taus.append(drafter.last_stats.tau)
                if repeat == 0:
                    mismatches += sum(not torch.equal(outputs[s], outputs["plain"]) for s in SIDES[1:])
    rate = {side: tokens[side] / seconds[side] for side in SIDES}
    report = {
        "device": describe_device(target.device),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "tokens_per_second": rate,
        "lookup_vs_plain": rate["lookup"] / rate["plain"],
        "no_lookup_vs_plain": rate["no lookup"] / rate["plain"],
        "lookup_vs_no_lookup": rate["lookup"] / rate["no lookup"],
        "lookup_tau": taus,
        "lookup_tau_median": statistics.median(taus),
        "mismatches": mismatches,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
