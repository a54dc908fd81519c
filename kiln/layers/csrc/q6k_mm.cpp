// Rows times a weight kept in GGUF's Q6_K on the CPU, 6 bits a weight: w = d * sc * (q - 32),
// q 0..63, an int8 scale sc per 16 columns and a float d per 256.
//
// The layout (kiln/layers/q6k_layout.py writes it), in blocks of 64 output rows:
//   low  [N / 64, K, 32] bytes: q's low 4 bits in PyTorch's CPU int4 layout (byte j of a
//        column holds row j's in its low nibble and row j + 32's in its high one);
//   high [N / 64, K / 4, 64] bytes: q's top 2 bits, a quad of columns a 64-byte vector whose
//        byte 4 r + i holds, in bits 2 j and 2 j + 1, row 16 j + r's at the quad's column i;
//   sub_scales [K / 16, N] int8 (sc), d [K / 256, N] float32.
// A quad of columns of a block is 192 bytes, and the scales 0.56 bits a weight: Q6_K's own
// 6.56 bits, where its dequantized bf16 weight streams 16.
//
// Rows go in as int8, one or two planes per 32 columns (kiln_int8_rows). A quad is then one
// vpdpbusd per 16 outputs and plane, as in the int4 kernel's int8 path: two vpermt2b gather
// each output row's four columns into a 32-bit lane, the low nibbles and the top bits are
// merged into q (0..63, unsigned), and q - 32 is taken on the sums: sum (q - 32) x =
// sum q x - 32 sum x. Each 16 columns' int32 sums are scaled by sc and the row's chunk scale
// (exact in int32 and float32 up to the last conversion), each 256 by d.
//
// Built at first use by kiln/layers/q6k_kernel.py (-O3 -march=native -fopenmp). The portable
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
constexpr int64_t SUB = 16;     // columns a sub-scale
constexpr int64_t SUPER = 256;  // columns a d

struct Problem {
  const int8_t* xq;      // [planes, rows, k]
  const float* xscale;   // [rows, k / CHUNK]: the first plane's scale
  const int32_t* bias;   // [rows, k / SUB]: 32 * sum x over the 16 (the planes combined)
  int64_t rows, k, planes;
  const uint8_t* low;
  const uint8_t* high;
  const int8_t* sub_scales;
  const float* d;
  int64_t n;
  float* out;            // [rows, n], added into
};

inline float chunk_scale(const Problem& p, int64_t m, int64_t kk) {
  return kiln_int8_rows::chunk_scale(p.xscale, p.k, static_cast<int>(p.planes), m, kk);
}

inline int32_t combined(const Problem& p, int64_t m, int64_t kk) {
  return kiln_int8_rows::combined(p.xq, p.rows, p.k, static_cast<int>(p.planes), m, kk);
}

inline int q_at(const Problem& p, int64_t block, int64_t row, int64_t kk) {
  const uint8_t lo = p.low[(block * p.k + kk) * 32 + row % 32];
  const int low4 = row < 32 ? lo & 15 : lo >> 4;
  const uint8_t hi = p.high[(block * p.k / 4 + kk / 4) * 64 + 4 * (row % 16) + kk % 4];
  return low4 | (((hi >> (2 * (row / 16))) & 3) << 4);
}

// The reference: one block, every row, the vector path's sums and roundings in scalar code.
void run_block_portable(const Problem& p, int64_t block) {
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t j = 0; j < BLOCK; ++j) {
      const int64_t col = block * BLOCK + j;
      float* o = p.out + m * p.n + col;
      for (int64_t s = 0; s < p.k / SUPER; ++s) {
        float facc = 0.0f;
        for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
          int32_t acc = 0;
          for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; ++kk)
            acc += q_at(p, block, j, kk) * combined(p, m, kk);
          const float sc = static_cast<float>(p.sub_scales[sub * p.n + col]);
          const float scaled = sc * chunk_scale(p, m, sub * SUB);
          facc = std::fma(static_cast<float>(acc - p.bias[m * (p.k / SUB) + sub]), scaled, facc);
        }
        *o = std::fma(facc, p.d[s * p.n + col], *o);
      }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KILN_Q6K_VNNI 1
