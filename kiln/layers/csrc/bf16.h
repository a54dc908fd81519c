// bfloat16 <-> float32 in scalar code, shared by the linears' kernels (int4_mm.cpp, bf16_mm.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace kiln_bf16 {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// `product(x, y)` on float32 rows x [rows, k] into a float32 output y [rows, n], where the
// caller's rows and output are float32 (dtype 0) or bf16 (1): bf16 rows widened here (exact), a
// bf16 output rounded once (to nearest even) from the float32 sums, as the caller's own
// conversions did, which cost more than a kernel's arithmetic at one row.
template <typename Product>
void in_float32(int x_dtype, const void* x, int64_t rows, int64_t k, int out_dtype, void* out,
                int64_t n, Product product) {
  std::vector<float> xf, yf;
  const float* xs = static_cast<const float*>(x);
  if (x_dtype == 1) {
    xf.resize(rows * k);
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < rows * k; ++i) xf[i] = bf16_to_float(xb[i]);
    xs = xf.data();
  }
  float* ys = static_cast<float*>(out);
  if (out_dtype == 1) {
    yf.resize(rows * n);
    ys = yf.data();
  }
  product(xs, ys);
  if (out_dtype == 1) {
    uint16_t* yb = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < rows * n; ++i) yb[i] = float_to_bf16(ys[i]);
  }
}

}  // namespace kiln_bf16
