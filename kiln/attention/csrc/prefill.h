// Prefill attention over kiln's paged KV cache on the CPU, read in place: every query token of a
// prompt chunk over its request's keys up to its own position (causal), the chunk's own keys
// included (the op writes them into the cache first).
//
// Query rows are the vector lanes: a group is W rows (token, query head) of one KV head's query
// heads, token-major, so the G heads sharing a KV head read each key once, and a work item is up
// to 64 groups sharing each tile of keys. Its queries are
// transposed once into [head_dim][W]; a key's element is then broadcast against a row of that
// transpose, so a score for W rows is head_dim fused multiply-adds and a key is never
// transposed or copied (float32 caches are read in place, bf16 rows widened 16 keys at a time
// into a buffer). The softmax max and sum run across keys, lane by lane: no horizontal
// reductions. Values are added the same way, out^T[d] += p_j * v_j[d]. Scores, the softmax and
// every sum are float32. With bf16 queries over a bf16 cache on AVX512-BF16, products are bf16
// pair products (exact, summed in float32: 2x the multiply-adds of an instruction), and the
// softmax weights are rounded to bf16 for them, as torch's flash kernel rounds them for bf16
// inputs; elsewhere bf16 rows are widened and the weights stay float32. Where the CPU has AMX
// tiles those pair products are tile products over 32 keys a step (amx_group_step): 1.9-2.5x
// the vector path for SmolLM2's and Qwen3's heads on a 2-core Xeon (benchmarks/decode_kernel_ab.py
// --prefill) when steps were 16 keys, the same products summed in another order.
//
// Included by paged_decode.cpp after its helpers (tile_rows); vectorised builds only
// (KILN_SIMD), the caller keeps torch's flash kernel elsewhere.

#pragma once

#include <vector>

#include "vector.h"
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KILN_PREFILL_AMX 1
#endif

