"""`hf-blockpilot` commands: answer one prompt, streamed, with the statistics (and the speedup over plain generate)."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import (
    CONTROLLERS,
    add_lookup_arg,
    add_model_args,
    add_optional_policy_arg,
    block_size_arg,
    build_controller,
    load_models,
    max_slowdown_arg,
    non_negative_float,
    positive_int,
    prompt_text,
)


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from ..data import chat_inputs
    from ..device_calibration import describe_device
    from ..tools.evaluation import compare_with_plain, timed_generate

    if args.max_slowdown is not None and args.controller != "default":  # before any model is loaded
        raise ValueError(
            f"--max-slowdown bounds the default controller's guard; --controller {args.controller} has none: "
            "drop one of them"
        )
    target, tokenizer, drafter = load_models(args, prompts=[args.prompt])
    controller = build_controller(args.controller, drafter, args.block_size, args.max_slowdown)
    input_ids = chat_inputs(tokenizer, args.prompt, target.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        gen["temperature"] = args.temperature
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds, stats = timed_generate(
        target, input_ids, drafter, streamer=streamer, draft_controller=controller, compile=args.compile, **gen
    )
    if args.no_stream:
        print(tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True))
    device = describe_device(target.device)
    result = {
        "device": f"{device['name']} ({' '.join(device['flags']) or 'no listed matmul flags'})",
        "dtype": str(target.dtype).removeprefix("torch."),
        "costs": stats.cost_model_source,
        "controller": stats.controller,
        "block_size": stats.block_size,
        "tau": round(stats.tau, 3),
        "verified_per_round": round(stats.verified_per_round, 2),
        "plain_rounds": stats.plain_rounds,
        "new_tokens": stats.new_tokens,
        "tokens_per_second": round(stats.new_tokens / seconds, 2),
    }
    if drafter.prompt_lookup:
        result["lookup_rounds"] = stats.lookup_rounds
    if args.compare:
        result.update(compare_with_plain(target, input_ids, drafter, controller, gen, args.repeats, out, args.compile))
    # stdout: the answer, then the results (or, with --json, the JSON record alone and the results on stderr)
    results_to = sys.stderr if args.json else sys.stdout
    print("\n" + " | ".join(f"{k}: {v}" for k, v in result.items()), file=results_to)
    rounds = [f"{d}/{a}" for d, a in zip(stats.drafted_per_round, stats.accepted_per_round) if d > 0]
    if rounds:
        print(f"rounds (drafts verified/accepted): {' '.join(rounds)}", file=results_to)
    else:  # the loop decoded plain: any measured speedup is the loop's overhead against generate's, or noise
        print(
            "rounds: none drafted (no width pays under this machine's costs: `hf-blockpilot calibrate` prints them); "
            "every token was a plain step",
            file=results_to,
        )
    if args.json:
        result["verified_and_accepted_per_round"] = [
            [d, a] for d, a in zip(stats.drafted_per_round, stats.accepted_per_round, strict=True)
        ]
        print(json.dumps(result))
    return 0 if result.get("identical_to_plain", True) else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands."""
    p = sub.add_parser("generate", help="answer a prompt with block-diffusion speculative decoding")
    p.add_argument("prompt", type=prompt_text)
    add_model_args(p)
    add_lookup_arg(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--block-size",
        type=block_size_arg,
        default=None,
        help="drafting width (turns the policy off); with --controller fixed, every draft is verified",
    )
    p.add_argument(
        "--controller",
        choices=CONTROLLERS,
        default="default",
        help="default: what generate() runs with no controller (the policy under its label controller, "
        "guarded never to lose to plain steps); adaptive: verify the drafts worth it each round; "
        "fixed: every draft; heuristic / ema / entropy: the baselines of `bench`",
    )
    p.add_argument(
        "--max-slowdown",
        type=max_slowdown_arg,
        default=None,
        metavar="FRACTION",
        help="with the default controller: draft only while, even if every draft were rejected, this request stays "
        "within this fraction of plain decoding's time (e.g. 0.05; a few plain steps first). Off by default",
    )
    add_optional_policy_arg(p)
    p.add_argument(
        "--compare",
        action="store_true",
        help="also time plain generate the same way (warmed, unstreamed, --repeats rounds of one run a side, back "
        "to back): speedup and identical output",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="timing rounds with --compare (speedup: median of their ratios)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the target's forwards torch.compile'd over a static cache (the first call compiles; with "
        "--compare, plain generate is also timed compiled)",
    )
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON on stdout")
    p.set_defaults(func=cmd_generate)
