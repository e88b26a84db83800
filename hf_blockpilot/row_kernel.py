"""CPU kernels for verify forwards: k rows in one pass over the weight, each row rounded exactly as this machine's
one-row product rounds it.

bfloat16: on CPUs without bfloat16 matrix instructions PyTorch computes a product of k rows as k one-row dot-product
passes, so a k-token verify costs nearly k plain steps; on CPUs with avx512_bf16 oneDNN's k-row products round
otherwise where the inputs exceed 512 (a down projection), so the exact path ran those row by row. float32: where
MKL's one-row product takes its SSE path (the AMD EPYCs seen), its k-row products round otherwise, so the exact path
ran k one-row products, k passes over the weight. `kernels/linear_rows.cpp` does each row's operations in the order
of the one-row product but reads the weight once for all rows. It is built at first use (a C++ compiler and ninja,
with `torch.utils.cpp_extension`, cached per machine and torch version) and used for a weight only where it probes
bit-equal to one-row `F.linear` (`rounds_as_one_row`) and, on the exact path, faster than the stock products
(`exact_verify.kernel_pays`); everywhere else, or with `HF_BLOCKPILOT_ROW_KERNEL=0`, the stock products serve.
docs/exactness.md has the measurements.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .kernel_build import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "linear_rows.cpp"
#: Set to "0" to never build or use the kernel.
SWITCH = "HF_BLOCKPILOT_ROW_KERNEL"
#: Its compile (and link) flags beyond `kernel_build.BASE_FLAGS`: rows spread over OpenMP threads.
FLAGS = ("-fopenmp",)
#: The float lanes of PyTorch's vectors per CPU capability: the bfloat16 accumulator layout `bf16_rows` reproduces
#: (PyTorch's own dot products). Only AVX2 is listed: the AVX-512 CPUs seen multiply bfloat16 with oneDNN, on native
#: bfloat16 instructions where the CPU has them (`bf16_pair_rows`, `NATIVE_BF16_BLOCK`).
LANE_WIDTHS = {"AVX2": 8}
#: Inputs oneDNN's one-row bfloat16 product sums into one accumulator before starting the next (avx512_bf16 CPUs).
NATIVE_BF16_BLOCK = 512
#: Rows of the probe's inputs: one-row products to compare against, at three input scales (the kernel's blocks of 4
#: rows, and each count of rows left over).
PROBE_ROWS = (6, 7, 5, 32)

RowKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_rounds_as_one_row: dict[tuple, bool] = {}


@functools.cache
def extension() -> Any | None:
    """The built `kernels/linear_rows.cpp` module (`bf16_rows(x, weight, lane_width)`, `f32_rows(x, weight)`), cached
    per process; `None` where it is switched off or cannot be built (`kernel_build.load_kernel`)."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    return load_kernel(SOURCE, FLAGS, FLAGS)


def _sums_in_sse_order(products: torch.Tensor, peel: int) -> torch.Tensor:
    """Each row of `products` (out, in) summed in MKL's SSE order (`kernels/linear_rows.cpp`): the first `peel`
    one by one into lane 0 of 4, then 4-input vectors lane by lane, lanes (0 + 2) + (1 + 3), the rest one by one."""
    vectors = (products.shape[1] - peel) // 4
    lanes = products.new_zeros(products.shape[0], 4)
    for j in range(peel):
        lanes[:, 0] = lanes[:, 0] + products[:, j]
    for block in products[:, peel : peel + 4 * vectors].unflatten(1, (vectors, 4)).unbind(1):
        lanes = lanes + block
    total = (lanes[:, 0] + lanes[:, 2]) + (lanes[:, 1] + lanes[:, 3])
    for j in range(peel + 4 * vectors, products.shape[1]):
        total = total + products[:, j]
    return total


@functools.cache
def one_row_float32_in_sse_order() -> bool:
    """Whether this machine's one-row float32 `F.linear` sums in the order `f32_rows` reproduces: emulated with
    PyTorch's elementwise operations on a small weight at three input scales, before anything is built."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 72, generator=generator)
    peel = 4 - weight.data_ptr() // 4 % 4
    for scale in (0.125, 1.0, 64.0):
        x = scale * torch.randn(1, 72, generator=generator)
        if not torch.equal(_sums_in_sse_order(weight * x, peel), F.linear(x, weight)[0]):
            return False
    return True


def row_kernel(dtype: torch.dtype) -> RowKernel | None:
    """`kernel(x (rows, in), weight (out, in))` -> (rows, out) in `dtype` (bfloat16: with this CPU's lane layout, or
    with native bfloat16 instructions on AVX-512 CPUs that have them; float32: where `one_row_float32_in_sse_order`);
    `None` for other dtypes, where none holds, or where `extension` is not available."""
    if dtype == torch.bfloat16:
        capability = torch.backends.cpu.get_cpu_capability()
        width = LANE_WIDTHS.get(capability)
        module = extension() if width is not None or capability == "AVX512" else None
        if module is None:
            return None
        if width is not None:
            return lambda x, weight: module.bf16_rows(x, weight, width)
        if module.has_bf16_pair_rows():  # built for a CPU with native bfloat16 products
            return lambda x, weight: module.bf16_pair_rows(x, weight, NATIVE_BF16_BLOCK)
        return None
    if dtype == torch.float32:
        module = extension() if one_row_float32_in_sse_order() else None
        return None if module is None else module.f32_rows
    return None


def rounds_as_one_row(weight: torch.Tensor) -> bool:
    """Whether `row_kernel` gives every row of a product with `weight` (bias-free) exactly what one-row
    `F.linear` gives it, probed once per shape and alignment (a float32 row's address decides MKL's order) on
    inputs at three scales. False for anything but a 2-D contiguous bfloat16 or float32 CPU weight, for a shape the
    kernel refuses, and where the kernel is not available."""
    key = (weight.data_ptr() % 64, tuple(weight.shape), weight.dtype, weight.device.type)
    if key not in _rounds_as_one_row:
        eligible = weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
        kernel = row_kernel(weight.dtype) if eligible else None
        exact = kernel is not None
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, rows in enumerate(PROBE_ROWS if exact else ()):
                x = (8.0 ** (i % 3 - 1) * torch.randn(rows, weight.shape[1], generator=generator)).to(weight)
                alone = torch.cat([F.linear(x[r : r + 1], weight) for r in range(rows)])
                try:
                    exact = torch.equal(kernel(x, weight), alone)
                except RuntimeError:  # a shape the kernel does not take (`bf16_pair_rows`: an odd input count)
                    exact = False
                if not exact:
                    break
        _rounds_as_one_row[key] = exact
    return _rounds_as_one_row[key]
