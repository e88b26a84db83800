"""A CPU kernel for one-query attention (a decoding step's, or a verify slot's on the exact path) that gives the bits
of PyTorch's `F.scaled_dot_product_attention`, in bfloat16 and in float32, several times faster per call.

PyTorch's one-query SDPA call costs tens of µs of overhead besides its work, paid per layer for every decoding step
and, on the exact path, for every verify slot (on CPUs with native bfloat16 instructions, avx512_bf16: Zen 4 EPYC, its
bfloat16 work alone is about 0.55 µs a key). `kernels/one_query_attention.cpp` computes the same operations in the
same order without the per-call overheads, a verify's slots in one call: bfloat16 in the order of oneDNN's bfloat16
products, float32 in MKL's (an AMX Xeon's; the few keys its gemv leaves over through MKL itself). It is built only
where PyTorch runs AVX-512 kernels (`kernel_build.load_kernel`) and used for a dtype and head layout only where it
probes bit-equal to SDPA on this machine, at this thread count (`exact_parts`); everywhere else, or with
`HF_BLOCKPILOT_ATTENTION_KERNEL=0`, PyTorch's SDPA serves. docs/exactness.md has the measurements.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .kernel_build import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "one_query_attention.cpp"
#: Set to "0" to never build or use the kernel.
SWITCH = "HF_BLOCKPILOT_ATTENTION_KERNEL"
#: Its compile flags beyond `kernel_build.BASE_FLAGS`: ATen's AVX-512 vectors (their `fexp_u20` / `exp_u20` are what
#: SDPA uses), and OpenMP (its float32 calls into MKL run inside a parallel region, sequential, as SDPA's do).
FLAGS = ("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-fopenmp")
#: Most keys it attends over: PyTorch's CPU flash kernel takes keys in blocks of 512 and rescales across blocks,
#: which the kernel does not do.
MAX_KEYS = 512
#: Key counts probed on random inputs (every remainder of 4 and 16, the edges of the block).
PROBE_KEYS = (1, 2, 3, 5, 17, 30, 64, 101, 255, 256, 301, 511, 512)
#: Key counts probed on adversarial inputs (`adversarial_values`): which keys' products are summed together.
ADVERSARIAL_KEYS = (7, 22, 101, 300)
#: How many parts the kernel may split the keys' weighted values in (oneDNN splits them over two threads where SDPA's
#: bfloat16 work is a single item: batch x heads = 1); float32 takes MKL's own way either way.
PARTS = (1, 2)

#: `kernel(query (1, H, n, D), key, value (1, Hkv, L, D), scale, parts)` -> (1, H, n, D) (`one_query_calls`).
OneQueryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]
_exact_parts: dict[tuple, int | None] = {}


@functools.cache
def extension() -> Any | None:
    """The built `kernels/one_query_attention.cpp` module (`one_query_attention(q, k, v, scale, parts)`,
    `has_float32()`), cached per process; `None` where it is switched off, PyTorch does not run AVX-512 kernels here,
    or it cannot be built."""
    if os.environ.get(SWITCH, "1") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    return load_kernel(SOURCE, FLAGS)


def _built_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, parts: int
) -> torch.Tensor:
    return extension().one_query_attention(query, key, value, scale, parts)


def adversarial_values(
    keys: int, head_dim: int, generator: torch.Generator, limit: int | None = 8
) -> Iterator[torch.Tensor]:
    """(keys, head_dim) float32 value blocks (exact in bfloat16 too), at most `limit` (`None`: as many as every pair
    of keys takes), each column with +2^24 at one key, -2^24 at another and 1.0 at the next key after the first but
    the second (every pair in turn, or a random sample of pairs): with every key weighted alike (query 0) the 1
    survives only where the two large values are summed before it, so the output shows the summation order."""
    pairs = [(a, b) for a in range(keys) for b in range(keys) if a != b]
    if limit is not None and len(pairs) > limit * head_dim:
        chosen = torch.randperm(len(pairs), generator=generator)[: limit * head_dim].tolist()
        pairs = [pairs[i] for i in chosen]
    for start in range(0, len(pairs), head_dim):
        v = torch.zeros(keys, head_dim)
        for d, (plus, minus) in enumerate(pairs[start : start + head_dim]):
            one = next(j for j in range(plus + 1, plus + keys + 1) if j % keys != minus) % keys
            v[plus, d], v[minus, d], v[one, d] = 2.0**24, -(2.0**24), 1.0
        yield v


def _one_query_calls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: each of `query`'s n last positions in its own one-query SDPA call, over the keys up to it."""
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    first = key.shape[2] - query.shape[2] + 1
    calls = [
        F.scaled_dot_product_attention(
            query[:, :, i : i + 1], key[:, :, : first + i], value[:, :, : first + i], scale=scale, **gqa
        )
        for i in range(query.shape[2])
    ]
    return torch.cat(calls, dim=2)


