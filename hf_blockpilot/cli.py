"""`hf-blockpilot` command line (thin: each subcommand calls the library)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .controllers import AcceptanceModel, DraftController
    from .modeling_block_diffusion import BlockDiffusionDrafter


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _block_size(text: str) -> int:
    from .controllers import check_block_size

    try:
        return check_block_size(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


class _SortedDistinct(argparse.Action):
    """For lists of block sizes: sorted, each once."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, sorted(set(values)))


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this torch build or machine has no CUDA; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available here; use --device cpu")
    return text


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target Hub id or directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter Hub id or directory (default: the embedded drafter)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")


def _add_lookup_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="rounds whose last tokens occurred earlier draft their continuation (lossless)")


def _add_optional_policy_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", dest="use_policy", default="default",
                        help="BlockPilot policy Hub id or directory; 'default': the embedded one (embedded pair only); 'none'")


def _load(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, BlockDiffusionDrafter]:
    """Target, tokenizer and drafter (with its policy, where the command has --policy) from the common flags."""
    from .defaults import checked_source, resolve_drafter, resolve_policy, resolve_target

    # a mistyped directory fails before any model is loaded
    policy_source = getattr(args, "use_policy", None) or getattr(args, "policy", None)
    for what, source in (("target", args.target), ("drafter", args.drafter), ("policy", policy_source)):
        if source is not None and source not in ("default", "none"):
            checked_source(source, what)
    target, tokenizer = resolve_target(args.target, dtype=args.dtype, device=args.device)
    drafter = resolve_drafter(args.drafter, dtype=args.dtype, device=args.device)
    drafter.prompt_lookup = getattr(args, "prompt_lookup", False)
    if getattr(args, "use_policy", None) is not None:
        # the embedded policy only belongs to the embedded pair
        default_pair = args.target is None and args.drafter is None
        choice = args.use_policy if args.use_policy != "default" or default_pair else None
        drafter.set_policy(resolve_policy(choice, device=args.device, prompt_lookup=drafter.prompt_lookup))
    return target, tokenizer, drafter


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from .evaluation import chat_inputs, timed_generate

    target, tokenizer, drafter = _load(args)
    controller = _controller(args.controller, drafter, args.block_size)
    input_ids = chat_inputs(tokenizer, args.prompt, target.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        gen["temperature"] = args.temperature
    if args.compare:  # warm both paths so neither pays first-call costs in the comparison
        timed_generate(target, input_ids, drafter, max_new_tokens=8, do_sample=False, draft_controller=controller)
        timed_generate(target, input_ids, max_new_tokens=8, do_sample=False)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds = timed_generate(target, input_ids, drafter, streamer=streamer, draft_controller=controller, **gen)
    if args.no_stream:
        print(tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True))
    stats = drafter.last_stats
    result = {
        "controller": stats.controller,
        "block_size": stats.block_size,
        "tau": round(stats.tau, 3),
        "verified_per_round": round(sum(stats.drafted_per_round) / max(len(stats.committed_per_draft_round), 1), 2),
        "new_tokens": stats.new_tokens,
        "tokens_per_second": round(stats.new_tokens / seconds, 2),
    }
    if drafter.prompt_lookup:
        result["lookup_rounds"] = stats.lookup_rounds
    if args.compare:
        plain, plain_seconds = timed_generate(target, input_ids, **gen)
        plain_tps = (plain.shape[1] - input_ids.shape[1]) / plain_seconds
        result["plain_tokens_per_second"] = round(plain_tps, 2)
        result["speedup"] = round(result["tokens_per_second"] / plain_tps, 3)
        if not gen["do_sample"]:
            result["identical_to_plain"] = bool(torch.equal(out, plain))
    print("\n" + " | ".join(f"{k}: {v}" for k, v in result.items()), file=sys.stderr)
    rounds = [f"{d}/{a}" for w, d, a in zip(stats.widths_per_round, stats.drafted_per_round, stats.accepted_per_round) if w > 1]
    print(f"rounds (drafts verified/accepted): {' '.join(rounds)}", file=sys.stderr)
    if args.json:
        result["verified_and_accepted_per_round"] = [
            [d, a] for d, a in zip(stats.drafted_per_round, stats.accepted_per_round, strict=True)
        ]
        print(json.dumps(result))
    return 0 if result.get("identical_to_plain", True) else 1


CONTROLLERS = ("adaptive", "fixed", "heuristic", "ema", "entropy")