constexpr int64_t CODES_AHEAD = 1024;  // bytes of low nibbles asked for ahead (as int4_mm.cpp)
// A block's sub-scales lie n bytes apart, one cache line each 16 columns (and its d's 256
// bytes each 256): streams the hardware prefetchers do not follow, asked for explicitly this
// many sub-scales ahead (0: not asked for; benchmarks/q6k_kernel.py --scales-ahead builds both)
#ifndef KILN_Q6K_SCALES_AHEAD
#define KILN_Q6K_SCALES_AHEAD 4
#endif
constexpr int64_t SCALES_AHEAD = KILN_Q6K_SCALES_AHEAD;

// A quad of columns as q (0..63) in dpbusd's lanes, outputs 16 j .. 16 j + 15 in w[j].
inline void quad_codes(const uint8_t* low, const uint8_t* high, __m512i idx0, __m512i idx1,
                       __m512i w[4]) {
  const __m512i four = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
  const __m512i a = _mm512_loadu_si512(low), b = _mm512_loadu_si512(low + 64);
  const __m512i h = _mm512_loadu_si512(high);
  const __m512i q0 = _mm512_permutex2var_epi8(a, idx0, b), q1 = _mm512_permutex2var_epi8(a, idx1, b);
  // 16-bit shifts: the mask after each keeps only bits that stayed inside their byte
  w[0] = _mm512_or_si512(_mm512_and_si512(q0, four), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
  w[1] = _mm512_or_si512(_mm512_and_si512(q1, four), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
  w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q0, 4), four), _mm512_and_si512(h, top));
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q1, 4), four),
                         _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
}

// Rows m0 .. m0 + R of one block, P int8 planes: acc[q][r][j] sums outputs 16 j .. + 16.
template <int R, int P>
void block_rows(const Problem& p, int64_t block, int64_t m0) {
  const int64_t n0 = block * BLOCK;
  const uint8_t* low = p.low + block * p.k * 32;
  const uint8_t* high = p.high + block * p.k * 16;
  const __m512i idx0 = quad_index(0), idx1 = quad_index(16);
  for (int64_t s = 0; s < p.k / SUPER; ++s) {
    __m512 facc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) facc[r][j] = _mm512_setzero_ps();
    if (SCALES_AHEAD > 0)  // the next d's four lines; past the end is harmless
      for (int64_t line = 0; line < 64; line += 16) prefetch(p.d + (s + 1) * p.n + n0 + line);
    for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
      if (SCALES_AHEAD > 0) prefetch(p.sub_scales + (sub + SCALES_AHEAD) * p.n + n0);
      __m512i acc[P][R][4];
      for (int q = 0; q < P; ++q)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_setzero_si512();
      for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; kk += 4) {
        prefetch(low + kk * 32 + CODES_AHEAD);
        prefetch(low + kk * 32 + CODES_AHEAD + 64);
        prefetch(high + kk * 16 + CODES_AHEAD / 2);
        __m512i w[4];
        quad_codes(low + kk * 32, high + kk * 16, idx0, idx1, w);
        for (int q = 0; q < P; ++q)
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, p.xq + (q * p.rows + m0 + r) * p.k + kk, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_dpbusd_epi32(acc[q][r][j], w[j], xb);
          }
      }
      __m512 sc[4];
      for (int j = 0; j < 4; ++j)
        sc[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.sub_scales + sub * p.n + n0 + 16 * j))));
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(chunk_scale(p, m0 + r, sub * SUB));
        const __m512i bias = _mm512_set1_epi32(p.bias[(m0 + r) * (p.k / SUB) + sub]);
        for (int j = 0; j < 4; ++j) {
          __m512i sum = acc[0][r][j];
          if constexpr (P == 2) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), acc[1][r][j]);
          const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, bias));
          facc[r][j] = _mm512_fmadd_ps(exact, _mm512_mul_ps(sc[j], xs), facc[r][j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 d = _mm512_loadu_ps(p.d + s * p.n + n0 + 16 * j);
      for (int r = 0; r < R; ++r) {
        float* o = p.out + (m0 + r) * p.n + n0 + 16 * j;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(facc[r][j], d, _mm512_loadu_ps(o)));
      }
    }
  }
}

