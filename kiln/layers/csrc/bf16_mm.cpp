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
};

// A tile: 8 rows by 3 vectors of 16 columns, 24 sums, 3 weights and a broadcast in registers.
// Measured against 4 x 6, 6 x 4, 12 x 2 and 16 x 1 at 1 to 528 rows: none faster beyond the
// runs' noise (16 x 1 and 12 x 2 slower from 8 rows on).
constexpr int ROWS = 8;
constexpr int VECTORS = 3;

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

template <int R>
void run_tile_rows(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors,
                   const uint16_t* next, int64_t next_vectors) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile_rows<R - 1>(p, m0, rows, v0, vectors, next, next_vectors);
  }
  tile_vectors<R, VECTORS>(p, m0, v0, vectors, next, next_vectors);
}

void run_tile(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors,
              const uint16_t* next, int64_t next_vectors) {
  run_tile_rows<ROWS>(p, m0, rows, v0, vectors, next, next_vectors);
}
#endif

#ifdef KILN_BF16_AMX
// Batches of AMX_MIN_ROWS rows and more on AMX tiles (Intel's matrix unit, Sapphire Rapids and
// later). The packed weight is already the layout a tile product's right-hand operand takes:
// 16 pairs along k by 16 columns, 64 bytes a row, so a tile of it is 16 consecutive vectors of
// one column block, loaded as they lie. One tdpbf16ps multiplies 16 rows by 32 of k by 16
// columns (8,192 pair products, each exact, summed in float32 as vdpbf16ps sums them, in
// another order). From 2 rows the tiles stream the weight at the memory's speed where the
// vector path's time grows with the rows (8.3 against 10.3 ms for 30 layers of SmolLM2's
// linears at 4 rows, 8.6 against 15.6 at 8: benchmarks/bf16_linears.py).
constexpr int64_t AMX_MIN_ROWS = 2;  // one row: the vector path, as fast (memory-bound)
constexpr int64_t AMX_ROW_BLOCKS = 2;  // a work item: 2 x 16 rows by 2 x 16 columns, 4 sums
constexpr int64_t AMX_VECTORS = 2;

// Linux gives a process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); where it refuses, the vector path runs every batch
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums (rows x 16 float32), 4-5: row blocks (rows x 32 bf16 of k), 6-7: the weight
// (16 pairs x 16 columns); `rows` in the last row block of a batch may be under 16
void amx_configure(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? 16 : rows);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The sums in `c` (rows x 16 float32) plus the bias, rounded to bf16 into columns n0.. of out
void amx_store(const Problem& p, const float* c, int64_t m0, int64_t rows, int64_t n0) {
  const Columns cols = columns(p, n0);
  for (int64_t r = 0; r < rows; ++r) store_row(p, cols, m0 + r, _mm512_load_ps(c + r * 16));
}

// Rows m0.. (two blocks of up to 16, `blocks` of them) by vectors v0, v0 + 1 over all of k.
// Tile numbers are instruction immediates, hence the unrolled blocks.
void amx_item(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors) {
  const int64_t pairs = p.k / 2, stride = p.k * 2;
  const uint16_t* x0 = p.x + m0 * p.k;
  const uint16_t* x1 = x0 + 16 * p.k;
  const uint16_t* w0 = p.packed + v0 * pairs * 32;
  const uint16_t* w1 = vectors > 1 ? w0 + pairs * 32 : w0;
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < p.k; kc += 32) {
    const int64_t q = kc / 2;  // pairs before this chunk
    _tile_loadd(6, w0 + q * 32, 64);
    _tile_loadd(7, w1 + q * 32, 64);
    _tile_loadd(4, x0 + kc, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + kc, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16 * 16];
  const int64_t first = two ? 16 : rows;
  _tile_stored(0, c, 64);
  amx_store(p, c, m0, first, v0 * 16);
  if (vectors > 1) {
    _tile_stored(1, c, 64);
    amx_store(p, c, m0, first, (v0 + 1) * 16);
  }
  if (two) {
    _tile_stored(2, c, 64);
    amx_store(p, c, m0 + 16, rows - 16, v0 * 16);
    if (vectors > 1) {
      _tile_stored(3, c, 64);
      amx_store(p, c, m0 + 16, rows - 16, (v0 + 1) * 16);
    }
  }
}

bool amx_runs(const Problem& p) { return p.m >= AMX_MIN_ROWS && p.k % 32 == 0 && amx_permitted(); }

