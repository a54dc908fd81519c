// A mixture-of-experts step's work around its two grouped products, for steps of few routed rows
// (decode): the rows sorted by expert and gathered, silu(gate) * up between the products, and the
// weighted sum back into each token's row. Done in PyTorch these were a dozen small ops a layer
// (a sort, an index_add for the counts, a gather, a chunk, silu, a product, an index, a product,
// zeros, an index_add) that cost a Qwen3-30B-A3B decode step about a third of its expert kernels'
// time. Compiled into each packed-weight kernel's library (int4_mm.cpp, q6k_mm.cpp,
// kquant_mm.cpp), so the library that runs a stack also routes its rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "swiglu.h"

namespace kiln_moe {

// ids [tokens, top_k] -> the routed rows sorted by expert, ties in row order (a stable counting
// sort, as argsort(stable=True) orders them): order [R] the flat index of each sorted row, and
// the groups (experts, starts, counts [groups]) of the active experts in expert order. `groups`
// points at 3 * R int64s. Returns the number of groups, or -1 where an id is outside
// [0, num_experts) or there is nothing to route (nothing else is written then).
inline int64_t route(const int64_t* ids, int64_t rows, int64_t num_experts, int64_t* order,
                     int64_t* groups) {
  if (rows <= 0 || num_experts <= 0) return -1;  // (the callers check; nothing to sort)
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (ids[r] < 0 || ids[r] >= num_experts) return -1;
    ++count[ids[r]];
  }
  std::vector<int64_t> next(num_experts, 0);
  int64_t active = 0, start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    next[e] = start;
    if (count[e] == 0) continue;
    groups[active] = e, groups[rows + active] = start, groups[2 * rows + active] = count[e];
    ++active, start += count[e];
  }
  for (int64_t r = 0; r < rows; ++r) order[next[ids[r]]++] = r;
  // the three arrays packed: experts, starts, counts side by side at [0, 3 * active)
  std::memmove(groups + active, groups + rows, sizeof(int64_t) * active);
  std::memmove(groups + 2 * active, groups + 2 * rows, sizeof(int64_t) * active);
  return active;
}

// out [R, k] float32: sorted row r is token order[r] / top_k of x [tokens, k] (dtype 0 float32,
// 1 bf16, widened exactly)
inline void gather(int x_dtype, const void* x, int64_t k, const int64_t* order, int64_t rows,
                   int64_t top_k, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = order[r] / top_k;
    float* dst = out + r * k;
    if (x_dtype == 1) {
      const uint16_t* src = static_cast<const uint16_t*>(x) + token * k;
      for (int64_t i = 0; i < k; ++i) dst[i] = kiln_bf16::bf16_to_float(src[i]);
    } else {
      std::memcpy(dst, static_cast<const float*>(x) + token * k, sizeof(float) * k);
    }
  }
}

// act [R, width] = silu(gate) * up, where row r of h [R, stride] holds gate at columns
// [0, width) and up at [width, 2 width), in float32 from the products' unrounded sums
inline void silu_mul(const float* h, int64_t rows, int64_t stride, int64_t width, float* act) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = h + r * stride;
    const float* up = gate + width;
    float* dst = act + r * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= width; i += 16)
      _mm512_storeu_ps(dst + i, kiln_swiglu::silu_mul(_mm512_loadu_ps(gate + i),
                                                      _mm512_loadu_ps(up + i)));
#endif
    for (; i < width; ++i) dst[i] = kiln_swiglu::silu_mul(gate[i], up[i]);
  }
}

// out [R / top_k tokens, width] (dtype 0 float32, 1 bf16): each token's routed rows of y
// [R, stride] (sorted by expert) times their weights (weights [tokens, top_k], w_dtype 0 float32,
// 1 bf16), summed in float32 in sorted order and rounded once
inline void combine(const float* y, int64_t rows, int64_t stride, int64_t width,
                    const int64_t* order, int64_t top_k, int w_dtype, const void* weights,
                    int out_dtype, void* out) {
  const int64_t tokens = rows / top_k;
  std::vector<float> sums(tokens * width, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t flat = order[r];
    const float w = w_dtype == 1
                        ? kiln_bf16::bf16_to_float(static_cast<const uint16_t*>(weights)[flat])
                        : static_cast<const float*>(weights)[flat];
    float* dst = sums.data() + (flat / top_k) * width;
    const float* src = y + r * stride;
    for (int64_t i = 0; i < width; ++i) dst[i] += w * src[i];
  }
  if (out_dtype == 1) {
    uint16_t* ob = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < tokens * width; ++i) ob[i] = kiln_bf16::float_to_bf16(sums[i]);
  } else {
    std::memcpy(out, sums.data(), sizeof(float) * tokens * width);
  }
}

}  // namespace kiln_moe

// The entry points of every library that includes this header (each library is one translation
// unit; ctypes finds them in the library it loaded)
extern "C" {

// kiln_moe::route, then the sorted rows gathered as float32 [R, k] (kiln_moe::gather)
int64_t kiln_moe_route(const int64_t* ids, int64_t rows, int64_t top_k, int64_t num_experts,
                       int x_dtype, const void* x, int64_t k, int64_t* order, int64_t* groups,
                       float* sorted_rows) {
  const int64_t active = kiln_moe::route(ids, rows, num_experts, order, groups);
  if (active >= 0) kiln_moe::gather(x_dtype, x, k, order, rows, top_k, sorted_rows);
  return active;
}

void kiln_moe_silu_mul(const float* h, int64_t rows, int64_t stride, int64_t width, float* act) {
  kiln_moe::silu_mul(h, rows, stride, width, act);
}

void kiln_moe_combine(const float* y, int64_t rows, int64_t stride, int64_t width,
                      const int64_t* order, int64_t top_k, int w_dtype, const void* weights,
                      int out_dtype, void* out) {
  kiln_moe::combine(y, rows, stride, width, order, top_k, w_dtype, weights, out_dtype, out);
}

}  // extern "C"
