// Rows of activations as int8 planes per chunk of 32 columns, as llama.cpp's Q8 rows: shared by
// the packed-weight kernels' int8 paths (int4_mm.cpp, q6k_mm.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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

}  // namespace kiln_int8_rows
