"""An exact one-query bfloat16 attention kernel, vectorized, against PyTorch's SDPA on this CPU: same bits, time per
call (docs/benchmarks.md, "A Zen 4 EPYC"; the order it follows: `scripts/bf16_sdpa_emulation_probe.py`).

    .venv/bin/python scripts/bf16_sdpa_kernel_probe.py --out docs/bf16-attention/amd-epyc-zen4-sdpa-kernel.json

Builds a small C++ extension (AVX-512 intrinsics and ATen's vector headers: a CPU with AVX-512, a compiler and
ninja) computing what PyTorch's CPU flash kernel computes for one bfloat16 query over at most 512 keys, head dim 64:
q·kᵀ for 4 keys a vector (accumulator d mod 4 per key, chained over 16 rows of 4 dimensions, then (0 + 2) +
(1 + 3)); scale, maximum, `fexp_u20`, weights rounded to bfloat16; p·v over the 64 dimensions in 4 vectors (groups
of 4 keys as (t0 + t2) + (t1 + t3), chained; the keys left over last first; on 2 threads two halves, the first
ceil(L / 2) keys). Not yet in the library: it would run each verify slot's attention, and could run plain steps'.
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
from bf16_sdpa_emulation_probe import adversarial_values, build  # this script's directory: run it as scripts/...

from hf_blockpilot.device_calibration import cpu_description

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <immintrin.h>
#include <cmath>
using Vec = at::vec::Vectorized<float>;

static inline __m512 bf16x16(const at::BFloat16* p) {  // 16 bf16 -> 16 f32
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 rows4(const at::BFloat16* a, const at::BFloat16* b, const at::BFloat16* c,
                            const at::BFloat16* d) {
  // 4 bf16 from each of 4 keys -> 16 f32 (key a in lanes 0-3, ...)
  long long qa, qb, qc, qd;
  std::memcpy(&qa, a, 8); std::memcpy(&qb, b, 8); std::memcpy(&qc, c, 8); std::memcpy(&qd, d, 8);
  __m256i raw = _mm256_set_epi64x(qd, qc, qb, qa);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// one head: q (64), keys (L, 64) with row stride ks, values (L, 64) with row stride vs -> out (64) bf16
static void head(const at::BFloat16* Q, const at::BFloat16* K, int64_t ks, const at::BFloat16* V,
                 int64_t vs_,
                 int64_t L, float scale, bool halves, at::BFloat16* out, float* s, float* p) {
  constexpr int64_t D = 64;
  __m512 qrep[16];
  for (int r = 0; r < 16; ++r) {
    float q4[16];
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 4; ++l) q4[4 * k + l] = static_cast<float>(Q[4 * r + l]);
    qrep[r] = _mm512_loadu_ps(q4);
  }
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    const at::BFloat16 *a = K + j * ks, *b = a + ks, *c = b + ks, *d = c + ks;
    __m512 acc = _mm512_mul_ps(rows4(a, b, c, d), qrep[0]);
    for (int r = 1; r < 16; ++r)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(rows4(a + 4 * r, b + 4 * r, c + 4 * r, d + 4 * r), qrep[r]));
    __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(1, 0, 3, 2)));  // lane0 = l0 + l2, lane1 = l1 + l3
    __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));      // lane0 = (l0 + l2) + (l1 + l3)
    float lanes[16];
    _mm512_storeu_ps(lanes, u);
    s[j] = lanes[0]; s[j + 1] = lanes[4]; s[j + 2] = lanes[8]; s[j + 3] = lanes[12];
  }
  for (; j < L; ++j) {
    float lane[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t e = 0; e < D; ++e)
      lane[e % 4] = lane[e % 4] + static_cast<float>(Q[e]) * static_cast<float>(K[j * ks + e]);
    s[j] = (lane[0] + lane[2]) + (lane[1] + lane[3]);
  }
  const int64_t n = Vec::size();
  float top = -INFINITY;
  Vec vtop(top), vscale(scale);
  int64_t i = 0;
  for (; i < n * (L / n); i += n) {
    auto t = Vec::loadu(s + i) * vscale;
    vtop = at::vec::maximum(vtop, t);
    t.store(s + i);
  }
  for (; i < L; ++i) { float t = s[i] * scale; top = std::max(top, t); s[i] = t; }
  top = std::max(top, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vtop));
  Vec vmax(top), vsum(0.f);
  for (i = 0; i < n * (L / n); i += n) {
    auto t = (Vec::loadu(s + i) - vmax).fexp_u20();
    vsum += t;
    // round to bf16 (nearest even) and back, as the kernel's bf16 weights
    __m512i bits = _mm512_castps_si512(t);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(0xFFFF0000));
    _mm512_storeu_ps(p + i, _mm512_castsi512_ps(rounded));
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; i < L; ++i) { float t = std::exp(s[i] - top); sum += t; p[i] = static_cast<float>(at::BFloat16(t)); }
  const float reciprocal = 1.f / sum;
  const int64_t split = halves ? (L + 1) / 2 : L;
  __m512 total[4];
  for (int part = 0; part < (halves ? 2 : 1); ++part) {
    const int64_t begin = part == 0 ? 0 : split, end = part == 0 ? split : L;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t x = begin;
    for (; x + 4 <= end; x += 4) {
      const __m512 p0 = _mm512_set1_ps(p[x]), p1 = _mm512_set1_ps(p[x + 1]);
      const __m512 p2 = _mm512_set1_ps(p[x + 2]), p3 = _mm512_set1_ps(p[x + 3]);
      for (int c = 0; c < 4; ++c) {
        const __m512 t0 = _mm512_mul_ps(p0, bf16x16(V + x * vs_ + 16 * c));
        const __m512 t1 = _mm512_mul_ps(p1, bf16x16(V + (x + 1) * vs_ + 16 * c));
        const __m512 t2 = _mm512_mul_ps(p2, bf16x16(V + (x + 2) * vs_ + 16 * c));
        const __m512 t3 = _mm512_mul_ps(p3, bf16x16(V + (x + 3) * vs_ + 16 * c));
        acc[c] = _mm512_add_ps(acc[c], _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3)));
      }
    }
    for (int64_t y = end - 1; y >= x; --y) {
      const __m512 py = _mm512_set1_ps(p[y]);
      for (int c = 0; c < 4; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(py, bf16x16(V + y * vs_ + 16 * c)));
    }
    for (int c = 0; c < 4; ++c) total[c] = part == 0 ? acc[c] : _mm512_add_ps(total[c], acc[c]);
  }
  const __m512 rec = _mm512_set1_ps(reciprocal);
  for (int c = 0; c < 4; ++c) {
    float o[16];
    _mm512_storeu_ps(o, _mm512_mul_ps(total[c], rec));
    for (int l = 0; l < 16; ++l) out[16 * c + l] = at::BFloat16(o[l]);
  }
}

// q (1, H, 1, 64), k / v (1, Hkv, L, 64) contiguous bf16 -> (1, H, 1, 64)
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, bool halves) {
  const int64_t H = q.size(1), Hkv = k.size(1), L = k.size(2), groups = H / Hkv;
  auto out = torch::empty_like(q);
  const auto* Q = q.data_ptr<at::BFloat16>();
  const auto* K = k.data_ptr<at::BFloat16>();
  const auto* V = v.data_ptr<at::BFloat16>();
  auto* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L), p(L);
    for (int64_t h = begin; h < end; ++h)
      head(Q + h * 64, K + (h / groups) * L * 64, 64, V + (h / groups) * L * 64, 64, L, (float)scale, halves,
           O + h * 64, s.data(), p.data());
  });
  return out;
}
"""


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


