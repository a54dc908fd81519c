// Rows times a weight kept in GGUF's Q5_K or Q4_K on the CPU, at the file's own bits: per 32
// columns w = d * sc * q - dmin * mn, q 0..31 (Q5_K) or 0..15 (Q4_K), sc and mn 6-bit unsigned
// integers per 32 columns, d and dmin one float each per 256.
//
// The layout (kiln/layers/kquant_layout.py writes it), in blocks of 64 output rows:
//   low  [N / 64, K, 32] bytes: q's low 4 bits in PyTorch's CPU int4 layout (byte j of a
//        column holds row j's in its low nibble and row j + 32's in its high one);
//   high [N / 64, K / 4, 32] bytes (Q5_K only): q's top bit, a quad of columns 32 bytes: with
//        p = 4 r + i, byte p % 32 holds in bit 4 (p / 32) + j the bit of row 16 j + r at the
//        quad's column i;
//   scales_mins [N / 64, K / 32, 2, 64] uint8: a block's 64 scales, then its 64 mins, per 32
//        columns; d_dmin [N / 64, K / 256, 2, 64] float32 likewise per 256.
// Each of the four is one sequential stream per block: in [K / 32, N] tables (as Q6_K's) each
// 32 columns' scales lay n bytes from the last, and a one-row product ran at 0.65-0.97x the
// int4 kernel's speed on the same Q4_K matrices; block-major, the prefetchers follow them.
// 5.75 (Q5_K) or 4.75 (Q4_K) bits a weight; the file's are 5.5 and 4.5 (it packs the 6-bit
// integers and keeps d in fp16); a Q5_K weight dequantized to bf16 streams 16.
//
// Rows go in as int8, one or two planes per 32 columns (kiln_int8_rows), as in q6k_mm.cpp: a
// quad of columns is two vpermt2b gathers, the nibbles (and top bits) merged into q, and one
// vpdpbusd per 16 outputs and plane. A sub-block of 32 columns is one chunk of the rows: its
// int32 sums are scaled by sc and the chunk's scale; the min term, mn times the chunk's sum of
// the quantized row, is added per 256 columns times dmin.
//
// Built at first use by kiln/layers/kquant_kernel.py (-O3 -march=native -fopenmp). The portable
// loops compute the same sums in the same order: the reference the tests hold the vector path
// to, bit for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "int8_rows.h"
#include "int8_rows_avx2.h"
#include "moe_route.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kiln_bf16::float_to_bf16;
using kiln_int8_rows::CHUNK;
using kiln_int8_rows::prefetch;
#if defined(__AVX512F__)
using kiln_int8_rows::quad_index;
#endif

constexpr int64_t BLOCK = 64;   // output rows a block
constexpr int64_t SUB = 32;     // columns a scale and min: one chunk of the rows
constexpr int64_t SUPER = 256;  // columns a d and dmin
static_assert(SUB == CHUNK, "a sub-block is one chunk of the int8 rows");

struct Problem {
  const int8_t* xq;       // [planes, rows, k]
  const float* xscale;    // [rows, k / CHUNK]: the first plane's scale
  const float* row_sums;  // [rows, k / SUB]: the quantized row's sum over each 32, scaled
  int64_t rows, k, planes;
  int bits;               // 5: the high plane holds q's top bit; 4: no high plane
  const uint8_t* low;
  const uint8_t* high;
  const uint8_t* scales_mins;
  const float* d_dmin;
  int64_t n;
  float* out;             // [rows, n], added into
};

// A block's 64 scales of sub-block `sub` (its mins follow them)
inline const uint8_t* scales_of(const Problem& p, int64_t block, int64_t sub) {
  return p.scales_mins + (block * (p.k / SUB) + sub) * 2 * BLOCK;
}

// A block's 64 d of super-block `s` (its dmin follow them)
inline const float* d_of(const Problem& p, int64_t block, int64_t s) {
  return p.d_dmin + (block * (p.k / SUPER) + s) * 2 * BLOCK;
}

inline float chunk_scale(const Problem& p, int64_t m, int64_t kk) {
  return kiln_int8_rows::chunk_scale(p.xscale, p.k, static_cast<int>(p.planes), m, kk);
}

