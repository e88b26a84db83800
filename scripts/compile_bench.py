"""`generate(..., compile=True)` against plain `generate`, eager and compiled, on the embedded pair.

    python scripts/compile_bench.py --out docs/bench-epyc-compile/compile.json

Per dtype, on the same prompts (HumanEval and MT-Bench, `--prompts` each): plain `generate` (eager, dynamic
cache), plain `generate` compiled over a static cache (Transformers' own compiled decoding, `PLAIN_COMPILED`),
and ours with the default controller (policy attached) and fixed widths, eager and with `compile=True`. A first,
untimed pass compiles, calibrates and keeps the outputs; its seconds beyond a timed pass are `compile_seconds`.
Then every configuration decodes all prompts in interleaved repeats (`interleaved_median_ms`: a further warm-up
round, then `--repeats`; the median kept). Greedy outputs are compared with eager plain `generate` in the same
dtype (`mismatched_prompts`).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from functools import partial
from pathlib import Path

import torch

from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.device_calibration import describe_device, interleaved_median_ms
from hf_blockpilot.tools.evaluation import PLAIN_COMPILED
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy


def decode(target, ids: torch.Tensor, config: dict, gen: dict) -> torch.Tensor:
    return target.generate(ids, attention_mask=torch.ones_like(ids), **config, **gen)


def decode_all(target, prompts: list[torch.Tensor], config: dict, gen: dict) -> None:
    for ids in prompts:
        decode(target, ids, config, gen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3, help="per set (HumanEval and MT-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # every dtype's and configuration's graphs count against one limit per compiled function (8 by default);
    # past it torch runs the forward eager, which would time eager forwards as compiled ones
    torch._dynamo.config.recompile_limit = 64

    records = load_prompts("humaneval", args.prompts) + load_prompts("mtbench", args.prompts)
    report = {"threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "rows": []}
    for dtype in args.dtypes:
        target, tokenizer = load_default_target(dtype=dtype)
        report["device"] = describe_device(target.device)
        drafter = resolve_drafter(None, dtype=dtype)
        drafter.set_policy(resolve_policy("default", prompt_lookup=False))
        prompts = [chat_inputs(tokenizer, r.prompt, target.device) for r in records]
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        configs = {"plain": {}, "plain compiled static": PLAIN_COMPILED}
        for label, controller in [("default", None)] + [(f"b={b}", b) for b in args.block_sizes]:
            for compiled in (False, True):
                configs[f"ours {label}{' compiled' if compiled else ''}"] = dict(
                    assistant_model=drafter, draft_controller=controller, compile=compiled
                )

        first_pass, outputs = {}, {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, config in configs.items():  # untimed: compiles, calibrates, warms up
                start = time.perf_counter()
                outputs[name] = [decode(target, ids, config, gen) for ids in prompts]
                first_pass[name] = time.perf_counter() - start
        inexact = sorted({str(w.message) for w in caught if "bit for bit" in str(w.message)})
        runs = {name: partial(decode_all, target, prompts, config, gen) for name, config in configs.items()}
        medians = {name: ms / 1000 for name, ms in interleaved_median_ms(runs, args.repeats, target.device).items()}
        tokens = sum(out.shape[1] - ids.shape[1] for out, ids in zip(outputs["plain"], prompts, strict=True))
        fastest_plain = min(medians[name] for name in ("plain", "plain compiled static"))
        for name in configs:
            mismatched = sum(
                not torch.equal(out, ref) for out, ref in zip(outputs[name], outputs["plain"], strict=True)
            )
            row = {
                "dtype": dtype,
                "config": name,
                "seconds": round(medians[name], 3),
                "tokens_per_second": round(tokens / medians[name], 2),
                "vs_plain_eager": round(medians["plain"] / medians[name], 3),
                "vs_fastest_plain": round(fastest_plain / medians[name], 3),
                "first_pass_seconds": round(first_pass[name], 1),
                "compile_seconds": round(max(first_pass[name] - medians[name], 0.0), 1),
                "mismatched_prompts": mismatched,
            }
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        report.setdefault("inexact_warnings", {})[dtype] = inexact
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
