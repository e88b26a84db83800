"""A/B of the decoding loop: an older commit's package beside this tree's, in one process, on one target object.

    git worktree add /tmp/hf-blockpilot-old 6c2e396
    python scripts/loop_ab_bench.py --old /tmp/hf-blockpilot-old --out docs/bench-epyc-one-loop/ab.json

The old tree's `hf_blockpilot` is imported as `hf_blockpilot_old` (its imports are relative) before this tree's,
so each package routes calls with its own drafter class. Per dtype, the embedded pair (policy attached, prompt
lookup off) decodes the same prompts with the default controller and with fixed widths (`--block-sizes`, default
4) through both packages, and
plain `generate` runs beside them, every configuration timed the same way in interleaved repeats (median of the
repeats' summed seconds). Outputs are checked token-identical to plain `generate` in the same dtype. `--compile`:
both packages' loops run with `compile=True`, and plain `generate` compiled over a static cache (`PLAIN_COMPILED`)
runs beside plain eager; compilation happens in the untimed warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def import_old(tree: Path):
    link_dir = Path(tempfile.mkdtemp(prefix="hf-blockpilot-old-"))
    (link_dir / "hf_blockpilot_old").symlink_to(tree.resolve() / "hf_blockpilot")
    sys.path.insert(0, str(link_dir))
    return importlib.import_module("hf_blockpilot_old")


def decode(target, ids, config: tuple, gen: dict) -> torch.Tensor:
    """`config`: (the package's `custom_generate` loop, or None for plain `generate`; the drafter; the draft
    controller; extra `generate` keywords). Each package's loop is called through Transformers' seam, so neither
    routes the other's calls."""
    loop, drafter, controller, extra = config
    if loop is None:
        return target.generate(ids, **gen, **extra)
    return target.generate(ids, custom_generate=loop, drafter=drafter, draft_controller=controller, **gen, **extra)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="a checkout (worktree) of the older commit")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=4, help="per set (HumanEval and MT-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[4], help="fixed widths timed beside the default")
    parser.add_argument("--compile", action="store_true", help="compile=True on both sides; plain compiled beside")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64  # every configuration's graphs: past the limit torch runs eager

    old = import_old(args.old)  # first: it captures stock `generate`
    import hf_blockpilot as new
    from hf_blockpilot.data import chat_inputs, load_prompts
    from hf_blockpilot.device_calibration import describe_device
    from hf_blockpilot.tools.evaluation import PLAIN_COMPILED
    from hf_blockpilot.tools.loading import load_default_target

    torch.set_num_threads(torch.get_num_threads())
    records = load_prompts("humaneval", args.prompts) + load_prompts("mtbench", args.prompts)
    report = {"old_tree": str(args.old), "compile": args.compile, "threads": torch.get_num_threads(), "rows": []}
    for dtype in args.dtypes:
        target, tokenizer = load_default_target(dtype=dtype)
        report["device"] = describe_device(target.device)
        prompts = [chat_inputs(tokenizer, r.prompt, target.device) for r in records]
        pairs = {}
        for name, package in (("old", old), ("new", new)):
            loading = importlib.import_module(f"{package.__name__}.tools.loading")
            drafter = loading.resolve_drafter(None, dtype=dtype)
            drafter.set_policy(loading.resolve_policy("default", prompt_lookup=False))
            pairs[name] = drafter
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        entries = {"old": old.generate, "new": new.generate}
        configs = {"plain": (None, None, None, {})}
        if args.compile:
            configs["plain compiled"] = (None, None, None, PLAIN_COMPILED)
        ours = {"compile": True} if args.compile else {}
        for name, drafter in pairs.items():
            for label, controller in [("default", None)] + [(f"b={b}", b) for b in args.block_sizes]:
                configs[f"{name} {label}"] = (entries[name], drafter, controller, ours)
        expected = [decode(target, ids, configs["plain"], gen) for ids in prompts]  # also warms up
        for name, config in configs.items():  # warm-up and exactness
            for ids, want in zip(prompts, expected, strict=True):
                if not torch.equal(decode(target, ids, config, gen), want):
                    print(f"{dtype} {name}: output differs from plain generate", file=sys.stderr)
                    report.setdefault("mismatches", []).append(f"{dtype} {name}")
        seconds = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, config in configs.items():
                start = time.perf_counter()
                for ids in prompts:
                    decode(target, ids, config, gen)
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        for name, value in medians.items():
            row = {"dtype": dtype, "config": name, "seconds": value, "vs_plain": medians["plain"] / value}
            if name.startswith("new "):
                row["new_vs_old"] = medians["old " + name[4:]] / value
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
