// Several rows of a linear, each row rounded exactly as this machine's one-row CPU product rounds it, in one pass
// over the weight (bfloat16: `bf16_rows`, or `bf16_pair_rows` with native bfloat16 instructions; float32: `f32_rows`).
//
// bfloat16. PyTorch computes a one-row bfloat16 product on CPUs without native bfloat16 matrix instructions as one
// dot product per output, in float32 arithmetic (ATen's `dot_with_fp32_arith`): 8 vector accumulators of W float
// lanes (W = the CPU capability's float vector width) take fused multiply-adds over blocks of 8 * W inputs, are
// summed pairwise (register i += register i + 4, + 2, + 1), then across lanes by a butterfly (lane i += lane
// i ^ W/2, ..., i ^ 1); a remainder of whole 2W-input vectors goes through one more accumulator, added the same
// way; single leftover inputs are added one by one. The result is rounded to bfloat16 (nearest, ties to even).
// Several rows through that kernel cost as many passes over the weight, each converting it to float32 again; here
// each output's weight row is converted once and reused for every input row.
//
// bfloat16 with native instructions (avx512_bf16: Zen 4 EPYC). oneDNN's one-row product sums each output's inputs in
// blocks of 512, each block pair by pair into a fresh float32 accumulator (`vdpbf16ps`: the odd element's product,
// then the even one's), the blocks' sums added in order, then rounds to bfloat16 (`vcvtneps2bf16`); its k-row
// products round otherwise where the inputs exceed a block, so the exact path ran them row by row. `bf16_pair_rows`
// uses the same instructions in the same order, 16 outputs a vector: the weight read once (16 rows of 16 pairs
// loaded and transposed in registers), each input row's pair broadcast.
//
// float32. MKL's one-row float32 product on CPUs where it takes its SSE path (the AMD EPYCs seen: found by summing
// +M, -M and ones, docs/exactness.md) is one dot product per output: the products (multiplied, rounded, then added:
// no fused multiply-add) of the inputs before the weight row's next 16-byte boundary (1 to 4 of them: 4 when the row
// is aligned) are summed one by one into lane 0 of 4 accumulator lanes; the following whole 4-input vectors are
// added lane by lane; the lanes are summed as (0 + 2) + (1 + 3), and the leftover inputs added one by one. A
// k-row product through MKL is a different (blocked) kernel that rounds otherwise, and k one-row products read the
// weight k times; here each weight row is read once for every input row. With AVX, two outputs' 4 lanes share one
// 8-lane register (the same multiplies and additions, lane for lane): 1.2-1.4x faster than 4-lane registers on a
// Zen 4 EPYC (docs/exactness.md).
//
// Same operations in the same order: fmaf / separate multiplies and plain float additions, compiled with
// -ffp-contract=off, so the results do not depend on how the compiler vectorizes. Whether this matches the
// installed PyTorch on this CPU is probed bit for bit per weight before use (hf_blockpilot/row_kernel.py);
// nothing assumes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "vec16.h"
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int kRegisters = 8;

inline float butterfly(float* lanes, int width) {
  for (int offset = width / 2; offset >= 1; offset /= 2) {
    for (int i = 0; i < offset; ++i) lanes[i] = lanes[i] + lanes[i + offset];
  }
  return lanes[0];
}

