// The vector layer of kiln's CPU attention kernels (paged_decode.cpp and prefill.h):
// float32 <-> bf16 conversions and W float32 lanes of AVX-512 (16) or AVX2 with FMA (8),
// KILN_SIMD defined where either is; portable code where neither.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline void from_float(float* p, float x) { *p = x; }
inline void from_float(uint16_t* p, float x) {  // round to nearest even, NaN kept
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

// The vector layer: W float32 lanes, AVX-512 (16) or AVX2 with FMA (8); KILN_SIMD where either.
#if defined(__AVX512F__)
#define KILN_SIMD 1
constexpr int64_t W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vpow2(vf p, vf fi) { return _mm512_scalef_ps(p, fi); }  // p * 2^fi
inline vf vfloor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// W int32 lanes; a where x <= y, else b, lane by lane
using vi = __m512i;
inline vi viload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vi viset(int32_t x) { return _mm512_set1_epi32(x); }
inline vf vselect_le(vi x, vi y, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(x, y), b, a); }
inline bool vany_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
inline __m256 vhalves(vf x) {  // the 16 lanes folded to 8
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(x), high);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_SIMD 1
constexpr int64_t W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// p * 2^fi for whole fi in [-126, 0]: the power built in the exponent field
inline vf vpow2(vf p, vf fi) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vfloor(vf x) { return _mm256_floor_ps(x); }
using vi = __m256i;
inline vi viload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi viset(int32_t x) { return _mm256_set1_epi32(x); }
inline vf vselect_le(vi x, vi y, vf a, vf b) { return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(x, y))); }
inline bool vany_gt(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
inline __m256 vhalves(vf x) { return x; }
#endif

#if defined(KILN_SIMD)
// The 8 vectors' sums as one vector of 8 (a transposing add tree: one horizontal reduction
// for 8 keys, where summing each alone costs 8)
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 low = _mm256_hadd_ps(s01, s23), high = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}
inline __m256 vsum8(const vf* a) {
  __m256 halves[8];
  for (int b = 0; b < 8; ++b) halves[b] = vhalves(a[b]);
  return hsum8(halves);
}
#endif

#if defined(KILN_SIMD)
// exp(x) for x <= 0 in every lane: 2^(x log2 e), the integer part in the exponent, the fraction
// by a degree-6 polynomial (relative error about 2e-7, as libm's expf); below -87, exp(-87)
inline vf vexp(vf x) {
  const vf t = vmax(x, vset(-87.f)) * vset(1.44269504088896341f);
  const vf fi = vfloor(t);
  const vf f = t - fi;
  vf p = vset(1.535336188319500e-4f);
  p = vfmadd(p, f, vset(1.339887440266574e-3f));
  p = vfmadd(p, f, vset(9.618437357674640e-3f));
  p = vfmadd(p, f, vset(5.550332471162809e-2f));
  p = vfmadd(p, f, vset(2.402264791363012e-1f));
  p = vfmadd(p, f, vset(6.931472028550421e-1f));
  return vpow2(vfmadd(p, f, vset(1.0f)), fi);
}
#endif

}  // namespace
