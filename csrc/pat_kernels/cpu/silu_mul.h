// SiLU-and-mul of one row with torch's formula's bits (silu_mul.cpp says how), for the kernels that apply
// it: silu_mul.cpp's own op and the MoE experts (moe_experts.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
#define PAT_SILU_AVX512
#elif defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#define PAT_SILU_AVX2
#endif

namespace pat_silu {

inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }

#if defined(PAT_SILU_AVX512)
constexpr int64_t kFloatLanes = 16;
#elif defined(PAT_SILU_AVX2)
constexpr int64_t kFloatLanes = 8;
#else
constexpr int64_t kFloatLanes = 0;  // no vector path: torch's scalar exp for every element
#endif

// torch's vector silu, `count` floats (a multiple of the lanes) at a time, times `u` when given.
inline void silu_vector(const float* g, const float* u, float* y, int64_t count) {
#if defined(PAT_SILU_AVX512)
  for (int64_t i = 0; i < count; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(x, _mm512_set1_ps(-0.0f)));  // exp(-x), torch's neg
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(y + i, u ? _mm512_mul_ps(s, _mm512_loadu_ps(u + i)) : s);
  }
#elif defined(PAT_SILU_AVX2)
  for (int64_t i = 0; i < count; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(y + i, u ? _mm256_mul_ps(s, _mm256_loadu_ps(u + i)) : s);
  }
#else
  for (int64_t i = 0; i < count; ++i) y[i] = u ? silu_scalar(g[i]) * u[i] : silu_scalar(g[i]);
#endif
}

// The elements of a row that torch's loop takes through its vectors: whole steps of two vectors of the
// dtype (a bfloat16 vector holds twice the elements of a float one).
inline int64_t vector_part(int64_t n, int64_t dtype_lanes) {
  return dtype_lanes ? n / (2 * dtype_lanes) * (2 * dtype_lanes) : 0;
}

inline void row_f32(const float* g, const float* u, float* y, int64_t n) {
  const int64_t whole = vector_part(n, kFloatLanes);
  silu_vector(g, u, y, whole);
  for (int64_t i = whole; i < n; ++i) y[i] = silu_scalar(g[i]) * u[i];
}

// bfloat16: silu in float rounded to bfloat16, then the product of the two bfloat16 values in float, rounded.
inline void row_bf16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* y, int64_t n) {
  constexpr int64_t kChunk = 64;  // a multiple of every vector part's step
  const int64_t whole = vector_part(n, 2 * kFloatLanes);
  float gf[kChunk], sf[kChunk];
  for (int64_t i = 0; i < whole; i += kChunk) {
    const int64_t m = std::min<int64_t>(kChunk, whole - i);
    for (int64_t j = 0; j < m; ++j) gf[j] = static_cast<float>(g[i + j]);
    silu_vector(gf, nullptr, sf, m);
    for (int64_t j = 0; j < m; ++j) {
      y[i + j] = c10::BFloat16(static_cast<float>(c10::BFloat16(sf[j])) * static_cast<float>(u[i + j]));
    }
  }
  for (int64_t i = whole; i < n; ++i) {
    const c10::BFloat16 s(silu_scalar(static_cast<float>(g[i])));
    y[i] = c10::BFloat16(static_cast<float>(s) * static_cast<float>(u[i]));
  }
}

}  // namespace pat_silu
