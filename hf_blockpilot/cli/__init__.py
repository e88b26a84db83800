"""`hf-blockpilot` command line (thin: each subcommand calls the library)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import bench, demo, drafter, env, generate, policy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockpilot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, drafter, policy, bench, demo, env):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.environ.get("HF_BLOCKPILOT_VERBOSE"):  # quiet by default: no weight-loading bars from the libraries
        import huggingface_hub.utils
        import transformers

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
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
        return _fail(args.command, "error", error, BAD_INPUT)
    except RuntimeError as error:  # the work itself failed (a model, a device, a kernel)
        return _fail(args.command, "failed", error, RUNTIME_FAILURE)


#: Exit statuses: bad input (a value, a path, a missing package) and a failure of the work itself. A command
#: whose checks fail (greedy output differing from plain decoding) also exits with RUNTIME_FAILURE.
BAD_INPUT, RUNTIME_FAILURE = 2, 1


def _fail(command: str, kind: str, error: BaseException, status: int) -> int:
    """One line on stderr naming the command and the error (the traceback with HF_BLOCKPILOT_DEBUG=1)."""
    if os.environ.get("HF_BLOCKPILOT_DEBUG"):
        raise error
    message = " ".join(str(error).split())
    print(f"hf-blockpilot {command}: {kind}: {message}\n(set HF_BLOCKPILOT_DEBUG=1 for the traceback)", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