inline int32_t combined(const Problem& p, int64_t m, int64_t kk) {
  return kiln_int8_rows::combined(p.xq, p.rows, p.k, static_cast<int>(p.planes), m, kk);
}

inline int q_at(const Problem& p, int64_t block, int64_t row, int64_t kk) {
  const uint8_t lo = p.low[(block * p.k + kk) * 32 + row % 32];
  const int low4 = row < 32 ? lo & 15 : lo >> 4;
  if (p.bits == 4) return low4;
  const int64_t pos = 4 * (row % 16) + kk % 4;
  const uint8_t hi = p.high[(block * p.k / 4 + kk / 4) * 32 + pos % 32];
  return low4 | (((hi >> (4 * (pos / 32) + row / 16)) & 1) << 4);
}

// The reference: one block, every row, the vector path's sums and roundings in scalar code.
void run_block_portable(const Problem& p, int64_t block) {
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t j = 0; j < BLOCK; ++j) {
      const int64_t col = block * BLOCK + j;
      float* o = p.out + m * p.n + col;
      for (int64_t s = 0; s < p.k / SUPER; ++s) {
        float facc = 0.0f, macc = 0.0f;
        for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
          int32_t acc = 0;
          for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; ++kk)
            acc += q_at(p, block, j, kk) * combined(p, m, kk);
          const float sc = static_cast<float>(scales_of(p, block, sub)[j]);
          facc = std::fma(static_cast<float>(acc), sc * chunk_scale(p, m, sub * SUB), facc);
        }
        for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
          const float mn = static_cast<float>(scales_of(p, block, sub)[BLOCK + j]);
          macc = std::fma(mn, p.row_sums[m * (p.k / SUB) + sub], macc);
        }
        *o = std::fma(facc, d_of(p, block, s)[j], *o);
        *o = std::fma(-macc, d_of(p, block, s)[BLOCK + j], *o);
      }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KILN_KQUANT_VNNI 1
constexpr int64_t CODES_AHEAD = 1024;  // bytes of low nibbles asked for ahead (as int4_mm.cpp)

// A quad of columns as q in dpbusd's lanes, outputs 16 j .. 16 j + 15 in w[j].
template <int BITS>
inline void quad_codes(const uint8_t* low, const uint8_t* high, __m512i idx0, __m512i idx1,
                       __m512i w[4]) {
  const __m512i four = _mm512_set1_epi8(0x0f);
  const __m512i a = _mm512_loadu_si512(low), b = _mm512_loadu_si512(low + 64);
  const __m512i q0 = _mm512_permutex2var_epi8(a, idx0, b), q1 = _mm512_permutex2var_epi8(a, idx1, b);
  w[0] = _mm512_and_si512(q0, four);
  w[1] = _mm512_and_si512(q1, four);
  w[2] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), four);
  w[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), four);
  if constexpr (BITS == 5) {
    // the 32 bytes in both halves, the upper half's high nibbles moved down: byte p's low
    // nibble then holds bits j = 0..3 of position p, and bit j goes to bit 4 (16-bit shifts:
    // bit 4 of a byte comes from a lower bit of the same byte)
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
    __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), bytes, 1);
    h = _mm512_mask_srli_epi16(h, 0xFFFF0000u, h, 4);
    const __m512i top = _mm512_set1_epi8(0x10);
    w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
    w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), top));
    w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
    w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), top));
  }
}

inline __m512 sixteen(const uint8_t* table) {  // 16 unsigned bytes as floats
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))));
}

// The super-block's end: out += d facc - dmin sum(mn row_sum), in the portable loops' order.
template <int R>
void finish_super(const Problem& p, int64_t block, int64_t s, int64_t m0, __m512 facc[R][4]) {
  const int64_t first = s * SUPER / SUB, n0 = block * BLOCK;
  for (int j = 0; j < 4; ++j) {
    __m512 macc[R];
    for (int r = 0; r < R; ++r) macc[r] = _mm512_setzero_ps();
    for (int64_t sub = first; sub < first + SUPER / SUB; ++sub) {
      const __m512 mn = sixteen(scales_of(p, block, sub) + BLOCK + 16 * j);
      for (int r = 0; r < R; ++r)
        macc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(p.row_sums[(m0 + r) * (p.k / SUB) + sub]),
                                  macc[r]);
    }
    const __m512 d = _mm512_loadu_ps(d_of(p, block, s) + 16 * j);
    const __m512 dmin = _mm512_loadu_ps(d_of(p, block, s) + BLOCK + 16 * j);
    for (int r = 0; r < R; ++r) {
      float* o = p.out + (m0 + r) * p.n + n0 + 16 * j;
      const __m512 with_d = _mm512_fmadd_ps(facc[r][j], d, _mm512_loadu_ps(o));
      _mm512_storeu_ps(o, _mm512_fnmadd_ps(macc[r], dmin, with_d));
    }
  }
}

