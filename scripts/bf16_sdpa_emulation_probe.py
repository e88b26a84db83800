"""Reproduce a one-query bfloat16 SDPA call bit for bit on a CPU whose PyTorch runs it through oneDNN (avx512_bf16;
docs/benchmarks.md, "A Zen 4 EPYC"): the blueprint for an exact one-query attention kernel faster than PyTorch's.

    .venv/bin/python scripts/bf16_sdpa_emulation_probe.py --out docs/bf16-attention/amd-epyc-zen4-sdpa-emulation.json

Builds a small C++ extension (a compiler and ninja needed; ATen's own vector headers) computing, per head, what
PyTorch's CPU flash kernel computes for one query (kv blocks of 512 keys; the probe stays within one block):
q·kᵀ summed in the order `scripts/sdpa_pv_order_probe.py --qk` reads (dimension d into accumulator d mod 4, each a
chain, then (0 + 2) + (1 + 3)); times the scale and the running maximum (16-lane vectors, then the remainder);
exp via ATen's `fexp_u20` (the vector part; `std::exp` for the remainder) with the lane sum `vec_reduce_all`; the
weights rounded to bfloat16; p·v in the order `sdpa_pv_order_probe.py` reads (aligned groups of 4 keys as
(t0 + t2) + (t1 + t3), group sums chained, the 1-3 keys left over added last key first; on 2 threads the keys
split into halves where SDPA's work is one item (batch x heads = 1: the adversarial cases' single head), the
first ceil(L / 2) keys and the rest, each summed so, the halves added last); times
1 / sum; rounded to bfloat16. Compared with
`F.scaled_dot_product_attention` (9 query heads over 3 key/value heads, head dim 64, `enable_gqa`): random
inputs at several key counts, and adversarial ones (q = 0, values +2^24, -2^24 and 1) that expose the p·v order,
each with the halves split and without.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from hf_blockpilot.attention_kernel import adversarial_values
from hf_blockpilot.device_calibration import cpu_description

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
using Vec = at::vec::Vectorized<float>;
static inline float bf(at::BFloat16 v) { return static_cast<float>(v); }

// q (D), k (L, D), v (L, D) bfloat16, one head -> (D) bfloat16; halves: p·v's keys in two halves added last.
torch::Tensor one_query(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale_d, bool halves) {
  const int64_t L = k.size(0), D = k.size(1);
  const float scale = static_cast<float>(scale_d);
  const auto* Q = q.data_ptr<at::BFloat16>();
  const auto* K = k.data_ptr<at::BFloat16>();
  const auto* V = v.data_ptr<at::BFloat16>();
  std::vector<float> s(L);
  for (int64_t j = 0; j < L; ++j) {
    float lane[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t d = 0; d < D; ++d) lane[d % 4] = lane[d % 4] + bf(Q[d]) * bf(K[j * D + d]);
    s[j] = (lane[0] + lane[2]) + (lane[1] + lane[3]);
  }
  const int64_t n = Vec::size();
  float top = -INFINITY;
  Vec vtop(top), vscale(scale);
  int64_t i = 0;
  for (; i < n * (L / n); i += n) {
    auto t = Vec::loadu(s.data() + i) * vscale;
    vtop = at::vec::maximum(vtop, t);
    t.store(s.data() + i);
  }
  for (; i < L; ++i) { float t = s[i] * scale; top = std::max(top, t); s[i] = t; }
  top = std::max(top, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vtop));
  std::vector<float> p(L), lanes(n);
  Vec vmax(top), vsum(0.f);
  for (i = 0; i < n * (L / n); i += n) {
    auto t = (Vec::loadu(s.data() + i) - vmax).fexp_u20();
    vsum += t;
    t.store(lanes.data());
    for (int64_t l = 0; l < n; ++l) p[i + l] = bf(at::BFloat16(lanes[l]));
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; i < L; ++i) { float t = std::exp(s[i] - top); sum += t; p[i] = bf(at::BFloat16(t)); }
  const float reciprocal = 1.f / sum;
  const int64_t split = halves ? (L + 1) / 2 : L;
  auto out = torch::empty({D}, torch::kBFloat16);
  auto* O = out.data_ptr<at::BFloat16>();
  for (int64_t d = 0; d < D; ++d) {
    float total = 0.f;
    for (int64_t part = 0; part < (halves ? 2 : 1); ++part) {
      const int64_t begin = part == 0 ? 0 : split, end = part == 0 ? split : L;
      float acc = 0.f;
      int64_t j = begin;
      for (; j + 4 <= end; j += 4) {
        const float t0 = p[j] * bf(V[j * D + d]), t1 = p[j + 1] * bf(V[(j + 1) * D + d]);
        const float t2 = p[j + 2] * bf(V[(j + 2) * D + d]), t3 = p[j + 3] * bf(V[(j + 3) * D + d]);
        acc = acc + ((t0 + t2) + (t1 + t3));
      }
      for (int64_t x = end - 1; x >= j; --x) acc = acc + p[x] * bf(V[x * D + d]);  // the 1-3 left: last first
      total = part == 0 ? acc : total + acc;
    }
    O[d] = at::BFloat16(total * reciprocal);
  }
  return out;
}
"""

