"""What the `hf-blockpilot` commands share: argument types, the common flags, loading the models, building
the draft controller."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..controllers import AcceptanceModel, DraftController
    from ..costs import CostModel
    from ..modeling_block_diffusion import BlockDiffusionDrafter


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def block_size_arg(text: str) -> int:
    from ..controllers import check_block_size

    try:
        return check_block_size(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def prompt_text(text: str) -> str:
    """A prompt argument: text that encodes as UTF-8 (bytes that do not decode arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("the prompt is not valid UTF-8 text; pass it as UTF-8") from None
    return text


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def max_slowdown_arg(text: str) -> float:
    from ..controllers import check_max_slowdown

    try:
        return check_max_slowdown(float(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class SortedDistinct(argparse.Action):
    """For lists of block sizes: sorted, each once."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, sorted(set(values)))


def device_arg(text: str) -> str:
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


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=None, help="target Hub id or directory (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--drafter", default=None, help="drafter Hub id or directory (default: the embedded drafter)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16, float16, or auto (default): the dtype this machine's calibration expects to decode "
        "fastest in among float32 and bfloat16 (float16 on GPUs without bf16), of those whose verifies it probed "
        "exact",
    )
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")


def add_lookup_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="rounds whose last tokens occurred earlier draft their continuation (lossless)",
    )


def add_optional_policy_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        dest="use_policy",
        default="default",
        help="BlockPilot policy Hub id or directory; 'default': the embedded one (embedded pair only); 'none'",
    )


def load_models(
    args: argparse.Namespace, choose_dtype: bool = True, prompts: Sequence[str] = ()
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, BlockDiffusionDrafter]:
    """Target, tokenizer and drafter (with its policy, where the command has --policy) from the common flags;
    `--dtype auto` in the dtype expected to answer the command's `prompts` fastest (their median chat length and
    median acceptance as the policy predicts it at the command's first temperature, `request_acceptance`, and
    `--max-new-tokens`, see `preferred_dtype`), or float32 without `choose_dtype` (the caller decides later, e.g.
    per batch size)."""
    from ..data import chat_inputs
    from ..device_calibration import preferred_dtype, request_acceptance
    from ..tools.loading import (
        checked_source,
        resolve_drafter,
        resolve_policy,
        resolve_target,
    )

    # a mistyped directory fails before any model is loaded
    policy_source = getattr(args, "use_policy", None) or getattr(args, "policy", None)
    for what, source in (("target", args.target), ("drafter", args.drafter), ("policy", policy_source)):
        if source is not None and source not in ("default", "none"):
            checked_source(source, what)
    auto = args.dtype == "auto"  # decided below, by this machine's calibration
    target, tokenizer = resolve_target(args.target, dtype="float32" if auto else args.dtype, device=args.device)
    drafter = resolve_drafter(args.drafter, dtype="float32" if auto else args.dtype, device=args.device)
    drafter.prompt_lookup = getattr(args, "prompt_lookup", False)
    if getattr(args, "use_policy", None) is not None:
        # the embedded policy only belongs to the embedded pair
        default_pair = args.target is None and args.drafter is None
        choice = args.use_policy if args.use_policy != "default" or default_pair else None
        drafter.set_policy(resolve_policy(choice, device=args.device, prompt_lookup=drafter.prompt_lookup))
    if auto and choose_dtype:
        request: dict[str, Any] = {"new_tokens": args.max_new_tokens} if hasattr(args, "max_new_tokens") else {}
        first = (getattr(args, "temperatures", None) or [0.0])[0]
        request["temperature"] = args.temperature if hasattr(args, "temperature") else first
        if prompts:
            inputs = [chat_inputs(tokenizer, prompt, target.device) for prompt in prompts]
            request["prompt_tokens"] = int(statistics.median(ids.shape[1] for ids in inputs))
            request["acceptance"] = statistics.median(
                request_acceptance(target, drafter, ids, request["temperature"]) for ids in inputs
            )
        chosen = preferred_dtype(target, drafter, **request)
        target.to(chosen)
        drafter.to(chosen)
    return target, tokenizer, drafter


CONTROLLERS = ("default", "adaptive", "fixed", "heuristic", "ema", "entropy")


def build_controller(
    name: str, drafter: BlockDiffusionDrafter, block_size: int | None, max_slowdown: float | None = None
) -> DraftController:
    """The `--controller` of a command: `default` is what `generate` runs with no controller
    (`default_controller`); `block_size` (if given) replaces the drafter's policy as the width; `max_slowdown`
    bounds the default's loss per request (`SpeculationGuard`; other controllers have no guard)."""
    from ..controllers import AdaptiveVerify, DraftController, PolicyBlockSize, SpeculationGuard, default_controller
    from ..tools.baselines import AcceptanceEMA, EntropyStop, HeuristicSchedule

    policy = drafter.policy if block_size is None else None
    width = block_size or drafter.block_size
    if name == "default":
        if block_size is None:
            return default_controller(drafter, max_slowdown)
        return SpeculationGuard(DraftController(width), max_slowdown=max_slowdown)
    if name == "adaptive":
        return AdaptiveVerify(width, policy=policy)
    if name == "fixed":
        return PolicyBlockSize(policy) if policy is not None else DraftController(width)
    return {"heuristic": HeuristicSchedule, "ema": AcceptanceEMA, "entropy": EntropyStop}[name](max_block_size=width)


def load_acceptance_model(source: str) -> AcceptanceModel:
    """An acceptance model from a JSON file (`acceptance_model.json`) or a policy directory that carries one."""
    from pathlib import Path

    from ..controllers import AcceptanceModel

    path = Path(source)
    if path.is_dir():
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        if not config.get("acceptance_model"):
            raise ValueError(
                f"{source} holds no acceptance model (a policy trained on labels with recorded rounds does)"
            )
        return AcceptanceModel.from_dict(config["acceptance_model"])
    if not path.is_file():
        raise FileNotFoundError(f"no acceptance model at {source}: pass an acceptance_model.json or a policy directory")
    return AcceptanceModel.from_dict(json.loads(path.read_text()))


def load_cost_model(source: str | os.PathLike[str]) -> CostModel:
    """A cost model from its JSON file, or a FileNotFoundError saying how to measure one."""
    from pathlib import Path

    from ..costs import CostModel

    if not Path(source).is_file():
        raise FileNotFoundError(
            f"no cost model at {source}: measure one with `hf-blockpilot measure-cost --output {source}`"
        )
    return CostModel.load(source)


def shard_of(args: argparse.Namespace) -> tuple[int, int]:
    """(shard, num_shards): from `accelerate launch` / torchrun (RANK, WORLD_SIZE) when set, else the flags."""
    return int(os.environ.get("RANK", args.shard)), int(os.environ.get("WORLD_SIZE", args.num_shards))
