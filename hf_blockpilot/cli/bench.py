"""`hf-blockpilot` commands: the benchmark: every method on the held-out sets; or, with `--batch-size`, plain vs
speculative batched `generate` per batch size."""

from __future__ import annotations

import argparse

from ._common import (
    SortedDistinct,
    add_lookup_arg,
    add_model_args,
    add_optional_policy_arg,
    block_size_arg,
    load_cost_model,
    load_models,
    non_negative_float,
    positive_int,
)

#: Options only the per-prompt bench reads: an error beside --batch-size, rather than silently ignored.
PER_PROMPT_ONLY = {
    "reference": "--reference",
    "block_sizes": "--block-sizes",
    "no_baselines": "--no-baselines",
    "cost_model": "--cost-model",
}


def cmd_bench(args: argparse.Namespace) -> int:
    if args.batch_size:
        return cmd_batch_bench(args)
    from ..controllers import AdaptiveVerify
    from ..data import load_prompts
    from ..device_calibration import calibration_enabled, resolve_cost_model
    from ..tools.baselines import baseline_controllers
    from ..tools.bench import markdown_report, run_benchmark

    file_cost_model = load_cost_model(args.cost_model) if args.cost_model else None  # a wrong path fails first
    prompts = [record.prompt for name in args.datasets for record in load_prompts(name, args.limit)]
    target, tokenizer, drafter = load_models(args, prompts=prompts)
    policy = drafter.policy
    block_sizes = args.block_sizes or ([b for b in policy.candidates if b > 1] if policy else [4, 8, 16])
    # the costs `generate` decides with (the file given, else this machine's calibration), for the modeled columns
    cost_model = resolve_cost_model(target, drafter, file_cost_model, args.max_block_size)
    controllers = {}
    if not args.no_baselines:
        controllers = {k: v for k, v in baseline_controllers([], args.max_block_size).items()}
        # calibrated by the policy's acceptance model where it carries one
        controllers["adaptive"] = AdaptiveVerify(
            args.max_block_size, acceptance=getattr(policy, "acceptance_model", None), cost_model=file_cost_model
        )
        if policy is not None:
            controllers["adaptive+policy"] = AdaptiveVerify(policy=policy, cost_model=file_cost_model)
    report = run_benchmark(
        target,
        tokenizer,
        drafter,
        args.datasets,
        block_sizes,
        policy,
        args.temperatures,
        args.limit,
        args.max_new_tokens,
        args.repeats,
        args.output_dir,
        controllers,
        args.reference,
        cost_model,
        # `auto`: the default in the dtype generate --dtype auto picks per prompt (calibration off: always float32)
        auto_dtype=args.dtype == "auto" and calibration_enabled(),
    )
    print(markdown_report(report))
    mismatches = sum(
        row["mismatches"] for run in report["runs"] if run["temperature"] == 0 for row in run["summary"].values()
    )
    mismatches += sum(
        row["mismatches"] for run in report["reference"] if run["temperature"] == 0 for row in run["summary"]
    )
    return 0 if mismatches == 0 else 1


def cmd_batch_bench(args: argparse.Namespace) -> int:
    """`bench --batch-size ...`: plain batched `generate` vs ours at each batch size; exit 1 on a greedy
    mismatch."""
    given = [flag for dest, flag in PER_PROMPT_ONLY.items() if getattr(args, dest)]
    if given:  # before any model is loaded
        raise ValueError(
            f"--batch-size runs the batch-size benchmark, which does not take {', '.join(given)} "
            "(per-prompt bench options): drop them, or drop --batch-size"
        )
    from ..device_calibration import preferred_dtype
    from ..tools.batch_bench import batch_markdown_report, run_batch_benchmark

    auto = args.dtype == "auto"  # each batch size in the dtype expected to decode it fastest
    target, tokenizer, drafter = load_models(args, choose_dtype=not auto)
    report = run_batch_benchmark(
        target,
        tokenizer,
        drafter,
        args.datasets,
        args.batch_size,
        args.temperatures,
        args.limit,
        args.max_new_tokens,
        args.repeats,
        args.output_dir,
        preferred_dtype if auto else None,
    )
    print(batch_markdown_report(report))
    return 0 if all(not run["mismatches"] for run in report["runs"] if run["temperature"] == 0) else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands."""
    p = sub.add_parser(
        "bench",
        help="plain vs fixed block sizes vs BlockPilot vs oracle: JSON, tables, plots (--batch-size: plain vs ours per "
        "batch size)",
    )
    add_model_args(p)
    add_lookup_arg(p)
    add_optional_policy_arg(p)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    p.add_argument("--block-sizes", type=block_size_arg, nargs="+", action=SortedDistinct, default=None)
    p.add_argument("--temperatures", type=non_negative_float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--limit", type=positive_int, default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument(
        "--max-block-size",
        type=block_size_arg,
        default=16,
        help="drafting width of the per-round controllers (adaptive, heuristic, ema, entropy)",
    )
    p.add_argument(
        "--no-baselines",
        action="store_true",
        help="only plain, fixed block sizes and the policy (no per-round controllers)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        help="cost_model.json to also time every method's rounds with (`hf-blockpilot measure-cost`; "
        "default: this machine's calibration, as generate uses)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="also time the DFlash authors' loop (dflash_generate) beside ours at each fixed b, with the "
        "drafter's full-vocabulary variant on both sides (pip install --no-deps dflash==0.1.0)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        nargs="+",
        action=SortedDistinct,
        default=None,
        metavar="B",
        help="batch-size mode: instead of the per-prompt bench, cut each dataset's prompts into batches of B "
        "(left padded) and time plain batched generate against generate(assistant_model=drafter) with the "
        "default controller at each B given (e.g. --batch-size 1 4 8 16); writes results.json, results.md and "
        "throughput_vs_batch.png, exits 1 on a greedy (T=0) row mismatch. Takes --datasets, --temperatures, "
        "--limit, --max-new-tokens, --repeats, --output-dir, the model options, --policy and --prompt-lookup; "
        "not --reference, --block-sizes, --no-baselines or --cost-model",
    )
    p.set_defaults(func=cmd_bench)
