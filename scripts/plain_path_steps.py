"""Where a call of ours that decodes plain spends its time, against plain `generate`, call by call.

    python scripts/plain_path_steps.py --calls 9 --max-new-tokens 64 [--dtype bfloat16]

The embedded pair (policy attached, prompt lookup on: the main job's settings, `--dtype auto`) answers one prompt
through our loop and through plain `generate`, the two alternating call by call (the order reversed every other
call). Forward hooks on the target time every forward, so each call splits into the prefill, the one-token steps
and the time outside forwards (the loops' own work). Prints each side's medians and the paired medians and spreads
of ours minus plain. Offline.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hf_blockpilot.cli import build_parser
from hf_blockpilot.cli._common import build_controller, load_models
from hf_blockpilot.data import chat_inputs
from hf_blockpilot.tools.evaluation import timed_generate

PROMPT = "Write a Python function that checks whether a string is a palindrome."
PARTS = ("call", "prefill", "step median", "steps", "outside forwards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=9, help="calls a side")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--dtype", default="auto", help="as `generate --dtype`")
    args = parser.parse_args()
    cli = build_parser().parse_args(
        [
            "generate",
            args.prompt,
            "--prompt-lookup",
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--dtype",
            args.dtype,
        ]
    )
    target, tokenizer, drafter = load_models(cli, prompts=[args.prompt])
    controller = build_controller(cli.controller, drafter, cli.block_size)
    ids = chat_inputs(tokenizer, args.prompt, target.device)
    forwards: list[list[float]] = []  # [start, tokens, end] per target forward

    def before(module, positional, kwargs):
        forwards.append([time.perf_counter(), kwargs["input_ids"].shape[1]])

    def after(module, positional, kwargs, output):
        forwards[-1].append(time.perf_counter())

    target.register_forward_pre_hook(before, with_kwargs=True)
    target.register_forward_hook(after, with_kwargs=True)
    sides = {
        "ours": lambda n: timed_generate(target, ids, drafter, draft_controller=controller, max_new_tokens=n),
        "plain": lambda n: timed_generate(target, ids, max_new_tokens=n),
    }
    for run in sides.values():  # warm-up
        run(4)
    parts: dict[str, list[tuple[float, ...]]] = {name: [] for name in sides}
    for i in range(args.calls):
        for name in sides if i % 2 == 0 else list(sides)[::-1]:
            forwards.clear()
            seconds = sides[name](args.max_new_tokens).seconds
            steps = [end - start for start, tokens, end in forwards if tokens == 1]
            prefill = sum(end - start for start, tokens, end in forwards if tokens > 1)
            inside = sum(end - start for start, _, end in forwards)
            parts[name].append((seconds, prefill, statistics.median(steps), sum(steps), seconds - inside))
    print(f"{target.dtype}, {args.calls} calls a side, {args.max_new_tokens} tokens (ms)")
    for name, rows in parts.items():
        medians = [statistics.median(row[j] for row in rows) * 1e3 for j in range(len(PARTS))]
        print(f"{name:6s} " + "  ".join(f"{what} {ms:.1f}" for what, ms in zip(PARTS, medians, strict=True)))
    for j, what in enumerate(PARTS):
        paired = sorted((a[j] - b[j]) * 1e3 for a, b in zip(parts["ours"], parts["plain"], strict=True))
        print(f"ours - plain, {what}: median {statistics.median(paired):.1f}, from {paired[0]:.0f} to {paired[-1]:.0f}")


if __name__ == "__main__":
    main()
