// Rows times a 4-bit packed weight on the CPU, read in PyTorch's own CPU int4 layout.
//
// The weight is what aten's _convert_weight_to_int4pack_for_cpu makes (kiln writes it with
// cpu_pack): [N / B, K, B / 2] bytes, blocks of B output rows (64 where PyTorch has AVX-512, 32
// with AVX2), byte j of a block's column k holding row j's code in its low nibble and row
// j + B / 2's in its high one; beside it a [K / G, N, 2] bfloat16 table of (scale, zero) per
// group of G columns, w = (code - 8) * scale + zero. So no second copy of the weight exists:
// this kernel and aten's read the same bytes. Where every zero is 0 (GGUF's Q4_0, symmetric
// GPTQ and AutoRound, Q8_0's high plane) the table may be [K / G, N, 1], the scales alone
// (`terms` 1): a one-row step streams 4.5 bits a weight instead of 5.
//
// Why a kernel of kiln's own: aten's takes bfloat16 rows only (a float32 model's rows go in
// twice, split in two), and on AVX2 machines it streams the weight at a few GB/s. Here a column
// k of a block is B codes side by side, so a row's product is B / W vector FMAs per column, the
// rows of a step sharing each widened code vector; float32 rows go in as they are. A group's
// sums are scaled once: sum_k w x = scale * sum_k code x + (zero - 8 scale) * sum_k x.
//
// Built at first use by kiln/layers/int4_kernel.py with the machine's compiler (-O3
// -march=native -fopenmp), through the same builder as the decode-attention kernel.

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "int8_rows.h"
#include "int8_rows_avx2.h"
#include "moe_route.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using kiln_bf16::bf16_to_float;
using kiln_int8_rows::CHUNK;
#if defined(__AVX512F__)
using kiln_int8_rows::quad_index;
#endif
using kiln_int8_rows::quantize_rows;

// A block's codes are one sequential stream, but each group's (scale, zero) pairs lie n * 4
// bytes from the last group's: a block touches k / group places in the scale table, more
// streams than the hardware prefetchers follow. Asked for explicitly, the codes a kilobyte
// ahead and the next block's pairs a group ahead, a 1B model's one-row step read its weights
// 1.3x faster from memory (docs/performance.md, "Asking for the weights ahead").
constexpr int64_t CODES_AHEAD = 1024;  // bytes; 512: 0.96x, 2048: level, 4096: 0.92x

using kiln_int8_rows::prefetch;

// The table entries of group g for the `width` outputs after n0's block: 2 bytes a term.
inline void prefetch_next_scales(const uint16_t* scales_zeros, int64_t terms, int64_t g,
                                 int64_t n, int64_t n0, int64_t width) {
  const char* next = reinterpret_cast<const char*>(scales_zeros + (g * n + n0 + width) * terms);
  for (int64_t line = 0; line < width * 2 * terms; line += 64) prefetch(next + line);
}

