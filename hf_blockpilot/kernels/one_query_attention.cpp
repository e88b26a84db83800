// One-query attention in the order PyTorch's CPU flash-attention kernel computes it, so that a decoding step or each
// slot of a verify gets the bits of its own `F.scaled_dot_product_attention` call, several times faster a call, and
// a verify's slots in one call (the last n queries of a row, query i over the keys up to its own).
//
// bfloat16, where its products run through oneDNN with native bfloat16 instructions (avx512_bf16: Zen 4 EPYC). Per
// query head (key/value head h / (H / Hkv)), over L <= 512 keys (one key block of PyTorch's kernel):
//   q·k: each key's dot product over the D dimensions, dimension d into float32 accumulator d mod 4 (chained over
//        D / 4 steps, multiply then add), then (a0 + a2) + (a1 + a3); four keys a vector;
//   times the scale, the maximum, exp(s - max) via ATen's `fexp_u20` (16-lane vectors; `std::exp` for the L mod 16
//        left), summed as PyTorch sums them (`weights`); the weights rounded to bfloat16;
//   p·v: each output dimension over the keys in `parts` consecutive parts of ceil(L / parts) keys (PyTorch's gemm
//        splits them in two when it runs on more than one thread), each part in aligned groups of four keys summed
//        (t0 + t2) + (t1 + t3) and chained, the 1-3 keys left added last key first; parts added in order;
//   times 1 / sum, rounded to bfloat16.
// float32, where PyTorch's float32 products are MKL's (an AMX Xeon: found by summing +M, -M and ones,
// docs/exactness.md): q·k as MKL's gemv sums it for keys in whole groups of four (`dot4_f32`), the 1-3 keys left
// through MKL's own `sgemm_` (exported by libtorch_cpu) as PyTorch's kernel calls it; times the scale, the maximum,
// exp(s - max) via ATen's `exp_u20` in 16-lane vectors summed lane by lane then across lanes, the L mod 16 left
// through exp in double rounded to float and added one by one (`weights_f32`); p·v as MKL's gemv sums it
// (`weighted_values_f32`); times 1 / sum. 2-3x faster than a call per query, and a verify's slots in one call.
// Compiled with ATen's AVX-512 vectors (-DCPU_CAPABILITY_AVX512) and -ffp-contract=off. Whether this matches the
// installed PyTorch on this CPU, and with how many parts, is probed bit for bit before use
// (hf_blockpilot/attention_kernel.py); nothing assumes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxKeys = 512;
constexpr int64_t kMaxHeadDim = 256;

// 16 bfloat16 -> 16 float32
inline __m512 widen16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 4 bfloat16 of each of 4 keys -> 16 float32 (key a in lanes 0-3, b in 4-7, ...)
inline __m512 widen4x4(const at::BFloat16* a, const at::BFloat16* b, const at::BFloat16* c, const at::BFloat16* d) {
  long long qa, qb, qc, qd;
  std::memcpy(&qa, a, 8);
  std::memcpy(&qb, b, 8);
  std::memcpy(&qc, c, 8);
  std::memcpy(&qd, d, 8);
  const __m256i raw = _mm256_set_epi64x(qd, qc, qb, qa);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16 (nearest, ties to even) -> float32, 16 lanes
inline __m512 round_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// q·k for every key: s[j]
void scores(const at::BFloat16* q, const at::BFloat16* k, int64_t k_row, int64_t L, int64_t D, float* s) {
  __m512 q4[kMaxHeadDim / 4];  // dims 4r..4r+3, repeated for the 4 keys of a vector
  for (int64_t r = 0; r < D / 4; ++r) {
    float lanes[16];
    for (int key = 0; key < 4; ++key)
      for (int l = 0; l < 4; ++l) lanes[4 * key + l] = static_cast<float>(q[4 * r + l]);
    q4[r] = _mm512_loadu_ps(lanes);
  }
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    const at::BFloat16 *a = k + j * k_row, *b = a + k_row, *c = b + k_row, *d = c + k_row;
    __m512 acc = _mm512_mul_ps(widen4x4(a, b, c, d), q4[0]);
    for (int64_t r = 1; r < D / 4; ++r)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(widen4x4(a + 4 * r, b + 4 * r, c + 4 * r, d + 4 * r), q4[r]));
    const __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(1, 0, 3, 2)));  // a0 + a2, a1 + a3
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));      // (a0 + a2) + (a1 + a3)
    float lanes[16];
    _mm512_storeu_ps(lanes, u);
    s[j] = lanes[0];
    s[j + 1] = lanes[4];
    s[j + 2] = lanes[8];
    s[j + 3] = lanes[12];
  }
  for (; j < L; ++j) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t e = 0; e < D; ++e)
      acc[e % 4] = acc[e % 4] + static_cast<float>(q[e]) * static_cast<float>(k[j * k_row + e]);
    s[j] = (acc[0] + acc[2]) + (acc[1] + acc[3]);
  }
}

