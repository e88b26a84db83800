"""How this CPU's one-row bfloat16 product sums, and what a one-query bfloat16 attention costs per key, on CPUs where
PyTorch multiplies bfloat16 with oneDNN's native instructions (avx512_bf16; docs/benchmarks.md, "A Zen 4 EPYC").

    .venv/bin/python scripts/bf16_onednn_order.py --out docs/bf16-attention/amd-epyc-zen4-onednn.json

1. Candidate summation orders of a one-row `F.linear` output, emulated in float32 arithmetic and compared with it bit
   for bit (mismatching outputs counted, 48 rows x 3 input scales a shape): the inputs in blocks of B, each block's
   pairs (2p, 2p + 1) added to a fresh float32 accumulator one after the other, odd element first (the order of
   `vdpbf16ps`) or even first; the blocks' sums added in order; the result rounded to bfloat16. Also how many
   outputs a k-row product (48 rows at once) rounds unlike the one-row products.
2. One SDPA call of one query (SmolLM2-135M's 9 heads over 3 key/value heads, head dim 64) over L keys, bfloat16
   and float32: microseconds a call (median of 5 x 300 calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_blockpilot.device_calibration import cpu_description

SHAPES = ((576, 1536), (576, 576), (1536, 576), (64, 2048), (64, 1000), (64, 3000))
BLOCKS = (128, 256, 384, 512, 768, 1024, None)  # None: one block (a single sequential sum)
SCALES = (0.125, 1.0, 8.0)
KEYS = (32, 128, 256, 512, 1024)


def emulated(x: torch.Tensor, weight: torch.Tensor, block: int | None, odd_first: bool) -> torch.Tensor:
    """(rows, out) bfloat16: each output summed in blocks of `block` inputs, pair by pair (see the docstring)."""
    xf, wf = x.float(), weight.float()
    size = x.shape[1]
    block = block or size
    total = None
    for start in range(0, size, block):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for pair in range(start // 2, min(start + block, size) // 2):
            first, second = (2 * pair + 1, 2 * pair) if odd_first else (2 * pair, 2 * pair + 1)
            acc = acc + xf[:, first : first + 1] * wf[:, first][None]
            acc = acc + xf[:, second : second + 1] * wf[:, second][None]
        total = acc if total is None else total + acc
    return total.bfloat16()


def summation_orders(rows: int = 48) -> dict:
    generator = torch.Generator().manual_seed(1)
    report = {}
    for out_features, in_features in SHAPES:
        counts: dict[str, list[int]] = {}
        for scale in SCALES:
            weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
            x = (torch.randn(rows, in_features, generator=generator) * scale).bfloat16()
            one_row = torch.cat([F.linear(x[r : r + 1], weight) for r in range(rows)])
            counts.setdefault("k-row product", []).append(int((F.linear(x, weight) != one_row).sum()))
            for block in BLOCKS:
                for odd_first in (True, False):
                    name = f"blocks of {block or 'all'}, {'odd' if odd_first else 'even'} first"
                    mismatches = int((emulated(x, weight, block, odd_first) != one_row).sum())
                    counts.setdefault(name, []).append(mismatches)
        report[f"{out_features}x{in_features}"] = counts
        exact = [name for name, c in counts.items() if name != "k-row product" and not any(c)]
        print(f"{out_features} x {in_features}: k-row mismatches {counts['k-row product']}; exact orders: {exact}")
    return report


def attention_us(dtype: torch.dtype, keys: int) -> float:
    q = torch.randn(1, 9, 1, 64, dtype=dtype)
    k, v = torch.randn(1, 3, keys, 64, dtype=dtype), torch.randn(1, 3, keys, 64, dtype=dtype)
    for _ in range(20):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    runs = []
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(300):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        runs.append((time.perf_counter() - begin) / 300 * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16-onednn-order.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    report = {"machine": cpu_description(), "threads": 2, "torch": torch.__version__}
    report["one_row_mismatches"] = summation_orders()
    report["one_query_sdpa_us"] = {
        str(dtype).removeprefix("torch."): {keys: round(attention_us(dtype, keys), 1) for keys in KEYS}
        for dtype in (torch.bfloat16, torch.float32)
    }
    print("one-query SDPA, us a call:", report["one_query_sdpa_us"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
