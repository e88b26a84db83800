"""`hf-blockpilot` commands: the environment report for bug reports."""

from __future__ import annotations

import argparse
import json


def cmd_env(args: argparse.Namespace) -> int:
    from ..tools.env_report import environment_report

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else "\n".join(f"- {k}: {v}" for k, v in report.items()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands."""
    p = sub.add_parser("env", help="versions, devices and embedded assets (paste into bug reports)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)