// Work items column-major, as the vector path's: a thread's items share their weight columns
// across the row tiles. A thread configures its tiles for full blocks, and again for a batch's
// last block where it is short.
void amx_matmul(const Problem& p, int threads) {
  constexpr int64_t ROWS_PER_ITEM = 16 * AMX_ROW_BLOCKS;
  const int64_t vectors = (p.n + 15) / 16, column_tiles = (vectors + AMX_VECTORS - 1) / AMX_VECTORS;
  const int64_t row_tiles = (p.m + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  const int64_t items = column_tiles * row_tiles;
#pragma omp parallel num_threads(threads)
  {
    int64_t configured = 0;  // the rows this thread's tiles are configured for
    const auto run = [&](int64_t m0, int64_t rows, int64_t v0, int64_t vectors) {
      const int64_t block = rows < 16 ? rows : 16;
      if (configured != block) amx_configure(block), configured = block;
      amx_item(p, m0, rows, v0, vectors);
    };
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t v0 = (item / row_tiles) * AMX_VECTORS, m0 = (item % row_tiles) * ROWS_PER_ITEM;
      const int64_t rows = p.m - m0 < ROWS_PER_ITEM ? p.m - m0 : ROWS_PER_ITEM;
      const int64_t vs = vectors - v0 < AMX_VECTORS ? vectors - v0 : AMX_VECTORS;
      if (rows > 16 && rows < 32) {  // blocks of 16 and fewer rows: one configuration each
        run(m0, 16, v0, vs);
        run(m0 + 16, rows - 16, v0, vs);
      } else {
        run(m0, rows, v0, vs);
      }
    }
    if (configured) _tile_release();
  }
}
#endif

#ifndef KILN_BF16_SIMD
// The same sums in scalar code: each pair's two products are exact in float32 and are added to
// the column's sum one after the other (Intel documents the odd one first; g++ 12 at -O3 gave
// wrong sums for that order here, errors of the values' size, so the even one goes first: a
// last-bit difference at most, as is the instruction's flushing of denormals, kept here).
void run_tile(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors,
              const uint16_t*, int64_t) {
  const int64_t pairs = p.k / 2;
  for (int64_t r = m0; r < m0 + rows; ++r) {
    for (int64_t c = v0 * 16; c < (v0 + vectors) * 16 && c < p.n; ++c) {
      const uint16_t* w = p.packed + (c / 16) * pairs * 32 + (c % 16) * 2;
      float sum = 0.0f;
      for (int64_t q = 0; q < pairs; ++q) {
        const float a = bf16_to_float(p.x[r * p.k + 2 * q]) * bf16_to_float(w[q * 32]);
        const float b = bf16_to_float(p.x[r * p.k + 2 * q + 1]) * bf16_to_float(w[q * 32 + 1]);
        sum += a;
        sum += b;
      }
      p.out[r * p.n + c] = float_to_bf16(sum + (p.bias ? bf16_to_float(p.bias[c]) : 0.0f));
    }
  }
}
#endif

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
// are tiles of ROWS rows by VECTORS * 16 columns, column-major so that a thread's items share
// their weight columns across the row tiles.
void kiln_bf16_mm(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                  const uint16_t* bias, uint16_t* out, int threads) {
  const Problem p{x, m, k, packed, n, bias, out};
#ifdef KILN_BF16_AMX
  if (amx_runs(p)) return amx_matmul(p, threads);
#endif
  const int64_t vectors = (n + 15) / 16, column_tiles = (vectors + VECTORS - 1) / VECTORS;
  const int64_t row_tiles = (m + ROWS - 1) / ROWS, items = column_tiles * row_tiles;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t v0 = (item / row_tiles) * VECTORS, m0 = (item % row_tiles) * ROWS;
    const int64_t rows = m - m0 < ROWS ? m - m0 : ROWS;
    // the next column tile's weights, fetched while the last row tile computes (none at 1 row
    // tile: that pass streams its own weights from memory already)
    const int64_t after = vectors - v0 - VECTORS;
    const int64_t next_vectors = row_tiles > 1 && m0 + ROWS >= m && after > 0
                                     ? (after < VECTORS ? after : VECTORS) : 0;
    const uint16_t* next = next_vectors ? packed + (v0 + VECTORS) * k * 16 : nullptr;
    run_tile(p, m0, rows, v0, vectors - v0 < VECTORS ? vectors - v0 : VECTORS, next, next_vectors);
  }
}

}  // extern "C"