// Rows m0 .. m0 + R of one block, P int8 planes: acc[q][r][j] sums outputs 16 j .. + 16.
template <int BITS, int R, int P>
void block_rows(const Problem& p, int64_t block, int64_t m0) {
  const int64_t n0 = block * BLOCK;
  const uint8_t* low = p.low + block * p.k * 32;
  const uint8_t* high = BITS == 5 ? p.high + block * p.k * 8 : nullptr;
  const __m512i idx0 = quad_index(0), idx1 = quad_index(16);
  for (int64_t s = 0; s < p.k / SUPER; ++s) {
    __m512 facc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) facc[r][j] = _mm512_setzero_ps();
    for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
      __m512i acc[P][R][4];
      for (int q = 0; q < P; ++q)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_setzero_si512();
      for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; kk += 4) {
        prefetch(low + kk * 32 + CODES_AHEAD);
        prefetch(low + kk * 32 + CODES_AHEAD + 64);
        if constexpr (BITS == 5)
          if (kk % 8 == 0) prefetch(high + kk * 8 + CODES_AHEAD / 4);
        __m512i w[4];
        quad_codes<BITS>(low + kk * 32, BITS == 5 ? high + kk * 8 : nullptr, idx0, idx1, w);
        for (int q = 0; q < P; ++q)
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, p.xq + (q * p.rows + m0 + r) * p.k + kk, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_dpbusd_epi32(acc[q][r][j], w[j], xb);
          }
      }
      for (int j = 0; j < 4; ++j) {
        const __m512 sc = sixteen(scales_of(p, block, sub) + 16 * j);
        for (int r = 0; r < R; ++r) {
          __m512i sum = acc[0][r][j];
          if constexpr (P == 2) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), acc[1][r][j]);
          const __m512 xs = _mm512_set1_ps(chunk_scale(p, m0 + r, sub * SUB));
          facc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, xs), facc[r][j]);
        }
      }
    }
    finish_super<R>(p, block, s, m0, facc);
  }
}

template <int BITS, int P>
void block_all_rows(const Problem& p, int64_t block) {
  int64_t m = 0;
  for (; m + 2 <= p.rows; m += 2) block_rows<BITS, 2, P>(p, block, m);
  for (; m < p.rows; ++m) block_rows<BITS, 1, P>(p, block, m);
}