namespace {
#if defined(KILN_SIMD)

constexpr int64_t PREFILL_KEYS = 16;   // keys per online-softmax step
constexpr int64_t PREFILL_MAX_DIM = 256;
constexpr int64_t VALUE_DIMS = 8;      // head dims whose sums stay in registers over a step
// row groups of W sharing each tile of keys: every item reads its KV head's whole context, so
// fewer, larger items read it fewer times. 64 against 8, a 512-token chunk over 16k keys:
// 1.09-1.15x (float32), 1.22-1.53x (bf16 on AMX tiles); over 512 keys level
constexpr int64_t PREFILL_GROUPS = 64;
// The tile path (AMX) takes keys 128 at a time: a group's sums, which live in memory between
// tile products, are loaded and stored once per 128 keys, with four value products of a weights
// tile's full depth (16 pairs: 32 keys) in between. Steps of 16 keys used half that depth and
// moved the sums eight times as often; with a work item's 64 groups the sums stream from L2.
constexpr int64_t AMX_KEYS = 128;
constexpr int64_t AMX_SUB = 32;  // keys per value product, and per pair of score tiles

struct PrefillShape {
  int64_t heads, kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t head_stride;  // elements from one head row to the next: head_dim, + 4 for int8
};

// One request's chunk: query tokens [start, start + tokens) of the step at positions
// [cached, cached + tokens), its keys through `table`
struct PrefillChunk {
  int64_t start, tokens, cached;
  const int32_t* table;
};

// qt[d * W + lane] = query row row0 + lane of KV head h (row = token * G + head in the group),
// and each lane's position; lanes past the chunk's rows get zeros and see every key
template <typename T>
inline void transpose_queries(const T* q, const PrefillChunk& c, int64_t h, int64_t row0,
                              const PrefillShape& sh, float* qt, int32_t* pos) {
  const int64_t G = sh.heads / sh.kv_heads, D = sh.head_dim, rows = c.tokens * G;
  for (int64_t lane = 0; lane < W; ++lane) {
    const int64_t row = row0 + lane;
    if (row >= rows) {
      pos[lane] = std::numeric_limits<int32_t>::max();
      for (int64_t d = 0; d < D; ++d) qt[d * W + lane] = 0.f;
      continue;
    }
    const T* qr = q + ((c.start + row / G) * sh.heads + h * G + row % G) * D;
    pos[lane] = static_cast<int32_t>(c.cached + row / G);
    for (int64_t d = 0; d < D; ++d) qt[d * W + lane] = to_float(qr[d]);
  }
}

#if defined(__AVX512BF16__)
// bf16 queries over a bf16 cache on AVX512-BF16: the transposed queries hold pairs of bf16,
// qt[d2 * W + lane] = (q[2 d2], q[2 d2 + 1]) as 32 bits, and a score for 16 rows is head_dim / 2
// dot-product instructions, each multiplying two bf16 pairs exactly into a float32 sum (the
// decode kernel's products), with the key's pair broadcast from the cache row itself
template <typename T, typename KV>
constexpr bool PAIR_DOTS = std::is_same_v<T, uint16_t> && std::is_same_v<KV, uint16_t>;

inline void transpose_pairs(const uint16_t* q, const PrefillChunk& c, int64_t h, int64_t row0,
                            const PrefillShape& sh, float* qt) {
  const int64_t G = sh.heads / sh.kv_heads, D = sh.head_dim, rows = c.tokens * G;
  for (int64_t lane = 0; lane < W; ++lane) {
    const int64_t row = row0 + lane;
    const uint16_t* qr = q + ((c.start + row / G) * sh.heads + h * G + row % G) * D;
    for (int64_t d2 = 0; d2 < D / 2; ++d2)
      if (row < rows) std::memcpy(qt + d2 * W + lane, qr + 2 * d2, 4);
      else qt[d2 * W + lane] = 0.f;
  }
}

template <int KB>
inline void score_pairs(const float* qt, const uint16_t* const* k, int64_t D, vf* s) {
  vf a[KB];
  for (int j = 0; j < KB; ++j) a[j] = vzero();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh qd = (__m512bh)_mm512_loadu_ps(qt + d2 * W);
    for (int j = 0; j < KB; ++j) {
      uint32_t pair;
      std::memcpy(&pair, k[j] + 2 * d2, 4);
      a[j] = _mm512_dpbf16_ps(a[j], qd, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
    }
  }
  for (int j = 0; j < KB; ++j) s[j] = a[j];
}

// vp[j2 * D + d] = (v_2j2[d], v_2j2+1[d]): the tile's value rows in pairs of keys, for pair
// products against pairs of weights (once per tile, for every group of the item)
template <int64_t KEYS = PREFILL_KEYS>
inline void value_pairs(const uint16_t* const* v, int64_t D, uint32_t* vp) {
  for (int64_t j2 = 0; j2 < KEYS / 2; ++j2) {
    const uint16_t *a = v[2 * j2], *b = v[2 * j2 + 1];
    uint32_t* dst = vp + j2 * D;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; d < D; ++d) dst[d] = static_cast<uint32_t>(a[d]) | static_cast<uint32_t>(b[d]) << 16;
  }
}

// acc^T[d] = alpha acc^T[d] + sum_j p_j v_j[d] by pair products: the weights rounded to bf16
// (as torch's flash kernel rounds them for bf16 inputs), the sums float32
inline void add_value_pairs(const vf* p, int64_t n, const uint32_t* vp, int64_t D, vf alpha,
                            float* acc) {
  __m512i pp[PREFILL_KEYS / 2];
  const int64_t n2 = (n + 1) / 2;
  for (int64_t j2 = 0; j2 < n2; ++j2) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p[2 * j2]));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p[2 * j2 + 1]));
    pp[j2] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  for (int64_t d0 = 0; d0 < D; d0 += VALUE_DIMS) {
    vf a[VALUE_DIMS];
    for (int i = 0; i < VALUE_DIMS; ++i) a[i] = vload(acc + (d0 + i) * W) * alpha;
    for (int64_t j2 = 0; j2 < n2; ++j2) {
      const uint32_t* row = vp + j2 * D + d0;
      for (int i = 0; i < VALUE_DIMS; ++i)
        a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)pp[j2], (__m512bh)_mm512_set1_epi32(static_cast<int>(row[i])));
    }
    for (int i = 0; i < VALUE_DIMS; ++i) vstore(acc + (d0 + i) * W, a[i]);
  }
}
#else
template <typename T, typename KV>
constexpr bool PAIR_DOTS = false;
#endif

