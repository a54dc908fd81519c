// Rows times a bfloat16 weight on CPUs with AVX512-BF16, and on AMX tiles where the CPU has them.
//
// The weight is packed once at load in pairs along k ([ceil(n/16), k/2, 16, 2]: for each 16
// output columns and each pair of input columns, one 64-byte vector), the layout the
// vdpbf16ps instruction reads: one instruction multiplies a row's pair (k, k+1), broadcast,
// by 16 columns' pairs and adds both exact products to 16 float32 sums. A tile of R rows by
// V * 16 columns keeps R * V sums in registers across all of k, so each weight vector loaded
// serves R rows and each row's pair serves V vectors; the sums are rounded to bfloat16 once,
// after the bias (round to nearest even, as torch rounds).
//
// Why a kernel of kiln's own: oneDNN's bf16 linear runs a 16-row batch at about 40% of these
// cores' vdpbf16ps peak and a single row at half the memory's bandwidth (docs/performance.md,
// "A bf16 kernel for the linears"); a decode step is linears over a few rows. On a CPU with AMX
// the same packed weight feeds tile products from 2 rows up (amx_matmul): 1.4-1.5x oneDNN's
// AMX path at 1 to 64 rows on a 2-core Xeon, 1.05x at 512.
//
// A gated MLP's gate/up product can end in SwiGLU's activation (kiln_bf16_mm_silu_mul): each
// work item sums one output vector's gate and up columns side by side and stores silu(gate) *
// up, rounded once, where Inductor's separate kernel read both back at bf16 and wrote the
// result again: 1.45-1.6x on the embedded model's gate/up and activation, 1 to 512 rows
// (benchmarks/swiglu_fused.py).
//
// Built at first use by kiln/layers/bf16_kernel.py with the machine's compiler (-O3
// -march=native -fopenmp). Without AVX512-BF16 the portable loops compute the same sums (the
// reference the tests hold the vector build to; the engine keeps oneDNN there).

#include <cstdint>
#include <cstring>

#include "bf16.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KILN_BF16_SIMD 1
#endif
#include "swiglu.h"
#if defined(KILN_BF16_SIMD) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KILN_BF16_AMX 1
#endif

namespace {

using kiln_bf16::bf16_to_float;
using kiln_bf16::float_to_bf16;

struct Problem {
  const uint16_t* x;       // [m, k] bf16 rows
  int64_t m, k;            // k even
  const uint16_t* packed;  // [vectors, k / 2, 16, 2] bf16
  int64_t n;               // output columns; vectors = ceil(n / 16), the last one zero-padded
  const uint16_t* bias;    // [n] bf16 or null
  uint16_t* out;           // [m, n] bf16
  // 0: out = x W (+ bias). Else a gated MLP's product (SwiGLU): output vector v is
  // silu(x W_v) * (x W_{v + gate_vectors}), the gate's and up projection's columns of one packed
  // weight; n = 16 * gate_vectors, no bias
  int64_t gate_vectors = 0;
};

// A tile: 8 rows by 3 vectors of 16 columns, 24 sums, 3 weights and a broadcast in registers.
// Measured against 4 x 6, 6 x 4, 12 x 2 and 16 x 1 at 1 to 528 rows: none faster beyond the
// runs' noise (16 x 1 and 12 x 2 slower from 8 rows on). Batches of WIDE_MIN_ROWS rows and more
// take 4 x 6 instead (plain products; a gated one keeps 8 rows by its gate and up vector): on a
// 2-core Zen 4, 30 layers of the embedded model's qkv, o and down, 1.07x at 512 rows and 1.03x
// at 64, where 8 x 3 stayed 1.07x faster at 16 and level at one.
constexpr int ROWS = 8;
constexpr int VECTORS = 3;
constexpr int WIDE_ROWS = 4;
constexpr int WIDE_VECTORS = 6;
constexpr int64_t WIDE_MIN_ROWS = 64;

// How a product's work items are cut: rows by vectors of 16 columns
struct Tiling {
  int64_t rows, vectors;
};

inline Tiling tiling(const Problem& p) {
  if (p.gate_vectors) return {ROWS, 1};
  return p.m >= WIDE_MIN_ROWS ? Tiling{WIDE_ROWS, WIDE_VECTORS} : Tiling{ROWS, VECTORS};
}

#ifdef KILN_BF16_SIMD
// The 16 output columns from n0 (a mask of those that exist: the last vector's may not) and
// their bias as float32 (zeros without one)
struct Columns {
  int64_t n0;
  __mmask16 mask;
  __m512 bias;
};

inline Columns columns(const Problem& p, int64_t n0) {
  const int64_t valid = p.n - n0 < 16 ? p.n - n0 : 16;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  __m512 bias = _mm512_setzero_ps();
  if (p.bias) {
    const __m256i b = _mm256_maskz_loadu_epi16(mask, p.bias + n0);
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  return {n0, mask, bias};
}

// Row r's 16 sums plus the bias, rounded to bf16 once (to nearest even) into out
inline void store_row(const Problem& p, const Columns& cols, int64_t r, __m512 sums) {
  const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(sums, cols.bias));
  _mm256_mask_storeu_epi16(p.out + r * p.n + cols.n0, cols.mask, (__m256i)y);
}

// Row r's gate and up sums combined, silu(gate) * up, rounded to bf16 once into out
inline void store_gated(const Problem& p, const Columns& cols, int64_t r, __m512 gate, __m512 up) {
  const __m256bh y = _mm512_cvtneps_pbh(kiln_swiglu::silu_mul(gate, up));
  _mm256_mask_storeu_epi16(p.out + r * p.n + cols.n0, cols.mask, (__m256i)y);
}

// Output vector v0 of a gated product for rows m0 .. m0 + R: the gate's and up projection's
// sums side by side over all of k, combined once. `next`: as tile's, the gate vector of the
// thread's next output vector (its up vector lies gate_vectors further).
template <int R>
void gated_tile(const Problem& p, int64_t m0, int64_t v0, const uint16_t* next) {
  const int64_t pairs = p.k / 2, up_offset = p.gate_vectors * pairs * 32;
  __m512 gate[R], up[R];
  for (int r = 0; r < R; ++r) gate[r] = up[r] = _mm512_setzero_ps();
  const uint16_t* w = p.packed + v0 * pairs * 32;
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512bh wg = (__m512bh)_mm512_loadu_si512(w + q * 32);
    const __m512bh wu = (__m512bh)_mm512_loadu_si512(w + up_offset + q * 32);
    if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + q * 32), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + up_offset + q * 32), _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, p.x + (m0 + r) * p.k + 2 * q, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      gate[r] = _mm512_dpbf16_ps(gate[r], xv, wg);
      up[r] = _mm512_dpbf16_ps(up[r], xv, wu);
    }
  }
  const Columns cols = columns(p, v0 * 16);
  for (int r = 0; r < R; ++r) store_gated(p, cols, m0 + r, gate[r], up[r]);
}

