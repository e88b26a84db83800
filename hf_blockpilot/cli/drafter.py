"""`hf-blockpilot` commands: train a DFlash drafter, and measure one by real decoding."""

from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

import torch

from ..configuration_block_diffusion import DFLASH2_DEFAULT_SIZES
from ._common import (
    SortedDistinct,
    add_lookup_arg,
    add_model_args,
    block_size_arg,
    device_arg,
    fraction,
    load_models,
    positive_int,
)


def cmd_prepare_hidden_states(args: argparse.Namespace) -> int:
    from ..configuration_block_diffusion import BlockDiffusionConfig
    from ..tools.loading import resolve_target
    from ..training.data import cache_hidden_states, read_sequences
    from ..training.distributed import init_from_torchrun

    init_from_torchrun()  # under torchrun every rank computes its share
    layer_ids = args.target_layer_ids
    if layer_ids is None and args.drafter is None:
        raise ValueError("give --target-layer-ids, or --drafter to read them from its config")
    if layer_ids is None:
        layer_ids = BlockDiffusionConfig.from_pretrained(args.drafter).dflash_config["target_layer_ids"]
    target, _ = resolve_target(args.target, dtype="float32", device=args.device)
    run = Path(args.output_dir)
    cache = cache_hidden_states(
        target, read_sequences(run / "data"), layer_ids, run / "hidden", getattr(torch, args.dtype)
    )
    print(cache)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from ..data import chat_training_prompts, read_prompt_file, stdlib_training_prompts
    from ..tools.loading import resolve_target
    from ..training.distributed import init_from_torchrun, rank_and_world_size
    from ..training.drafter import DrafterTrainingConfig, train_drafter

    if args.self_distill and not args.conversations:
        raise SystemExit("--self-distill answers the turns of --conversations files: give them too")
    init_from_torchrun()  # under torchrun: one rank of several (DDP), else a single process
    target, tokenizer = resolve_target(args.target, dtype="float32", device=args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..training.data import conversation_prompts, read_conversations, write_conversations

    sources = [
        stdlib_training_prompts(args.num_prompts, seed=args.seed),
        chat_training_prompts(args.chat_prompts, seed=args.seed),
        *(read_prompt_file(path) for path in args.prompts_file or []),
    ]
    if args.self_distill:  # the target answers every user turn of the conversations, read as they are answered
        sources += [conversation_prompts(path) for path in args.conversations]
    elif args.conversations and rank_and_world_size()[0] == 0:  # the others wait for the data in train_drafter
        sequences = chain.from_iterable(read_conversations(path, tokenizer) for path in args.conversations)
        write_conversations(sequences, Path(args.output_dir) / "data")
    # conversations are read as they are answered; the other prompts are listed (the progress bar's total)
    prompts = chain.from_iterable(sources) if args.self_distill else [p for source in sources for p in source]
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
        save_every_minutes=args.save_every_minutes,
        fsdp=args.fsdp,
    )
    drafter = train_drafter(
        target,
        tokenizer,
        args.output_dir,
        prompts or None,
        num_layers=args.num_layers,
        target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id,
        draft_vocab_size=_draft_vocab_size(args),
        generation_batch_size=args.generation_batch_size,
        max_new_tokens=args.max_new_tokens,
        config=config,
        refresh_draft_vocab=args.refresh_draft_vocab,
        cache_hidden_states_on_disk=not args.no_hidden_cache,
        init_drafter=args.init_drafter,
        generation_minutes=args.generation_minutes,
        dflash2=DFLASH2_DEFAULT_SIZES if args.dflash2 else None,
    )
    if args.save_to and rank_and_world_size()[0] == 0:
        drafter.save_pretrained(args.save_to)
    return 0


def _draft_vocab_size(args: argparse.Namespace) -> int | None:
    """`--draft-vocab-size`: 8192 ids by default (the full vocabulary for a DFlash 2 drafter); 0: full."""
    if args.draft_vocab_size is None:
        return None if args.dflash2 else 8192
    return args.draft_vocab_size or None


