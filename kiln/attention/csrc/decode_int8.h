// Decode rows over an int8 cache on AVX-512 with VNNI and BW: paged_decode.cpp's attend_range
// for that case, included after decode_bf16.h, whose online softmax (softmax_update) it shares.
//
// Keys are scored by integer dot products as in the general path: the query quantized per head
// as the cache's rows are, (k + 128) . q8 summed exactly in int32 by vpdpbusd. Where a key's
// row for every KV head is short (SmolLM2's 204 bytes), blocks of 16 keys are transposed so
// one instruction adds 4 dims of 16 keys and the sums come out a key a lane
// (score_int8_keys); longer rows (Qwen3's 1 KiB) are read whole, 64 dims an instruction, and
// reduced by the bf16 path's add tree (score_int8_rows).
// Values are added by integer products too. Each head's step weights times their value rows'
// scales, w = p * vs, are quantized to 8 unsigned bits against the step's largest
// (w ~ u * round(w / u), u = max w / 255); four keys' value rows are interleaved bytewise, so
// one vpdpbusd adds four keys' terms for 16 dims, summed exactly in int32 over the step and
// added to the float32 sums once a step as u * sum. A weight moves by at most u / 2, 1/510 of
// the step's largest: less than the int8 values' own rounding (up to 1/254 of a row's
// largest value), and the softmax's sum is taken from the unrounded weights. On SmolLM2's 9/3
// heads of 64 a key's values were 36 float32 FMAs and 12 conversions (widened int8 rows); here
// they are 9 vpdpbusd and 6 byte unpacks. The next step's rows are asked for into L2 as this
// step's are used, as the bf16 path does.
// On a 2-core Zen 4 (benchmarks/decode_kernel_ab.py --layers 30, 1 to 64 rows, 512 to 16k keys,
// against the general path): 1.23-1.59x with integer values, and 1.07-1.16x more on SmolLM2's
// heads from the transposed scores.
// Where the CPU lacks AVX512-VNNI or AVX512-BW, or head_dim is not a multiple of 64, the general
// path runs; -DKILN_DECODE_INT8_VALUES=0 chooses it here (tests, A/B).

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(KILN_INT8_DOTS)
#if !defined(KILN_DECODE_INT8_VALUES)
#define KILN_DECODE_INT8_VALUES 1
#endif
#else
#undef KILN_DECODE_INT8_VALUES
#define KILN_DECODE_INT8_VALUES 0
#endif

#if KILN_DECODE_INT8_VALUES