template <int R>
void run_gated_rows(const Problem& p, int64_t m0, int64_t rows, int64_t v0, const uint16_t* next) {
  if constexpr (R > 1) {
    if (rows < R) return run_gated_rows<R - 1>(p, m0, rows, v0, next);
  }
  gated_tile<R>(p, m0, v0, next);
}

// Rows m0 .. m0 + R by vectors v0 .. v0 + V over all of k. `next`, where given, is the weight of
// the tile this thread takes after the current row tiles (`next_vectors` of them): its lines are
// fetched into L2 while this tile computes from weights already there, so that memory and the
// pair products overlap.
template <int R, int V>
void tile(const Problem& p, int64_t m0, int64_t v0, const uint16_t* next, int64_t next_vectors) {
  const int64_t pairs = p.k / 2;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* w = p.packed + v0 * pairs * 32;
  for (int64_t q = 0; q < pairs; ++q) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) {
      wv[v] = (__m512bh)_mm512_loadu_si512(w + (v * pairs + q) * 32);
      if (v < next_vectors)
        _mm_prefetch(reinterpret_cast<const char*>(next + (v * pairs + q) * 32), _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, p.x + (m0 + r) * p.k + 2 * q, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const Columns cols = columns(p, (v0 + v) * 16);
    for (int r = 0; r < R; ++r) store_row(p, cols, m0 + r, acc[r][v]);
  }
}

template <int R, int V>
void tile_vectors(const Problem& p, int64_t m0, int64_t v0, int64_t vectors, const uint16_t* next,
                  int64_t next_vectors) {
  if constexpr (V > 1) {
    if (vectors < V) return tile_vectors<R, V - 1>(p, m0, v0, vectors, next, next_vectors);
  }
  tile<R, V>(p, m0, v0, next, next_vectors);
}

template <int R, int V>
void run_tile_rows(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors,
                   const uint16_t* next, int64_t next_vectors) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile_rows<R - 1, V>(p, m0, rows, v0, vectors, next, next_vectors);
  }
  tile_vectors<R, V>(p, m0, v0, vectors, next, next_vectors);
}

void run_tile(const Problem& p, const Tiling& t, int64_t m0, int64_t rows, int64_t v0,
              int64_t vectors, const uint16_t* next, int64_t next_vectors) {
  if (p.gate_vectors) return run_gated_rows<ROWS>(p, m0, rows, v0, next_vectors ? next : nullptr);
  if (t.vectors == WIDE_VECTORS)
    return run_tile_rows<WIDE_ROWS, WIDE_VECTORS>(p, m0, rows, v0, vectors, next, next_vectors);
  run_tile_rows<ROWS, VECTORS>(p, m0, rows, v0, vectors, next, next_vectors);
}
#endif