// The vector layer: W float32 lanes; codes(p) widens W bytes to W int32 lanes; scale_zero
// reads W (scale, zero) bfloat16 pairs, which are 32-bit lanes: the scale is a lane's low half
// moved up, the zero its high half; scale_only reads W bfloat16 scales.
#if defined(__AVX512F__)
#define KILN_SIMD 1
constexpr int64_t W = 16;
constexpr int REGS = 32;
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vi codes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf low_nibbles(vi v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))); }
inline vf high_nibbles(vi v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
inline void scale_zero(const uint16_t* p, vf* scale, vf* zero) {
  const vi v = _mm512_loadu_si512(p);
  *scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
inline vf scale_only(const uint16_t* p) {
  const vi v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_SIMD 1
constexpr int64_t W = 8;
constexpr int REGS = 16;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vi codes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vf low_nibbles(vi v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline vf high_nibbles(vi v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
inline void scale_zero(const uint16_t* p, vf* scale, vf* zero) {
  const vi v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *zero = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
inline vf scale_only(const uint16_t* p) {
  const vi v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

#ifdef KILN_SIMD
// W outputs' scale and bias (zero - 8 scale) from a table of TERMS bf16 values an output
template <int TERMS>
inline void scale_bias(const uint16_t* table, vf* scale, vf* bias) {
  if constexpr (TERMS == 2) {
    vf zero;
    scale_zero(table, scale, &zero);
    *bias = vfmadd(vset(-8.0f), *scale, zero);
  } else {
    *scale = scale_only(table);
    *bias = vfmadd(vset(-8.0f), *scale, vzero());
  }
}
#endif

struct Problem {
  const float* x;  // [rows, k]
  int64_t rows, k;
  const uint8_t* packed;
  const uint16_t* scales_zeros;  // [k / group, n, terms]
  int64_t terms;                 // 2: (scale, zero); 1: the scale alone, zero 0
  int64_t n, block, group;
  const float* sums;  // [rows, k / group]: each row's sum over each group
  float* out;         // [rows, n]
};

#ifdef KILN_SIMD
// Rows m0 .. m0 + R of one block of B = V * W output rows: per group, V accumulators per row
// over the group's columns, then folded into `out` with the group's scales and zeros.
template <int V, int R, int TERMS>
void block_rows(const Problem& p, int64_t block, int64_t m0) {
  constexpr int HALF = V / 2;  // code vectors per column in each nibble
  const int64_t n0 = block * V * W, groups = p.k / p.group;
  const uint8_t* column = p.packed + block * p.k * (V * W / 2);
  constexpr int64_t COLUMN = V * W / 2;  // bytes of codes per column
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_next_scales(p.scales_zeros, TERMS, g, p.n, n0, V * W);
    vf acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = vzero();
    for (int64_t kk = g * p.group; kk < (g + 1) * p.group; ++kk) {
      const uint8_t* bytes = column + kk * COLUMN;
      if ((kk * COLUMN) % 64 == 0) prefetch(bytes + CODES_AHEAD);  // once a cache line
      vf xb[R];
      for (int r = 0; r < R; ++r) xb[r] = vset(p.x[(m0 + r) * p.k + kk]);
      for (int c = 0; c < HALF; ++c) {
        const vi v = codes(bytes + c * W);
        const vf lo = low_nibbles(v), hi = high_nibbles(v);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = vfmadd(lo, xb[r], acc[r][c]);
          acc[r][HALF + c] = vfmadd(hi, xb[r], acc[r][HALF + c]);
        }
      }
    }
    for (int j = 0; j < V; ++j) {
      vf scale, bias;
      scale_bias<TERMS>(p.scales_zeros + (g * p.n + n0 + j * W) * TERMS, &scale, &bias);
      for (int r = 0; r < R; ++r) {
        float* o = p.out + (m0 + r) * p.n + n0 + j * W;
        const vf folded = vfmadd(bias, vset(p.sums[(m0 + r) * groups + g]), vload(o));
        vstore(o, vfmadd(acc[r][j], scale, folded));
      }
    }
  }
}

// As many rows at once as the registers hold (V * R accumulators, R broadcasts, two codes).
template <int V>
constexpr int rows_at_once() {
  constexpr int fit = (REGS - 3) / (V + 1);
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

template <int V, int TERMS>
void block_all_rows(const Problem& p, int64_t block) {
  constexpr int R = rows_at_once<V>();
  int64_t m = 0;
  for (; m + R <= p.rows; m += R) block_rows<V, R, TERMS>(p, block, m);
  for (; m < p.rows; ++m) block_rows<V, 1, TERMS>(p, block, m);
}

template <int TERMS>
bool run_block_terms(const Problem& p, int64_t block) {
  switch (p.block / W) {
    case 2: block_all_rows<2, TERMS>(p, block); return true;
    case 4: block_all_rows<4, TERMS>(p, block); return true;
    case 8: block_all_rows<8, TERMS>(p, block); return true;
    default: return false;
  }
}

bool run_block(const Problem& p, int64_t block) {
  return p.terms == 1 ? run_block_terms<1>(p, block) : run_block_terms<2>(p, block);
}
#else
bool run_block(const Problem&, int64_t) { return false; }
#endif

// The int8-activation path (AVX512-VNNI with VBMI, blocks of 64 rows): each row's columns
// quantized to int8 per chunk of 32 (scale = largest |x| / 127, as llama.cpp's Q8 rows), so a
// column quad of 64 weights is one vpdpbusd per 16 outputs: codes times int8 columns, summed
// four at a time into int32 lanes. The float path above spends about 14 vector operations on
// 64 weights (widen, convert, FMA); this one about 3.5, so a 1B model's step is bound by the
// weight stream again instead of by the core.
//
// vpdpbusd sums the four bytes of a 32-bit lane, which must be one output row's four columns;
// the layout has a column's 64 codes side by side (row j low nibble, row j + 32 high), so one
// vpermt2b per 16 rows gathers four columns' bytes into lanes. The high nibble is kept in
// place (& 0xf0: 16 times the code) and its sums scaled by 1/16, which is exact.
// A product whose rows go in as int8 planes (kiln_int8_rows::quantize_rows)
struct Int8Problem {
  const int8_t* xq;     // [planes, rows, k]: the codes, then (two planes) their remainders'
  const float* xscale;  // [rows, k / CHUNK]: the first plane's scale (the second's is / 256)
  const float* sums;    // [rows, k / group]: each row's float32 sum over each group
  int64_t rows, k;
  const uint8_t* packed;
  const uint16_t* scales_zeros;
  int64_t terms;
  int64_t n, group;
  float* out;
};

#if defined(KILN_SIMD) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KILN_INT8_ROWS 1
#define KILN_INT8_VNNI 1

// Rows m0 .. m0 + R of block `block`: acc[r][j] holds outputs n0 + 16 j .. + 16 of row r.
template <int R, int P, int TERMS>
void block_rows_int8(const Int8Problem& p, int64_t block, int64_t m0) {
  const int64_t n0 = block * 64, groups = p.k / p.group, chunks = p.k / CHUNK;
  const uint8_t* column = p.packed + block * p.k * 32;
  const __m512i idx0 = quad_index(0), idx1 = quad_index(16);
  const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(int8_t(0xf0));
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_next_scales(p.scales_zeros, TERMS, g, p.n, n0, 64);
    __m512 facc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) facc[r][j] = _mm512_setzero_ps();
    for (int64_t c = g * p.group / CHUNK; c < (g + 1) * p.group / CHUNK; ++c) {
      __m512i acc[P][R][4];
      for (int q = 0; q < P; ++q)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_setzero_si512();
      for (int64_t kk = c * CHUNK; kk < (c + 1) * CHUNK; kk += 4) {
        const uint8_t* bytes = column + kk * 32;
        prefetch(bytes + CODES_AHEAD);
        prefetch(bytes + CODES_AHEAD + 64);
        const __m512i a = _mm512_loadu_si512(bytes), b = _mm512_loadu_si512(bytes + 64);
        const __m512i q0 = _mm512_permutex2var_epi8(a, idx0, b);
        const __m512i q1 = _mm512_permutex2var_epi8(a, idx1, b);
        const __m512i w[4] = {_mm512_and_si512(q0, low), _mm512_and_si512(q1, low),
                              _mm512_and_si512(q0, high), _mm512_and_si512(q1, high)};
        for (int q = 0; q < P; ++q)
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, p.xq + (q * p.rows + m0 + r) * p.k + kk, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < 4; ++j)
              acc[q][r][j] = _mm512_dpbusd_epi32(acc[q][r][j], w[j], xb);
          }
      }
      // each plane's int32 sums (below 240 * 127 * 32 < 2^24: exact in float32) scaled alone
      for (int r = 0; r < R; ++r) {
        const float s = p.xscale[(m0 + r) * chunks + c];
        for (int q = 0; q < P; ++q) {
          const float sq = q == 0 ? s : s * (1.0f / 256);
          const __m512 lo_scale = _mm512_set1_ps(sq), hi_scale = _mm512_set1_ps(sq * 0.0625f);
          for (int j = 0; j < 4; ++j)
            facc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[q][r][j]),
                                         j < 2 ? lo_scale : hi_scale, facc[r][j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      vf scale, bias;
      scale_bias<TERMS>(p.scales_zeros + (g * p.n + n0 + j * 16) * TERMS, &scale, &bias);
      for (int r = 0; r < R; ++r) {
        float* o = p.out + (m0 + r) * p.n + n0 + j * 16;
        const vf folded = vfmadd(bias, vset(p.sums[(m0 + r) * groups + g]), vload(o));
        vstore(o, vfmadd(facc[r][j], scale, folded));
      }
    }
  }
}

template <int P, int TERMS>
void block_all_rows_int8(const Int8Problem& p, int64_t block) {
  int64_t m = 0;
  for (; m + 2 <= p.rows; m += 2) block_rows_int8<2, P, TERMS>(p, block, m);
  for (; m < p.rows; ++m) block_rows_int8<1, P, TERMS>(p, block, m);
}

template <int P>
void block_all_rows_int8(const Int8Problem& p, int64_t block) {
  if (p.terms == 1)
    block_all_rows_int8<P, 1>(p, block);
  else
    block_all_rows_int8<P, 2>(p, block);
}

// The blocks of rows the int8 path reads: PyTorch's layout on AVX-512 CPUs
inline bool int8_block_ok(int64_t block) { return block == 64; }

template <int P>
void run_int8_block(const Int8Problem& p, int64_t b, int64_t /*block*/) {
  block_all_rows_int8<P>(p, b);
}

#elif defined(KILN_SIMD) && !defined(__AVX512F__)
// AVX2 (csrc/int8_rows_avx2.h): four columns' bytes of 16 rows go into 32-bit lanes by two rounds
// of unpacks, in the rows' own order, and vpmaddubsw with vpmaddwd sums a lane's four products.
// Both of PyTorch's layouts are read: blocks of 32 rows (its packing on AVX2 CPUs) and of 64.
// Each plane's int32 sums are scaled alone, as the AVX-512 path scales them.
#define KILN_INT8_ROWS 1
namespace avx2 = kiln_int8_rows_avx2;
constexpr int64_t ROW_TILE = 16;  // rows whose float sums a block keeps at once
constexpr int CHUNK_QUADS = CHUNK / 4;

// A quad of columns' 16 bytes each (`stride` bytes apart): x[0] holds rows 0..7 of the 16 in
// its lanes, x[1] rows 8..15; each byte has row r's code in its low nibble, row r + B / 2's high
inline void quad16(const uint8_t* col, int64_t stride, __m256i x[2]) {
  const auto load = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + i * stride));
  };
  const __m128i c0 = load(0), c1 = load(1), c2 = load(2), c3 = load(3);
  const __m128i lo01 = _mm_unpacklo_epi8(c0, c1), hi01 = _mm_unpackhi_epi8(c0, c1);
  const __m128i lo23 = _mm_unpacklo_epi8(c2, c3), hi23 = _mm_unpackhi_epi8(c2, c3);
  const auto both = [](__m128i lo, __m128i hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  };
  x[0] = both(_mm_unpacklo_epi16(lo01, lo23), _mm_unpackhi_epi16(lo01, lo23));
  x[1] = both(_mm_unpacklo_epi16(hi01, hi23), _mm_unpackhi_epi16(hi01, hi23));
}

// A chunk's 8 quads of a block of B rows as codes 0..15: w[quad][v] holds rows 8 v .. 8 v + 7
template <int B>
inline void chunk_codes(const uint8_t* column, __m256i w[CHUNK_QUADS][B / 8]) {
  const __m256i four = _mm256_set1_epi8(0x0f);
  for (int quad = 0; quad < CHUNK_QUADS; ++quad) {
    const uint8_t* bytes = column + 4 * quad * (B / 2);
    for (int line = 0; line < 2 * B; line += 64) prefetch(bytes + CODES_AHEAD + line);
    for (int half = 0; half < B / 32; ++half) {
      __m256i x[2];
      quad16(bytes + 16 * half, B / 2, x);
      for (int i = 0; i < 2; ++i) {
        w[quad][2 * half + i] = _mm256_and_si256(x[i], four);
        w[quad][B / 16 + 2 * half + i] = _mm256_and_si256(_mm256_srli_epi16(x[i], 4), four);
      }
    }
  }
}

// Rows m0 .. m0 + rows (at most ROW_TILE) of block `block` of B rows, P planes
template <int B, int P, int TERMS>
void block_rows_int8_avx2(const Int8Problem& p, int64_t block, int64_t m0, int64_t rows) {
  constexpr int V = B / 8;
  const int64_t n0 = block * B, groups = p.k / p.group, chunks = p.k / CHUNK;
  const uint8_t* column = p.packed + block * p.k * (B / 2);
  alignas(32) float facc[ROW_TILE][B];
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_next_scales(p.scales_zeros, TERMS, g, p.n, n0, B);
    std::memset(facc, 0, sizeof(float) * B * rows);
    for (int64_t c = g * p.group / CHUNK; c < (g + 1) * p.group / CHUNK; ++c) {
      __m256i w[CHUNK_QUADS][V];
      chunk_codes<B>(column + c * CHUNK * (B / 2), w);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float s = p.xscale[m * chunks + c];
        for (int q = 0; q < P; ++q) {
          __m256i acc[V];
          avx2::plane_sums<CHUNK_QUADS, 15, V>(w, p.xq + (q * p.rows + m) * p.k + c * CHUNK, acc);
          const __m256 sq = _mm256_set1_ps(q == 0 ? s : s * (1.0f / 256));
          for (int v = 0; v < V; ++v) {
            float* f = facc[r] + 8 * v;
            _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[v]), sq, _mm256_load_ps(f)));
          }
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      vf scale, bias;
      scale_bias<TERMS>(p.scales_zeros + (g * p.n + n0 + 8 * v) * TERMS, &scale, &bias);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = p.out + (m0 + r) * p.n + n0 + 8 * v;
        const vf folded = vfmadd(bias, vset(p.sums[(m0 + r) * groups + g]), vload(o));
        vstore(o, vfmadd(_mm256_load_ps(facc[r] + 8 * v), scale, folded));
      }
    }
  }
}

