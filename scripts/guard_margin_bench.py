"""The speculation guard's pause margin, on real decoding: the embedded pair (prompt lookup on, its policy's
controller as `generate` serves it, `default_controller`) decodes each held-out prompt greedily with fixed widths,
unguarded, and guarded at each `--margins` value (`SpeculationGuard(pause_margin=m)`, wall-clock timing as shipped);
every request is priced by this machine's calibration (`CostModel.modeled_decode_ms`: no host noise), per set
against the best fixed width. Wall-clock seconds are kept beside.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/guard_margin_bench.py --limit 8 --out docs/guard-margin-zen4

Writes results.json and prints the table; about 6 minutes for 8 prompts a set on a 2-core EPYC.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_blockpilot.controllers import DraftController, SpeculationGuard, default_controller
from hf_blockpilot.data import chat_inputs
from hf_blockpilot.data.evaluation_sets import load_prompts
from hf_blockpilot.device_calibration import resolve_cost_model
from hf_blockpilot.tools.bench import machine_info
from hf_blockpilot.tools.loading import resolve_drafter, resolve_policy, resolve_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--margins", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    parser.add_argument("--out", type=Path, default=Path("runs/guard-margin"))
    args = parser.parse_args()
    target, tokenizer = resolve_target(None, dtype=args.dtype)
    drafter = resolve_drafter(None, dtype=args.dtype)
    drafter.prompt_lookup = True
    drafter.set_policy(resolve_policy("default", prompt_lookup=True))
    cost = resolve_cost_model(target, drafter, None, max(drafter.policy.candidates))
    methods = {f"b={b}": lambda b=b: DraftController(b) for b in args.block_sizes}
    served = default_controller(drafter).inner  # the policy's controller as `generate` serves it, unguarded
    methods["unguarded"] = lambda: served
    methods |= {f"guard {m:g}": lambda m=m: SpeculationGuard(served, pause_margin=m) for m in args.margins}
    results: dict[str, dict[str, list[dict]]] = {}
    for dataset in args.datasets:
        for record in load_prompts(dataset, limit=args.limit):
            input_ids = chat_inputs(tokenizer, record.prompt, target.device, record.history)
            for name, controller in methods.items():
                begin = time.perf_counter()
                out = target.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    assistant_model=drafter,
                    draft_controller=controller(),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    return_dict_in_generate=True,
                )
                stats = out.speculation_stats
                results.setdefault(dataset, {}).setdefault(name, []).append(
                    {
                        "prompt_id": record.id,
                        "modeled_seconds": cost.modeled_decode_ms(stats, 0.0) / 1000,
                        "seconds": time.perf_counter() - begin,
                        "tau": stats.tau,
                    }
                )
            print(dataset, record.id, flush=True)
    lines = ["| set | best fixed (modeled s) | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for dataset, per_method in results.items():
        total = {name: sum(r["modeled_seconds"] for r in rows) for name, rows in per_method.items()}
        best = min((n for n in total if n.startswith("b=")), key=total.__getitem__)
        ratios = " | ".join(f"{total[best] / total[name]:.3f}" for name in methods)
        lines.append(f"| {dataset} | {best} {total[best]:.2f} | {ratios} |")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = vars(args) | {"out": str(args.out)}
    report = {"machine": machine_info(target), "cost_model_source": cost.source, "settings": settings}
    (args.out / "results.json").write_text(json.dumps(report | {"results": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