// The tile's head rows as float32: a float32 cache's own rows, bf16 ones widened into buf and
// int8 ones dequantized into it (values times the row's scale); keys past n point at zeros
template <typename KV>
inline void float_rows(const KV* cache, const int64_t* rows, int64_t n, int64_t offset,
                       int64_t D, float* buf, const float* zeros, const float** out) {
  for (int64_t j = 0; j < PREFILL_KEYS; ++j) {
    if (j >= n) {
      out[j] = zeros;
      continue;
    }
    const KV* src = cache + rows[j] + offset;
    if constexpr (std::is_same_v<KV, float>) {
      out[j] = src;
    } else {
      float* dst = buf + j * D;
      int64_t d = 0;
      if constexpr (std::is_same_v<KV, int8_t>) {
        const float scale = row_scale(src, D);
        for (; d + W <= D; d += W) vstore(dst + d, vload(src + d) * vset(scale));
        for (; d < D; ++d) dst[d] = to_float(src[d]) * scale;
      } else {
        for (; d + W <= D; d += W) vstore(dst + d, vload(src + d));
        for (; d < D; ++d) dst[d] = to_float(src[d]);
      }
      out[j] = dst;
    }
  }
}

// s[j] = (the W query rows) . k_j for KB keys, the sums in registers
template <int KB>
inline void score_keys(const float* qt, const float* const* k, int64_t D, vf* s) {
  vf a[KB];
  for (int j = 0; j < KB; ++j) a[j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    const vf qd = vload(qt + d * W);
    for (int j = 0; j < KB; ++j) a[j] = vfmadd(qd, vset(k[j][d]), a[j]);
  }
  for (int j = 0; j < KB; ++j) s[j] = a[j];
}

// acc^T[d] = alpha acc^T[d] + sum_j p_j v_j[d] over the tile's n keys, VALUE_DIMS dims at once
inline void add_values(const vf* p, int64_t n, const float* const* v, int64_t D, vf alpha,
                       float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += VALUE_DIMS) {
    vf a[VALUE_DIMS];
    for (int i = 0; i < VALUE_DIMS; ++i) a[i] = vload(acc + (d0 + i) * W) * alpha;
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < VALUE_DIMS; ++i) a[i] = vfmadd(p[j], vset(v[j][d0 + i]), a[i]);
    for (int i = 0; i < VALUE_DIMS; ++i) vstore(acc + (d0 + i) * W, a[i]);
  }
}

// One online-softmax step over a tile of keys from position t: scores s in, weights out (in s);
// m and l, the running max and sum, updated; returns the factor earlier sums are scaled by.
// `causal`: some key of the tile lies past some row's position (the diagonal, the chunk's end).
// `slack` > 0: the max moves (every lane's, to its true max) only when some lane's score passes
// its max by more than slack; otherwise every lane keeps its max, a weight is at most e^slack,
// and the factor is exactly 1.
// `count`: the keys of the step (PREFILL_KEYS, or fewer on the tile path's last step).
inline vf softmax_step(vf* s, int64_t t, bool causal, vi pos, float scale, vf& m, vf& l,
                       float slack = 0.f, int64_t count = PREFILL_KEYS) {
  const vf minus_inf = vset(NEG_INF);
  vf mx = m;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = s[j] * vset(scale);
    if (causal) s[j] = vselect_le(viset(static_cast<int32_t>(t + j)), pos, s[j], minus_inf);
    mx = vmax(mx, s[j]);
  }
  if (slack > 0.f && !vany_gt(mx, m + vset(slack))) mx = m;  // m = -inf moves on the first step
  const vf alpha = vexp(m - mx);  // 0 (to float32's last bits) on the first step, m = -inf
  vf sum = vzero();
  for (int64_t j = 0; j < count; ++j) {
    s[j] = vexp(s[j] - mx);
    if (causal) s[j] = vselect_le(viset(static_cast<int32_t>(t + j)), pos, s[j], vzero());
    sum = sum + s[j];
  }
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

// A group of W rows of chunk c (KV head h) and its running softmax: queries transposed, output
// sums transposed, each lane's position, max and sum
struct RowGroup {
  int64_t row0, rows, keys, first_hidden;  // keys: through its last row's position
  float *qt, *acc;
  int32_t pos[W];
  vf m, l;
};