// One output of one row: x and w already float32, `len` inputs, `width` lanes a vector.
inline float dot(const float* x, const float* w, int64_t len, int width) {
  float acc[kRegisters * 16];
  const int block = kRegisters * width;
  for (int l = 0; l < block; ++l) acc[l] = 0.0f;
  const int64_t aligned = len & ~static_cast<int64_t>(block - 1);
  for (int64_t j = 0; j < aligned; j += block) {
    for (int l = 0; l < block; ++l) acc[l] = std::fmaf(x[j + l], w[j + l], acc[l]);
  }
  for (int offset = kRegisters / 2; offset >= 1; offset /= 2) {  // register i += register i + offset
    for (int r = 0; r < offset; ++r) {
      for (int e = 0; e < width; ++e) acc[r * width + e] = acc[r * width + e] + acc[(r + offset) * width + e];
    }
  }
  float sum = butterfly(acc, width);
  float tail[16];
  for (int e = 0; e < width; ++e) tail[e] = 0.0f;
  const int64_t aligned_vec = len & ~static_cast<int64_t>(2 * width - 1);
  for (int64_t j = aligned; j < aligned_vec; j += 2 * width) {
    for (int e = 0; e < width; ++e) tail[e] = std::fmaf(x[j + e], w[j + e], tail[e]);
    for (int e = 0; e < width; ++e) tail[e] = std::fmaf(x[j + width + e], w[j + width + e], tail[e]);
  }
  sum = sum + butterfly(tail, width);
  for (int64_t j = aligned_vec; j < len; ++j) sum = sum + x[j] * w[j];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// `dot` for width 8, its main loop in AVX2 registers (the same fused multiply-adds, lane for lane).
inline float dot8(const float* x, const float* w, int64_t len) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const int64_t aligned = len & ~static_cast<int64_t>(kRegisters * 8 - 1);
  for (int64_t j = 0; j < aligned; j += kRegisters * 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(w + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), _mm256_loadu_ps(w + j + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 16), _mm256_loadu_ps(w + j + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 24), _mm256_loadu_ps(w + j + 24), a3);
    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 32), _mm256_loadu_ps(w + j + 32), a4);
    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 40), _mm256_loadu_ps(w + j + 40), a5);
    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 48), _mm256_loadu_ps(w + j + 48), a6);
    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 56), _mm256_loadu_ps(w + j + 56), a7);
  }
  a0 = _mm256_add_ps(a0, a4), a1 = _mm256_add_ps(a1, a5), a2 = _mm256_add_ps(a2, a6), a3 = _mm256_add_ps(a3, a7);
  a0 = _mm256_add_ps(a0, a2), a1 = _mm256_add_ps(a1, a3);
  a0 = _mm256_add_ps(a0, a1);
  float lanes[8];
  _mm256_storeu_ps(lanes, a0);
  float sum = butterfly(lanes, 8);
  float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t aligned_vec = len & ~static_cast<int64_t>(15);
  for (int64_t j = aligned; j < aligned_vec; j += 16) {
    for (int e = 0; e < 8; ++e) tail[e] = std::fmaf(x[j + e], w[j + e], tail[e]);
    for (int e = 0; e < 8; ++e) tail[e] = std::fmaf(x[j + 8 + e], w[j + 8 + e], tail[e]);
  }
  sum = sum + butterfly(tail, 8);
  for (int64_t j = aligned_vec; j < len; ++j) sum = sum + x[j] * w[j];
  return sum;
}
#endif

inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

}  // namespace

// x: (rows, in) bfloat16, weight: (out, in) bfloat16, both contiguous; width: 8 (AVX2) or 16 (AVX-512).
torch::Tensor bf16_rows(const torch::Tensor& x, const torch::Tensor& weight, int64_t width) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes (rows, in), (out, in)");
  TORCH_CHECK(width == 8 || width == 16, "width 8 or 16");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1), out = wc.size(0);
  auto xf = xc.to(at::kFloat);  // exact: every bfloat16 is a float32
  auto result = torch::empty({rows, out}, x.options());
  const float* xs = xf.data_ptr<float>();
  const at::BFloat16* ws = wc.data_ptr<at::BFloat16>();
  at::BFloat16* ys = result.data_ptr<at::BFloat16>();
#ifdef _OPENMP
  omp_set_num_threads(at::get_num_threads());  // this build's OpenMP runtime, held to torch's thread count
#endif
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(in);
    for (int64_t n = begin; n < end; ++n) {
      const at::BFloat16* row = ws + n * in;
      int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; k + 8 <= in; k += 8) {  // a bfloat16 is the top half of its float32
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
        _mm256_storeu_ps(w.data() + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
      }
#endif
      for (; k < in; ++k) w[k] = to_float(row[k]);
      for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX2__) && defined(__FMA__)
        const float value = width == 8 ? dot8(xs + r * in, w.data(), in) : dot(xs + r * in, w.data(), in, width);
#else
        const float value = dot(xs + r * in, w.data(), in, width);
#endif
        ys[r * out + n] = at::BFloat16(value);
      }
    }
  });
  return result;
}

namespace {

constexpr int kLanes = 4;

// How many inputs precede the 16-byte boundary that a weight row's vectors start at (1 to 4).
inline int64_t peel_of(const float* w) {
  return kLanes - static_cast<int64_t>((reinterpret_cast<std::uintptr_t>(w) / sizeof(float)) % kLanes);
}

// Each input row's sums for O outputs of the inputs before the vectors (`peel` of them), added one by one.
template <int R, int O>
inline void heads(const float* const* x, const float* const* w, int64_t len, int64_t peel, float (&head)[R][O]) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = 0.0f;
      for (int64_t j = 0; j < peel && j < len; ++j) { const float p = w[o][j] * x[r][j]; s = s + p; }
      head[r][o] = s;
    }
}