template <int B, int P, int TERMS>
void block_all_rows_int8_avx2(const Int8Problem& p, int64_t block) {
  for (int64_t m = 0; m < p.rows; m += ROW_TILE)
    block_rows_int8_avx2<B, P, TERMS>(p, block, m, std::min(ROW_TILE, p.rows - m));
}

inline bool int8_block_ok(int64_t block) { return block == 32 || block == 64; }

template <int P>
void run_int8_block(const Int8Problem& p, int64_t b, int64_t block) {
  if (block == 64)
    p.terms == 1 ? block_all_rows_int8_avx2<64, P, 1>(p, b) : block_all_rows_int8_avx2<64, P, 2>(p, b);
  else
    p.terms == 1 ? block_all_rows_int8_avx2<32, P, 1>(p, b) : block_all_rows_int8_avx2<32, P, 2>(p, b);
}

#endif

// The reference: the same sums in scalar code, any block size.
void run_block_portable(const Problem& p, int64_t block) {
  const int64_t half = p.block / 2, n0 = block * p.block, groups = p.k / p.group;
  const uint8_t* column = p.packed + block * p.k * half;
  std::vector<float> acc(p.block);
  for (int64_t m = 0; m < p.rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t kk = g * p.group; kk < (g + 1) * p.group; ++kk) {
        const float xk = p.x[m * p.k + kk];
        const uint8_t* bytes = column + kk * half;
        for (int64_t j = 0; j < half; ++j) {
          acc[j] += float(bytes[j] & 15) * xk;
          acc[half + j] += float(bytes[j] >> 4) * xk;
        }
      }
      for (int64_t j = 0; j < p.block; ++j) {
        const uint16_t* sz = p.scales_zeros + (g * p.n + n0 + j) * p.terms;
        const float scale = bf16_to_float(sz[0]), zero = p.terms == 2 ? bf16_to_float(sz[1]) : 0.0f;
        p.out[m * p.n + n0 + j] += acc[j] * scale + (zero - 8.0f * scale) * p.sums[m * groups + g];
      }
    }
  }
}