namespace {

inline bool int8_decode_supported(int64_t head_dim) {
  return head_dim > 0 && head_dim % 64 == 0 && head_dim <= 256;
}

// 16 vectors of 16 int32 lanes transposed: lane j of x[d] becomes lane d of x[j] (unpacks of
// 32- and 64-bit pairs, then each group of four 128-bit quarters transposed)
inline void transpose16(__m512i* x) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // u[4m + e], quarter L: lane 4L + e of x[4m .. 4m + 3]
    const __m512i* a = t + 4 * m;
    x[4 * m] = _mm512_unpacklo_epi64(a[0], a[2]);
    x[4 * m + 1] = _mm512_unpackhi_epi64(a[0], a[2]);
    x[4 * m + 2] = _mm512_unpacklo_epi64(a[1], a[3]);
    x[4 * m + 3] = _mm512_unpackhi_epi64(a[1], a[3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i b0 = _mm512_shuffle_i32x4(x[e], x[4 + e], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(x[e], x[4 + e], 0xee);
    const __m512i b2 = _mm512_shuffle_i32x4(x[8 + e], x[12 + e], 0x44);
    const __m512i b3 = _mm512_shuffle_i32x4(x[8 + e], x[12 + e], 0xee);
    t[e] = _mm512_shuffle_i32x4(b0, b2, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(b0, b2, 0xdd);
    t[8 + e] = _mm512_shuffle_i32x4(b1, b3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b1, b3, 0xdd);
  }
  for (int d = 0; d < 16; ++d) x[d] = t[d];
}

// scales[h * STEP + j] = the scale of key j's row in KV head h of `cache` (keys or values),
// zero past n
inline void row_scales(const int8_t* cache, const int64_t* rows, int64_t n, const Shape& sh,
                       float* scales) {
  for (int64_t h = 0; h < sh.kv_heads; ++h) {
    for (int64_t j = 0; j < n; ++j)
      scales[h * STEP + j] = row_scale(cache + rows[j] + h * sh.head_stride, sh.head_dim);
    std::fill(scales + h * STEP + n, scales + (h + 1) * STEP, 0.f);
  }
}

// s[i * STEP + j] = the score of key j for query head i (anything past n). A group of 16 keys'
// rows are first copied in order (whole rows, as the hardware prefetchers stream them) into
// `flipped`, their sign bits flipped (k + 128 as unsigned bytes), KV head by KV head and 64-dim
// chunk by chunk; each such block of 16 is transposed, so that lane j of vector d holds dims
// 4d .. 4d + 3 of key j: one vpdpbusd with the query's 4 bytes of those dims broadcast adds
// them for 16 keys at once, and the sums come out one key a lane, with no add tree to reduce
// them. The next step's key rows are asked for into L2 a KV head at a time, spread over the
// products (asked for in one burst with the copy, Qwen3's rows measured 0.84-0.91x).
template <int C>
inline void score_int8_keys(const QuantizedQuery& qq, const int8_t* kc, const int64_t* rows,
                            int64_t n, const Shape& sh, const float* ks, float* s,
                            const int64_t* next_rows, int64_t next_n) {
  constexpr int64_t D = 64 * C;
  const int64_t G = sh.heads / sh.kv_heads, HS = sh.head_stride;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  thread_local std::vector<__m512i> flipped_buffer;  // KV heads x C blocks of 16 keys' 64 bytes
  if (flipped_buffer.size() < static_cast<size_t>(sh.kv_heads * C * KEYS))
    flipped_buffer.resize(sh.kv_heads * C * KEYS);
  __m512i* flipped = flipped_buffer.data();
  alignas(64) int32_t sums[MAX_HEADS * KEYS];
  for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
    for (int64_t j = 0; j < KEYS; ++j) {  // past n: the last key again (its lanes unused)
      const int8_t* row = kc + rows[std::min(j0 + j, n - 1)];
      for (int64_t h = 0; h < sh.kv_heads; ++h)
        for (int c = 0; c < C; ++c)
          flipped[(h * C + c) * KEYS + j] =
              _mm512_xor_si512(_mm512_loadu_si512(row + h * HS + 64 * c), flip);
    }
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      for (int64_t j = j0; j < j0 + KEYS && j < next_n; ++j)
        prefetch_into_l2(kc + next_rows[j] + h * HS, D + 4);
      for (int c = 0; c < C; ++c) {
        __m512i x[16];
        for (int64_t j = 0; j < KEYS; ++j) x[j] = flipped[(h * C + c) * KEYS + j];
        transpose16(x);
        for (int64_t g = 0; g < G; ++g) {
          int32_t q4[16];
          std::memcpy(q4, qq.values + (h * G + g) * D + 64 * c, 64);
          __m512i a = c == 0 ? _mm512_setzero_si512() : _mm512_load_si512(sums + g * KEYS);
          for (int d = 0; d < 16; ++d) a = _mm512_dpbusd_epi32(a, x[d], _mm512_set1_epi32(q4[d]));
          _mm512_store_si512(sums + g * KEYS, a);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = h * G + g;
        const __m512 dots = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + g * KEYS)),
                                          _mm512_set1_ps(qq.offset[i]));
        const __m512 scaled = _mm512_mul_ps(dots, _mm512_set1_ps(qq.scale[i]));
        const __m512 k = _mm512_load_ps(ks + h * STEP + j0);
        _mm512_storeu_ps(s + i * STEP + j0, _mm512_mul_ps(scaled, k));
      }
    }
  }
}

