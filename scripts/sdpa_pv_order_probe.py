"""In which order a one-query bfloat16 SDPA call sums p·v over the keys, and q·kᵀ over the head dimensions, on this
CPU (docs/benchmarks.md, "A Zen 4 EPYC": the first step towards an exact, faster one-query attention).

    .venv/bin/python scripts/sdpa_pv_order_probe.py --keys 64 --at 0 21 [--threads 1] [--qk]

With q = 0 every key gets the same probability, so the output is (the sum of the value column) / keys. Each value
column holds +B (B = 2^24) at one key, -B at another and 1.0 at a third, zeros elsewhere: the 1 is lost exactly when
it joins the partial sum holding +B before -B's does (B + 1 rounds back to B; -B + 1 is exact). For +B at each of
`--at`, the script prints, per position of -B, the keys whose 1 is lost: the keys summed with +B's before the
two partial sums meet, which is the summation tree read off level by level. With `--qk` the same placements go
into the keys' 64 dimensions instead (q = ones; each of 64 keys its own placement; v = identity, so the output shows
which keys' scores lost their 1): per position of -B, the dimensions summed with +B's first.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

B = 2.0**24


def lost_ones(keys: int, plus_at: list[int]) -> dict[tuple[int, int, int], bool]:
    """{(+B key, -B key, 1 key): whether the 1 is lost}, 64 placements (the head dimension) per SDPA call."""
    placements = [(a, b, c) for a in plus_at for b in range(keys) for c in range(keys) if len({a, b, c}) == 3]
    lost = {}
    for start in range(0, len(placements), 64):
        chunk = placements[start : start + 64]
        v = torch.zeros(keys, 64)
        for d, (a, b, c) in enumerate(chunk):
            v[a, d], v[b, d], v[c, d] = B, -B, 1.0
        q, k = torch.zeros(1, 1, 1, 64).bfloat16(), torch.zeros(1, 1, keys, 64).bfloat16()
        out = F.scaled_dot_product_attention(q, k, v.bfloat16()[None, None])[0, 0, 0].float()
        for d, placement in enumerate(chunk):
            lost[placement] = round(out[d].item() * keys) == 0
    return lost


def lost_in_scores(plus_at: list[int], dims: int = 64) -> dict[tuple[int, int, int], bool]:
    """{(+B dim, -B dim, 1 dim): whether the 1 is lost from that key's q·k}, 64 keys per SDPA call."""
    placements = [(a, b, c) for a in plus_at for b in range(dims) for c in range(dims) if len({a, b, c}) == 3]
    lost = {}
    for start in range(0, len(placements), 64):
        chunk = placements[start : start + 64]
        k = torch.zeros(len(chunk), dims)
        for j, (a, b, c) in enumerate(chunk):
            k[j, a], k[j, b], k[j, c] = B, -B, 1.0
        q, v = torch.ones(1, 1, 1, dims).bfloat16(), torch.eye(len(chunk), dims).bfloat16()
        out = F.scaled_dot_product_attention(q, k.bfloat16()[None, None], v[None, None])[0, 0, 0].float()
        middle = (out[: len(chunk)].max() + out[: len(chunk)].min()) / 2  # scores 0 or 1/8: two levels of weight
        for j, placement in enumerate(chunk):
            lost[placement] = bool(out[j] < middle)
    return lost


def ranges(values: list[int]) -> str:
    spans: list[list[int]] = []
    for value in values:
        if spans and value == spans[-1][1] + 1:
            spans[-1][1] = value
        else:
            spans.append([value, value])
    return " ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--at", type=int, nargs="+", default=[0], help="positions of +B")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--qk", action="store_true", help="probe q·kᵀ over the 64 head dimensions instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size, what = (64, "dim") if args.qk else (args.keys, "key")
    lost = lost_in_scores(args.at) if args.qk else lost_ones(args.keys, args.at)
    for a in args.at:
        print(f"+B at {what} {a}: per {what} of -B, the {what}s whose 1 joins +B's partial sum first (lost)")
        for b in range(size):
            if b != a:
                print(f"  -B at {b:3d}: {ranges([c for c in range(size) if lost.get((a, b, c))])}")


if __name__ == "__main__":
    main()