template <int P>
void block_all_rows(const Problem& p, int64_t block) {
  int64_t m = 0;
  for (; m + 2 <= p.rows; m += 2) block_rows<2, P>(p, block, m);
  for (; m < p.rows; ++m) block_rows<1, P>(p, block, m);
}

void run_block(const Problem& p, int64_t block) {
  if (p.planes == 2)
    block_all_rows<2>(p, block);
  else
    block_all_rows<1>(p, block);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KILN_Q6K_AVX2 1
namespace avx2 = kiln_int8_rows_avx2;
constexpr int64_t CODES_AHEAD = 1024;  // as the AVX-512 path
constexpr int64_t SCALES_AHEAD = 4;
constexpr int64_t ROW_TILE = 16;  // rows whose float sums a block keeps at once (4 KB)
constexpr int QUADS = SUB / 4;

// A sub-block's four quads as q (0..63) in vpmaddubsw's lanes: w[quad][a], lane_row order
inline void sub_codes(const uint8_t* low, const uint8_t* high, __m256i w[QUADS][8]) {
  const __m256i top = _mm256_set1_epi8(0x30);
  for (int quad = 0; quad < QUADS; ++quad) {
    avx2::quad_nibbles(low + quad * 128, w[quad]);
    for (int a = 0; a < 4; ++a) {
      // rows 16 j + r of lane group j take bits 2 j, 2 j + 1 of the high byte 4 r + column
      const __m256i h = avx2::both_halves(high + quad * 64 + 16 * a);
      const __m256i j01 = _mm256_and_si256(avx2::shift_halves(h, 4, 2), top);
      const __m256i j23 = _mm256_and_si256(avx2::shift_halves(h, 0, -2), top);
      w[quad][a] = _mm256_or_si256(w[quad][a], j01);
      w[quad][a + 4] = _mm256_or_si256(w[quad][a + 4], j23);
    }
  }
}

// Rows m0 .. m0 + rows (at most ROW_TILE) of one block, P int8 planes: the AVX-512 path's sums
// and roundings with each sub-block's codes unpacked once for all the rows.
template <int P>
void block_rows_avx2(const Problem& p, int64_t block, int64_t m0, int64_t rows) {
  const int64_t n0 = block * BLOCK;
  const uint8_t* low = p.low + block * p.k * 32;
  const uint8_t* high = p.high + block * p.k * 16;
  alignas(32) float facc[ROW_TILE][BLOCK];
  for (int64_t s = 0; s < p.k / SUPER; ++s) {
    std::memset(facc, 0, sizeof(float) * BLOCK * rows);
    for (int64_t line = 0; line < 64; line += 16) prefetch(p.d + (s + 1) * p.n + n0 + line);
    for (int64_t sub = s * SUPER / SUB; sub < (s + 1) * SUPER / SUB; ++sub) {
      prefetch(p.sub_scales + (sub + SCALES_AHEAD) * p.n + n0);
      for (int64_t ahead = 0; ahead < SUB * 32; ahead += 64) prefetch(low + sub * SUB * 32 + CODES_AHEAD + ahead);
      for (int64_t ahead = 0; ahead < SUB * 16; ahead += 64) prefetch(high + sub * SUB * 16 + CODES_AHEAD / 2 + ahead);
      __m256i w[QUADS][8];
      sub_codes(low + sub * SUB * 32, high + sub * SUB * 16, w);
      __m256 sc[8];
      for (int a = 0; a < 8; ++a) sc[a] = avx2::lane_bytes<true>(p.sub_scales + sub * p.n + n0, a);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        __m256i acc[8];
        avx2::sub_sums<QUADS, 63, P>(w, p.xq + m * p.k + sub * SUB, p.rows * p.k, acc);
        const __m256 xs = _mm256_set1_ps(chunk_scale(p, m, sub * SUB));
        const __m256i bias = _mm256_set1_epi32(p.bias[m * (p.k / SUB) + sub]);
        for (int a = 0; a < 8; ++a) {
          const __m256 exact = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[a], bias));
          float* f = facc[r] + 8 * a;
          _mm256_store_ps(f, _mm256_fmadd_ps(exact, _mm256_mul_ps(sc[a], xs), _mm256_load_ps(f)));
        }
      }
    }
    for (int a = 0; a < 8; ++a) {
      const __m256 d = avx2::lane_floats(p.d + s * p.n + n0, a);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = p.out + (m0 + r) * p.n + n0;
        const __m256 f = _mm256_load_ps(facc[r] + 8 * a);
        avx2::store_lane_floats(o, a, _mm256_fmadd_ps(f, d, avx2::lane_floats(o, a)));
      }
    }
  }
}