void run_block(const Problem& p, int64_t block) {
  if (p.bits == 5)
    p.planes == 2 ? block_all_rows<5, 2>(p, block) : block_all_rows<5, 1>(p, block);
  else
    p.planes == 2 ? block_all_rows<4, 2>(p, block) : block_all_rows<4, 1>(p, block);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_KQUANT_AVX2 1
namespace avx2 = kiln_int8_rows_avx2;
constexpr int64_t CODES_AHEAD = 1024;  // as the AVX-512 path
constexpr int64_t ROW_TILE = 16;  // rows whose float sums a block keeps at once (4 KB)
constexpr int QUADS = SUB / 4;

// A sub-block's eight quads as q in vpmaddubsw's lanes: w[quad][a], lane_row order
template <int BITS>
inline void sub_codes(const uint8_t* low, const uint8_t* high, __m256i w[QUADS][8]) {
  const __m256i top = _mm256_set1_epi8(0x10);
  for (int quad = 0; quad < QUADS; ++quad) {
    avx2::quad_nibbles(low + quad * 128, w[quad]);
    if constexpr (BITS == 5)
      for (int a = 0; a < 4; ++a) {
        // row 16 j + r at column i: bit 4 (p / 32) + j of byte p % 32, p = 4 r + i; ymm a's
        // rows r = 4 a .. 4 a + 3 take bytes 16 (a % 2) .., bits 4 (a / 2) + j, moved to bit 4
        const __m256i h = avx2::both_halves(high + quad * 32 + 16 * (a % 2));
        const int bit = 4 * (a / 2);
        const __m256i j01 = _mm256_and_si256(avx2::shift_halves(h, 4 - bit, 3 - bit), top);
        const __m256i j23 = _mm256_and_si256(avx2::shift_halves(h, 2 - bit, 1 - bit), top);
        w[quad][a] = _mm256_or_si256(w[quad][a], j01);
        w[quad][a + 4] = _mm256_or_si256(w[quad][a + 4], j23);
      }
  }
}

// The super-block's end for rows m0 .. m0 + rows: out += d facc - dmin sum(mn row_sum), in
// the portable loops' order
void finish_super_avx2(const Problem& p, int64_t block, int64_t s, int64_t m0, int64_t rows,
                       const float (*facc)[BLOCK]) {
  const int64_t first = s * SUPER / SUB, n0 = block * BLOCK;
  for (int a = 0; a < 8; ++a) {
    const __m256 d = avx2::lane_floats(d_of(p, block, s), a);
    const __m256 dmin = avx2::lane_floats(d_of(p, block, s) + BLOCK, a);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 macc = _mm256_setzero_ps();
      for (int64_t sub = first; sub < first + SUPER / SUB; ++sub) {
        const __m256 mn = avx2::lane_bytes<false>(scales_of(p, block, sub) + BLOCK, a);
        macc = _mm256_fmadd_ps(mn, _mm256_set1_ps(p.row_sums[(m0 + r) * (p.k / SUB) + sub]), macc);
      }
      float* o = p.out + (m0 + r) * p.n + n0;
      const __m256 with_d = _mm256_fmadd_ps(_mm256_load_ps(facc[r] + 8 * a), d, avx2::lane_floats(o, a));
      avx2::store_lane_floats(o, a, _mm256_fnmadd_ps(macc, dmin, with_d));
    }
  }
}

// Rows m0 .. m0 + rows (at most ROW_TILE) of one block, P int8 planes: the AVX-512 path's sums
// and roundings with each sub-block's codes unpacked once for all the rows.
template <int BITS, int P>
void block_rows_avx2(const Problem& p, int64_t block, int64_t m0, int64_t rows) {
  const uint8_t* low = p.low + block * p.k * 32;
  const uint8_t* high = BITS == 5 ? p.high + block * p.k * 8 : nullptr;
  alignas(32) float facc[ROW_TILE][BLOCK];
  for (int64_t s = 0; s < p.k / SUPER; ++s) {
    std::memset(facc, 0, sizeof(float) * BLOCK * rows);
    for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
      for (int64_t ahead = 0; ahead < SUB * 32; ahead += 64) prefetch(low + sub * SUB * 32 + CODES_AHEAD + ahead);
      if constexpr (BITS == 5)
        for (int64_t ahead = 0; ahead < SUB * 8; ahead += 64) prefetch(high + sub * SUB * 8 + CODES_AHEAD / 4 + ahead);
      __m256i w[QUADS][8];
      sub_codes<BITS>(low + sub * SUB * 32, BITS == 5 ? high + sub * SUB * 8 : nullptr, w);
      __m256 sc[8];
      for (int a = 0; a < 8; ++a) sc[a] = avx2::lane_bytes<false>(scales_of(p, block, sub), a);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        __m256i acc[8];
        avx2::sub_sums<QUADS, (1 << BITS) - 1, P>(w, p.xq + m * p.k + sub * SUB, p.rows * p.k, acc);
        const __m256 xs = _mm256_set1_ps(chunk_scale(p, m, sub * SUB));
        for (int a = 0; a < 8; ++a) {
          float* f = facc[r] + 8 * a;
          _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[a]), _mm256_mul_ps(sc[a], xs),
                                             _mm256_load_ps(f)));
        }
      }
    }
    finish_super_avx2(p, block, s, m0, rows, facc);
  }
}

template <int BITS>
void block_all_rows_avx2(const Problem& p, int64_t block) {
  for (int64_t m = 0; m < p.rows; m += ROW_TILE) {
    const int64_t rows = std::min(ROW_TILE, p.rows - m);
    p.planes == 2 ? block_rows_avx2<BITS, 2>(p, block, m, rows)
                  : block_rows_avx2<BITS, 1>(p, block, m, rows);
  }
}

