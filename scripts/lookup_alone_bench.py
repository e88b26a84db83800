"""Modeled benchmark of prompt lookup alone (`LookupBudget`: a request whose drafter cannot pay still verifies the
looked-up drafts that do), under every recorded cost table.

The target answers held-out prompts greedily (bfloat16, cached in --out/answers.json); each answer is then decoded
round by round as the loop decodes a single request that decodes plain with prompt lookup on: at each position the
n-gram lookup proposes a continuation, `LookupBudget` picks how many of its drafts to verify (0: a plain step), the
drafts matching the answer are accepted, and the round is timed by the table (a target forward over the verified
tokens, no drafter forward). Fixed verify counts (every round verifies up to K looked-up drafts) are shown beside.
Pooled speedup over plain steps in the same table (worst prompt in brackets).

    .venv/bin/python scripts/lookup_alone_bench.py --limit 12 --out runs/lookup-alone   # ~5 min on 2 cores

Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import torch

from hf_blockpilot.controllers import LookupBudget
from hf_blockpilot.costs import CostModel
from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.prompt_lookup import NgramLookup
from hf_blockpilot.tools.loading import resolve_target

FIXED = (1, 2, 4, 8)


def answers(args) -> dict[str, dict[str, list[int]]]:
    """{"set/id": {"prompt": ids, "answer": ids}}, the target's greedy answers (cached)."""
    cache = args.out / "answers.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}
    target = tokenizer = None
    for dataset in args.datasets:
        for record in load_prompts(dataset, args.limit):
            key = f"{dataset}/{record.id}"
            if key in done:
                continue
            if target is None:
                target, tokenizer = resolve_target(None, dtype="bfloat16")
            ids = chat_inputs(tokenizer, record.prompt, target.device)
            with torch.inference_mode():
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            done[key] = {"prompt": ids[0].tolist(), "answer": out[0, ids.shape[1] :].tolist()}
            cache.write_text(json.dumps(done))
            print(f"answered {key} ({len(done)})", flush=True)
    return done


def decode(prompt: list[int], answer: list[int], cost: CostModel, fixed: int | None) -> float:
    """Modeled ms of decoding `answer` with lookup alone (`fixed`: verify up to that many drafts each round)."""
    lookup, budget = NgramLookup(), LookupBudget(cost, 0.0)
    position, ms = 0, cost.verify_ms(1)  # the prefill's token
    while position < len(answer) - 1:
        looked = lookup.continuation(torch.tensor([prompt + answer[: position + 1]]), len(answer) - position - 1)
        count = min(fixed, len(looked)) if fixed else budget.drafts(len(looked), lookup.matched)
        accepted = 0
        while accepted < count and looked[accepted] == answer[position + 1 + accepted]:
            accepted += 1
        if not fixed:
            budget.observe(count, accepted)
        ms += cost.verify_ms(count + 1)
        position += accepted + 1
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("runs/lookup-alone"))
    parser.add_argument("--tables", nargs="+", default=["../shared/calibrations/*.json", "docs/calibrations/*.json"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = answers(args)
    tables = {Path(p).stem: CostModel.load(p) for pattern in args.tables for p in sorted(glob.glob(pattern))}
    methods = {"LookupBudget": None} | {f"K={k}": k for k in FIXED}
    results: dict = {}
    for name, cost in tables.items():
        for dataset in args.datasets:
            rows = {key: v for key, v in data.items() if key.startswith(f"{dataset}/")}
            plain = {key: len(v["answer"]) * cost.verify_ms(1) for key, v in rows.items()}
            cell = {}
            for method, fixed in methods.items():
                ms = {key: decode(v["prompt"], v["answer"], cost, fixed) for key, v in rows.items()}
                cell[method] = {
                    "pooled_speedup": sum(plain.values()) / sum(ms.values()),
                    "min_speedup": min(plain[k] / ms[k] for k in ms),
                }
            results.setdefault(name, {})[dataset] = {"prompts": len(rows), "methods": cell}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| cost table | set | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for name, per_set in results.items():
        for dataset, cell in per_set.items():
            m = cell["methods"]
            lines.append(
                f"| {name} | {dataset} | "
                + " | ".join(f"{m[k]['pooled_speedup']:.2f}x ({m[k]['min_speedup']:.2f}x)" for k in methods)
                + " |"
            )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