#if defined(KILN_PREFILL_AMX)
// bf16 queries over a bf16 cache on a CPU with AMX tiles (Intel's matrix unit): the pair
// products of a step go to two tile products, scores^T = keys x queries^T and out^T +=
// values^T x weights^T, in the layouts the vector path already keeps (the transposed query
// pairs, the weights' pairs, the transposed sums), the keys read from the cache as they lie. One
// tdpbf16ps is 16 x 16 x 32 pair products, where the vector path made 16 x 32 instructions of
// 16. The softmax and its rescaling stay vector code, unchanged.

// Linux gives a process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); where it refuses, the vector path runs
inline bool prefill_amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

inline bool prefill_amx(int64_t head_dim) { return head_dim % 32 == 0 && prefill_amx_permitted(); }

struct alignas(64) PrefillTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 0, 1: scores^T of the step's two halves (16 keys x 16 rows, float32); 2: the rows' query pairs
// for 32 dims (16 x 16 pairs); 3: 16 dims of the transposed sums (16 x 16 float32); 4: those
// dims' values over the 32 keys (16 x 16 pairs); 5: the weights (16 key pairs x 16 rows); 6, 7:
// the two halves' keys, 32 dims of each (16 x 32 bf16)
inline void prefill_amx_configure() {
  PrefillTiles cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// vt[d * 16 + j2] = vp[j2 * D + d]: 16 rows of value pairs (32 keys) transposed, dims as tile
// rows (once per step, for every group of the item), 16 x 16 words at a time in registers
inline void transpose_value_pairs(const uint32_t* vp, int64_t D, uint32_t* vt) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512i r[16], u[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(vp + i * D + d0);
    for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by words
      u[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      u[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // then by pairs of words
      for (int k = 0; k < 2; ++k) {
        r[i + k] = _mm512_unpacklo_epi64(u[i + k], u[i + 2 + k]);
        r[i + 2 + k] = _mm512_unpackhi_epi64(u[i + k], u[i + 2 + k]);
      }
    }
    // each 128-bit lane q of r[i] (i = 4a + b) now holds dim 4q + (b: 0, 2, 1, 3 -> 0..3) of
    // rows 4a..4a+3; gather the lanes of the four row quads into whole dims
    for (int b = 0; b < 4; ++b) {
      const __m512i x0 = r[b], x1 = r[4 + b], x2 = r[8 + b], x3 = r[12 + b];
      const __m512i lo01 = _mm512_shuffle_i32x4(x0, x1, 0x44), hi01 = _mm512_shuffle_i32x4(x0, x1, 0xEE);
      const __m512i lo23 = _mm512_shuffle_i32x4(x2, x3, 0x44), hi23 = _mm512_shuffle_i32x4(x2, x3, 0xEE);
      u[b] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);       // lane 0
      u[4 + b] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);   // lane 1
      u[8 + b] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);   // lane 2
      u[12 + b] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);  // lane 3
    }
    constexpr int order[4] = {0, 2, 1, 3};  // r index b -> dim within a lane
    for (int q = 0; q < 4; ++q)
      for (int b = 0; b < 4; ++b)
        _mm512_storeu_si512(vt + (d0 + 4 * q + order[b]) * 16, u[4 * q + b]);
  }
}

// The sums live in memory between tile products, so rescaling them is a pass over all of them.
// The running max moves only when a score passes it by more than this (weights up to e^8, about
// 3000: float32 sums and bf16 weights keep their relative precision), so after a row's first
// keys most steps skip that pass.
constexpr float AMX_MAX_SLACK = 8.f;

// A step's keys and values as the tile products read them, shared by the groups of an item:
// for each 16 keys, where their rows start and how far apart (in place in the cache, or
// staged); for each 32 keys, their value pairs transposed (transpose_value_pairs)
struct AmxStep {
  const uint16_t* keys[AMX_KEYS / 16];
  int64_t stride[AMX_KEYS / 16];
  uint16_t* kstage;  // [AMX_KEYS][D]
  uint32_t* vpairs;  // [AMX_SUB / 2][D]
  uint32_t* vt;      // [AMX_KEYS / AMX_SUB][D][16]
  float* scores;     // [AMX_KEYS][W]
  uint32_t* weights; // [AMX_KEYS / 2][W]
};

