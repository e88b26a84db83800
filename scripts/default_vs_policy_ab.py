"""Default (guarded controller) against the policy alone on one prompt, alternating, one process: do identical rounds
cost the same? Prints each call's seconds and the medians.

    .venv/bin/python scripts/default_vs_policy_ab.py --dataset mtbench --index 0 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hf_blockpilot  # noqa: F401  (routes generate(assistant_model=drafter))
from hf_blockpilot.controllers import PolicyBlockSize, default_controller
from hf_blockpilot.data import chat_inputs, load_prompts
from hf_blockpilot.tools.evaluation import timed_generate
from hf_blockpilot.tools.loading import load_default_target, resolve_drafter, resolve_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target, tokenizer = load_default_target(args.dtype)
    drafter = resolve_drafter(None, args.dtype)
    drafter.prompt_lookup = True
    drafter.set_policy(resolve_policy("default", prompt_lookup=True))
    prompt = load_prompts(args.dataset, args.index + 1)[args.index]
    ids = chat_inputs(tokenizer, prompt.prompt, "cpu", prompt.history)
    methods = {"policy": lambda: PolicyBlockSize(drafter.policy), "default": lambda: default_controller(drafter)}
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    for make in methods.values():  # warm
        timed_generate(target, ids, drafter, draft_controller=make(), **kwargs)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(args.repeats):
        for name in methods if r % 2 == 0 else reversed(list(methods)):
            run = timed_generate(target, ids, drafter, draft_controller=methods[name](), **kwargs)
            seconds[name].append(run.seconds)
            print(
                f"{name:8s} {run.seconds:.2f} s  rounds {len(run.stats.drafted_per_round)}  tau {run.stats.tau:.2f}",
                flush=True,
            )
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.2f} s over {len(values)}")
    print(f"torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