def cmd_eval_drafter(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..data import load_prompts
    from ..tools.evaluation import measure_tau, replay_tau

    if args.replay and (args.prompt_lookup or args.card):
        raise ValueError(
            "--replay measures the drafter alone, with no equality check: drop --prompt-lookup and --card (a card "
            "states figures of real decoding), or drop --replay"
        )
    target, tokenizer, drafter = load_models(args)
    reports = []
    for name in args.datasets:
        prompts = load_prompts(name, args.limit)
        if args.replay:
            responses = Path(args.responses_dir) / f"{name}-{args.max_new_tokens}" if args.responses_dir else None
            report = replay_tau(
                target,
                tokenizer,
                drafter,
                prompts,
                args.block_sizes,
                args.max_new_tokens,
                responses,
                args.generation_batch_size,
            )
        else:
            report = measure_tau(target, tokenizer, drafter, prompts, args.block_sizes, args.max_new_tokens)
        reports.append(asdict(report))
        cells = " | ".join(f"b={b}: τ={report.tau[b]:.2f}" for b in report.block_sizes)
        checked = f"mismatches: {sum(report.mismatches.values())}" if not args.replay else "by replay"
        print(f"{name} ({report.prompts} prompts): {cells} | {checked}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(reports, f, indent=2)
    if args.card:
        from ..tools.cards import drafter_model_card
        from ..tools.evaluation import TauReport

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


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands (training defaults come from `DrafterTrainingConfig`)."""
    from ..training.drafter import DrafterTrainingConfig

    config = DrafterTrainingConfig()
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (resumable)")
    p.add_argument("--target", default=None)
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--output-dir", required=True, help="run directory: data, hidden-state cache, checkpoint")
    p.add_argument("--num-prompts", type=int, default=4000, help="stdlib (code) prompts answered by the target")
    p.add_argument("--chat-prompts", type=int, default=2000, help="general chat prompts answered by the target")
    p.add_argument(
        "--prompts-file",
        nargs="+",
        default=None,
        help='more prompts for the target to answer: JSON lines with "prompt" and an optional unique "id"',
    )
    p.add_argument(
        "--conversations",
        nargs="+",
        default=None,
        help="ShareGPT / SpecForge-style JSONL files ({id, conversations: [{role, content}]}), trained on as they "
        "are: the loss falls on the assistant turns only (with --num-prompts 0 --chat-prompts 0: on them alone)",
    )
    p.add_argument(
        "--self-distill",
        action="store_true",
        help="with --conversations: the target answers each user turn after the conversation's earlier turns "
        "instead (resumable; under torchrun every rank answers its share), and trains on its own answers",
    )
    p.add_argument(
        "--generation-batch-size", type=positive_int, default=64, help="prompts answered per target generate call"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=192)
    p.add_argument(
        "--generation-minutes",
        type=float,
        default=None,
        help="stop answering new prompts after this long and train on what was answered (rerun to go on)",
    )
    p.add_argument("--num-layers", type=positive_int, default=1)
    p.add_argument(
        "--target-layer-ids", type=int, nargs="+", default=None, help="context layers (default: DFlash spread)"
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="id for draft slots (default: last embedding row)")
    p.add_argument("--warmup-steps", type=int, default=config.warmup_steps)
    p.add_argument("--block-size", type=positive_int, default=config.block_size)
    p.add_argument(
        "--draft-vocab-size", type=int, default=None, help="0: full vocabulary (default 8192; full with --dflash2)"
    )
    p.add_argument(
        "--dflash2",
        action="store_true",
        help="train a DFlash 2 drafter (convolutions around attention and MLP, a candidate selector; z-lab's "
        f"published sizes {DFLASH2_DEFAULT_SIZES}) instead of DFlash (v1)",
    )
    p.add_argument(
        "--refresh-draft-vocab",
        action="store_true",
        help="when resuming, rebuild the reduced vocabulary from the current data (e.g. after adding chat prompts)",
    )
    p.add_argument("--max-steps", type=positive_int, default=config.max_steps)
    p.add_argument("--max-minutes", type=float, default=config.max_minutes)
    p.add_argument(
        "--save-every-minutes",
        type=float,
        default=config.save_every_minutes,
        help="also checkpoint when this long passed since the last checkpoint",
    )
    p.add_argument("--learning-rate", type=float, default=config.learning_rate)
    p.add_argument("--anchors", type=positive_int, default=config.anchors_per_sequence)
    p.add_argument(
        "--decoding-anchors",
        type=fraction,
        default=config.decoding_anchor_fraction,
        metavar="FRACTION",
        help="share of anchors where greedy decoding with the current drafter starts its rounds "
        "(replayed each step over a window of twice as many positions: one more drafter forward per sequence)",
    )
    p.add_argument(
        "--sequences-per-step",
        type=positive_int,
        default=config.sequences_per_step,
        help="sequences per optimizer step (one forward)",
    )
    p.add_argument(
        "--no-hidden-cache",
        action="store_true",
        help="compute target hidden states in every step instead of caching them on disk (pays on a GPU)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the drafter (and, with --no-hidden-cache, the target's layers) with FSDP2 "
        "instead of replicating the drafter with DDP",
    )
    p.add_argument(
        "--validation-fraction", type=float, default=config.validation_fraction, help="sequences held out to track τ"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=config.seed)
    p.add_argument("--save-to", default=None, help="also save the final drafter here")
    p.add_argument(
        "--init-drafter",
        default=None,
        help="start a new run from this drafter (Hub id or directory): fine-tuning with a fresh optimizer",
    )
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser(
        "prepare-hidden-states",
        help="write the target's hidden states of a run's sequences to disk (offline; resumable; torchrun shards it)",
    )
    p.add_argument("--target", default=None)
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--output-dir", required=True, help="the run directory whose data/ holds the sequences")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="target layers the drafter reads")
    p.add_argument("--drafter", default=None, help="or read them from this drafter's config (Hub id or directory)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="as stored")
    p.set_defaults(func=cmd_prepare_hidden_states)

    p = sub.add_parser("eval-drafter", help="τ by real greedy decoding on held-out prompt sets")
    add_model_args(p)
    add_lookup_arg(p)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    p.add_argument("--block-sizes", nargs="+", type=block_size_arg, action=SortedDistinct, default=[4, 8, 16])
    p.add_argument("--limit", type=positive_int, default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument(
        "--replay",
        action="store_true",
        help="τ by replay along the target's own greedy answers (answered once, then every position drafted in "
        "batches): about 10x faster than decoding, equal to it up to rounding; no equality check",
    )
    p.add_argument("--responses-dir", default=None, help="with --replay: keep the target's answers here for reuse")
    p.add_argument(
        "--generation-batch-size",
        type=positive_int,
        default=1,
        help="with --replay: prompts per generate call (> 1 is faster; padded batches may differ at near-ties)",
    )
    p.add_argument("--output", default=None, help="write the reports as JSON")
    p.add_argument("--card", default=None, help="write a model card (README.md) with the measured τ here")
    p.add_argument("--card-name", default=None)
    p.add_argument("--card-target-name", default=None, help="Hub id of the target named on the card")
    p.add_argument("--card-recipe", default=None, help="markdown file describing the training recipe and data")
    p.add_argument("--card-train-command", default=None)
    p.set_defaults(func=cmd_eval_drafter)
