"""`hf-blockpilot` commands: label, train, time and evaluate BlockPilot policies."""

from __future__ import annotations

import argparse
import json

from ._common import (
    SortedDistinct,
    add_lookup_arg,
    add_model_args,
    block_size_arg,
    load_acceptance_model,
    load_cost_model,
    load_models,
    non_negative_float,
    positive_int,
    shard_of,
)

_FRESH_PROMPT_POOL = 12_000  # candidates drawn per generator before a drafter's training prompts are left out


def cmd_collect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..data import (
        chat_training_prompts,
        follow_up_prompts,
        load_prompts,
        short_answer_prompts,
        stdlib_training_prompts,
    )
    from ..device_calibration import calibrate
    from ..training.data import target_answers, unseen_prompts
    from ..training.oracle import collect_oracle_labels

    if args.adaptive and args.cost_model is False:
        raise ValueError(
            "--adaptive weighs each round's verify budget by the measured cost model: drop --no-cost-model"
        )
    time_costs = args.adaptive if args.cost_model is None else args.cost_model
    target, tokenizer, drafter = load_models(args)
    generators = {"stdlib": stdlib_training_prompts, "chat": chat_training_prompts, "short": short_answer_prompts}

    def fresh(name: str, count: int, seed: int) -> list:  # a drafter's τ on its own training data is inflated
        pool = generators[name](max(count, _FRESH_PROMPT_POOL) if args.exclude_responses else count, seed=seed)
        return unseen_prompts(pool, tokenizer, args.exclude_responses, count)

    prompts = []
    for name in args.dataset:  # --num-prompts of each
        if name in generators:
            prompts += fresh(name, args.num_prompts, args.seed)
        elif name == "multiturn":  # a follow-up to the target's own answer of a first chat or code request
            half = args.num_prompts // 2
            firsts = fresh("chat", args.num_prompts - half, args.seed + 1) + fresh("stdlib", half, args.seed + 1)
            answers = target_answers(
                target, tokenizer, firsts, args.max_new_tokens, Path(args.output_dir) / "first-turns"
            )
            prompts += follow_up_prompts(answers, args.seed)
        else:
            prompts += load_prompts(name, args.num_prompts)
    shard, num_shards = shard_of(args)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    cost_path = Path(args.output_dir) / "cost_model.json"
    if shard == 0 and time_costs and not cost_path.exists():
        calibrate(target, drafter, args.candidates).cost_model.save(cost_path)
    if args.verify and shard == 0:
        from ..training.oracle import check_replay_against_decoding

        check = check_replay_against_decoding(
            target, tokenizer, drafter, prompts[: args.verify], args.candidates, args.max_new_tokens
        )
        (Path(args.output_dir) / "replay_check.json").write_text(json.dumps(check, indent=2))
        print(
            f"replay == real decoding for {check['equal']}/{check['checked']} (prompt, b) pairs; "
            f"replay {check['speedup']:.1f}x faster than decoding once per b"
        )
        if check["equal"] != check["checked"]:
            return 1
    cost = load_cost_model(cost_path) if cost_path.exists() else None
    acceptance = load_acceptance_model(args.acceptance_model) if args.acceptance_model else None
    path = collect_oracle_labels(
        target,
        tokenizer,
        drafter,
        prompts,
        args.output_dir,
        args.candidates,
        args.feature_layers,
        args.max_new_tokens,
        shard=shard,
        num_shards=num_shards,
        temperatures=args.temperatures,
        cost=cost,
        acceptance=acceptance,
        adaptive=args.adaptive,
    )
    print(f"labels written to {path}")
    return 0


