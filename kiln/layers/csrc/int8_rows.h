// Rows of activations as int8 planes per chunk of 32 columns, as llama.cpp's Q8 rows, what a
// kernel reads of them (a chunk's scale, the planes combined), the loop over blocks of outputs,
// a prefetch, and the gather of the int4 layout's codes into vpdpbusd's lanes: shared by the
// packed-weight kernels' int8 paths (int4_mm.cpp, q6k_mm.cpp, kquant_mm.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kiln_int8_rows {

constexpr int64_t CHUNK = 32;  // columns per int8 scale

// Each row's chunks of 32 columns as int8 codes and a float32 scale (round to nearest); with
// two planes, the second holds the remainders at 1/256 of the scale: 16 bits of each value.
// xq is [planes, rows, k], xscale [rows, k / CHUNK].
inline void quantize_rows(const float* x, int64_t rows, int64_t k, int planes, int8_t* xq,
                          float* xscale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < k / CHUNK; ++c) {
      const float* xs = x + m * k + c * CHUNK;
      float amax = 0.0f;
      for (int64_t i = 0; i < CHUNK; ++i) amax = std::max(amax, std::fabs(xs[i]));
      const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      xscale[m * (k / CHUNK) + c] = scale;
      for (int64_t i = 0; i < CHUNK; ++i) {
        const float q = std::nearbyint(xs[i] * inverse);
        xq[m * k + c * CHUNK + i] = static_cast<int8_t>(q);
        if (planes == 2) {  // the exact product's remainder, rounded once, whatever the compiler
          const float rest = std::nearbyint(std::fma(xs[i], inverse, -q) * 256.0f);
          xq[(rows + m) * k + c * CHUNK + i] = static_cast<int8_t>(std::clamp(rest, -127.0f, 127.0f));
        }
      }
    }
  }
}

// The float factor of row m's chunk holding column kk: with two planes the sums are taken at
// 256 times the first plane's scale
inline float chunk_scale(const float* xscale, int64_t k, int planes, int64_t m, int64_t kk) {
  const float s = xscale[m * (k / CHUNK) + kk / CHUNK];
  return planes == 2 ? s * (1.0f / 256) : s;
}

// Row m's int8 planes at column kk combined as the sums combine them: 256 x0 + x1, or x0
inline int32_t combined(const int8_t* xq, int64_t rows, int64_t k, int planes, int64_t m,
                        int64_t kk) {
  const int32_t x0 = xq[m * k + kk];
  return planes == 2 ? 256 * x0 + xq[(rows + m) * k + kk] : x0;
}

// A product's rows as `planes` int8 planes and their chunks' scales (quantize_rows)
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> xscale;
  QuantizedRows(const float* x, int64_t rows, int64_t k, int planes, int threads)
      : xq(planes * rows * k), xscale(rows * (k / CHUNK)) {
    quantize_rows(x, rows, k, planes, xq.data(), xscale.data(), threads);
  }
};

// `run_block(b)` for each block b of the output's columns, the blocks split across `threads`
template <typename RunBlock>
void for_each_block(int64_t blocks, int threads, RunBlock run_block) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) run_block(b);
}

// `run_block(g, b)` for block b of product g's output columns, for `groups` products of
// `blocks` blocks each (a step's experts): one parallel region for all of them, where a call
// per product would fork and join its threads once each. Items run product by product: a
// thread's share is runs of consecutive blocks of one weight, streams the prefetchers follow
// (interleaving the products block by block, which balances unequal row counts, ran a
// Qwen3-30B-A3B expert block 1.09-1.16x slower at 1 to 16 tokens).
template <typename RunBlock>
void for_each_group_block(int64_t groups, int64_t blocks, int threads, RunBlock run_block) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < groups * blocks; ++item) run_block(item / blocks, item % blocks);
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }  // prefetcht0

#if defined(__AVX512F__)
// The gather of a quad of columns of PyTorch's CPU int4 layout (blocks of 64 rows, a column's 32
// bytes side by side) into vpdpbusd's lanes: lane r takes byte j of a (columns k, k + 1) or b
// (columns k + 2, k + 3) for row r0 + r, so one vpermt2b gives each row its four columns.
inline __m512i quad_index(int r0) {
  alignas(64) uint8_t idx[64];
  for (int r = 0; r < 16; ++r) {
    const int row = r0 + r;
    idx[4 * r] = row, idx[4 * r + 1] = 32 + row, idx[4 * r + 2] = 64 + row, idx[4 * r + 3] = 96 + row;
  }
  return _mm512_load_si512(idx);
}
#endif

}  // namespace kiln_int8_rows
