"""CPU kernels for verify forwards: k rows in one pass over the weight, each row rounded exactly as this machine's
one-row product rounds it (or, native bfloat16, as its product of a batch's rows does).

bfloat16: on CPUs without bfloat16 matrix instructions PyTorch computes a product of k rows as k one-row dot-product
passes, so a k-token verify costs nearly k plain steps; on CPUs with avx512_bf16 oneDNN's k-row products round
otherwise where the inputs exceed 512 (a down projection), so the exact path ran those row by row. float32: MKL's
k-row products round otherwise than its one-row product, whether that takes its SSE path (the AMD EPYCs seen) or its
AVX-512 one (an AMX Xeon), so the exact path ran k one-row products, k passes over the weight.
`kernels/linear_rows.cpp` does each row's operations in the order of the one-row product but reads the weight once
for all rows. It is built at first use (a C++ compiler and ninja, with `torch.utils.cpp_extension`, cached per
machine and torch version) and used for a weight only where it probes bit-equal to `F.linear` (`exact_row_kernel`)
and, on the exact path, faster than the stock products (`exact_verify.kernel_pays`); everywhere else, or with
`HF_BLOCKPILOT_ROW_KERNEL=0`, the stock products serve.
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
#: bfloat16 instructions where the CPU has them (`bf16_pair_rows`, `NATIVE_BF16_BLOCKS`).
LANE_WIDTHS = {"AVX2": 8}
#: Inputs oneDNN's bfloat16 products sum into one accumulator before starting the next (avx512_bf16 CPUs), in the
#: order `exact_row_kernel` tries them: 512 in one-row products; products of 4 or more rows of 1536 inputs took 1024 on
#: a Zen 4 EPYC (docs/exactness.md).
NATIVE_BF16_BLOCKS = (512, 1024, 256, 2048)
#: Rows of the probe's inputs: one-row products to compare against, at three input scales (the kernel's blocks of 4
#: rows, and each count of rows left over).
PROBE_ROWS = (6, 7, 5, 32)
#: The order probe's weight entries and large inputs (`order_probe`): their products, +-2^24, lose a 1 added to them
#: first in float32's 24-bit significand, and each factor (2^12, 2^-12) is exact in float16 and bfloat16 too.
ORDER_PROBE_SCALE = 2.0**12
#: Rows of the order probe's inputs in `exact_row_kernel`.
ORDER_PROBE_ROWS = 16

RowKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_exact_row_kernels: dict[tuple, RowKernel | None] = {}


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


def row_kernels(dtype: torch.dtype) -> list[RowKernel]:
    """The kernels `exact_row_kernel` probes for `dtype`, in order: bfloat16 with this CPU's lane layout, or with
    native bfloat16 instructions (AVX-512 CPUs that have them) one per block of `NATIVE_BF16_BLOCKS`; float32:
    `f32_rows` where `one_row_float32_in_sse_order`, and on AVX-512 CPUs `f32_rows16` (MKL's AVX-512 one-row order,
    an AMX Xeon's); none for other dtypes, where none holds, or where `extension` is not available."""
    if dtype == torch.bfloat16:
        capability = torch.backends.cpu.get_cpu_capability()
        width = LANE_WIDTHS.get(capability)
        module = extension() if width is not None or capability == "AVX512" else None
        if module is None:
            return []
        if width is not None:
            return [lambda x, weight: module.bf16_rows(x, weight, width)]
        if module.has_bf16_pair_rows():  # built for a CPU with native bfloat16 products
            return [functools.partial(_pair_rows, module, block) for block in NATIVE_BF16_BLOCKS]
        return []
    if dtype == torch.float32:
        sse = one_row_float32_in_sse_order()
        module = extension() if sse or torch.backends.cpu.get_cpu_capability() == "AVX512" else None
        if module is None:
            return []
        return ([module.f32_rows] if sse else []) + ([module.f32_rows16] if module.has_f32_rows16() else [])
    return []


def _pair_rows(module: Any, block: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return module.bf16_pair_rows(x, weight, block)


def exact_row_kernel(weight: torch.Tensor, rows: int = 1) -> RowKernel | None:
    """The first of `row_kernels` that gives every row of a product with `weight` (bias-free) exactly what
    `F.linear` gives it in a product of `rows` rows (1: alone), probed once per shape, alignment (a float32 row's
    address decides MKL's order) and `rows`, on inputs at three scales, one spread over many exponents (which
    tells a sum in blocks of 512 inputs from one in blocks of 1024) and an `order_probe` (which tells any other
    summation order or internal precision). `None` for anything but a 2-D contiguous bfloat16 or float32 CPU
    weight, for a shape no kernel takes, and where no kernel is available."""
    key = (weight.data_ptr() % 64, tuple(weight.shape), weight.dtype, weight.device.type, rows)
    if key not in _exact_row_kernels:
        eligible = weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
        kernels = row_kernels(weight.dtype) if eligible else []
        generator = torch.Generator().manual_seed(0)
        probes = []
        with torch.no_grad():
            for i, count in enumerate(PROBE_ROWS if kernels else ()):
                x = 8.0 ** (i % 3 - 1) * torch.randn(-(-count // rows) * rows, weight.shape[1], generator=generator)
                if i == len(PROBE_ROWS) - 1:  # the widest probe: magnitudes over many exponents
                    x = x * torch.exp(2 * torch.randn(x.shape, generator=generator))
                probes.append((x.to(weight), weight))
            if kernels:
                probes.append(order_probe(weight, -(-ORDER_PROBE_ROWS // rows) * rows, generator))
            expected = [torch.cat([F.linear(part, w) for part in x.split(rows)]) for x, w in probes]
            _exact_row_kernels[key] = next((k for k in kernels if _gives(k, probes, expected)), None)
    return _exact_row_kernels[key]


def _gives(kernel: RowKernel, probes: list[tuple[torch.Tensor, torch.Tensor]], expected: list[torch.Tensor]) -> bool:
    try:
        return all(torch.equal(kernel(x, w), out) for (x, w), out in zip(probes, expected, strict=True))
    except RuntimeError:  # a shape the kernel does not take (`bf16_pair_rows`: an odd input count)
        return False


def order_probe(weight: torch.Tensor, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (`rows`, in) and a weight of `weight`'s shape, dtype and address alignment (kernels are chosen by
    those, not by values) whose products show the order a product sums its inputs in: each output's weight row is
    S at three random inputs and 0 elsewhere, each input is +S, -S or 1 / S (S = `ORDER_PROBE_SCALE`), so where an
    output's three products are 2^24, -2^24 and 1 it is 1 if the large ones are summed first and 0 if the 1 meets
    either first (or 1 always, at a higher internal precision). Two kernels that sum in different orders agree on
    random inputs nearly always in bfloat16 (a float32 sum's last bits flip its bfloat16 rounding only within a few
    ulps of a midpoint: AMX's products and `bf16_pair_rows` differed on 1 of 768 outputs of a real forward, 0 of
    6,400 random ones); here they differ on many outputs."""
    out_features, in_features = weight.shape
    picks = torch.randint(0, in_features, (out_features, 3), generator=generator)
    values = torch.zeros(out_features, in_features).scatter_(1, picks, ORDER_PROBE_SCALE)
    levels = torch.tensor([ORDER_PROBE_SCALE, -ORDER_PROBE_SCALE, 1.0 / ORDER_PROBE_SCALE])
    x = levels[torch.randint(0, 3, (rows, in_features), generator=generator)]
    return x.to(weight.dtype), aligned_like(weight, values)


def aligned_like(weight: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor holding `values` in `weight`'s dtype, at an address as far past a 64-byte boundary
    as `weight`'s (MKL's float32 order depends on it)."""
    size = weight.element_size()
    storage = torch.empty(values.numel() + 64 // size, dtype=weight.dtype, device=weight.device)
    start = (weight.data_ptr() % 64 - storage.data_ptr() % 64) % 64 // size
    out = storage[start : start + values.numel()].view(values.shape)
    return out.copy_(values)
