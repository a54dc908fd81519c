// SwiGLU's activation, silu(gate) * up, on 16 float32 lanes: the epilogue of bf16_mm.cpp's gated
// product, where a gated MLP's gate and up sums are combined before they are rounded or stored
// (Inductor's separate kernel read and wrote them at bf16 once more, a 512-row chunk of the
// embedded model's MLP moving 4.5 MB a layer for it).
#pragma once

#include <cmath>

namespace kiln_swiglu {

// silu(g) * u in scalar float32 (the portable build's, and the tests' reference for it)
inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

#if defined(__AVX512F__)
// exp(x) within about 2 ulp of float32: x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6
// polynomial for e^r, then scaled by 2^n. x is clamped to exp's finite range.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2's high part, exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // and the rest
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g u / (1 + e^-g); the reciprocal by vrcp14ps and one Newton step (relative
// error about 2^-28), where a division would take the divider's 16 cycles a vector
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 d = _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, inv), u);
}
#endif

}  // namespace kiln_swiglu