// score_int8_keys' result for rows longer than TRANSPOSED_ROW_BYTES: each key's row read
// whole, in order, its products with each query head left unreduced (16 int32 lanes), and each
// head's 16 keys reduced by one transposing add tree (hsum16). Transposing blocks of 16 keys
// took 1.15x less arithmetic on Qwen3's 8 KV heads of 128 but read their 1 KiB rows out of
// order: 0.95-1.03x from memory (benchmarks/decode_kernel_ab.py --layers 30), where SmolLM2's
// 204-byte rows gained 1.07-1.16x. Fills ks as row_scales does, as it reads each row.
template <int C>
inline void score_int8_rows(const QuantizedQuery& qq, const int8_t* kc, const int64_t* rows,
                            int64_t n, const Shape& sh, float* ks, float* s,
                            const int64_t* next_rows, int64_t next_n) {
  constexpr int64_t D = 64 * C;
  const int64_t G = sh.heads / sh.kv_heads, HS = sh.head_stride;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  thread_local std::vector<float> part_buffer;  // heads x 32 vectors: up to 128 KiB
  if (part_buffer.size() < static_cast<size_t>(sh.heads * STEP * 16))
    part_buffer.resize(sh.heads * STEP * 16);
  float* part = part_buffer.data();
  for (int64_t j = 0; j < n; ++j) {  // lanes past n are left as they were (and go unused)
    if (j < next_n) prefetch_into_l2(kc + next_rows[j], sh.kv_heads * HS);
    const int8_t* row = kc + rows[j];
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      ks[h * STEP + j] = row_scale(row + h * HS, D);
      __m512i kv[C];
      for (int c = 0; c < C; ++c)
        kv[c] = _mm512_xor_si512(_mm512_loadu_si512(row + h * HS + 64 * c), flip);
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* q = qq.values + (h * G + g) * D;
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kv[0], _mm512_load_si512(q));
        for (int c = 1; c < C; ++c)
          a = _mm512_dpbusd_epi32(a, kv[c], _mm512_load_si512(q + 64 * c));
        _mm512_storeu_ps(part + ((h * G + g) * STEP + j) * 16, _mm512_cvtepi32_ps(a));
      }
    }
  }
  for (int64_t h = 0; n < STEP && h < sh.kv_heads; ++h)
    std::fill(ks + h * STEP + n, ks + (h + 1) * STEP, 0.f);
  for (int64_t i = 0; i < sh.heads; ++i) {
    const __m512 offset = _mm512_set1_ps(qq.offset[i]), scale = _mm512_set1_ps(qq.scale[i]);
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
      const __m512 dots = _mm512_sub_ps(hsum16(part + (i * STEP + j0) * 16), offset);
      const __m512 k = _mm512_load_ps(ks + (i / G) * STEP + j0);
      _mm512_storeu_ps(s + i * STEP + j0, _mm512_mul_ps(_mm512_mul_ps(dots, scale), k));
    }
  }
}

// Rows up to this many bytes (every KV head of a key) are scored by score_int8_keys, longer
// ones by score_int8_rows
constexpr int64_t TRANSPOSED_ROW_BYTES = 512;

// Each head's step weights p times their value rows' scales (vs: KV head h's at h * STEP),
// quantized to bytes: wq + i * STEP, key j at byte j; unit[i] what a byte's 1 is worth
inline void quantize_weights(const float* p, const float* vs, const Shape& sh, uint8_t* wq,
                             float* unit) {
  const int64_t G = sh.heads / sh.kv_heads;
  for (int64_t i = 0; i < sh.heads; ++i) {
    const float* s = vs + (i / G) * STEP;
    const __m512 w0 = _mm512_mul_ps(_mm512_loadu_ps(p + i * STEP), _mm512_loadu_ps(s));
    const __m512 w1 =
        _mm512_mul_ps(_mm512_loadu_ps(p + i * STEP + KEYS), _mm512_loadu_ps(s + KEYS));
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1));
    // A step whose weights are all below about 1e-36 of the running max (255 / top not finite)
    // adds nothing: the general path's sum of them is below float32's reach of the output. An
    // infinite or NaN weight (an infinite value scale) makes the head's output NaN, as the
    // general path's inf * 0 does.
    const float inv_top = 255.f / top;
    const bool finite = top <= std::numeric_limits<float>::max();
    const bool any = finite && top > 0.f && inv_top <= std::numeric_limits<float>::max();
    unit[i] = any ? top / 255.f : finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(any ? inv_top : 0.f);
    // w * inv is then in [0, 255] (w >= 0, finite), rounded to nearest (the default MXCSR mode)
    const __m128i b0 = _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w0, inv)));
    const __m128i b1 = _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w1, inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + i * STEP), b0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + i * STEP + KEYS), b1);
  }
}