// One weight as cpu_dequantize_t forms it in T (float or bf16): (code * scale) + (zero - 8 *
// scale), each operation rounded to T as PyTorch's elementwise ops round, so the two agree bit
// for bit.
template <typename T>
inline float as_stored(float x) {
  if constexpr (std::is_same_v<T, uint16_t>)
    return bf16_to_float(kiln_bf16::float_to_bf16(x));
  else
    return x;
}

template <typename T>
inline void store(T* p, float x) {
  if constexpr (std::is_same_v<T, uint16_t>)
    *p = kiln_bf16::float_to_bf16(x);
  else
    *p = x;
}

// A block's 64-output slice of a group as cpu_dequantize_t scales it: scale, and the bias
// zero - 8 * scale as T holds it (`terms` bf16 values an output: scale and zero, or the scale)
template <typename T>
inline void group_terms(const uint16_t* table, int64_t terms, int64_t block, float* scale,
                        float* bias) {
  for (int64_t j = 0; j < block; ++j) {
    scale[j] = bf16_to_float(table[terms * j]);
    const float zero = terms == 2 ? bf16_to_float(table[2 * j + 1]) : 0.0f;
    bias[j] = as_stored<T>(zero - as_stored<T>(8.0f * scale[j]));
  }
}

// Column kk of a block (`half` bytes: code j in byte j's low nibble, code j + half in its high)
// into out[0, block)
template <typename T>
inline void dequantize_column(const uint8_t* bytes, const float* scale, const float* bias,
                              int64_t half, T* out) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (half == 32) {  // four vectors of 16 outputs
    for (int c = 0; c < 4; ++c) {
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(bytes + (c & 1) * 16)));
      const __m512i codes = c < 2 ? _mm512_and_si512(wide, _mm512_set1_epi32(15))
                                  : _mm512_srli_epi32(wide, 4);
      __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(codes), _mm512_loadu_ps(scale + 16 * c));
      if constexpr (std::is_same_v<T, uint16_t>) {  // rounded to bf16 (nearest even) each op
        x = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x));
        const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(x, _mm512_loadu_ps(bias + 16 * c)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c), (__m256i)y);
      } else {
        _mm512_storeu_ps(reinterpret_cast<float*>(out) + 16 * c,
                         _mm512_add_ps(x, _mm512_loadu_ps(bias + 16 * c)));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < 2 * half; ++j) {
    const int code = j < half ? bytes[j] & 15 : bytes[j - half] >> 4;
    store(out + j, as_stored<T>(static_cast<float>(code) * scale[j]) + bias[j]);
  }
}

