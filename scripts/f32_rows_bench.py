"""How does this machine's one-row float32 product sum, and does `f32_rows` reproduce it faster?

    python scripts/f32_rows_bench.py --out runs/f32-rows.json

1. order: for a weight of ones, an input of ones with +M at position i and -M at j (M = 2^40: a one added to a
   partial sum holding M vanishes) gives the count of inputs outside the smallest partial sum holding both, as in
   FPRev; printed for i = 0 and j < 16 at weight offsets 0-3 floats (MKL's SSE path: 2 3 4 5 ... when aligned);
2. the emulation `one_row_float32_in_sse_order` uses, and whether it matches `F.linear` here;
3. the kernel (`kernels/linear_rows.cpp`, `f32_rows`; built if it matches): outputs that differ from one-row
   `F.linear` per SmolLM2-135M weight shape, weight offsets 0-3, 1-16 rows, three input scales;
4. one linear: k one-row products (what the exact path computed before) vs the kernel vs MKL's k-row product
   (not exact), for 1 / 2 / 4 / 8 / 16 rows. Prints tables and writes JSON. Offline, no model needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bf16_rows_bench import SHAPES, median_ms  # this script's directory: run it as scripts/f32_rows_bench.py

from hf_blockpilot.device_calibration import cpu_description
from hf_blockpilot.row_kernel import one_row_float32_in_sse_order, row_kernels

ROWS = (1, 2, 3, 4, 8, 9, 16)


def sum_tree_sizes(offset: int, inputs: int = 64, positions: int = 16) -> list[int]:
    """For i = 0 and each j < `positions`: how many inputs the smallest partial sum holding inputs 0 and j holds."""
    storage = torch.ones(8 * inputs + offset)
    weight = storage[offset:].view(8, inputs)
    sizes = []
    for j in range(1, positions):
        x = torch.ones(1, inputs)
        x[0, 0], x[0, j] = 2.0**40, -(2.0**40)
        sizes.append(int(inputs - F.linear(x, weight)[0, 0]))
    return sizes


def misaligned(out: int, inp: int, offset: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(out * inp + offset, generator=generator)[offset:].view(out, inp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/f32-rows.json"))
    args = parser.parse_args()
    result: dict = {"device": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    result["sum_tree_sizes"] = {offset: sum_tree_sizes(offset) for offset in range(4)}
    for offset, sizes in result["sum_tree_sizes"].items():
        print(f"weight offset {offset}: partial sums holding inputs 0 and j = 1..15: {sizes}")
    result["sse_order"] = one_row_float32_in_sse_order()
    print(f"one-row float32 products sum in MKL's SSE order here: {result['sse_order']}")
    kernel = next(iter(row_kernels(torch.float32)), None)
    if kernel is None:
        print("no float32 row kernel here (another order, or no build)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        return
    generator = torch.Generator().manual_seed(0)
    mismatches = {}
    with torch.no_grad():
        for out, inp in SHAPES:
            wrong = 0
            for offset in range(4):
                weight = misaligned(out, inp, offset, generator)
                for rows in ROWS:
                    for scale in (0.125, 1.0, 64.0):
                        x = scale * torch.randn(rows, inp, generator=generator)
                        alone = torch.cat([F.linear(x[r : r + 1], weight) for r in range(rows)])
                        wrong += int((kernel(x, weight) != alone).sum())
            mismatches[f"{out}x{inp}"] = wrong
    result["outputs_differing"] = mismatches
    print("outputs differing from one-row F.linear:", mismatches)
    timings = []
    print(f"{'shape':>12} {'rows':>4} {'one-row x k ms':>15} {'kernel ms':>10} {'k-row (inexact) ms':>19}")
    for out, inp in [(1536, 576), (576, 1536), (49152, 576)]:
        weight = torch.randn(out, inp, generator=generator)
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, inp, generator=generator)
            row = {
                "shape": f"{out}x{inp}",
                "rows": rows,
                "one_row_products_ms": median_ms(lambda x=x, w=weight: [F.linear(r, w) for r in x.split(1)]),
                "kernel_ms": median_ms(lambda x=x, w=weight: kernel(x, w)),
                "k_row_product_ms": median_ms(lambda x=x, w=weight: F.linear(x, w)),
            }
            timings.append(row)
            print(
                f"{row['shape']:>12} {rows:>4} {row['one_row_products_ms']:>15.3f} {row['kernel_ms']:>10.3f} "
                f"{row['k_row_product_ms']:>19.3f}"
            )
    result["timings"] = timings
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