// acc (GS heads of one KV head, head_dim = 64 * C floats each, in int8 order: of each 64 dims,
// vector m's lane 4L + e holds dim 16L + 4m + e) times their correction, plus the step's
// weighted value rows. Keys go four at a time: their rows interleaved bytewise by two rounds of
// unpacks (within each 128 bits), so that a 32-bit lane holds one dim of the four keys and
// vpdpbusd adds the four terms, the weights' four bytes broadcast. Past n a key is the last
// key again with weight 0. The next step's value rows (next_rows, given to one group of a KV
// head) are asked for into L2.
template <int C, int GS>
inline void add_int8_values(const uint8_t* wq, const float* unit, const float* correction,
                            const int8_t* vc, const int64_t* rows, int64_t n, int64_t offset,
                            float* acc, const int64_t* next_rows, int64_t next_n) {
  constexpr int64_t D = 64 * C;
  __m512i sums[GS][C][4];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < 4; ++v) sums[g][c][v] = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 4) {
    const int8_t* r[4];
    for (int b = 0; b < 4; ++b) r[b] = vc + rows[std::min(j + b, n - 1)] + offset;
    for (int64_t b = j; b < j + 4 && b < next_n; ++b)
      prefetch_into_l2(vc + next_rows[b] + offset, D + 4);
    __m512i w[GS];
    for (int g = 0; g < GS; ++g) {
      int32_t four;
      std::memcpy(&four, wq + g * STEP + j, 4);
      w[g] = _mm512_set1_epi32(four);
    }
    for (int c = 0; c < C; ++c) {
      const __m512i r0 = _mm512_loadu_si512(r[0] + 64 * c), r1 = _mm512_loadu_si512(r[1] + 64 * c);
      const __m512i r2 = _mm512_loadu_si512(r[2] + 64 * c), r3 = _mm512_loadu_si512(r[3] + 64 * c);
      const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
      const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
      const __m512i x[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
      for (int g = 0; g < GS; ++g)
        for (int v = 0; v < 4; ++v) sums[g][c][v] = _mm512_dpbusd_epi32(sums[g][c][v], w[g], x[v]);
    }
  }
  for (int g = 0; g < GS; ++g) {
    const __m512 cg = _mm512_set1_ps(correction[g]), ug = _mm512_set1_ps(unit[g]);
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < 4; ++v) {
        float* a = acc + g * D + 64 * c + 16 * v;
        const __m512 kept = _mm512_mul_ps(_mm512_loadu_ps(a), cg);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][c][v]), ug, kept));
      }
  }
}

// The heads sharing each KV head in register groups: at most 16 int32 sums (GS x 4C vectors)
// a group. The next step's value rows are asked for by each KV head's first group.
template <int C>
inline void int8_values_for(const uint8_t* wq, const float* unit, const float* correction,
                            const int8_t* vc, const int64_t* rows, int64_t n, const Shape& sh,
                            float* acc, const int64_t* next_rows, int64_t next_n) {
  constexpr int MAX_GS = C >= 4 ? 1 : 4 / C;
  const int64_t G = sh.heads / sh.kv_heads;
  for (int64_t h = 0; h < sh.kv_heads; ++h)
    for (int64_t g = 0; g < G; g += MAX_GS) {
      const int64_t i = h * G + g, ahead = g == 0 ? next_n : 0;
      const auto group = [&](auto size) {
        add_int8_values<C, decltype(size)::value>(wq + i * STEP, unit + i, correction + i, vc,
                                                  rows, n, h * sh.head_stride, acc + i * 64 * C,
                                                  next_rows, ahead);
      };
      switch (std::min<int64_t>(MAX_GS, G - g)) {
        case 4: group(std::integral_constant<int, std::min(4, MAX_GS)>()); break;
        case 3: group(std::integral_constant<int, std::min(3, MAX_GS)>()); break;
        case 2: group(std::integral_constant<int, std::min(2, MAX_GS)>()); break;
        default: group(std::integral_constant<int, 1>()); break;
      }
    }
}

// add_int8_values' order back into dimension order: of each 64 dims, the four vectors' 128-bit
// quarters transposed (quarter L of vector m holds dims 16L + 4m .. 16L + 4m + 3)
inline void int8_order(float* acc, int64_t count) {
  for (int64_t c = 0; c < count; c += 64) {
    const __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
    const __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);
    const __m512 b0 = _mm512_shuffle_f32x4(a0, a1, 0x44), b1 = _mm512_shuffle_f32x4(a0, a1, 0xee);
    const __m512 b2 = _mm512_shuffle_f32x4(a2, a3, 0x44), b3 = _mm512_shuffle_f32x4(a2, a3, 0xee);
    _mm512_storeu_ps(acc + c, _mm512_shuffle_f32x4(b0, b2, 0x88));
    _mm512_storeu_ps(acc + c + 16, _mm512_shuffle_f32x4(b0, b2, 0xdd));
    _mm512_storeu_ps(acc + c + 32, _mm512_shuffle_f32x4(b1, b3, 0x88));
    _mm512_storeu_ps(acc + c + 48, _mm512_shuffle_f32x4(b1, b3, 0xdd));
  }
}