// W^T [k, n] in T from the packed weight: what cpu_dequantize_t makes with PyTorch's ops (about
// 0.4 GB/s written on the AMX Xeon, most of a packed prefill chunk's linear time). A work item
// is one group of one block: its scales and biases once, then its `group` columns.
template <typename T>
void dequantize_t(const uint8_t* packed, const uint16_t* scales_zeros, int64_t terms, int64_t n,
                  int64_t k, int64_t block, int64_t group, T* out, int threads) {
  const int64_t half = block / 2, blocks = n / block, groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < groups * blocks; ++item) {
    const int64_t g = item / blocks, b = item % blocks;
    float scale[64], bias[64];
    group_terms<T>(scales_zeros + (g * n + b * block) * terms, terms, block, scale, bias);
    for (int64_t kk = g * group; kk < (g + 1) * group; ++kk)
      dequantize_column(packed + (b * k + kk) * half, scale, bias, half, out + kk * n + b * block);
  }
}

// Each row's float32 sum over each group of `group` columns, [rows, k / group]: the zero term's
// factor
std::vector<float> group_sums(const float* x, int64_t rows, int64_t k, int64_t group,
                              int threads) {
  const int64_t groups = k / group;
  std::vector<float> sums(rows * groups, 0.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t kk = 0; kk < k; ++kk) sums[m * groups + kk / group] += x[m * k + kk];
  return sums;
}

}  // namespace

