"""An exact one-query bfloat16 attention kernel, vectorized, against PyTorch's SDPA on this CPU: same bits, time per
call (docs/benchmarks.md, "A Zen 4 EPYC"; the order it follows: `scripts/bf16_sdpa_emulation_probe.py`).

    .venv/bin/python scripts/bf16_sdpa_kernel_probe.py --out docs/bf16-attention/amd-epyc-zen4-sdpa-kernel.json

The kernel is the library's (`hf_blockpilot/attention_kernel.py`, `kernels/one_query_attention.cpp`: a CPU with
AVX-512, a compiler and ninja), with the p·v split its probe finds for each head layout (`exact_parts`).
For each key count: mismatching outputs on random inputs (SmolLM2-135M's 9 query heads over 3 key/value heads) and
on adversarial ones (q = 0, values ±2^24 and 1; up to 101 keys), and the median microseconds of a call of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_blockpilot import attention_kernel
from hf_blockpilot.device_calibration import cpu_description

KEYS = (16, 32, 100, 101, 256, 301, 511)


def median_us(call, calls: int = 300) -> float:
    for _ in range(20):
        call()
    runs = []
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - begin) / calls * 1e6)
    return statistics.median(runs)


def adversarial_mismatches(keys: int) -> int:
    """One head (SDPA's work a single item: on 2 threads oneDNN splits p·v's keys in two), q = 0."""
    parts = attention_kernel.exact_parts(1, 1, 64)
    wrong = 0
    for values in attention_kernel.adversarial_values(keys, 64, torch.Generator(), limit=None):  # every pair
        q, k, v = torch.zeros(1, 1, 1, 64).bfloat16(), torch.zeros(1, 1, keys, 64).bfloat16(), values[None, None]
        got = attention_kernel._built_kernel(q, k, v, 0.125, parts)
        wrong += int((got != F.scaled_dot_product_attention(q, k, v)).sum())
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16-sdpa-kernel.json"))
    parser.add_argument("--threads", type=int, default=2, choices=(1, 2), help="the split rule is known for 1 and 2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = attention_kernel.exact_parts(9, 3, 64)
    if parts is None:
        raise SystemExit("the attention kernel is not exact (or not built) on this CPU")
    generator = torch.Generator().manual_seed(0)
    report = {"machine": cpu_description(), "threads": args.threads, "torch": torch.__version__, "keys": {}}
    for keys in KEYS:
        wrong = 0
        for _ in range(3):
            q = torch.randn(1, 9, 1, 64, generator=generator).bfloat16()
            k, v = (torch.randn(1, 3, keys, 64, generator=generator).bfloat16() for _ in range(2))
            reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            wrong += int((attention_kernel._built_kernel(q, k, v, 0.125, parts) != reference).sum())
        row = {
            "random_outputs": 3 * 9 * 64,
            "random_mismatches": wrong,
            "adversarial_mismatches": adversarial_mismatches(keys) if keys <= 101 else None,
            "sdpa_us": round(median_us(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)), 1),
            "kernel_us": round(median_us(partial(attention_kernel._built_kernel, q, k, v, 0.125, parts)), 1),
        }
        report["keys"][keys] = row
        print(f"{keys} keys: {row} ({row['sdpa_us'] / row['kernel_us']:.1f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