void run_block(const Problem& p, int64_t block) {
  for (int64_t m = 0; m < p.rows; m += ROW_TILE) {
    const int64_t rows = std::min(ROW_TILE, p.rows - m);
    p.planes == 2 ? block_rows_avx2<2>(p, block, m, rows) : block_rows_avx2<1>(p, block, m, rows);
  }
}
#else
void run_block(const Problem& p, int64_t block) { run_block_portable(p, block); }
#endif

// 32 times each row's int8 sum over each 16 columns, its planes combined as the sums combine
// them (the q - 32 term)
void row_bias(const Problem& p, int32_t* bias) {
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t sub = 0; sub < p.k / SUB; ++sub) {
      int32_t sum = 0;
      for (int64_t kk = sub * SUB; kk < (sub + 1) * SUB; ++kk) sum += combined(p, m, kk);
      bias[m * (p.k / SUB) + sub] = 32 * sum;
    }
}

void q6k_mm(const float* x, int64_t rows, int64_t k, const uint8_t* low, const uint8_t* high,
            const int8_t* sub_scales, const float* d, int64_t n, float* out, int planes,
            int threads, bool portable) {
  const kiln_int8_rows::QuantizedRows q(x, rows, k, planes, threads);
  std::vector<int32_t> bias(rows * (k / SUB));
  Problem p{q.xq.data(), q.xscale.data(), bias.data(), rows, k, planes, low, high, sub_scales, d,
            n, out};
  row_bias(p, bias.data());
  std::memset(out, 0, sizeof(float) * rows * n);
  kiln_int8_rows::for_each_block(n / BLOCK, threads, [&](int64_t b) {
    portable ? run_block_portable(p, b) : run_block(p, b);
  });
}

// A step's experts in one call, as kquant_mm_experts: group g multiplies rows [starts[g],
// starts[g] + counts[g]) of x by expert experts[g] of the stack (`low` ... `d` the first
// expert's, each buffer `strides` bytes from one expert's to the next's) into the same rows of
// out [rows, n] (rows of no group: zeros), every group's blocks in one parallel region.
void q6k_mm_experts(const float* x, int64_t rows, int64_t k, const uint8_t* low,
                    const uint8_t* high, const int8_t* sub_scales, const float* d,
                    const int64_t* strides, int64_t n, int64_t groups, const int64_t* experts,
                    const int64_t* starts, const int64_t* counts, float* out, int planes,
                    int threads) {
  std::memset(out, 0, sizeof(float) * rows * n);
  std::vector<kiln_int8_rows::QuantizedRows> quantized;
  std::vector<std::vector<int32_t>> bias(groups);
  std::vector<Problem> problems;
  quantized.reserve(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t e = experts[g];
    quantized.emplace_back(x + starts[g] * k, counts[g], k, planes, threads);
    bias[g].resize(counts[g] * (k / SUB));
    const auto* dd = reinterpret_cast<const uint8_t*>(d) + e * strides[3];
    problems.push_back({quantized[g].xq.data(), quantized[g].xscale.data(), bias[g].data(),
                        counts[g], k, planes, low + e * strides[0], high + e * strides[1],
                        sub_scales + e * strides[2], reinterpret_cast<const float*>(dd), n,
                        out + starts[g] * n});
    row_bias(problems[g], bias[g].data());
  }
  kiln_int8_rows::for_each_group_block(groups, n / BLOCK, threads,
                                       [&](int64_t g, int64_t b) { run_block(problems[g], b); });
}