extern "C" {

// 0: portable loops, 1: AVX2 with FMA, 2: AVX-512 (as the decode-attention kernel counts).
int kiln_int4_mm_isa() {
#if defined(__AVX512F__)
  return 2;
#elif defined(KILN_SIMD)
  return 1;
#else
  return 0;
#endif
}

// Whether this build's int8-activation path (AVX512-VNNI with VBMI, or AVX2) reads PyTorch's
// layout of `block` rows: 64 on AVX-512, 32 or 64 on AVX2; 0 everywhere without the path.
int kiln_int4_mm_int8_block(int64_t block) {
#ifdef KILN_INT8_ROWS
  return int8_block_ok(block) ? 1 : 0;
#else
  (void)block;
  return 0;
#endif
}

// out [rows, n] float32 = x [rows, k] float32 times the packed weight (n a multiple of block,
// k of group; `terms` 2 or 1 bf16 values an output and group in the table); added to what out
// holds when accumulate is set (a second plane of Q8_0). With
// int8_planes 1 or 2, the rows go in as one or two int8 planes per 32 columns (8 or 16 bits of
// each value) where this build has that path for `block` (kiln_int4_mm_int8_block); else (and
// with 0) as float32.
void kiln_int4_mm(const float* x, int64_t rows, int64_t k, const uint8_t* packed,
                  const uint16_t* scales_zeros, int terms, int64_t n, int64_t block,
                  int64_t group, float* out, int accumulate, int threads, int int8_planes) {
  const std::vector<float> sums = group_sums(x, rows, k, group, threads);
  if (!accumulate) std::memset(out, 0, sizeof(float) * rows * n);
#ifdef KILN_INT8_ROWS
  if ((int8_planes == 1 || int8_planes == 2) && int8_block_ok(block) && group % CHUNK == 0) {
    std::vector<int8_t> xq(int8_planes * rows * k);
    std::vector<float> xscale(rows * (k / CHUNK));
    quantize_rows(x, rows, k, int8_planes, xq.data(), xscale.data(), threads);
    const Int8Problem q{xq.data(), xscale.data(), sums.data(), rows, k, packed, scales_zeros,
                        terms, n, group, out};
    if (int8_planes == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t b = 0; b < n / block; ++b) run_int8_block<1>(q, b, block);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t b = 0; b < n / block; ++b) run_int8_block<2>(q, b, block);
    }
    return;
  }