// Each (row, output)'s 4 lanes summed as (0 + 2) + (1 + 3), then the inputs after the vectors added one by one.
template <int R, int O>
inline void finish(const float* const* x, const float* const* w, int64_t len, int64_t tail,
                   const float (&lanes)[R][O][kLanes], float* y, int64_t stride) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      const float* a = lanes[r][o];
      float v = (a[0] + a[2]) + (a[1] + a[3]);
      for (int64_t j = tail; j < len; ++j) { const float p = w[o][j] * x[r][j]; v = v + p; }
      y[r * stride + o] = v;
    }
}

// O outputs (weight rows w[0..O), same peel) for R input rows x[0..R) -> y[r * stride + o], each in MKL's order.
template <int R, int O>
inline void block(const float* const* x, const float* const* w, int64_t len, int64_t peel, float* y, int64_t stride) {
  float head[R][O];
  heads<R, O>(x, w, len, peel, head);
  const int64_t start = peel < len ? peel : len;
  const int64_t tail = start + (len - start) / kLanes * kLanes;
  float lanes[R][O][kLanes];
#if defined(__AVX__)
  if constexpr (O % 2 == 0) {  // two outputs' 4 lanes in one 8-lane register: the same operations, lane for lane
    __m256 acc[R][O / 2];
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; o += 2)
        acc[r][o / 2] = _mm256_setr_ps(head[r][o], 0.0f, 0.0f, 0.0f, head[r][o + 1], 0.0f, 0.0f, 0.0f);
    for (int64_t j = start; j < tail; j += kLanes) {
      __m256 wv[O / 2];
      for (int o = 0; o < O; o += 2)
        wv[o / 2] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(w[o] + j)), _mm_loadu_ps(w[o + 1] + j), 1);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x[r] + j));
        for (int o = 0; o < O / 2; ++o) acc[r][o] = _mm256_add_ps(acc[r][o], _mm256_mul_ps(wv[o], xv));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; o += 2) _mm256_storeu_ps(lanes[r][o], acc[r][o / 2]);
    finish<R, O>(x, w, len, tail, lanes, y, stride);
    return;
  }
#endif
#if defined(__SSE2__)
  __m128 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm_setr_ps(head[r][o], 0.0f, 0.0f, 0.0f);
  for (int64_t j = start; j < tail; j += kLanes) {
    __m128 wv[O];
    for (int o = 0; o < O; ++o) wv[o] = _mm_loadu_ps(w[o] + j);
    for (int r = 0; r < R; ++r) {
      const __m128 xv = _mm_loadu_ps(x[r] + j);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm_add_ps(acc[r][o], _mm_mul_ps(wv[o], xv));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) _mm_storeu_ps(lanes[r][o], acc[r][o]);
#else
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      lanes[r][o][0] = head[r][o];
      lanes[r][o][1] = lanes[r][o][2] = lanes[r][o][3] = 0.0f;
      for (int64_t j = start; j < tail; j += kLanes)
        for (int l = 0; l < kLanes; ++l) { const float p = w[o][j + l] * x[r][j + l]; lanes[r][o][l] = lanes[r][o][l] + p; }
    }
#endif
  finish<R, O>(x, w, len, tail, lanes, y, stride);
}

// O outputs for every input row, four rows at a time (R * O independent accumulators keep the adders busy).
template <int O>
inline void outputs(const float* xs, int64_t rows, const float* const* w, int64_t in, int64_t peel, float* y, int64_t out) {
  int64_t r = 0;
  const float* x[4];
  for (; r + 4 <= rows; r += 4) {
    for (int q = 0; q < 4; ++q) x[q] = xs + (r + q) * in;
    block<4, O>(x, w, in, peel, y + r * out, out);
  }
  for (int q = 0; r + q < rows; ++q) x[q] = xs + (r + q) * in;
  switch (rows - r) {
    case 3: block<3, O>(x, w, in, peel, y + r * out, out); break;
    case 2: block<2, O>(x, w, in, peel, y + r * out, out); break;
    case 1: block<1, O>(x, w, in, peel, y + r * out, out); break;
    default: break;
  }
}

// A float32 product's operands: x (rows, in), weight (out, in), result y (rows, out), all contiguous.
struct F32Product {
  const float* xs;
  int64_t rows, in;
  const float* ws;
  float* ys;
  int64_t out;
};

