"""Where a one-query bfloat16 attention's time goes on a CPU without bfloat16 instructions, and can its bits be had
cheaper? (docs/benchmarks.md, "Why an exact 2-token bfloat16 verify cannot cost much under 1.25 steps here")

    .venv/bin/python scripts/bf16_attention_probe.py --out runs/bf16-attention-probe.json

PyTorch's CPU flash-attention kernel computes q·kᵀ and p·v of bfloat16 inputs with `cpublas::gemm`, which on such
CPUs (oneDNN declining bfloat16) calls MKL's `GEMM_BF16BF16F32`, exported by libtorch_cpu. This script builds a
tiny extension that calls it directly (a C++ compiler and ninja needed) and prints:
1. the time of one SDPA call (one query, SmolLM2-135M's 9 heads over 3 key/value heads, head dim 64) and of its 18
   MKL products called directly, on 2 threads and on 1;
2. which of a group's terms MKL's p·v adds first: values B, -B (B = 2^24) and ones, the ones lost to rounding for
   each placement of B and -B (0 where B and -B meet before any one does);
3. how often candidate summation orders give MKL's float32 p·v outputs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from bf16_rows_bench import median_ms  # this script's directory: run it as scripts/bf16_attention_probe.py
from torch.utils.cpp_extension import load_inline

from hf_blockpilot.device_calibration import cpu_description

SOURCE = r"""
#include <torch/extension.h>
#include <chrono>
extern "C" void GEMM_BF16BF16F32(const char*, const char*, const int*, const int*, const int*, const float*,
                                 const void*, const int*, const void*, const int*, const float*, float*, const int*);