#else
  (void)int8_planes;
#endif
  const Problem p{x, rows, k, packed, scales_zeros, terms, n, block, group, sums.data(), out};
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < n / block; ++b) {
    if (!run_block(p, b)) run_block_portable(p, b);
  }
}

// kiln_int4_mm for a step's experts in one call, each group's products bit for bit kiln_int4_mm's
// on its rows alone: group g multiplies rows [starts[g], starts[g] + counts[g]) of x by expert
// experts[g]'s plane (`packed` and `scales_zeros` the first expert's, each `strides` bytes from
// one expert's to the next's) into the same rows of out [rows, n] (rows of no group: zeros, or
// what out held with accumulate), every group's blocks in one parallel region.
void kiln_int4_mm_experts(const float* x, int64_t rows, int64_t k, const uint8_t* packed,
                          const uint16_t* scales_zeros, int terms, const int64_t* strides,
                          int64_t n, int64_t block, int64_t group, int64_t groups,
                          const int64_t* experts, const int64_t* starts, const int64_t* counts,
                          float* out, int accumulate, int threads, int int8_planes) {
  const int64_t kgroups = k / group;
  const std::vector<float> sums = group_sums(x, rows, k, group, threads);
  if (!accumulate) std::memset(out, 0, sizeof(float) * rows * n);
  const auto codes_of = [&](int64_t g) { return packed + experts[g] * strides[0]; };
  const auto table_of = [&](int64_t g) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(scales_zeros) + experts[g] * strides[1];
    return reinterpret_cast<const uint16_t*>(bytes);
  };