void run_block(const Problem& p, int64_t block) {
  p.bits == 5 ? block_all_rows_avx2<5>(p, block) : block_all_rows_avx2<4>(p, block);
}
#else
void run_block(const Problem& p, int64_t block) { run_block_portable(p, block); }
#endif

// Each row's quantized sum over each 32 columns (its planes combined as the sums combine them),
// times the chunk's scale: the min term's factor
void row_sums(const Problem& p, float* sums) {
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t sub = 0; sub < p.k / SUB; ++sub) {
      int32_t sum = 0;
      for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; ++kk) sum += combined(p, m, kk);
      sums[m * (p.k / SUB) + sub] = static_cast<float>(sum) * chunk_scale(p, m, sub * SUB);
    }
}

struct Weight {
  const uint8_t* low;
  const uint8_t* high;
  const uint8_t* scales_mins;
  const float* d_dmin;
  int64_t n;
  int bits;

  // Expert e's weight in a stack whose four buffers lie `strides` bytes from one expert's to
  // the next's
  Weight expert(int64_t e, const int64_t* strides) const {
    const auto* dd = reinterpret_cast<const uint8_t*>(d_dmin) + e * strides[3];
    const uint8_t* top = bits == 5 ? high + e * strides[1] : high;  // Q4_K's is empty
    return {low + e * strides[0], top, scales_mins + e * strides[2],
            reinterpret_cast<const float*>(dd), n, bits};
  }
};

void kquant_mm(const float* x, int64_t rows, int64_t k, const Weight& w, float* out, int planes,
               int threads, bool portable) {
  const kiln_int8_rows::QuantizedRows q(x, rows, k, planes, threads);
  std::vector<float> sums(rows * (k / SUB));
  Problem p{q.xq.data(), q.xscale.data(), sums.data(), rows, k, planes, w.bits, w.low, w.high,
            w.scales_mins, w.d_dmin, w.n, out};
  row_sums(p, sums.data());
  std::memset(out, 0, sizeof(float) * rows * w.n);
  kiln_int8_rows::for_each_block(w.n / BLOCK, threads, [&](int64_t b) {
    portable ? run_block_portable(p, b) : run_block(p, b);
  });
}

// A step's experts in one call: group g multiplies rows [starts[g], starts[g] + counts[g]) of x
// by expert experts[g] of `stack` into the same rows of out [rows, n] (rows of no group: zeros),
// every group's blocks in one parallel region. Each group's sums are kquant_mm's on its rows.
void kquant_mm_experts(const float* x, int64_t rows, int64_t k, const Weight& stack,
                       const int64_t* strides, int64_t groups, const int64_t* experts,
                       const int64_t* starts, const int64_t* counts, float* out, int planes,
                       int threads) {
  std::memset(out, 0, sizeof(float) * rows * stack.n);
  std::vector<kiln_int8_rows::QuantizedRows> quantized;
  std::vector<std::vector<float>> sums(groups);
  std::vector<Problem> problems;
  quantized.reserve(groups);
  for (int64_t g = 0; g < groups; ++g) {
    quantized.emplace_back(x + starts[g] * k, counts[g], k, planes, threads);
    sums[g].resize(counts[g] * (k / SUB));
    const Weight w = stack.expert(experts[g], strides);
    problems.push_back({quantized[g].xq.data(), quantized[g].xscale.data(), sums[g].data(),
                        counts[g], k, planes, w.bits, w.low, w.high, w.scales_mins, w.d_dmin,
                        w.n, out + starts[g] * w.n});
    row_sums(problems[g], sums[g].data());
  }
  kiln_int8_rows::for_each_group_block(groups, stack.n / BLOCK, threads,
                                       [&](int64_t g, int64_t b) { run_block(problems[g], b); });
}

