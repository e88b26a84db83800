"""Probes of the installed Transformers and torch: what differs between the releases we support."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

# Transformers 5.23 keeps `output_hidden_states=[indices]` at their usual positions (None elsewhere); 5.17
# drops the embeddings entry and shifts the rest, so it is only used where this helper exists.
try:
    from transformers.utils.output_capturing import resolve_hidden_states_indices  # noqa: F401

    SELECTION_KEEPS_POSITIONS = True
except ImportError:
    SELECTION_KEEPS_POSITIONS = False


def runs_bf16_natively(device: torch.device | str) -> bool:
    """Whether bfloat16 matrix products of many rows run natively (faster than float32) on `device`: CUDA GPUs
    with bf16 support, CPUs with AMX or AVX-512 BF16. Elsewhere, e.g. on AVX2-only CPUs, they are emulated and
    much slower (docs/design-measurements.md), so training keeps float32 there. Decoding is timed instead
    (`decode_dtypes`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":  # private but long-standing probes; absent ones count as "no"
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return False


def decode_dtypes(device: torch.device | str) -> list[torch.dtype]:
    """The dtypes decoding may be fastest in on `device`, to be timed, not assumed: float32 and bfloat16 on every
    CPU (a one-token step reads each weight once, so half-size weights can pay even where bfloat16 products are
    emulated: on an AVX2-only Zen 3 plain bfloat16 decoded 1.2-1.5x faster than float32), float32 and bfloat16 (float16
    without bf16 support) on CUDA, float32 elsewhere."""
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.float32, torch.bfloat16]
    if device.type == "cuda":
        return [torch.float32, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16]
    return [torch.float32]


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes a KV cache: `cache` from Transformers 5.24 (where
    `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def tensor_version(tensor: torch.Tensor) -> tuple | None:
    """What identifies a tensor's current contents, for caches of values derived from it: its storage, dtype,
    device and in-place version counter. `None` for inference-mode tensors, which keep no counter."""
    try:
        return tensor.data_ptr(), tensor._version, tensor.dtype, tensor.device
    except RuntimeError:
        return None