// attend_range over an int8 cache, head_dim = 64 * C, keys scored by score_int8_keys
// (TRANSPOSED) or score_int8_rows: one scorer an instantiation, as with both in one the
// compiler's choices cost the transposed path 1.15x (SmolLM2's heads, from memory)
template <int C, bool TRANSPOSED, typename Q>
void attend_range_int8_chunks(const Q* q, const int8_t* kc, const int8_t* vc, const int32_t* table,
                              int64_t t0, int64_t t1, const Shape& sh, float* acc, float* m,
                              float* l) {
  const int64_t H = sh.heads, row_elems = sh.kv_heads * sh.head_stride;
  QuantizedQuery qq;
  {
    float qf[MAX_HEADS * 256];
    for (int64_t i = 0; i < H * sh.head_dim; ++i) qf[i] = to_float(q[i]);
    quantize_query(qf, sh, qq);
  }
  alignas(64) float sc[MAX_HEADS * STEP], p[MAX_HEADS * STEP], ks[MAX_HEADS * STEP];
  alignas(64) float vs[MAX_HEADS * STEP];
  alignas(64) float lanes[MAX_HEADS * 16] = {};
  alignas(64) uint8_t wq[MAX_HEADS * STEP];
  float correction[MAX_HEADS], unit[MAX_HEADS];
  int64_t rows_buffer[2][STEP];
  int64_t* rows = rows_buffer[0];
  int64_t* next_rows = rows_buffer[1];
  std::fill(m, m + H, NEG_INF);
  std::fill(acc, acc + H * sh.head_dim, 0.f);
  const auto scores = [&](int64_t i, __m512& s0, __m512& s1) {
    s0 = _mm512_load_ps(sc + i * STEP);
    s1 = _mm512_load_ps(sc + i * STEP + KEYS);
  };
  if (t0 < t1) tile_rows(table, t0, std::min(STEP, t1 - t0), sh.block_size, row_elems, rows);
  for (int64_t t = t0; t < t1; t += STEP) {
    const int64_t n = std::min(STEP, t1 - t);
    const int64_t next_n = std::max<int64_t>(0, std::min(STEP, t1 - t - STEP));
    if (next_n) tile_rows(table, t + STEP, next_n, sh.block_size, row_elems, next_rows);
    if constexpr (TRANSPOSED) {
      row_scales(kc, rows, n, sh, ks);
      score_int8_keys<C>(qq, kc, rows, n, sh, ks, sc, next_rows, next_n);
    } else {
      score_int8_rows<C>(qq, kc, rows, n, sh, ks, sc, next_rows, next_n);
    }
    softmax_update(scores, n, sh, m, lanes, p, correction);
    row_scales(vc, rows, n, sh, vs);
    quantize_weights(p, vs, sh, wq, unit);
    int8_values_for<C>(wq, unit, correction, vc, rows, n, sh, acc, next_rows, next_n);
    std::swap(rows, next_rows);
  }
  for (int64_t i = 0; i < H; ++i) l[i] = _mm512_reduce_add_ps(_mm512_load_ps(lanes + 16 * i));
  int8_order(acc, H * sh.head_dim);
}

template <int C, typename Q>
void attend_range_int8_dim(const Q* q, const int8_t* kc, const int8_t* vc, const int32_t* table,
                           int64_t t0, int64_t t1, const Shape& sh, float* acc, float* m,
                           float* l) {
  if (sh.kv_heads * sh.head_stride <= TRANSPOSED_ROW_BYTES)
    attend_range_int8_chunks<C, true>(q, kc, vc, table, t0, t1, sh, acc, m, l);
  else
    attend_range_int8_chunks<C, false>(q, kc, vc, table, t0, t1, sh, acc, m, l);
}

template <typename Q>
void attend_range_int8(const Q* q, const int8_t* kc, const int8_t* vc, const int32_t* table,
                       int64_t t0, int64_t t1, const Shape& sh, float* acc, float* m, float* l) {
  switch (sh.head_dim / 64) {  // 1 to 4: int8_decode_supported
    case 1: return attend_range_int8_dim<1>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 2: return attend_range_int8_dim<2>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 3: return attend_range_int8_dim<3>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    default: return attend_range_int8_dim<4>(q, kc, vc, table, t0, t1, sh, acc, m, l);
  }
}

}  // namespace

#endif