// W^T [k, n] in T (float or bf16): (q - 32) * (sc * d), exact in float32 (11 + 7 + 6 bits),
// rounded once to bf16. A work item is one column of one block.
template <typename T>
void dequantize_t(const uint8_t* low, const uint8_t* high, const int8_t* sub_scales,
                  const float* d, int64_t n, int64_t k, T* out, int threads) {
  const Problem p{nullptr, nullptr, nullptr, 0, k, 0, low, high, sub_scales, d, n, nullptr};
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < k * (n / BLOCK); ++item) {
    const int64_t kk = item / (n / BLOCK), block = item % (n / BLOCK);
    for (int64_t j = 0; j < BLOCK; ++j) {
      const int64_t col = block * BLOCK + j;
      const float scale = static_cast<float>(sub_scales[kk / SUB * n + col]) * d[kk / SUPER * n + col];
      const float w = static_cast<float>(q_at(p, block, j, kk) - 32) * scale;
      if constexpr (std::is_same_v<T, uint16_t>)
        out[kk * n + col] = float_to_bf16(w);
      else
        out[kk * n + col] = w;
    }
  }
}

}  // namespace

extern "C" {

// The vector path this build has: 2 AVX512-VNNI with VBMI, 1 AVX2 with FMA, 0 none (the engine
// then keeps Q6_K dequantized)
int kiln_q6k_isa() {
#if defined(KILN_Q6K_VNNI)
  return 2;
#elif defined(KILN_Q6K_AVX2)
  return 1;
#else
  return 0;
#endif
}

// out [rows, n] (out_dtype 0 float32, 1 bf16) = x [rows, k] (x_dtype likewise) times the
// weight; n a multiple of 64, k of 256; the rows as `planes` (1 or 2) int8 planes. `portable`:
// the scalar loops (the tests' reference).
void kiln_q6k_mm(int x_dtype, const void* x, int64_t rows, int64_t k, const uint8_t* low,
                 const uint8_t* high, const int8_t* sub_scales, const float* d, int64_t n,
                 int out_dtype, void* out, int planes, int threads, int portable) {
  kiln_bf16::in_float32(x_dtype, x, rows, k, out_dtype, out, n, [&](const float* xs, float* ys) {
    q6k_mm(xs, rows, k, low, high, sub_scales, d, n, ys, planes == 2 ? 2 : 1, threads,
           portable != 0);
  });
}

// kiln_q6k_mm for a step's experts (q6k_mm_experts): x [rows, k] sorted by expert, out
// [rows, n] (rows of no group: zeros)
void kiln_q6k_mm_experts(int x_dtype, const void* x, int64_t rows, int64_t k, const uint8_t* low,
                         const uint8_t* high, const int8_t* sub_scales, const float* d,
                         const int64_t* strides, int64_t n, int64_t groups,
                         const int64_t* experts, const int64_t* starts, const int64_t* counts,
                         int out_dtype, void* out, int planes, int threads) {
  kiln_bf16::in_float32(x_dtype, x, rows, k, out_dtype, out, n, [&](const float* xs, float* ys) {
    q6k_mm_experts(xs, rows, k, low, high, sub_scales, d, strides, n, groups, experts, starts,
                   counts, ys, planes == 2 ? 2 : 1, threads);
  });
}

// W^T [k, n] (out_dtype 0 float32, 1 bf16): the large-batch path's weight
void kiln_q6k_dequantize_t(const uint8_t* low, const uint8_t* high, const int8_t* sub_scales,
                           const float* d, int64_t n, int64_t k, int out_dtype, void* out,
                           int threads) {
  if (out_dtype == 1)
    dequantize_t(low, high, sub_scales, d, n, k, static_cast<uint16_t*>(out), threads);
  else
    dequantize_t(low, high, sub_scales, d, n, k, static_cast<float*>(out), threads);
}

}  // extern "C"