def cmd_train_policy(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..training.policy_training import PolicyTrainingConfig, read_label_manifest, train_policy_from_labels

    read_label_manifest(args.labels, args.candidates)  # bad input fails before any model is loaded
    config = PolicyTrainingConfig(loss=args.loss, objective=args.objective, seed=args.seed, tau_head=args.tau_head)
    target, _, drafter = load_models(args)
    cost = load_cost_model(args.cost_model) if args.cost_model else None
    acceptance = load_acceptance_model(args.acceptance_model) if args.acceptance_model else None
    _, report, comparison = train_policy_from_labels(
        args.labels, args.output, target, drafter, config, cost, args.candidates, acceptance
    )
    print(json.dumps(asdict(report), indent=2))
    for name, row in (comparison or {}).items():
        print(
            f"labels by {name}: best fixed b={row['best_fixed_b']}, oracle {row['oracle_tokens_per_second']:.1f} "
            f"modeled tok/s (fixed {row['best_fixed_tokens_per_second']:.1f}), "
            f"oracle b counts {row['oracle_counts']}"
        )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..device_calibration import calibration_path, load_or_calibrate

    target, _, drafter = load_models(args)
    calibration = load_or_calibrate(target, drafter, args.max_width, force=args.force)
    fingerprint = calibration.fingerprint
    print(
        f"device: {fingerprint['name']} ({' '.join(fingerprint['flags']) or 'no listed matmul flags'}), "
        f"{fingerprint['dtype']}, {fingerprint['threads']} threads, torch {fingerprint['torch']}"
    )
    print(calibration.table())
    inexact = calibration.cost_model.inexact_rows
    print(f"verify forwards probed exact: {'no, over ' + str(inexact) + ' tokens' if inexact else 'yes, every width'}")
    how = "read from the cache" if calibration.from_cache else f"measured in {calibration.seconds:.1f} s"
    print(f"{how}: {calibration_path(fingerprint)}")
    return 0


def cmd_measure_cost(args: argparse.Namespace) -> int:
    from ..device_calibration import calibrate

    target, _, drafter = load_models(args)
    sizes = sorted(set(args.candidates) | {1})  # b = 1 (a plain step) is the reference
    calibration = calibrate(target, drafter, sizes, args.context_tokens, args.repeats)
    cost = calibration.cost_model
    cost.save(args.output)
    print(calibration.table())
    plain = cost.round_ms(1)
    for b in sizes:
        print(
            f"b={b}: round {cost.round_ms(b):.2f} ms = {cost.round_ms(b) / plain:.2f} plain steps "
            f"(at T>0: {cost.round_ms(b, 1.0):.2f} ms)"
        )
    print(f"cost model written to {args.output}")
    return 0


def cmd_evaluate_policy(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..data import load_prompts
    from ..tools.evaluation import decode_methods, summarize_methods
    from ..tools.loading import resolve_policy

    target, tokenizer, drafter = load_models(args)
    policy = resolve_policy(args.policy, device=target.device, prompt_lookup=drafter.prompt_lookup)
    if policy is None:
        raise ValueError(f"--policy {args.policy!r} gives no policy; pass a policy Hub id or directory")
    block_sizes = args.block_sizes or [b for b in policy.candidates if b > 1]
    output = {}
    for name in args.datasets:
        results = decode_methods(
            target,
            tokenizer,
            drafter,
            load_prompts(name, args.limit),
            block_sizes,
            policy,
            args.max_new_tokens,
            args.repeats,
        )
        summary = summarize_methods(results)
        output[name] = {"summary": summary, "results": [asdict(r) for r in results]}
        print(f"\n{name}\n| method | tokens/s | speedup | τ | mismatches |\n|---|---|---|---|---|")
        for method, row in summary.items():
            print(
                f"| {method} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f} | {row['tau']:.2f} "
                f"| {row['mismatches']} |"
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(output, f, indent=2)
    return 0


def cmd_import_policy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..tools.policy_import import import_authors_policy, read_authors_predictor

    if len(set(args.candidates)) != len(args.candidates):
        raise ValueError(f"--candidates {args.candidates}: one distinct block size per output class, in class order")
    predictor = read_authors_predictor(args.checkpoint)  # a missing or malformed file fails before the models load
    target, _, drafter = load_models(args)
    policy = import_authors_policy(
        predictor,
        target,
        drafter,
        args.candidates,
        target_name=args.target or target.name_or_path,
        drafter_name=args.drafter or drafter.name_or_path,
    )
    policy.save_pretrained(args.output)
    policy.generate_model_card().save(Path(args.output) / "README.md")  # save_pretrained keeps an existing card
    print(
        f"policy over block sizes {policy.candidates} ({sum(p.numel() for p in policy.parameters())} parameters, "
        f"{args.checkpoint} -> {args.output}); use it with --policy {args.output}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands (training defaults come from `PolicyTrainingConfig`)."""
    from ..policy import TAU_HEADS
    from ..training.policy_training import PolicyTrainingConfig

    training = PolicyTrainingConfig()
    p = sub.add_parser("collect", help="oracle block-size labels by drafter replay (resumable, shardable)")
    add_model_args(p)
    add_lookup_arg(p)
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--dataset",
        nargs="+",
        default=["stdlib"],
        help="stdlib / chat / short / multiturn (training-prompt generators; multiturn: a follow-up to the "
        "target's answer of a first chat or code request) and/or evaluation set names",
    )
    p.add_argument("--num-prompts", type=positive_int, default=200, help="prompts per dataset")
    p.add_argument(
        "--exclude-responses", default=None, help="a drafter's responses.jsonl: its prompts are left out of stdlib/chat"
    )
    p.add_argument("--candidates", type=positive_int, nargs="+", action=SortedDistinct, default=[1, 4, 8, 12, 16, 20])
    p.add_argument(
        "--feature-layers",
        type=int,
        nargs="+",
        default=None,
        help="target layers the policy reads (default: the middle and second-to-last: 14 28 on a 30-layer target)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument(
        "--temperatures",
        type=non_negative_float,
        nargs="+",
        default=[0.0, 1.0],
        help="label each prompt at these sampling temperatures (0 = greedy; T>0: expected acceptance)",
    )
    p.add_argument(
        "--cost-model",
        dest="cost_model",
        action="store_true",
        default=None,
        help="also time this machine's cost model into the labels (modeled times per record): what --adaptive "
        "labels and the classifying objectives need; τ labels (the default policy's) carry no machine",
    )
    p.add_argument("--no-cost-model", dest="cost_model", action="store_false", help="never time it (the default)")
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="first check replay == real decoding on N prompts (and time both)",
    )
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="label decoding under the per-round controller (AdaptiveVerify): the best drafting width "
        "*with* it; needs the cost model",
    )
    p.add_argument(
        "--acceptance-model",
        default=None,
        help="with --adaptive: the controller's acceptance model (acceptance_model.json or a policy "
        "directory from a first `train-policy`); default: the training-free entropy bound",
    )
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("train-policy", help="train a BlockPilot policy on collected labels")
    add_model_args(p)
    p.add_argument("--labels", required=True, help="a `collect` output directory")
    p.add_argument("--output", required=True, help="directory for the policy checkpoint")
    p.add_argument(
        "--candidates",
        type=positive_int,
        nargs="+",
        action=SortedDistinct,
        default=None,
        help="a subset of the collected block sizes",
    )
    p.add_argument(
        "--objective",
        choices=["tau", "throughput", "acceptance"],
        default=training.objective,
        help="tau: predict τ(b), priced per request by the serving machine's costs (travels across machines); "
        "throughput / acceptance: classify the best width (under --cost-model / by τ alone)",
    )
    p.add_argument(
        "--loss", choices=["regret", "ce"], default=None, help="the classifying objectives' loss (default regret)"
    )
    p.add_argument(
        "--tau-head",
        choices=TAU_HEADS,
        default=training.tau_head,
        help="tau objective: one output per candidate width (per_width), or one acceptance per draft slot whose "
        "running products sum to τ(b) (per_slot: consistent across widths by construction)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        help="a cost_model.json (`hf-blockpilot measure-cost`): what the classifiers learn the best width under "
        "(default: the one `collect` measured in --labels) / what prices the tau report (default: this machine's)",
    )
    p.add_argument(
        "--acceptance-model",
        default=None,
        help="store this acceptance model (acceptance_model.json or a policy directory) in the policy; "
        "default: fitted on the rounds recorded in --labels",
    )
    p.add_argument("--seed", type=int, default=training.seed)
    p.set_defaults(func=cmd_train_policy)

    p = sub.add_parser(
        "calibrate",
        help="time this machine's costs for the pair (cached; generate does it on first use) and print the table",
    )
    add_model_args(p)
    p.add_argument("--max-width", type=block_size_arg, default=16, help="the widest block to time")
    p.add_argument("--force", action="store_true", help="re-measure even if a calibration is cached")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("measure-cost", help="time verify rounds per block size on this device (a policy's cost model)")
    add_model_args(p)
    p.add_argument("--output", required=True, help="where to write cost_model.json")
    p.add_argument(
        "--candidates", type=positive_int, nargs="+", action=SortedDistinct, default=[1, 2, 4, 8, 12, 16, 20]
    )
    p.add_argument("--context-tokens", type=positive_int, default=256)
    p.add_argument(
        "--repeats", type=positive_int, default=20, help="timed calls per block size (median; raise on noisy hosts)"
    )
    p.set_defaults(func=cmd_measure_cost)

    p = sub.add_parser("evaluate-policy", help="real decoding with the policy vs each fixed b and the oracle")
    add_model_args(p)
    add_lookup_arg(p)
    p.add_argument(
        "--policy", required=True, help="policy Hub id or directory; 'default': the embedded one (embedded pair only)"
    )
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument(
        "--block-sizes",
        type=block_size_arg,
        nargs="+",
        action=SortedDistinct,
        default=None,
        help="default: the policy's candidates",
    )
    p.add_argument("--limit", type=positive_int, default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--output", default=None)
    p.set_defaults(func=cmd_evaluate_policy)

    p = sub.add_parser(
        "import-policy", help="convert the BlockPilot authors' predictor (model.pt) into a policy checkpoint"
    )
    add_model_args(p)
    p.add_argument("checkpoint", help="the authors' MLP state dict (AMAP-ML/BlockPilot utils/model.pt layout)")
    p.add_argument("--output", required=True, help="directory for the policy checkpoint (Hub format)")
    p.add_argument(
        "--candidates",
        type=positive_int,
        nargs="+",
        default=[14, 15, 16, 17, 18],
        help="the block size of each output class, in class order (theirs: 14..18)",
    )
    p.set_defaults(func=cmd_import_policy)