// One step of a group by tile products over its keys among [t, t + n): 32 at a time, as far as
// its last row's position reaches
inline void amx_group_step(RowGroup& g, int64_t t, int64_t n, const AmxStep& st, int64_t D,
                           float scale) {
  const int64_t subs = (std::min(n, g.keys - t) + AMX_SUB - 1) / AMX_SUB;
  for (int64_t sub = 0; sub < subs; ++sub) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(2, g.qt + c * 16 * W, W * 4);
      _tile_loadd(6, st.keys[2 * sub] + c * 32, st.stride[2 * sub]);
      _tile_loadd(7, st.keys[2 * sub + 1] + c * 32, st.stride[2 * sub + 1]);
      _tile_dpbf16ps(0, 6, 2);
      _tile_dpbf16ps(1, 7, 2);
    }
    _tile_stored(0, st.scores + sub * AMX_SUB * W, W * 4);
    _tile_stored(1, st.scores + (sub * AMX_SUB + 16) * W, W * 4);
  }
  // the softmax works on the stored scores in place: they do not fit the registers
  vf* s = reinterpret_cast<vf*>(st.scores);
  const int64_t count = subs * AMX_SUB;
  const bool causal = t + count > g.first_hidden;
  const vf alpha = softmax_step(s, t, causal, viload(g.pos), scale, g.m, g.l, AMX_MAX_SLACK,
                                count);
  for (int64_t j2 = 0; j2 < count / 2; ++j2) {  // weights rounded to bf16, in key pairs
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[2 * j2]));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[2 * j2 + 1]));
    _mm512_store_si512(st.weights + j2 * W, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  if (vany_gt(vset(1.f), alpha))
    for (int64_t d = 0; d < D; ++d) vstore(g.acc + d * W, vload(g.acc + d * W) * alpha);
  for (int64_t c = 0; c < D / 16; ++c) {
    _tile_loadd(3, g.acc + c * 16 * W, W * 4);
    for (int64_t sub = 0; sub < subs; ++sub) {
      _tile_loadd(4, st.vt + (sub * D + c * 16) * 16, 64);
      _tile_loadd(5, st.weights + sub * (AMX_SUB / 2) * W, W * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(3, g.acc + c * 16 * W, W * 4);
  }
}

// One AMX step of every group over keys [t, t + n): a 16-key run's rows read where they lie in
// the cache when evenly apart (every row checked: blocks under 16 tokens put a run across
// several blocks), else staged; the values paired and transposed once for all groups
inline void amx_items_step(RowGroup* rg, int64_t groups, int64_t t, int64_t n,
                           const uint16_t* const* kb, const uint16_t* const* vb,
                           const int64_t* rows, int64_t row_elems, int64_t D, float scale,
                           AmxStep& st) {
  const int64_t subs = (n + AMX_SUB - 1) / AMX_SUB;
  for (int64_t run = 0; run < 2 * subs; ++run) {
    const int64_t j0 = 16 * run;
    bool in_place = n >= j0 + 16;
    for (int64_t j = 1; in_place && j < 16; ++j) in_place = rows[j0 + j] == rows[j0] + j * row_elems;
    if (in_place) {
      st.keys[run] = kb[j0], st.stride[run] = row_elems * 2;
    } else {
      for (int64_t j = 0; j < 16; ++j) std::memcpy(st.kstage + (j0 + j) * D, kb[j0 + j], D * 2);
      st.keys[run] = st.kstage + j0 * D, st.stride[run] = D * 2;
    }
  }
  for (int64_t sub = 0; sub < subs; ++sub) {
    value_pairs<AMX_SUB>(vb + sub * AMX_SUB, D, st.vpairs);
    transpose_value_pairs(st.vpairs, D, st.vt + sub * D * 16);
  }
  for (int64_t i = 0; i < groups; ++i)
    if (t < rg[i].keys) amx_group_step(rg[i], t, n, st, D, scale);
}
#endif

// One step of a group over the tile of keys from t (n of them, as float32 rows kp, vp; or as
// the cache's bf16 rows kb, scored by pair products)
template <bool pairs>
inline void group_step(RowGroup& g, int64_t t, int64_t n, const float* const* kp,
                       const uint16_t* const* kb, const float* const* vp,
                       const uint32_t* vpairs, int64_t D, float scale) {
  vf s[PREFILL_KEYS];
#if defined(__AVX512BF16__)
  if constexpr (pairs) score_pairs<16>(g.qt, kb, D, s);
#endif
  (void)kb;
  if constexpr (pairs) {
  } else if constexpr (W == 16) {
    score_keys<16>(g.qt, kp, D, s);
  } else {  // 8 sums and a query vector fit AVX2's 16 registers
    score_keys<8>(g.qt, kp, D, s);
    score_keys<8>(g.qt, kp + 8, D, s + 8);
  }
  // a partial tile is its group's last, so always causal: keys past n are hidden from every
  // real row (only lanes past the chunk's rows weigh their zero rows, and are not written)
  const bool causal = t + PREFILL_KEYS > g.first_hidden;
  const vf alpha = softmax_step(s, t, causal, viload(g.pos), scale, g.m, g.l);
#if defined(__AVX512BF16__)
  if constexpr (pairs) add_value_pairs(s, n, vpairs, D, alpha, g.acc);
#endif
  (void)vp, (void)vpairs;
  if constexpr (!pairs) add_values(s, n, vp, D, alpha, g.acc);
}

// Row groups [group0, group0 + groups) of KV head h of chunk c, their attention into out. The
// groups share each tile of keys, widened once and read from the core's cache by every group
// (one group per item read a long context's keys from memory for every 16 rows).
template <typename T, typename KV>
void prefill_groups(const T* q, const KV* kc, const KV* vc, const PrefillChunk& c, int64_t h,
                    int64_t group0, int64_t groups, const PrefillShape& sh, T* out) {
  const int64_t G = sh.heads / sh.kv_heads, D = sh.head_dim, HS = sh.head_stride;
  const int64_t row_elems = sh.kv_heads * HS;
  std::vector<float> buffers(2 * groups * D * W, 0.f);  // queries and sums, transposed
  alignas(64) float kbuf[PREFILL_KEYS * PREFILL_MAX_DIM], vbuf[PREFILL_KEYS * PREFILL_MAX_DIM];
  alignas(64) static const float zeros[PREFILL_MAX_DIM] = {};
  alignas(64) static const uint16_t zero_pairs[PREFILL_MAX_DIM] = {};
  constexpr bool pairs = PAIR_DOTS<T, KV>;
  RowGroup rg[PREFILL_GROUPS];
  int64_t keys = 0;
  for (int64_t i = 0; i < groups; ++i) {
    RowGroup& g = rg[i];
    g.row0 = (group0 + i) * W;
    g.rows = std::min<int64_t>(W, c.tokens * G - g.row0);
    g.keys = c.cached + (g.row0 + g.rows - 1) / G + 1;
    g.first_hidden = c.cached + g.row0 / G + 1;
    g.qt = buffers.data() + 2 * i * D * W;
    g.acc = g.qt + D * W;
    g.m = vset(NEG_INF), g.l = vzero();
    transpose_queries(q, c, h, g.row0, sh, g.qt, g.pos);
#if defined(__AVX512BF16__)
    if constexpr (pairs) transpose_pairs(q, c, h, g.row0, sh, g.qt);
#endif
    keys = std::max(keys, g.keys);
  }
  int64_t rows[AMX_KEYS];
  const float *kp[PREFILL_KEYS], *vp[PREFILL_KEYS];
  const uint16_t *kb[AMX_KEYS], *vb[AMX_KEYS];
  alignas(64) uint32_t vpairs[PREFILL_KEYS / 2 * PREFILL_MAX_DIM];
  int64_t step = PREFILL_KEYS;
#if defined(KILN_PREFILL_AMX)
  const bool amx = pairs && prefill_amx(D);
  std::vector<float> amx_buffers;  // 64-byte aligned pieces: AmxStep's
  AmxStep st;
  if (amx) {
    const int64_t floats =
        AMX_KEYS * D / 2 + AMX_SUB / 2 * D + AMX_KEYS / 2 * D + AMX_KEYS * W + AMX_KEYS / 2 * W;
    amx_buffers.resize(floats + 16);
    float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(amx_buffers.data()) + 63) & ~uintptr_t(63));
    st.kstage = reinterpret_cast<uint16_t*>(p), p += AMX_KEYS * D / 2;
    st.vpairs = reinterpret_cast<uint32_t*>(p), p += AMX_SUB / 2 * D;
    st.vt = reinterpret_cast<uint32_t*>(p), p += AMX_KEYS / 2 * D;
    st.scores = p, p += AMX_KEYS * W;
    st.weights = reinterpret_cast<uint32_t*>(p);
    prefill_amx_configure(), step = AMX_KEYS;
  }
#endif
  for (int64_t t = 0; t < keys; t += step) {
    const int64_t n = std::min(step, keys - t);
    tile_rows(c.table, t, n, sh.block_size, row_elems, rows);
    if constexpr (pairs) {
      for (int64_t j = 0; j < step; ++j) {
        kb[j] = j < n ? reinterpret_cast<const uint16_t*>(kc + rows[j] + h * HS) : zero_pairs;
        vb[j] = j < n ? reinterpret_cast<const uint16_t*>(vc + rows[j] + h * HS) : zero_pairs;
      }
#if defined(KILN_PREFILL_AMX)
      if (amx) {
        amx_items_step(rg, groups, t, n, kb, vb, rows, row_elems, D, sh.scale, st);
        continue;
      }
#endif
#if defined(__AVX512BF16__)
      value_pairs(vb, D, vpairs);
#endif
    } else {
      float_rows(kc, rows, n, h * HS, D, kbuf, zeros, kp);
      float_rows(vc, rows, n, h * HS, D, vbuf, zeros, vp);
    }
    for (int64_t i = 0; i < groups; ++i)
      if (t < rg[i].keys)
        group_step<pairs>(rg[i], t, std::min(n, rg[i].keys - t), kp, kb, vp, vpairs, D,
                          sh.scale);
  }
#if defined(KILN_PREFILL_AMX)
  if (amx) _tile_release();
#endif
  for (int64_t i = 0; i < groups; ++i) {
    const RowGroup& g = rg[i];
    alignas(64) float sums[W];
    vstore(sums, g.l);
    for (int64_t lane = 0; lane < g.rows; ++lane) {
      const int64_t row = g.row0 + lane;
      T* o = out + ((c.start + row / G) * sh.heads + h * G + row % G) * D;
      const float inv = 1.f / sums[lane];
      for (int64_t d = 0; d < D; ++d) from_float(o + d, g.acc[d * W + lane] * inv);
    }
  }
}