// Column-major c (m x n) = op(a) op(b), as cpublas::gemm passes it.
torch::Tensor gemm(std::string ta, std::string tb, int64_t m, int64_t n, int64_t k, torch::Tensor a, int64_t lda,
                   torch::Tensor b, int64_t ldb, int64_t ldc) {
  auto c = torch::zeros({n * ldc}, torch::kFloat);
  int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  float alpha = 1, beta = 0;
  GEMM_BF16BF16F32(ta.c_str(), tb.c_str(), &M, &N, &K, &alpha, a.data_ptr(), &LDA, b.data_ptr(), &LDB, &beta,
                   c.data_ptr<float>(), &LDC);
  return c;
}
// Mean microseconds of the products one flash-attention call makes for one query: per head, q·kᵀ then p·v.
double products_us(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor p, int64_t repeats) {
  const int heads = q.size(0), groups = heads / k.size(0), keys = k.size(1), dim = q.size(1), one = 1;
  const float alpha = 1, beta = 0;
  auto qk = torch::empty({heads, keys}, torch::kFloat), out = torch::empty({heads, dim}, torch::kFloat);
  auto Q = (at::BFloat16*)q.data_ptr(), K = (at::BFloat16*)k.data_ptr(), V = (at::BFloat16*)v.data_ptr();
  auto P = (at::BFloat16*)p.data_ptr();
  auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < repeats; ++r) {
    for (int h = 0; h < heads; ++h) {
      const int kv = h / groups;
      GEMM_BF16BF16F32("T", "N", &keys, &one, &dim, &alpha, K + kv * keys * dim, &dim, Q + h * dim, &dim, &beta,
                       qk.data_ptr<float>() + h * keys, &keys);
      GEMM_BF16BF16F32("N", "N", &dim, &one, &keys, &alpha, V + kv * keys * dim, &dim, P + h * keys, &keys, &beta,
                       out.data_ptr<float>() + h * dim, &dim);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats * 1e6;
}
"""


def attention_times(mkl, keys: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, keys, 64, generator=g).bfloat16() for _ in range(2))
    p = torch.rand(9, keys, generator=g).bfloat16()

    return {
        "sdpa_us": 1e3 * median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 200),
        "mkl_products_us": mkl.products_us(q[0, :, 0].contiguous(), k[0].contiguous(), v[0].contiguous(), p, 200),
    }


def absorbed_ones(mkl, n: int = 16) -> list[list[int]]:
    big = 2.0**24
    table = []
    for at_big in range(n):
        row = []
        for at_minus in range(n):
            values = [1.0] * n
            values[at_big], values[at_minus] = big, -big
            v = torch.tensor(values)[:, None].expand(n, 64).bfloat16().contiguous()
            total = mkl.gemm("N", "N", 64, 1, n, v, 64, torch.ones(n).bfloat16(), n, 64)[0].item()
            row.append(-1 if at_big == at_minus else int(n - 2 - total))
        table.append(row)
    return table


def candidate_orders(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the rows of `x` (exact bfloat16 products, float32) in a few plausible orders."""
    n = x.shape[0]
    zero = torch.zeros(x.shape[1])

    def grouped(step: int, combine) -> torch.Tensor:
        total, i = zero.clone(), 0
        while i + step <= n:
            total = combine(total, x[i : i + step])
            i += step
        while i < n:
            total = total + x[i]
            i += 1
        return total

    return {
        "sequential": grouped(1, lambda t, g: t + g[0]),
        "pairs (l, l+1)": grouped(2, lambda t, g: t + (g[0] + g[1])),
        "groups of 4: (0+2)+(1+3)": grouped(4, lambda t, g: t + ((g[0] + g[2]) + (g[1] + g[3]))),
        "groups of 4: (0+1)+(2+3)": grouped(4, lambda t, g: t + ((g[0] + g[1]) + (g[2] + g[3]))),
        "4 partial sums": four_partial_sums(x),
    }


def four_partial_sums(x: torch.Tensor) -> torch.Tensor:
    """ATen's `sum` helper in its reference gemm: 4 partial sums over whole groups of 4, the rest into the first."""
    n = x.shape[0]
    partial = [torch.zeros(x.shape[1]) for _ in range(4)]
    whole = n - n % 4
    for i in range(n):
        k = i % 4 if i < whole else 0
        partial[k] = partial[k] + x[i]
    return ((partial[0] + partial[1]) + partial[2]) + partial[3]


def order_mismatches(mkl, keys: int, trials: int = 20) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    wrong: dict[str, int] = {}
    for _ in range(trials):
        v = torch.randn(keys, 64, generator=g).bfloat16()
        p = torch.rand(keys, generator=g).bfloat16()
        got = mkl.gemm("N", "N", 64, 1, keys, v.contiguous(), 64, p.contiguous(), keys, 64)
        for name, total in candidate_orders(v.float() * p.float()[:, None]).items():
            wrong[name] = wrong.get(name, 0) + int((got != total).sum())
    return {name: count / (trials * 64) for name, count in wrong.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bf16-attention-probe.json")
    args = parser.parse_args()
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    mkl = load_inline(
        name="hf_blockpilot_mkl_bf16_probe",
        cpp_sources=[SOURCE],
        functions=["gemm", "products_us"],
        extra_ldflags=[f"-L{lib}", "-ltorch_cpu"],
    )
    threads = torch.get_num_threads()
    name, flags = cpu_description()
    result: dict = {
        "machine": " ".join([name, *flags]),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "times_us": {},
    }
    for count in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(count)
        result["times_us"][f"{count} threads"] = {f"{k} keys": attention_times(mkl, k) for k in (64, 256)}
    torch.set_num_threads(threads)
    result["ones_absorbed_16"] = absorbed_ones(mkl)
    result["order_mismatch_share"] = {str(k): order_mismatches(mkl, k) for k in (8, 64, 256)}
    print(result["machine"])
    for threads_key, rows in result["times_us"].items():
        for keys, row in rows.items():
            sdpa, products = row["sdpa_us"], row["mkl_products_us"]
            print(f"{threads_key}, {keys}: SDPA {sdpa:.0f} µs, its MKL products {products:.0f} µs")
    print("ones absorbed (row: where B is, column: where -B is; -1: same place):")
    for row in result["ones_absorbed_16"]:
        print(" ".join(f"{n:2d}" for n in row))
    for keys, shares in result["order_mismatch_share"].items():
        print(f"{keys} keys: " + ", ".join(f"{name} {share:.0%}" for name, share in shares.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