// s <- s * scale; returns max(s), as PyTorch's `_mul_reduce_max_fusion_kernel`: whole vectors, then the keys left
float scale_and_max(float* s, int64_t L, float scale) {
  const int64_t n = Vec::size();
  const int64_t vectors = n * (L / n);
  float top = -INFINITY;
  Vec vtop(top);
  const Vec vscale(scale);
  int64_t i = 0;
  for (; i < vectors; i += n) {
    const Vec t = Vec::loadu(s + i) * vscale;
    vtop = at::vec::maximum(vtop, t);
    t.store(s + i);
  }
  for (; i < L; ++i) {
    const float t = s[i] * scale;
    top = std::max(top, t);
    s[i] = t;
  }
  return std::max(top, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vtop));
}

// s <- s * scale; p <- bfloat16(exp(s - max(s))); returns the sum of the unrounded exponentials
float weights(float* s, int64_t L, float scale, float* p) {
  const int64_t n = Vec::size();
  const int64_t vectors = n * (L / n);
  const float top = scale_and_max(s, L, scale);
  int64_t i = 0;
  // exp and the sum as PyTorch's `_exp_reduce_sum_fusion_kernel` for bfloat16 weights: 32 keys a step into two
  // vector sums, a last 16 into a third added to the first, the two added, then across lanes, then keys left
  const Vec vmax(top);
  Vec sums[2] = {Vec(0.f), Vec(0.f)}, tail(0.f);
  const int64_t pairs = 2 * n * (L / (2 * n));
  for (; i < vectors; i += n) {
    const Vec t = (Vec::loadu(s + i) - vmax).fexp_u20();
    if (i < pairs)
      sums[(i / n) % 2] = sums[(i / n) % 2] + t;
    else
      tail = tail + t;
    _mm512_storeu_ps(p + i, round_to_bf16(t));
  }
  sums[0] = sums[0] + tail;
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sums[0] + sums[1]);
  for (; i < L; ++i) {
    const float t = std::exp(s[i] - top);
    sum += t;
    p[i] = static_cast<float>(at::BFloat16(t));
  }
  return sum;
}

// out <- bfloat16(sum_j p[j] v[j] / sum)
void weighted_values(const float* p, const at::BFloat16* v, int64_t v_row, int64_t L, int64_t D, int64_t parts,
                     float sum, at::BFloat16* out) {
  const int64_t columns = D / 16;
  const int64_t chunk = (L + parts - 1) / parts;
  __m512 total[kMaxHeadDim / 16];
  for (int64_t begin = 0, part = 0; begin < L; begin += chunk, ++part) {
    const int64_t end = std::min(L, begin + chunk);
    __m512 acc[kMaxHeadDim / 16];
    for (int64_t c = 0; c < columns; ++c) acc[c] = _mm512_setzero_ps();
    int64_t x = begin;
    for (; x + 4 <= end; x += 4) {
      const __m512 p0 = _mm512_set1_ps(p[x]), p1 = _mm512_set1_ps(p[x + 1]);
      const __m512 p2 = _mm512_set1_ps(p[x + 2]), p3 = _mm512_set1_ps(p[x + 3]);
      for (int64_t c = 0; c < columns; ++c) {
        const __m512 t0 = _mm512_mul_ps(p0, widen16(v + x * v_row + 16 * c));
        const __m512 t1 = _mm512_mul_ps(p1, widen16(v + (x + 1) * v_row + 16 * c));
        const __m512 t2 = _mm512_mul_ps(p2, widen16(v + (x + 2) * v_row + 16 * c));
        const __m512 t3 = _mm512_mul_ps(p3, widen16(v + (x + 3) * v_row + 16 * c));
        acc[c] = _mm512_add_ps(acc[c], _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3)));
      }
    }
    for (int64_t y = end - 1; y >= x; --y) {
      const __m512 py = _mm512_set1_ps(p[y]);
      for (int64_t c = 0; c < columns; ++c)
        acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(py, widen16(v + y * v_row + 16 * c)));
    }
    for (int64_t c = 0; c < columns; ++c) total[c] = part == 0 ? acc[c] : _mm512_add_ps(total[c], acc[c]);
  }
  const __m512 reciprocal = _mm512_set1_ps(1.f / sum);
  for (int64_t c = 0; c < columns; ++c) {
    float o[16];
    _mm512_storeu_ps(o, _mm512_mul_ps(total[c], reciprocal));
    for (int l = 0; l < 16; ++l) out[16 * c + l] = at::BFloat16(o[l]);
  }
}

