// Shared by the kernels of this folder (AVX-512 builds).
#pragma once
#include <immintrin.h>

// A 16-lane vector summed by halves: lanes (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1): how MKL's AVX-512 float32
// gemv sums its lanes.
inline float halves(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// The end of MKL's AVX-512 one-row float32 order: the lanes of `acc` summed by halves, then the 1-15 inputs left
// (`w_left` times `x_left` in the lanes of `mask`) fused-multiply-added into a fresh vector whose lane 0 holds that
// sum, summed by halves again (none left: `mask` 0).
inline float finish_order16(__m512 acc, __m512 w_left, __m512 x_left, __mmask16 mask) {
  const float sum = halves(acc);
  if (!mask) return sum;
  const __m512 seeded = _mm512_maskz_mov_ps(1, _mm512_set1_ps(sum));
  return halves(_mm512_mask3_fmadd_ps(w_left, x_left, seeded, mask));
}