// The frame both float32 kernels share: the checks, the result, and `body(product, begin, end)` for the weight rows
// [begin, end), spread over torch's threads.
template <typename Body>
torch::Tensor f32_product(const torch::Tensor& x, const torch::Tensor& weight, const Body& body) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes (rows, in), (out, in)");
  TORCH_CHECK(weight.is_contiguous(), "a contiguous weight");
  auto xc = x.contiguous();
  auto result = torch::empty({xc.size(0), weight.size(0)}, x.options());
  const F32Product p{xc.data_ptr<float>(), xc.size(0), xc.size(1), weight.data_ptr<float>(), result.data_ptr<float>(),
                     weight.size(0)};
#ifdef _OPENMP
  omp_set_num_threads(at::get_num_threads());
#endif
  at::parallel_for(0, p.out, 16, [&](int64_t begin, int64_t end) { body(p, begin, end); });
  return result;
}
}  // namespace

// x: (rows, in) float32, weight: (out, in) float32, contiguous.
torch::Tensor f32_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  return f32_product(x, weight, [](const F32Product& p, int64_t begin, int64_t end) {
    const float *xs = p.xs, *ws = p.ws;
    const int64_t rows = p.rows, in = p.in, out = p.out;
    float* ys = p.ys;
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
      const float* w[4] = {ws + n * in, ws + (n + 1) * in, ws + (n + 2) * in, ws + (n + 3) * in};
      const int64_t peel = peel_of(w[0]);
      if (peel == peel_of(w[1]) && peel == peel_of(w[2]) && peel == peel_of(w[3])) {
        outputs<4>(xs, rows, w, in, peel, ys + n, out);
      } else {
        for (int o = 0; o < 4; ++o) outputs<1>(xs, rows, w + o, in, peel_of(w[o]), ys + n + o, out);
      }
    }
    for (; n < end; ++n) {
      const float* w[1] = {ws + n * in};
      outputs<1>(xs, rows, w, in, peel_of(w[0]), ys + n, out);
    }
  });
}

#if defined(__AVX512F__)
namespace {

constexpr int64_t kAhead = 4;  // weight rows the loads prefetch ahead

// R input rows x[0..R) against one weight row w -> y[r * stride], each in MKL's AVX-512 one-row order.
template <int R>
inline void rows16(const float* const* x, const float* w, int64_t len, float* y, int64_t stride) {
  if (len == 0) {
    for (int r = 0; r < R; ++r) y[r * stride] = 0.0f;
    return;
  }
  const int64_t vectors = (len - 1) / 16, left = (len - 1) - 16 * vectors;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(w[0] * x[r][0]));
  for (int64_t v = 0; v < vectors; ++v) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * v + kAhead * len), _MM_HINT_T0);  // rows ahead, from memory
    const __m512 wv = _mm512_loadu_ps(w + 1 + 16 * v);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + 1 + 16 * v), acc[r]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
  const __m512 wv = _mm512_maskz_loadu_ps(mask, w + 1 + 16 * vectors);
  for (int r = 0; r < R; ++r)
    y[r * stride] = finish_order16(acc[r], wv, _mm512_maskz_loadu_ps(mask, x[r] + 1 + 16 * vectors), mask);
}

}  // namespace
#endif

// x: (rows, in) float32, weight: (out, in) float32, contiguous -> (rows, out), each row as MKL's one-row product
// rounds it on AVX-512 CPUs where it takes this path (an AMX Xeon, family 6 model 167: found by summing +M, -M and
// ones, docs/exactness.md): per output, lane 0 of 16 starts at the first input's product, the next whole 16-input
// vectors are fused-multiply-added lane by lane, the lanes summed by halves (`halves`); the 1 to 15 inputs left are
// fused-multiply-added into a fresh vector whose lane 0 holds that sum, summed by halves again. Each weight row is
// read from memory once and stays in L1 for every input row.
torch::Tensor f32_rows16(const torch::Tensor& x, const torch::Tensor& weight) {
#if defined(__AVX512F__)
  return f32_product(x, weight, [](const F32Product& p, int64_t begin, int64_t end) {
    const float *xs = p.xs, *ws = p.ws;
    const int64_t rows = p.rows, in = p.in, out = p.out;
    float* ys = p.ys;
    const float* xr[8];
    for (int64_t n = begin; n < end; ++n) {
      const float* w = ws + n * in;
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8) {
        for (int q = 0; q < 8; ++q) xr[q] = xs + (r + q) * in;
        rows16<8>(xr, w, in, ys + r * out + n, out);
      }
      for (int q = 0; r + q < rows; ++q) xr[q] = xs + (r + q) * in;
      switch (rows - r) {
        case 7: rows16<7>(xr, w, in, ys + r * out + n, out); break;
        case 6: rows16<6>(xr, w, in, ys + r * out + n, out); break;
        case 5: rows16<5>(xr, w, in, ys + r * out + n, out); break;
        case 4: rows16<4>(xr, w, in, ys + r * out + n, out); break;
        case 3: rows16<3>(xr, w, in, ys + r * out + n, out); break;
        case 2: rows16<2>(xr, w, in, ys + r * out + n, out); break;
        case 1: rows16<1>(xr, w, in, ys + r * out + n, out); break;
        default: break;
      }
    }
  });