def _controller(name: str, drafter: BlockDiffusionDrafter, block_size: int | None) -> DraftController:
    """The `--controller` of a command: `block_size` (if given) replaces the drafter's policy as the width."""
    from .controllers import AcceptanceEMA, AdaptiveVerify, EntropyStop, HeuristicSchedule, PolicyBlockSize

    policy = drafter.policy if block_size is None else None
    width = block_size or drafter.block_size
    if name == "adaptive":
        return AdaptiveVerify(width, policy=policy)
    if name == "fixed":
        return PolicyBlockSize(policy) if policy is not None else DraftController(width)
    return {"heuristic": HeuristicSchedule, "ema": AcceptanceEMA, "entropy": EntropyStop}[name](max_block_size=width)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from .datasets import chat_training_prompts, read_prompt_file, stdlib_training_prompts
    from .defaults import resolve_target
    from .training.drafter import DrafterTrainingConfig, train_drafter

    target, tokenizer = resolve_target(args.target, dtype="float32", device=args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = stdlib_training_prompts(args.num_prompts, seed=args.seed) + chat_training_prompts(
        args.chat_prompts, seed=args.seed
    )
    for path in args.prompts_file or []:
        prompts += read_prompt_file(path)
    config = DrafterTrainingConfig(
        block_size=args.block_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        anchors_per_sequence=args.anchors,
        sequences_per_step=args.sequences_per_step,
        max_minutes=args.max_minutes,
        warmup_steps=args.warmup_steps,
        validation_fraction=args.validation_fraction,
        seed=args.seed,
        decoding_anchor_fraction=args.decoding_anchors,
    )
    drafter = train_drafter(
        target,
        tokenizer,
        args.output_dir,
        prompts or None,
        num_layers=args.num_layers,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        draft_vocab_size=args.draft_vocab_size or None,
        generation_batch_size=args.generation_batch_size,
        max_new_tokens=args.max_new_tokens,
        config=config,
        refresh_draft_vocab=args.refresh_draft_vocab,
        cache_hidden_states_on_disk=not args.no_hidden_cache,
        init_drafter=args.init_drafter,
    )
    if args.save_to:
        drafter.save_pretrained(args.save_to)
    return 0


def cmd_eval_drafter(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .datasets import load_prompts
    from .evaluation import measure_tau

    target, tokenizer, drafter = _load(args)
    reports = []
    for name in args.datasets:
        report = measure_tau(
            target, tokenizer, drafter, load_prompts(name, args.limit), args.block_sizes, args.max_new_tokens
        )
        reports.append(asdict(report))
        cells = " | ".join(f"b={b}: τ={report.tau[b]:.2f}" for b in report.block_sizes)
        print(f"{name} ({report.prompts} prompts): {cells} | mismatches: {sum(report.mismatches.values())}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(reports, f, indent=2)
    if args.card:
        from pathlib import Path

        from .cards import drafter_model_card
        from .evaluation import TauReport

        card = drafter_model_card(
            drafter,
            name=args.card_name or Path(args.drafter or "drafter").name,
            target_name=args.card_target_name or getattr(target.config, "_name_or_path", ""),
            reports=[TauReport(**r) for r in reports],
            recipe=Path(args.card_recipe).read_text() if args.card_recipe else "",
            train_command=args.card_train_command or "",
            eval_command=(
                f"hf-blockpilot eval-drafter --datasets {' '.join(args.datasets)} --block-sizes "
                f"{' '.join(map(str, args.block_sizes))} --max-new-tokens {args.max_new_tokens}"
                + (f" --limit {args.limit}" if args.limit else "")
                + (" --prompt-lookup" if args.prompt_lookup else "")
            ),
        )
        card.save(args.card)
    return 0 if all(sum(r["mismatches"].values()) == 0 for r in reports) else 1


def _shard(args: argparse.Namespace) -> tuple[int, int]:
    """(shard, num_shards): from `accelerate launch` / torchrun (RANK, WORLD_SIZE) when set, else the flags."""
    import os

    return int(os.environ.get("RANK", args.shard)), int(os.environ.get("WORLD_SIZE", args.num_shards))


_FRESH_PROMPT_POOL = 12_000  # candidates drawn per generator before a drafter's training prompts are left out


def cmd_collect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .datasets import chat_training_prompts, load_prompts, stdlib_training_prompts
    from .training.data import unseen_prompts
    from .training.oracle import collect_oracle_labels
    from .training.policy_training import measure_cost_model

    if args.adaptive and not args.cost_model:
        raise ValueError("--adaptive weighs each round's verify budget by the measured cost model: drop --no-cost-model")
    target, tokenizer, drafter = _load(args)
    prompts = []
    for name in args.dataset:  # --num-prompts of each
        if name in ("stdlib", "chat"):  # fresh prompts: a drafter's τ on its own training data is inflated
            make = stdlib_training_prompts if name == "stdlib" else chat_training_prompts
            pool = make(max(args.num_prompts, _FRESH_PROMPT_POOL) if args.exclude_responses else args.num_prompts,
                        seed=args.seed)
            prompts += unseen_prompts(pool, tokenizer, args.exclude_responses, args.num_prompts)
        else:
            prompts += load_prompts(name, args.num_prompts)
    shard, num_shards = _shard(args)
    cost_path = Path(args.output_dir) / "cost_model.json"
    if shard == 0 and args.cost_model and not cost_path.exists():
        cost_path.parent.mkdir(parents=True, exist_ok=True)
        measure_cost_model(target, drafter, args.candidates).save(cost_path)
    if args.verify and shard == 0:
        from .training.oracle import check_replay_against_decoding

        check = check_replay_against_decoding(
            target, tokenizer, drafter, prompts[: args.verify], args.candidates, args.max_new_tokens
        )
        (Path(args.output_dir) / "replay_check.json").write_text(json.dumps(check, indent=2))
        print(f"replay == real decoding for {check['equal']}/{check['checked']} (prompt, b) pairs; "
              f"replay {check['speedup']:.1f}x faster than decoding once per b")
        if check["equal"] != check["checked"]:
            return 1
    from .costs import CostModel

    cost = CostModel.load(cost_path) if cost_path.exists() else None
    acceptance = _acceptance_model(args.acceptance_model) if args.acceptance_model else None
    path = collect_oracle_labels(
        target, tokenizer, drafter, prompts, args.output_dir, args.candidates, args.feature_layers,
        args.max_new_tokens, shard=shard, num_shards=num_shards, temperatures=args.temperatures, cost=cost,
        acceptance=acceptance, adaptive=args.adaptive,
    )
    print(f"labels written to {path}")
    return 0


def _acceptance_model(source: str) -> AcceptanceModel:
    """An acceptance model from a JSON file (`acceptance_model.json`) or a policy directory that carries one."""
    from pathlib import Path

    from .controllers import AcceptanceModel

    path = Path(source)
    if path.is_dir():
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        if not config.get("acceptance_model"):
            raise ValueError(f"{source} holds no acceptance model (a policy trained on labels with recorded rounds does)")
        return AcceptanceModel.from_dict(config["acceptance_model"])
    if not path.is_file():
        raise FileNotFoundError(f"no acceptance model at {source}: pass an acceptance_model.json or a policy directory")
    return AcceptanceModel.from_dict(json.loads(path.read_text()))


def cmd_train_policy(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from .training.oracle import read_oracle_labels
    from .training.policy_training import CostModel, PolicyTrainingConfig, train_policy

    labels = Path(args.labels)
    if not (labels / "manifest.json").is_file():
        raise FileNotFoundError(f"no labels in {labels} (no manifest.json): collect them first with "
                                f"`hf-blockpilot collect --output-dir {labels}`")
    manifest = json.loads((labels / "manifest.json").read_text())
    target, _, drafter = _load(args)
    records = read_oracle_labels(labels)
    cost_path = Path(args.cost_model) if args.cost_model else labels / "cost_model.json"
    if args.cost_model and not cost_path.is_file():
        raise SystemExit(f"no cost model at {cost_path}: measure one with `hf-blockpilot measure-cost --output {cost_path}`")
    cost = CostModel.load(cost_path) if cost_path.exists() else None
    missing_costs = sorted(set(args.candidates or manifest["candidates"]) - set(cost.target_ms)) if cost else []
    if missing_costs:
        raise SystemExit(f"the cost model {cost_path} has no latency for block sizes {missing_costs}; measure them "
                         "with `hf-blockpilot measure-cost --candidates ...` or pass --candidates without them")
    config = PolicyTrainingConfig(loss=args.loss, objective=args.objective, seed=args.seed)
    candidates = args.candidates or manifest["candidates"]
    missing = sorted(set(candidates) - set(manifest["candidates"]))
    if missing:
        raise SystemExit(f"block sizes {missing} were not collected in {labels} (collected: {manifest['candidates']})")
    acceptance = _acceptance_model(args.acceptance_model) if args.acceptance_model else None
    policy, report = train_policy(
        records, candidates, manifest["feature_layers"], target, drafter, config, cost,
        prompt_lookup=manifest.get("prompt_lookup", False), acceptance=acceptance,
    )
    policy.save_pretrained(args.output)
    if policy.acceptance_model is not None:
        (Path(args.output) / "acceptance_model.json").write_text(json.dumps(policy.acceptance_model.to_dict(), indent=2))
    policy.generate_model_card().save(Path(args.output) / "README.md")  # save_pretrained keeps an existing card
    (Path(args.output) / "training_report.json").write_text(json.dumps(asdict(report), indent=2))
    print(json.dumps(asdict(report), indent=2))
    if cost is not None:
        from .training.policy_training import compare_objectives

        comparison = compare_objectives(records, candidates, cost)
        (Path(args.output) / "objectives.json").write_text(json.dumps(comparison, indent=2))
        for name, row in comparison.items():
            print(f"labels by {name}: best fixed b={row['best_fixed_b']}, oracle {row['oracle_tokens_per_second']:.1f} "
                  f"modeled tok/s (fixed {row['best_fixed_tokens_per_second']:.1f}), oracle b counts {row['oracle_counts']}")
    return 0


def cmd_measure_cost(args: argparse.Namespace) -> int:
    from .training.policy_training import measure_cost_model

    target, _, drafter = _load(args)
    sizes = sorted(set(args.candidates) | {1})  # b = 1 (a plain step) is the reference
    cost = measure_cost_model(target, drafter, sizes, args.context_tokens, args.repeats)
    cost.save(args.output)
    plain = cost.round_ms(1)
    for b in sizes:
        print(f"b={b}: round {cost.round_ms(b):.2f} ms = {cost.round_ms(b) / plain:.2f} plain steps "
              f"(at T>0: {cost.round_ms(b, 1.0):.2f} ms)")
    print(f"cost model written to {args.output}")
    return 0


def cmd_evaluate_policy(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .datasets import load_prompts
    from .defaults import resolve_policy
    from .evaluation import decode_methods, summarize_methods

    target, tokenizer, drafter = _load(args)
    policy = resolve_policy(args.policy, device=target.device, prompt_lookup=drafter.prompt_lookup)
    if policy is None:
        raise ValueError(f"--policy {args.policy!r} gives no policy; pass a policy Hub id or directory")
    block_sizes = args.block_sizes or [b for b in policy.candidates if b > 1]
    output = {}
    for name in args.datasets:
        results = decode_methods(
            target, tokenizer, drafter, load_prompts(name, args.limit), block_sizes, policy,
            args.max_new_tokens, args.repeats,
        )
        summary = summarize_methods(results)
        output[name] = {"summary": summary, "results": [asdict(r) for r in results]}
        print(f"\n{name}\n| method | tokens/s | speedup | τ | mismatches |\n|---|---|---|---|---|")
        for method, row in summary.items():
            print(f"| {method} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f} | {row['tau']:.2f} | {row['mismatches']} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(output, f, indent=2)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_benchmark

    from .controllers import AdaptiveVerify, baseline_controllers

    target, tokenizer, drafter = _load(args)
    policy = drafter.policy
    block_sizes = args.block_sizes or ([b for b in policy.candidates if b > 1] if policy else [4, 8, 16])
    controllers = {}
    if not args.no_baselines:
        controllers = {k: v for k, v in baseline_controllers([], args.max_block_size).items()}
        controllers["adaptive"] = AdaptiveVerify(args.max_block_size)
        if policy is not None:
            controllers["adaptive+policy"] = AdaptiveVerify(policy=policy)
    report = run_benchmark(
        target, tokenizer, drafter, args.datasets, block_sizes, policy, args.temperatures, args.limit,
        args.max_new_tokens, args.repeats, args.output_dir, controllers,
    )
    from .bench import markdown_report

    print(markdown_report(report))
    mismatches = sum(row["mismatches"] for run in report["runs"] if run["temperature"] == 0 for row in run["summary"].values())
    return 0 if mismatches == 0 else 1


def cmd_env(args: argparse.Namespace) -> int:
    from .environment import environment_report

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else "\n".join(f"- {k}: {v}" for k, v in report.items()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import build_demo

    target, tokenizer, drafter = _load(args)
    controller = _controller(args.controller, drafter, None)
    build_demo(target, tokenizer, drafter, controller).launch(
        server_name=args.host, server_port=args.port, share=args.share
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockpilot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="answer a prompt with block-diffusion speculative decoding")
    p.add_argument("prompt")
    _add_model_args(p)
    _add_lookup_arg(p)
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--block-size", type=_block_size, default=None,
                   help="drafting width (turns the policy off); with --controller fixed, every draft is verified")
    p.add_argument("--controller", choices=CONTROLLERS, default="adaptive",
                   help="adaptive: verify the drafts worth it each round (default); fixed: every draft; "
                        "heuristic / ema / entropy: the baselines of `bench`")
    _add_optional_policy_arg(p)
    p.add_argument("--compare", action="store_true", help="also run plain generate: speedup and identical output")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON on stdout")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (resumable)")
    p.add_argument("--target", default=None)
    p.add_argument("--device", type=_device, default="cpu")
    p.add_argument("--output-dir", required=True, help="run directory: data, hidden-state cache, checkpoint")
    p.add_argument("--num-prompts", type=int, default=4000, help="stdlib (code) prompts answered by the target")
    p.add_argument("--chat-prompts", type=int, default=2000, help="general chat prompts answered by the target")
    p.add_argument("--prompts-file", nargs="+", default=None,
                   help="more prompts for the target to answer: JSON lines with \"prompt\" and an optional unique \"id\"")
    p.add_argument("--generation-batch-size", type=_positive_int, default=64, help="prompts answered per target generate call")
    p.add_argument("--max-new-tokens", type=_positive_int, default=192)
    p.add_argument("--num-layers", type=_positive_int, default=1)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="context layers (default: DFlash spread)")
    p.add_argument("--mask-token-id", type=int, default=None, help="id for draft slots (default: last embedding row)")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="0: full vocabulary")
    p.add_argument("--refresh-draft-vocab", action="store_true",
                   help="when resuming, rebuild the reduced vocabulary from the current data (e.g. after adding chat prompts)")
    p.add_argument("--max-steps", type=_positive_int, default=2000)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--anchors", type=_positive_int, default=32)
    p.add_argument("--decoding-anchors", type=_fraction, default=0.0, metavar="FRACTION",
                   help="share of anchors where greedy decoding with the current drafter starts its rounds "
                        "(replayed each step over a window of twice as many positions: one more drafter forward per sequence)")
    p.add_argument("--sequences-per-step", type=_positive_int, default=4, help="sequences per optimizer step (one forward)")
    p.add_argument("--no-hidden-cache", action="store_true",
                   help="compute target hidden states in every step instead of caching them on disk (pays on a GPU)")
    p.add_argument("--validation-fraction", type=float, default=0.02, help="sequences held out to track τ")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-to", default=None, help="also save the final drafter here")
    p.add_argument("--init-drafter", default=None,
                   help="start a new run from this drafter (Hub id or directory): fine-tuning with a fresh optimizer")
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser("eval-drafter", help="τ by real greedy decoding on held-out prompt sets")
    _add_model_args(p)
    _add_lookup_arg(p)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--block-sizes", nargs="+", type=_positive_int, action=_SortedDistinct, default=[4, 8, 16])
    p.add_argument("--limit", type=_positive_int, default=None)
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--output", default=None, help="write the reports as JSON")
    p.add_argument("--card", default=None, help="write a model card (README.md) with the measured τ here")
    p.add_argument("--card-name", default=None)
    p.add_argument("--card-target-name", default=None, help="Hub id of the target named on the card")
    p.add_argument("--card-recipe", default=None, help="markdown file describing the training recipe and data")
    p.add_argument("--card-train-command", default=None)
    p.set_defaults(func=cmd_eval_drafter)

    p = sub.add_parser("collect", help="oracle block-size labels by drafter replay (resumable, shardable)")
    _add_model_args(p)
    _add_lookup_arg(p)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--dataset", nargs="+", default=["stdlib"],
                   help="stdlib / chat (training-prompt generators) and/or evaluation set names")
    p.add_argument("--num-prompts", type=_positive_int, default=200, help="prompts per dataset")
    p.add_argument("--exclude-responses", default=None,
                   help="a drafter's responses.jsonl: its prompts are left out of stdlib/chat")
    p.add_argument("--candidates", type=_positive_int, nargs="+", action=_SortedDistinct, default=[1, 4, 8, 12, 16, 20])
    p.add_argument("--feature-layers", type=int, nargs="+", default=None,
                   help="target layers the policy reads (default: the middle and second-to-last: 14 28 on a 30-layer target)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperatures", type=_non_negative_float, nargs="+", default=[0.0, 1.0],
                   help="label each prompt at these sampling temperatures (0 = greedy; T>0: expected acceptance)")
    p.add_argument("--no-cost-model", dest="cost_model", action="store_false", help="skip timing the cost model")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="first check replay == real decoding on N prompts (and time both)")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=_positive_int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--adaptive", action="store_true",
                   help="label decoding under the per-round controller (AdaptiveVerify): the best drafting width "
                        "*with* it; needs the cost model")
    p.add_argument("--acceptance-model", default=None,
                   help="with --adaptive: the controller's acceptance model (acceptance_model.json or a policy "
                        "directory from a first `train-policy`); default: the training-free entropy bound")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("train-policy", help="train a BlockPilot policy on collected labels")
    _add_model_args(p)
    p.add_argument("--labels", required=True, help="a `collect` output directory")
    p.add_argument("--output", required=True, help="directory for the policy checkpoint")
    p.add_argument("--candidates", type=_positive_int, nargs="+", action=_SortedDistinct, default=None, help="a subset of the collected block sizes")
    p.add_argument("--loss", choices=["regret", "ce"], default="regret")
    p.add_argument("--objective", choices=["throughput", "acceptance"], default="throughput")
    p.add_argument("--cost-model", default=None,
                   help="a cost_model.json measured on the device you serve on (`hf-blockpilot measure-cost`); "
                        "default: the one `collect` measured in --labels")
    p.add_argument("--acceptance-model", default=None,
                   help="store this acceptance model (acceptance_model.json or a policy directory) in the policy; "
                        "default: fitted on the rounds recorded in --labels")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_policy)

    p = sub.add_parser("measure-cost", help="time verify rounds per block size on this device (a policy's cost model)")
    _add_model_args(p)
    p.add_argument("--output", required=True, help="where to write cost_model.json")
    p.add_argument("--candidates", type=_positive_int, nargs="+", action=_SortedDistinct, default=[1, 2, 4, 8, 12, 16, 20])
    p.add_argument("--context-tokens", type=_positive_int, default=256)
    p.add_argument("--repeats", type=_positive_int, default=20, help="timed calls per block size (median; raise on noisy hosts)")
    p.set_defaults(func=cmd_measure_cost)

    p = sub.add_parser("evaluate-policy", help="real decoding with the policy vs each fixed b and the oracle")
    _add_model_args(p)
    _add_lookup_arg(p)
    p.add_argument("--policy", required=True,
                   help="policy Hub id or directory; 'default': the embedded one (embedded pair only)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--block-sizes", type=_positive_int, nargs="+", action=_SortedDistinct, default=None, help="default: the policy's candidates")
    p.add_argument("--limit", type=_positive_int, default=None)
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--repeats", type=_positive_int, default=1)
    p.add_argument("--output", default=None)
    p.set_defaults(func=cmd_evaluate_policy)

    p = sub.add_parser("bench", help="plain vs fixed block sizes vs BlockPilot vs oracle: JSON, tables, plots")
    _add_model_args(p)
    _add_lookup_arg(p)
    _add_optional_policy_arg(p)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k"])
    p.add_argument("--block-sizes", type=_positive_int, nargs="+", action=_SortedDistinct, default=None)
    p.add_argument("--temperatures", type=_non_negative_float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--limit", type=_positive_int, default=None)
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--repeats", type=_positive_int, default=3)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--max-block-size", type=_block_size, default=16,
                   help="drafting width of the per-round controllers (adaptive, heuristic, ema, entropy)")
    p.add_argument("--no-baselines", action="store_true",
                   help="only plain, fixed block sizes and the policy (no per-round controllers)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="Gradio demo: plain vs BlockPilot side by side, rounds highlighted")
    _add_model_args(p)
    _add_lookup_arg(p)
    _add_optional_policy_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="Gradio share link")
    p.add_argument("--controller", choices=CONTROLLERS, default="adaptive",
                   help="how the BlockPilot side drafts and verifies (default: adaptive, under the policy)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("env", help="versions, devices and embedded assets (paste into bug reports)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    package_logger = logging.getLogger("hf_blockpilot")
    if not package_logger.handlers:  # the library's own messages (not Transformers') on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"hf-blockpilot {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, ModuleNotFoundError) as error:  # bad input, missing files or packages
        if os.environ.get("HF_BLOCKPILOT_DEBUG"):
            raise
        print(f"hf-blockpilot {args.command}: error: {error}\n(set HF_BLOCKPILOT_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
