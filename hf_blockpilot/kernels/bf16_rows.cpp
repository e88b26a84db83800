// Several rows of a bfloat16 linear, each row rounded exactly as PyTorch's one-row CPU kernel rounds it.
//
// PyTorch computes a one-row bfloat16 product on CPUs without native bfloat16 matrix instructions as one dot
// product per output, in float32 arithmetic (ATen's `dot_with_fp32_arith`): 8 vector accumulators of W float
// lanes (W = the CPU capability's float vector width) take fused multiply-adds over blocks of 8 * W inputs, are
// summed pairwise (register i += register i + 4, + 2, + 1), then across lanes by a butterfly (lane i += lane
// i ^ W/2, ..., i ^ 1); a remainder of whole 2W-input vectors goes through one more accumulator, added the same
// way; single leftover inputs are added one by one. The result is rounded to bfloat16 (nearest, ties to even).
//
// Several rows through the same kernel cost as many passes over the weight, each converting it to float32 again.
// Here each output's weight row is converted once and reused for every input row, with the same operations in
// the same order: fmaf for the fused steps and plain float additions, compiled with -ffp-contract=off, so the
// results do not depend on how the compiler vectorizes. Whether this matches the installed PyTorch on this CPU
// is probed bit for bit per weight shape before use (hf_blockpilot/row_kernel.py); nothing assumes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
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
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& weight, int64_t width) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear_rows", &linear_rows); }