#else
  TORCH_CHECK(false, "built without avx512f");
#endif
}

// Whether this build has `f32_rows16` (compiled for a CPU with avx512f).
bool has_f32_rows16() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

// 16 vectors of 16 dwords (row j: pairs p0..p15 of output j) -> out[p] = pair p of outputs 0..15
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int g = 0; g < 4; ++g) {
    t[4 * g] = _mm512_unpacklo_epi32(r[4 * g], r[4 * g + 1]);
    t[4 * g + 1] = _mm512_unpackhi_epi32(r[4 * g], r[4 * g + 1]);
    t[4 * g + 2] = _mm512_unpacklo_epi32(r[4 * g + 2], r[4 * g + 3]);
    t[4 * g + 3] = _mm512_unpackhi_epi32(r[4 * g + 2], r[4 * g + 3]);
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    out[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

}  // namespace
#endif

// x (rows, in) and weight (out, in) bfloat16, `in` even -> (rows, out) bfloat16, as oneDNN's one-row product on CPUs
// with avx512_bf16 rounds each row (see the top of this file); `block`: inputs a fresh accumulator takes.
torch::Tensor bf16_pair_rows(const torch::Tensor& x, const torch::Tensor& weight, int64_t block) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes (rows, in), (out, in)");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), N = wc.size(0);
  TORCH_CHECK(K % 2 == 0 && block % 32 == 0, "an even number of inputs, blocks of whole 16-pair steps");
  auto out = torch::empty({R, N}, x.options());
  const auto* X = reinterpret_cast<const int32_t*>(xc.data_ptr<at::BFloat16>());  // pairs
  const auto* W = reinterpret_cast<const int*>(wc.data_ptr<at::BFloat16>());
  auto* Y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t pairs = K / 2, tiles = (N + 15) / 16;
  constexpr int64_t kRows = 8;  // input rows whose accumulators stay in registers
#ifdef _OPENMP
  omp_set_num_threads(at::get_num_threads());  // this build's OpenMP runtime, held to torch's thread count
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * 16, lanes = std::min<int64_t>(16, N - o0);
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int>(pairs)));
      for (int64_t r0 = 0; r0 < R; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, R - r0);
        __m512 total[kRows], acc[kRows];
        for (int64_t b = 0; b < pairs; b += block / 2) {
          const int64_t bend = std::min<int64_t>(pairs, b + block / 2);
          for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
          int64_t p = b;
          for (; p + 16 <= bend; p += 16) {
            __m512i loaded[16], w[16];
            for (int64_t j = 0; j < 16; ++j)
              loaded[j] = j < lanes ? _mm512_loadu_si512(W + (o0 + j) * pairs + p) : _mm512_setzero_si512();
            transpose16(loaded, w);
            for (int64_t q = 0; q < 16; ++q)
              for (int64_t r = 0; r < rows; ++r) {
                const __m512i xv = _mm512_set1_epi32(X[(r0 + r) * pairs + p + q]);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)xv, (__m512bh)w[q]);
              }
          }
          for (; p < bend; ++p) {
            const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, W + o0 * pairs + p, 4);
            for (int64_t r = 0; r < rows; ++r) {
              const __m512i xv = _mm512_set1_epi32(X[(r0 + r) * pairs + p]);
              acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)xv, (__m512bh)w);
            }
          }
          for (int64_t r = 0; r < rows; ++r) total[r] = b == 0 ? acc[r] : _mm512_add_ps(total[r], acc[r]);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m256bh y = _mm512_cvtneps_pbh(total[r]);
          _mm256_mask_storeu_epi16(Y + (r0 + r) * N + o0, mask, (__m256i)y);
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "built without avx512_bf16");
#endif
}

// Whether this build has `bf16_pair_rows` (compiled for a CPU with avx512_bf16).
bool has_bf16_pair_rows() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_pair_rows", &bf16_pair_rows);
  m.def("has_bf16_pair_rows", &has_bf16_pair_rows);
  m.def("bf16_rows", &bf16_rows);
  m.def("f32_rows", &f32_rows);
  m.def("f32_rows16", &f32_rows16);
  m.def("has_f32_rows16", &has_f32_rows16);
}