KEYS = (16, 32, 64, 100, 101, 256, 301, 511)
ADVERSARIAL_KEYS = (16, 22, 30, 34, 98, 100, 101, 102, 103, 105)


def build(name: str = "sdpa_emulation_probe", source: str = SOURCE, functions: tuple[str, ...] = ("one_query",)):
    """Compile `source` (C++ over ATen's AVX-512 vector headers) once per machine, cached under ~/.cache."""
    directory = Path.home() / ".cache" / "hf_blockpilot" / name
    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    return load_inline(
        f"hf_blockpilot_{name}",
        cpp_sources=source,
        functions=list(functions),
        build_directory=str(directory),
        extra_cflags=flags,
    )


def mismatches(ext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, halves: bool) -> int:
    """Outputs of one SDPA call (q (1, H, 1, D), k / v (1, Hkv, L, D)) the emulation misses."""
    reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])[0, :, 0]
    groups = q.shape[1] // k.shape[1]
    wrong = 0
    for h in range(q.shape[1]):
        got = ext.one_query(
            q[0, h, 0].contiguous(),
            k[0, h // groups].contiguous(),
            v[0, h // groups].contiguous(),
            q.shape[-1] ** -0.5,
            halves,
        )
        wrong += int((got != reference[h]).sum())
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16-sdpa-emulation.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = build()
    generator = torch.Generator().manual_seed(0)
    report = {
        "machine": cpu_description(),
        "threads": args.threads,
        "torch": torch.__version__,
        "random": {},
        "adversarial": {},
    }
    for keys in KEYS:
        counts = {"outputs": 0, "halves": 0, "one chain": 0}
        for _ in range(args.trials):
            q = torch.randn(1, 9, 1, 64, generator=generator).bfloat16()
            k, v = (torch.randn(1, 3, keys, 64, generator=generator).bfloat16() for _ in range(2))
            counts["outputs"] += 9 * 64
            counts["halves"] += mismatches(ext, q, k, v, True)
            counts["one chain"] += mismatches(ext, q, k, v, False)
        report["random"][keys] = counts
        print(f"random, {keys} keys: mismatching outputs {counts}")
    for keys in ADVERSARIAL_KEYS:
        counts = {"outputs": 0, "halves": 0, "one chain": 0}
        for v in adversarial_values(keys, 64, torch.Generator(), limit=None):  # every pair of keys
            q, k = torch.zeros(1, 1, 1, 64).bfloat16(), torch.zeros(1, 1, keys, 64).bfloat16()
            counts["outputs"] += 64
            counts["halves"] += mismatches(ext, q, k, v[None, None], True)
            counts["one chain"] += mismatches(ext, q, k, v[None, None], False)
        report["adversarial"][keys] = counts
        print(f"adversarial, {keys} keys: mismatching outputs {counts}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