// s <- s * scale; s <- exp(s - max(s)); returns their sum (PyTorch's float32 softmax of one key block)
float weights_f32(float* s, int64_t L, float scale) {
  const int64_t n = Vec::size();
  const int64_t vectors = n * (L / n);
  const float top = scale_and_max(s, L, scale);
  int64_t i = 0;
  const Vec vmax(top);
  Vec acc(0.f);
  for (; i < vectors; i += n) {
    const Vec t = (Vec::loadu(s + i) - vmax).exp_u20();
    acc = acc + t;
    t.store(s + i);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < L; ++i) {
    const float t = static_cast<float>(std::exp(static_cast<double>(s[i] - top)));
    sum += t;
    s[i] = t;
  }
  return sum;
}

}  // namespace

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

// q·k of L keys (rows k_row apart) through MKL's `sgemm_`, as PyTorch's flash kernel asks `cpublas::gemm` for its
// scores (K q, one column), with the leading dimensions `cpublas::gemm` normalizes to (a single key: lda = D)
void mkl_scores(const float* q, const float* k, int64_t k_row, int64_t L, int64_t D, float* s) {
  const int M = L, N = 1, K = D, LDA = L == 1 ? D : k_row, LDB = D, LDC = L;
  const float one = 1.f, zero = 0.f;
  sgemm_("T", "N", &M, &N, &K, &one, k, &LDA, q, &LDB, &zero, s, &LDC);
}

// q·k of four keys, each as MKL's float32 gemv sums a key of its whole groups of four: lane 0 of 16 starts at
// dimension 0's product, dimensions 1.. fused-multiply-added into lane (d - 1) mod 16 a vector at a time, summed by
// halves, the 1-15 left fused-multiply-added into a fresh vector whose lane 0 holds that sum, summed by halves again
inline void dot4_f32(const float* q, const float* k, int64_t k_row, int64_t D, float* s) {
  const int64_t vectors = (D - 1) / 16, left = (D - 1) - 16 * vectors;
  __m512 acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(k[j * k_row] * q[0]));
  for (int64_t v = 0; v < vectors; ++v) {
    const __m512 qv = _mm512_loadu_ps(q + 1 + 16 * v);
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(k + j * k_row + 1 + 16 * v), qv, acc[j]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
  const __m512 qv = _mm512_maskz_loadu_ps(mask, q + 1 + 16 * vectors);
  for (int j = 0; j < 4; ++j)
    s[j] = finish_order16(acc[j], _mm512_maskz_loadu_ps(mask, k + j * k_row + 1 + 16 * vectors), qv, mask);
}

// out (D) <- sum_j p[j] v[j] as MKL's float32 gemv sums it: per 16 output dimensions, each 8 keys j..j+7 into the
// running sum as fma(p6, v6, .), fma(p4, v4, .), + fma(p5, v5, p7 v7), + (fma(p0, v0, p2 v2) + fma(p1, v1, p3 v3)),
// then the L mod 8 keys left fused-multiply-added in order
void weighted_values_f32(const float* p, const float* v, int64_t v_row, int64_t L, int64_t D, float* out) {
  for (int64_t c = 0; c < D; c += 16) {
    const float* vc = v + c;
    const auto P = [&](int64_t j) { return _mm512_set1_ps(p[j]); };
    const auto V = [&](int64_t j) { return _mm512_loadu_ps(vc + j * v_row); };
    const auto pair = [&](int64_t a, int64_t b) { return _mm512_fmadd_ps(P(a), V(a), _mm512_mul_ps(P(b), V(b))); };
    __m512 acc = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x + 8 <= L; x += 8) {
      acc = _mm512_fmadd_ps(P(x + 6), V(x + 6), acc);
      acc = _mm512_fmadd_ps(P(x + 4), V(x + 4), acc);
      acc = _mm512_add_ps(acc, pair(x + 5, x + 7));
      acc = _mm512_add_ps(acc, _mm512_add_ps(pair(x, x + 2), pair(x + 1, x + 3)));
    }
    for (; x < L; ++x) acc = _mm512_fmadd_ps(P(x), V(x), acc);
    _mm512_storeu_ps(out + c, acc);
  }
}