#ifdef KILN_INT8_ROWS
  if ((int8_planes == 1 || int8_planes == 2) && int8_block_ok(block) && group % CHUNK == 0) {
    std::vector<kiln_int8_rows::QuantizedRows> quantized;
    std::vector<Int8Problem> problems;
    quantized.reserve(groups);
    for (int64_t g = 0; g < groups; ++g) {
      quantized.emplace_back(x + starts[g] * k, counts[g], k, int8_planes, threads);
      problems.push_back({quantized[g].xq.data(), quantized[g].xscale.data(),
                          sums.data() + starts[g] * kgroups, counts[g], k, codes_of(g),
                          table_of(g), terms, n, group, out + starts[g] * n});
    }
    kiln_int8_rows::for_each_group_block(groups, n / block, threads, [&](int64_t g, int64_t b) {
      int8_planes == 1 ? run_int8_block<1>(problems[g], b, block)
                       : run_int8_block<2>(problems[g], b, block);
    });
    return;
  }
#endif
  std::vector<Problem> problems;
  for (int64_t g = 0; g < groups; ++g)
    problems.push_back({x + starts[g] * k, counts[g], k, codes_of(g), table_of(g), terms, n,
                        block, group, sums.data() + starts[g] * kgroups, out + starts[g] * n});
  kiln_int8_rows::for_each_group_block(groups, n / block, threads, [&](int64_t g, int64_t b) {
    if (!run_block(problems[g], b)) run_block_portable(problems[g], b);
  });
}

// kiln_int4_mm over rows and an output of either type (dtype 0 float32, 1 bf16), converted
// inside the call (kiln_bf16::in_float32)
void kiln_int4_mm_cast(int x_dtype, const void* x, int64_t rows, int64_t k, const uint8_t* packed,
                       const uint16_t* scales_zeros, int terms, int64_t n, int64_t block,
                       int64_t group, int out_dtype, void* out, int threads, int int8_planes) {
  kiln_bf16::in_float32(x_dtype, x, rows, k, out_dtype, out, n, [&](const float* xs, float* ys) {
    kiln_int4_mm(xs, rows, k, packed, scales_zeros, terms, n, block, group, ys, 0, threads,
                 int8_planes);
  });
}

// W^T [k, n] (out_dtype 0 float32, 1 bf16) from the packed weight, as cpu_dequantize_t makes
// it: the large-batch path's weight, for one dense matmul
void kiln_int4_dequantize_t(const uint8_t* packed, const uint16_t* scales_zeros, int terms,
                            int64_t n, int64_t k, int64_t block, int64_t group, int out_dtype,
                            void* out, int threads) {
  if (out_dtype == 1)
    dequantize_t(packed, scales_zeros, terms, n, k, block, group, static_cast<uint16_t*>(out),
                 threads);
  else
    dequantize_t(packed, scales_zeros, terms, n, k, block, group, static_cast<float*>(out),
                 threads);
}

}  // extern "C"
