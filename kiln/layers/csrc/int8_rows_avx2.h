// The AVX2 form of the packed-weight kernels' int8 paths (q6k_mm.cpp, kquant_mm.cpp), for CPUs
// without AVX512-VNNI and VBMI (AVX2 desktops, Skylake and Cascade Lake servers): a quad of
// columns of PyTorch's CPU int4 layout (blocks of 64 rows, a column's 32 bytes side by side,
// byte j holding row j's code in its low nibble and row j + 32's in its high one) is turned
// into vpmaddubsw's lanes by two rounds of unpacks, where AVX-512 takes one vpermt2b. Each
// 32-bit lane then holds one row's four columns, and vpmaddubsw with vpmaddwd sums them into
// int32: the sums vpdpbusd makes, exact in any order, so the portable loops stay the reference
// bit for bit. (llama.cpp's AVX2 dot products take the same two instructions.)
//
// The unpacks leave the rows in their own order: ymm a (0..7) of a block's codes holds in lane
// l the row lane_row(a, l). Per-row tables (scales, d, the output) are read and written in
// that order, two runs of four rows a vector.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kiln_int8_rows_avx2 {

// The row of a 64-row block that lane l (0..7) of ymm a (0..7) holds
constexpr int lane_row(int a, int l) { return 32 * (a / 4) + 4 * (a % 4) + 16 * (l / 4) + l % 4; }

// The first of ymm a's two runs of four rows; the second starts 16 rows later
constexpr int lane_base(int a) { return lane_row(a, 0); }

// A quad of columns (the 128 bytes at `low`) as four ymm whose 32-bit lanes hold a row's four
// column bytes: x[a] lane l is row lane_row(a, l) in the low nibbles, that row + 32 in the high.
inline void quad_bytes(const uint8_t* low, __m256i x[4]) {
  const auto* v = reinterpret_cast<const __m256i*>(low);
  const __m256i c0 = _mm256_loadu_si256(v), c1 = _mm256_loadu_si256(v + 1);
  const __m256i c2 = _mm256_loadu_si256(v + 2), c3 = _mm256_loadu_si256(v + 3);
  const __m256i lo01 = _mm256_unpacklo_epi8(c0, c1), hi01 = _mm256_unpackhi_epi8(c0, c1);
  const __m256i lo23 = _mm256_unpacklo_epi8(c2, c3), hi23 = _mm256_unpackhi_epi8(c2, c3);
  x[0] = _mm256_unpacklo_epi16(lo01, lo23);  // rows 0..3 | 16..19
  x[1] = _mm256_unpackhi_epi16(lo01, lo23);  // rows 4..7 | 20..23
  x[2] = _mm256_unpacklo_epi16(hi01, hi23);  // rows 8..11 | 24..27
  x[3] = _mm256_unpackhi_epi16(hi01, hi23);  // rows 12..15 | 28..31
}

// A quad's 4-bit codes, w[a] for a = 0..7 in lane_row order (w[a + 4]: the high nibbles)
inline void quad_nibbles(const uint8_t* low, __m256i w[8]) {
  const __m256i four = _mm256_set1_epi8(0x0f);
  __m256i x[4];
  quad_bytes(low, x);
  for (int a = 0; a < 4; ++a) {
    w[a] = _mm256_and_si256(x[a], four);
    w[a + 4] = _mm256_and_si256(_mm256_srli_epi16(x[a], 4), four);  // bits kept inside a byte
  }
}

// The 16 bytes at p in both halves of a ymm
inline __m256i both_halves(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Each 32-bit lane of h shifted left by `lo` (lanes 0..3) and `hi` (lanes 4..7); a negative
// count shifts right. The two counts must not have opposite signs.
inline __m256i shift_halves(__m256i h, int lo, int hi) {
  if (lo >= 0 && hi >= 0) return _mm256_sllv_epi32(h, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
  return _mm256_srlv_epi32(h, _mm256_setr_epi32(-lo, -lo, -lo, -lo, -hi, -hi, -hi, -hi));
}

// Four int8 values of a row's plane at column kk in every lane
inline __m256i four_bytes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// One plane's row sums over QUADS quads of codes w[quad][v] (codes 0 .. MAX_CODE, V vectors of
// rows a quad), the plane's bytes of the row at x: acc[v] lane l the int32 sum of the codes times
// the values. vpmaddubsw adds a lane's two products in 16 bits, and runs of RUN quads are summed
// in 16 bits before vpmaddwd widens them: RUN * 2 * MAX_CODE * 127 must fit (the planes are int8
// in -127..127), so none saturates.
template <int QUADS, int MAX_CODE, int V>
inline void plane_sums(const __m256i (*w)[V], const int8_t* x, __m256i acc[V]) {
  constexpr int FIT = 32767 / (2 * MAX_CODE * 127), RUN = FIT < QUADS ? FIT : QUADS;
  static_assert(RUN >= 1 && QUADS % RUN == 0, "a run of 16-bit sums must divide the quads");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i xb[QUADS];
  for (int quad = 0; quad < QUADS; ++quad) xb[quad] = four_bytes(x + 4 * quad);
  for (int v = 0; v < V; ++v) {
    __m256i sum = _mm256_setzero_si256();
    for (int run = 0; run < QUADS; run += RUN) {
      __m256i s16 = _mm256_setzero_si256();
      for (int quad = run; quad < run + RUN; ++quad)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[quad][v], xb[quad]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(s16, ones));
    }
    acc[v] = sum;
  }
}

// The row's P planes (`plane_stride` bytes apart) combined as the int8-row kernels combine them:
// 256 x0 + x1 with two planes (exact in int32), x0 with one
template <int QUADS, int MAX_CODE, int P>
inline void sub_sums(const __m256i (*w)[8], const int8_t* x, int64_t plane_stride, __m256i acc[8]) {
  plane_sums<QUADS, MAX_CODE, 8>(w, x, acc);
  if constexpr (P == 2) {
    __m256i rest[8];
    plane_sums<QUADS, MAX_CODE, 8>(w, x + plane_stride, rest);
    for (int a = 0; a < 8; ++a) acc[a] = _mm256_add_epi32(_mm256_slli_epi32(acc[a], 8), rest[a]);
  }
}

// A block's 64 per-row values (at p, row order) for ymm a's lanes, as floats
inline __m256 lane_floats(const float* p, int a) {
  const int b = lane_base(a);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + b)), _mm_loadu_ps(p + b + 16), 1);
}

inline void store_lane_floats(float* p, int a, __m256 v) {
  const int b = lane_base(a);
  _mm_storeu_ps(p + b, _mm256_castps256_ps128(v));
  _mm_storeu_ps(p + b + 16, _mm256_extractf128_ps(v, 1));
}

// A block's 64 per-row bytes (at p, row order) for ymm a's lanes, widened to floats: signed
// (int8) or unsigned (uint8)
template <bool SIGNED>
inline __m256 lane_bytes(const void* p, int a) {
  const auto* bytes = static_cast<const uint8_t*>(p) + lane_base(a);
  int32_t lo, hi;
  std::memcpy(&lo, bytes, 4);
  std::memcpy(&hi, bytes + 16, 4);
  const __m128i eight = _mm_setr_epi32(lo, hi, 0, 0);
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
}

}  // namespace kiln_int8_rows_avx2
#endif
