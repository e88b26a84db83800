"""Whether a row's own masked one-query SDPA call gives it what plain batched decoding's call over all B rows gives
it, in bfloat16 on this CPU (docs/exactness.md, "A batch's verify"): the exact path computes a batch's verify slots
as per-row calls (`kernels/slot_calls.cpp`), while plain batched `generate` makes one call for the batch's rows.

    .venv/bin/python scripts/batched_sdpa_row_probe.py --out docs/bf16-attention/amd-epyc-zen5-batched-vs-row.json

Layout of SmolLM2-135M (9 query heads over 3 key/value heads, head dim 64), packed as Transformers packs a masked
one-query call (the 3 query heads of a key/value head as its rows), leading keys masked per row as left padding
masks them. Counts rows whose output differs in any bit: on random inputs (B of 2 / 4 / 8, 20-512 keys, query
scales 0.5 / 1 / 3), and on adversarial ones (q = 0 so every key weighs alike, values +-2^24 and 1: the output shows
the order of p·v's sums, `attention_kernel.adversarial_values`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_blockpilot.attention_kernel import adversarial_values
from hf_blockpilot.device_calibration import cpu_description

KV_HEADS, GROUPS, HEAD_DIM = 3, 3, 64
ADVERSARIAL_KEYS = (7, 22, 101, 300, 301, 511)
ADVERSARIAL_PADS = ((0, 3), (0, 3, 1, 9), (0, 0, 0))


def differing_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> int:
    """Rows whose own call differs from the batch's call in any output."""
    batched = F.scaled_dot_product_attention(q, k, v, mask)
    return sum(
        not torch.equal(
            F.scaled_dot_product_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], mask[r : r + 1]),
            batched[r : r + 1],
        )
        for r in range(q.shape[0])
    )


def padded_mask(batch: int, keys: int, pads: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    for r, pad in enumerate(pads):
        mask[r, ..., :pad] = False
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300, help="random batches")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    random_rows = random_differing = 0
    for _ in range(args.trials):
        batch, keys = rng.choice((2, 4, 8)), rng.randint(20, 512)
        q = (rng.choice((0.5, 1.0, 3.0)) * torch.randn(batch, KV_HEADS, GROUPS, HEAD_DIM)).bfloat16()
        k, v = (torch.randn(batch, KV_HEADS, keys, HEAD_DIM).bfloat16() for _ in "kv")
        mask = padded_mask(batch, keys, [rng.randint(0, keys // 2) for _ in range(batch)])
        random_rows += batch
        random_differing += differing_rows(q, k, v, mask)
    generator = torch.Generator().manual_seed(0)
    adversarial: dict[int, list[int]] = {}
    for keys in ADVERSARIAL_KEYS:
        counts = adversarial.setdefault(keys, [0, 0])
        for values in adversarial_values(keys, HEAD_DIM, generator, limit=4):
            for pads in ADVERSARIAL_PADS:
                batch = len(pads)
                q = torch.zeros(batch, KV_HEADS, GROUPS, HEAD_DIM).bfloat16()
                k = torch.zeros(batch, KV_HEADS, keys, HEAD_DIM).bfloat16()
                v = values.bfloat16()[None, None].expand(batch, KV_HEADS, keys, HEAD_DIM)
                counts[0] += batch
                counts[1] += differing_rows(q, k, v, padded_mask(batch, keys, list(pads)))
    name, flags = cpu_description()
    report = {
        "machine": f"{name} ({' '.join(flags)})",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "random": {"rows": random_rows, "differing": random_differing},
        "adversarial": {str(keys): {"rows": n, "differing": d} for keys, (n, d) in adversarial.items()},
    }
    print(f"{report['machine']}, torch {report['torch']}, {report['threads']} threads")
    print(f"random inputs: {random_differing} of {random_rows} rows differ from the batched call")
    for keys, (n, d) in adversarial.items():
        print(f"adversarial, {keys} keys: {d} of {n} rows differ")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