// one query over L keys: out <- softmax(scale q·k) v, as PyTorch's flash kernel computes a one-query call: the keys
// in whole groups of four (`dot4_f32`), the 1-3 left through MKL itself (its gemv's remainder), p·v as MKL sums it
void one_query_f32(const float* q, const float* k, int64_t k_row, const float* v, int64_t v_row, int64_t L, int64_t D,
                   float scale, float* s, float* out) {
  const int64_t grouped = L / 4 * 4;
  for (int64_t j = 0; j < grouped; j += 4) dot4_f32(q, k + j * k_row, k_row, D, s + j);
  if (grouped < L) mkl_scores(q, k + grouped * k_row, k_row, L - grouped, D, s + grouped);
  const float sum = weights_f32(s, L, scale);
  weighted_values_f32(s, v, v_row, L, D, out);
  const Vec reciprocal(1.f / sum);
  at::vec::map<float>([reciprocal](Vec x) { return x * reciprocal; }, out, out, D);
}

}  // namespace

// q (1, H, n, D), k / v (1, Hkv, L, D) CPU tensors of one dtype (bfloat16, or float32 where `has_float32`), each with
// unit stride in D -> (1, H, n, D): query i (the i-th of the last n positions) over the first L - n + 1 + i keys, each
// as its own one-query call computes it (`parts`: bfloat16's p·v split; float32 takes MKL's own)
torch::Tensor one_query_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t parts) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: 4-D (batch, heads, tokens, head dim)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "q, k, v: one dtype");
  TORCH_CHECK(dtype == at::kBFloat16 || (dtype == at::kFloat && sgemm_ != nullptr),
              "bfloat16, or float32 where PyTorch's BLAS is MKL");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  const int64_t H = q.size(1), n = q.size(2), Hkv = k.size(1), L = k.size(2), D = q.size(3);
  TORCH_CHECK(q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1, "one row");
  TORCH_CHECK(v.size(1) == Hkv && v.size(2) == L && k.size(3) == D && v.size(3) == D && H % Hkv == 0,
              "k and v: (1, Hkv, L, D) with Hkv dividing the query heads");
  TORCH_CHECK(D % 16 == 0 && D <= kMaxHeadDim, "head dim: a multiple of 16 up to ", kMaxHeadDim);
  TORCH_CHECK(n >= 1 && n <= L && L <= kMaxKeys, "1 to L queries over at most ", kMaxKeys, " keys");
  TORCH_CHECK(parts == 1 || parts == 2, "parts: 1 or 2");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "unit stride in the head dim");
  auto out = torch::empty({1, H, n, D}, q.options());
  const int64_t groups = H / Hkv, q_head = q.stride(1), q_row = q.stride(2);
  const int64_t k_head = k.stride(1), k_row = k.stride(2), v_head = v.stride(1), v_row = v.stride(2);
  const float scale_f = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    const float *Q = q.const_data_ptr<float>(), *K = k.const_data_ptr<float>(), *V = v.const_data_ptr<float>();
    float* O = out.data_ptr<float>();
    at::parallel_for(0, H * n, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float s[kMaxKeys];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / n, i = item % n, kv = h / groups, keys = L - n + 1 + i;
        one_query_f32(Q + h * q_head + i * q_row, K + kv * k_head, k_row, V + kv * v_head, v_row, keys, D, scale_f, s,
                      O + item * D);
      }
    });
    return out;
  }
  const auto* Q = q.const_data_ptr<at::BFloat16>();
  const auto* K = k.const_data_ptr<at::BFloat16>();
  const auto* V = v.const_data_ptr<at::BFloat16>();
  auto* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, H * n, 1, [&](int64_t begin, int64_t end) {
    float s[kMaxKeys], p[kMaxKeys];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / n, i = item % n, kv = h / groups, keys = L - n + 1 + i;
      scores(Q + h * q_head + i * q_row, K + kv * k_head, k_row, keys, D, s);
      const float sum = weights(s, keys, scale_f, p);
      weighted_values(p, V + kv * v_head, v_row, keys, D, parts, sum, O + item * D);
    }
  });
  return out;
}

// Whether this build can serve float32 (PyTorch's BLAS exports MKL's `sgemm_`).
bool has_float32() { return sgemm_ != nullptr; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("one_query_attention", &one_query_attention,
        "One row's last queries, each as a one-query SDPA call over the keys up to it computes it");
  m.def("has_float32", &has_float32);
}