#ifdef KILN_BF16_AMX
#include "bf16_amx.h"
#endif

#ifndef KILN_BF16_SIMD
// The same sums in scalar code: each pair's two products are exact in float32 and are added to
// the column's sum one after the other (Intel documents the odd one first; g++ 12 at -O3 gave
// wrong sums for that order here, errors of the values' size, so the even one goes first: a
// last-bit difference at most, as is the instruction's flushing of denormals, kept here).
float column_sum(const Problem& p, int64_t r, int64_t c) {
  const int64_t pairs = p.k / 2;
  const uint16_t* w = p.packed + (c / 16) * pairs * 32 + (c % 16) * 2;
  float sum = 0.0f;
  for (int64_t q = 0; q < pairs; ++q) {
    const float a = bf16_to_float(p.x[r * p.k + 2 * q]) * bf16_to_float(w[q * 32]);
    const float b = bf16_to_float(p.x[r * p.k + 2 * q + 1]) * bf16_to_float(w[q * 32 + 1]);
    sum += a;
    sum += b;
  }
  return sum;
}

void run_tile(const Problem& p, const Tiling&, int64_t m0, int64_t rows, int64_t v0,
              int64_t vectors, const uint16_t*, int64_t) {
  for (int64_t r = m0; r < m0 + rows; ++r) {
    for (int64_t c = v0 * 16; c < (v0 + vectors) * 16 && c < p.n; ++c) {
      const float sum = column_sum(p, r, c);
      p.out[r * p.n + c] = float_to_bf16(
          p.gate_vectors ? kiln_swiglu::silu_mul(sum, column_sum(p, r, c + p.gate_vectors * 16))
                         : sum + (p.bias ? bf16_to_float(p.bias[c]) : 0.0f));
    }
  }
}
#endif

void run_matmul(const Problem& p, int threads) {
#ifdef KILN_BF16_AMX
  if (amx_runs(p)) return amx_matmul(p, threads);
#endif
  const Tiling t = tiling(p);
  const int64_t per_item = t.vectors;
  const int64_t vectors = (p.n + 15) / 16, column_tiles = (vectors + per_item - 1) / per_item;
  const int64_t row_tiles = (p.m + t.rows - 1) / t.rows, items = column_tiles * row_tiles;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t v0 = (item / row_tiles) * per_item, m0 = (item % row_tiles) * t.rows;
    const int64_t rows = p.m - m0 < t.rows ? p.m - m0 : t.rows;
    // the next column tile's weights, fetched while the last row tile computes (none at 1 row
    // tile: that pass streams its own weights from memory already)
    const int64_t after = vectors - v0 - per_item;
    const int64_t next_vectors = row_tiles > 1 && m0 + t.rows >= p.m && after > 0
                                     ? (after < per_item ? after : per_item) : 0;
    const uint16_t* next = next_vectors ? p.packed + (v0 + per_item) * p.k * 16 : nullptr;
    run_tile(p, t, m0, rows, v0, vectors - v0 < per_item ? vectors - v0 : per_item, next,
             next_vectors);
  }
}

}  // namespace

extern "C" {

// 1 where batches of AMX_MIN_ROWS rows and more run on AMX tiles (built with AMX, and Linux
// gave this process the tile registers), else 0.
int kiln_bf16_mm_amx() {
#ifdef KILN_BF16_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 where this build multiplies with AVX512-BF16, 0 for the portable loops.
int kiln_bf16_mm_isa() {
#ifdef KILN_BF16_SIMD
  return 1;
#else
  return 0;
#endif
}

// out [m, n] bf16 = x [m, k] bf16 times the packed weight, plus bias where given. Work items
// are tiles of rows by vectors of 16 columns (`tiling`; one output vector of a gated product),
// column-major so that a thread's items share their weight columns across the row tiles.
void kiln_bf16_mm(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                  const uint16_t* bias, uint16_t* out, int threads) {
  run_matmul(Problem{x, m, k, packed, n, bias, out}, threads);
}

// out [m, n] bf16 = silu(x W_gate) * (x W_up), a gated MLP's activation fused into its product:
// the packed weight holds 2n columns, the gate's n then the up projection's n; n % 16 == 0.
// Each output element is rounded to bf16 once, from the float32 sums.
void kiln_bf16_mm_silu_mul(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed,
                           int64_t n, uint16_t* out, int threads) {
  run_matmul(Problem{x, m, k, packed, n, nullptr, out, n / 16}, threads);
}

}  // extern "C"