// W^T [k, n] in T (float or bf16): q (sc d) - mn dmin, both products exact in float32 (6 + 11
// bits, 5 + 17), the difference rounded once, as the gguf package computes it; then once more
// to bf16. A work item is one column of one block.
template <typename T>
void dequantize_t(const Weight& w, int64_t k, T* out, int threads) {
  const Problem p{nullptr, nullptr, nullptr, 0, k, 0, w.bits, w.low, w.high, w.scales_mins,
                  w.d_dmin, w.n, nullptr};
  const int64_t n = w.n;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < k * (n / BLOCK); ++item) {
    const int64_t kk = item / (n / BLOCK), block = item % (n / BLOCK);
    for (int64_t j = 0; j < BLOCK; ++j) {
      const int64_t col = block * BLOCK + j;
      const uint8_t* sm = scales_of(p, block, kk / SUB);
      const float* dd = d_of(p, block, kk / SUPER);
      const float scale = static_cast<float>(sm[j]) * dd[j];
      const float minimum = static_cast<float>(sm[BLOCK + j]) * dd[BLOCK + j];
      const float value = std::fma(static_cast<float>(q_at(p, block, j, kk)), scale, -minimum);
      if constexpr (std::is_same_v<T, uint16_t>)
        out[kk * n + col] = float_to_bf16(value);
      else
        out[kk * n + col] = value;
    }
  }
}

}  // namespace

extern "C" {

// The vector path this build has: 2 AVX512-VNNI with VBMI, 1 AVX2 with FMA, 0 none (the engine
// then keeps Q5_K dequantized and Q4_K on the int4 kernel)
int kiln_kquant_isa() {
#if defined(KILN_KQUANT_VNNI)
  return 2;
#elif defined(KILN_KQUANT_AVX2)
  return 1;
#else
  return 0;
#endif
}

// out [rows, n] (out_dtype 0 float32, 1 bf16) = x [rows, k] (x_dtype likewise) times the
// weight of `bits` (4 or 5; high unused at 4); n a multiple of 64, k of 256; the rows as
// `planes` (1 or 2) int8 planes. `portable`: the scalar loops (the tests' reference).
void kiln_kquant_mm(int x_dtype, const void* x, int64_t rows, int64_t k, int bits,
                    const uint8_t* low, const uint8_t* high, const uint8_t* scales_mins,
                    const float* d_dmin, int64_t n, int out_dtype, void* out, int planes,
                    int threads, int portable) {
  const Weight w{low, high, scales_mins, d_dmin, n, bits == 5 ? 5 : 4};
  kiln_bf16::in_float32(x_dtype, x, rows, k, out_dtype, out, n, [&](const float* xs, float* ys) {
    kquant_mm(xs, rows, k, w, ys, planes == 2 ? 2 : 1, threads, portable != 0);
  });
}

// kiln_kquant_mm for a step's experts (kquant_mm_experts): x [rows, k] sorted by expert, the
// weights a stack of experts whose buffers lie `strides` bytes apart, out [rows, n] (rows of no
// group: zeros)
void kiln_kquant_mm_experts(int x_dtype, const void* x, int64_t rows, int64_t k, int bits,
                            const uint8_t* low, const uint8_t* high, const uint8_t* scales_mins,
                            const float* d_dmin, const int64_t* strides, int64_t n,
                            int64_t groups, const int64_t* experts, const int64_t* starts,
                            const int64_t* counts, int out_dtype, void* out, int planes,
                            int threads) {
  const Weight stack{low, high, scales_mins, d_dmin, n, bits == 5 ? 5 : 4};
  kiln_bf16::in_float32(x_dtype, x, rows, k, out_dtype, out, n, [&](const float* xs, float* ys) {
    kquant_mm_experts(xs, rows, k, stack, strides, groups, experts, starts, counts, ys,
                      planes == 2 ? 2 : 1, threads);
  });
}

// W^T [k, n] (out_dtype 0 float32, 1 bf16): the large-batch path's weight
void kiln_kquant_dequantize_t(int bits, const uint8_t* low, const uint8_t* high,
                              const uint8_t* scales_mins, const float* d_dmin, int64_t n,
                              int64_t k, int out_dtype, void* out, int threads) {
  const Weight w{low, high, scales_mins, d_dmin, n, bits == 5 ? 5 : 4};
  if (out_dtype == 1)
    dequantize_t(w, k, static_cast<uint16_t*>(out), threads);
  else
    dequantize_t(w, k, static_cast<float*>(out), threads);
}

}  // extern "C"