// Every prefill chunk of the step: request r's tokens [starts[r], starts[r + 1]) of q and out
// ([tokens, heads, head_dim]) over the first lens[r] keys its table maps. A work item is up to
// PREFILL_GROUPS row groups of one KV head, fewer where that leaves under 4 items a thread;
// items go to the threads longest first (a chunk's later rows see more keys).
template <typename T, typename KV>
void prefill(const T* q, const KV* kc, const KV* vc, const int32_t* tables,
             const int32_t* starts, const int32_t* lens, T* out, int64_t reqs,
             const PrefillShape& sh, int threads) {
  const int64_t G = sh.heads / sh.kv_heads;
  std::vector<int64_t> groups(reqs);
  int64_t all_groups = 0;
  for (int64_t r = 0; r < reqs; ++r) {
    groups[r] = ((starts[r + 1] - starts[r]) * G + W - 1) / W;
    all_groups += groups[r] * sh.kv_heads;
  }
  const int64_t per_item = std::max<int64_t>(1, std::min(PREFILL_GROUPS, all_groups / (4 * threads)));
  std::vector<int64_t> first(reqs + 1, 0);  // work items before request r
  for (int64_t r = 0; r < reqs; ++r)
    first[r + 1] = first[r] + (groups[r] + per_item - 1) / per_item * sh.kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = first[reqs] - 1; it >= 0; --it) {
    const int64_t r = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
    const int64_t local = it - first[r], tokens = starts[r + 1] - starts[r];
    const int64_t group0 = local / sh.kv_heads * per_item;
    const PrefillChunk c{starts[r], tokens, lens[r] - tokens, tables + r * sh.table_width};
    prefill_groups(q, kc, vc, c, local % sh.kv_heads, group0,
                   std::min(per_item, groups[r] - group0), sh, out);
  }
}

inline bool prefill_supports(int64_t head_dim) {
  return head_dim % VALUE_DIMS == 0 && head_dim <= PREFILL_MAX_DIM;
}

#endif
}  // namespace