def adversarial_mismatches(ext, keys: int, halves: bool) -> int:
    wrong = 0
    for values in adversarial_values(keys):
        q, k, v = torch.zeros(1, 1, 1, 64).bfloat16(), torch.zeros(1, 1, keys, 64).bfloat16(), values[None, None]
        wrong += int((ext.attention(q, k, v, 0.125, halves) != F.scaled_dot_product_attention(q, k, v)).sum())
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16-sdpa-kernel.json"))
    parser.add_argument("--threads", type=int, default=2, choices=(1, 2), help="the split rule is known for 1 and 2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    halves = args.threads == 2
    ext = build("sdpa_kernel_probe", SOURCE, ("attention",))
    generator = torch.Generator().manual_seed(0)
    report = {"machine": cpu_description(), "threads": args.threads, "torch": torch.__version__, "keys": {}}
    for keys in KEYS:
        wrong = 0
        for _ in range(3):
            q = torch.randn(1, 9, 1, 64, generator=generator).bfloat16()
            k, v = (torch.randn(1, 3, keys, 64, generator=generator).bfloat16() for _ in range(2))
            reference = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            wrong += int((ext.attention(q, k, v, 0.125, halves) != reference).sum())
        row = {
            "random_outputs": 3 * 9 * 64,
            "random_mismatches": wrong,
            "adversarial_mismatches": adversarial_mismatches(ext, keys, halves) if keys <= 101 else None,
            "sdpa_us": round(median_us(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)), 1),
            "kernel_us": round(median_us(partial(ext.attention, q, k, v, 0.125, halves)), 1),
        }
        report["keys"][keys] = row
        print(f"{keys} keys: {row} ({row['sdpa_us'] / row['kernel_us']:.1f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