def probe_parts(
    kernel: OneQueryKernel, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> int | None:
    """The first of `PARTS` with which `kernel` gives every output of one-query SDPA calls in `dtype` bit for bit
    (`heads` query heads over `kv_heads`, scale 1 / sqrt(head_dim)): on random inputs at each of `PROBE_KEYS` (flat
    and peaky weights; at the last, several queries in one call, as a verify's slots) and on adversarial ones at
    `ADVERSARIAL_KEYS`; `None` where no way does."""
    generator = torch.Generator().manual_seed(0)
    scale = 1.0 / math.sqrt(head_dim)
    cases = []
    for i, keys in enumerate(PROBE_KEYS):
        queries = 4 if keys == PROBE_KEYS[-1] else 1
        q = (4.0 ** (i % 2) * torch.randn(1, heads, queries, head_dim, generator=generator)).to(dtype)
        k, v = (torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype) for _ in range(2))
        cases.append((q, k, v))
    for keys in ADVERSARIAL_KEYS:
        q, k = torch.zeros(1, heads, 1, head_dim, dtype=dtype), torch.zeros(1, kv_heads, keys, head_dim, dtype=dtype)
        for v in adversarial_values(keys, head_dim, generator):
            cases.append((q, k, v.to(dtype)[None, None].expand(1, kv_heads, -1, -1)))
    with torch.no_grad():
        expected = [_one_query_calls(*case, scale) for case in cases]
        for parts in PARTS:
            if all(torch.equal(kernel(*case, scale, parts), want) for case, want in zip(cases, expected, strict=True)):
                return parts
    return None


def exact_parts(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """How the built kernel splits p·v to give this machine's SDPA in `dtype` (bfloat16 or float32) bit for bit for
    this head layout at PyTorch's current thread count (`probe_parts`, once per dtype, layout and thread count); `None`
    where it does not, or where the kernel is not available."""
    key = (dtype, heads, kv_heads, head_dim, torch.get_num_threads())
    if key not in _exact_parts:
        module = extension() if dtype in (torch.bfloat16, torch.float32) else None
        eligible = (
            module is not None
            and (dtype == torch.bfloat16 or module.has_float32())
            and head_dim % 16 == 0
            and head_dim <= 256
            and heads % kv_heads == 0
        )
        _exact_parts[key] = probe_parts(_built_kernel, heads, kv_heads, head_dim, dtype) if eligible else None
    return _exact_parts[key]


def one_query_calls(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor | None:
    """For one row's last n queries (`query` (1, H, n, D)) on CPU in bfloat16 or float32, unmasked, query i (0-based)
    attending over the first L - n + 1 + i of `key` / `value`'s L keys: what n one-query
    `F.scaled_dot_product_attention` calls (scale `scale`; GQA: query heads grouped over the key / value heads) give,
    bit for bit, in one kernel call where the kernel probes exact for this dtype and layout (`exact_parts`); `None`
    where it does not serve (another dtype or device, more rows, more than `MAX_KEYS` keys): the caller then runs
    SDPA."""
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1:3]
    if (
        query.dtype not in (torch.bfloat16, torch.float32)
        or key.dtype != query.dtype
        or value.dtype != query.dtype
        or query.device.type != "cpu"
        or batch != 1
        or not 1 <= queries <= keys <= MAX_KEYS
        or value.shape[-1] != head_dim
        or query.stride(-1) != 1
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    ):
        return None
    parts = exact_parts(heads, kv_heads, head_dim, query.dtype)
    if parts is None:
        return None
    return _built_kernel(query, key, value, 1.0 / math.sqrt(head_dim) if scale is None else scale, parts)
