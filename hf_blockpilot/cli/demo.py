"""`hf-blockpilot` commands: the Gradio demo."""

from __future__ import annotations

import argparse

from ._common import (
    CONTROLLERS,
    add_lookup_arg,
    add_model_args,
    add_optional_policy_arg,
    build_controller,
    load_models,
)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools.demo import build_demo

    target, tokenizer, drafter = load_models(args)
    controller = build_controller(args.controller, drafter, None)
    build_demo(target, tokenizer, drafter, controller).launch(
        server_name=args.host, server_port=args.port, share=args.share
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands."""
    p = sub.add_parser("demo", help="Gradio demo: plain vs BlockPilot side by side, rounds highlighted")
    add_model_args(p)
    add_lookup_arg(p)
    add_optional_policy_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="Gradio share link")
    p.add_argument(
        "--controller",
        choices=CONTROLLERS,
        default="default",
        help="how the BlockPilot side drafts and verifies (default: what generate() runs by default)",
    )
    p.set_defaults(func=cmd_demo)
