// Decode rows of bf16 queries over a bf16 cache on AVX-512: paged_decode.cpp's attend_range
// for that case, included by it after the helpers it shares (Shape, tile_rows, prefetch_rows).
//
// The same numerics as the general path (exact products of bf16 values summed in float32, a
// float32 softmax, values accumulated in float32), arranged so that a key costs few vector
// instructions. On the AMX Xeon the general path spent, with the cache in L2 (64 rows x 600 keys,
// SmolLM2's heads), 0.69 ms of a 1.5 ms call on scores, 0.31 on the softmax and 0.39 on values:
// - bf16 widened without a shuffle: a 32-bit lane holds elements 2k (low half) and 2k + 1 (high
//   half), so a shift gives the even ones and a mask the odd ones. Keys are scored by float32
//   FMAs on a KV head's widened row, once for its query heads (the query split the same way):
//   AVX512-BF16's pair products ran at a quarter of FMA's rate there. Where they run at FMA's
//   rate (Zen 4, a build without AMX), keys are scored by them instead (score_pair_products).
// - Each head's unreduced products of 16 keys reduced by one transposing add tree into a vector
//   of 16 scores, where a horizontal sum per key and head was most of the scores' time.
// - The online softmax on those vectors, 32 keys an update, where a scalar running max was. A
//   head's max moves only when a score passes it by more than 8, and its sums stay 16 lanes
//   until the range ends: 1.07-1.10x with the cache in L2, 1.03-1.06x from memory on
//   SmolLM2's heads (64 x 600, 1 x 7000), 1.01-1.05x on Qwen3's.
// - Values widened the same way into sums kept as even and odd halves in registers over a
//   step's keys, each key's weight broadcast once; put back in order at the end of the range.
//   Where pair products run at FMA's rate, values take them too (add_value_pairs).
// A key's rows for every KV head are read whole and in order. With FMA scores (the AMX Xeon) its
// value row is asked for while it is scored and the key rows are left to the hardware
// prefetchers: asking for the next step's keys while values were added (a burst of 32 rows)
// made the kernel 1.08-1.17x slower on SmolLM2's heads and 1.15-1.23x on Qwen3's, from memory
// (1 to 64 rows, 512 to 16k keys, benchmarks/decode_kernel_ab.py --layers 30). With pair
// products (Zen 4) both are asked for a step ahead into L2, spread over the step: the next
// step's key rows one a key while this step's are scored, its value rows one a key while this
// step's values are added (score_pair_products, add_value_pairs).

#pragma once

#include <vector>

#if defined(__AVX512F__)

namespace {

constexpr int64_t KEYS = 16;  // keys a score vector holds
constexpr int64_t STEP = 2 * KEYS;  // keys a softmax update takes: two score vectors a head

// lane j of the result = the sum of the 16 floats at vectors + 16 * j
inline __m512 hsum16(const float* vectors) {
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k) {  // lane L: [a(0+2), b(0+2), a(1+3), b(1+3)] of its 4 elements
    const __m512 a = _mm512_loadu_ps(vectors + 32 * k), b = _mm512_loadu_ps(vectors + 32 * k + 16);
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k) {  // lane L: keys 4k..4k+3, each summed over lane L
    const __m512d x = _mm512_castps_pd(pairs[2 * k]), y = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int EVEN = _MM_SHUFFLE(2, 0, 2, 0), ODD = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], EVEN),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], ODD));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], EVEN),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], ODD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, EVEN), _mm512_shuffle_f32x4(q01, q23, ODD));
}

// bf16 values as float32: a 32-bit lane holds elements 2k (low half) and 2k + 1 (high half)
inline __m512 even_half(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 odd_half(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// q (bf16, heads x D) as float32 in the halves' order: each 32 dims' even ones, then odd ones
inline void split_query(const uint16_t* q, int64_t count, float* qs) {
  for (int64_t c = 0; c < count; c += 32) {
    const __m512i v = _mm512_loadu_si512(q + c);
    _mm512_storeu_ps(qs + c, even_half(v));
    _mm512_storeu_ps(qs + c + 16, odd_half(v));
  }
}

// part + (i * STEP + j) * 16: the 16 unreduced products of query head i and key j (rows[j]),
// zero past n; C = head_dim / 32. Each KV head's key row is widened once, for its G query
// heads: float32 products by FMA, where AVX512-BF16's pair products ran at a quarter of FMA's
// rate here.
template <int C>
inline void score_products(const float* qs, const uint16_t* kc, const uint16_t* vc,
                           const int64_t* rows, int64_t n, const Shape& sh, float* part) {
  constexpr int64_t D = 32 * C;
  const int64_t G = sh.heads / sh.kv_heads;
  for (int64_t j = 0; j < n; ++j) {
    prefetch_value_row(vc, rows + j, sh);
    const uint16_t* row = kc + rows[j];
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      __m512 even[C], odd[C];
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(row + h * D + 32 * c);
        even[c] = even_half(v);
        odd[c] = odd_half(v);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qi = qs + (h * G + g) * D;
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qi), even[0]);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(qi + 16), odd[0]);
        for (int c = 1; c < C; ++c) {
          a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 32 * c), even[c], a0);
          a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 32 * c + 16), odd[c], a1);
        }
        _mm512_storeu_ps(part + ((h * G + g) * STEP + j) * 16, _mm512_add_ps(a0, a1));
      }
    }
  }
  for (int64_t i = 0; n < STEP && i < sh.heads; ++i)
    for (int64_t j = n; j < STEP; ++j)
      _mm512_storeu_ps(part + (i * STEP + j) * 16, _mm512_setzero_ps());
}

// The same products as AVX512-BF16 pair products, where that instruction runs at the rate of a
// float32 FMA (AMD's Zen 4) and so does twice its work: a query head's 32 dims against a key's
// 32 in one instruction, from the bf16 rows themselves, nothing widened. On a 2-core Zen 4
// (benchmarks/decode_kernel_ab.py): 1.13-1.17x the kernel with the cache in L2 (SmolLM2's
// heads), 1.02-1.08x from memory (--layers 30), 1.00-1.04x on Qwen3's. On the AMX Xeon the pair
// products ran at a quarter of FMA's rate, so a build with AMX keeps score_products.
// -DKILN_DECODE_PAIR_SCORES=0 or 1 chooses either where the CPU has AVX512-BF16 (tests, A/B).
#if !defined(KILN_DECODE_PAIR_SCORES)
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define KILN_DECODE_PAIR_SCORES 1
#else
#define KILN_DECODE_PAIR_SCORES 0
#endif
#endif
#if KILN_DECODE_PAIR_SCORES && !defined(__AVX512BF16__)
#undef KILN_DECODE_PAIR_SCORES
#define KILN_DECODE_PAIR_SCORES 0
#endif

// Values by pair products too (add_value_pairs), where scores are: -DKILN_DECODE_PAIR_VALUES=0/1
// chooses apart from them.
#if !defined(KILN_DECODE_PAIR_VALUES)
#define KILN_DECODE_PAIR_VALUES KILN_DECODE_PAIR_SCORES
#endif
#if KILN_DECODE_PAIR_VALUES && !defined(__AVX512BF16__)
#undef KILN_DECODE_PAIR_VALUES
#define KILN_DECODE_PAIR_VALUES 0
#endif

inline void prefetch_into_l2(const void* row, int64_t bytes) {
  const char* line = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(line + b, _MM_HINT_T2);
}

#if KILN_DECODE_PAIR_SCORES
// score_products' result from q (bf16, heads x D as stored) by pair products: lane L of a head's
// vector sums dims 2L, 2L + 1 of each 32. The next step's key rows (next_rows) are asked for into
// L2 one a key: with the little arithmetic a key takes, the kernel otherwise waits on memory
// between steps (1.08-1.13x on SmolLM2's 384-byte rows from memory; on Qwen3's 2 KiB rows it
// pays only with the value rows asked for too, add_value_pairs).
template <int C>
inline void score_pair_products(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                const int64_t* rows, int64_t n, const Shape& sh, float* part,
                                const int64_t* next_rows, int64_t next_n) {
  constexpr int64_t D = 32 * C;
  const int64_t G = sh.heads / sh.kv_heads, row_bytes = sh.kv_heads * D * 2;
  for (int64_t j = 0; j < n; ++j) {
    if (!KILN_DECODE_PAIR_VALUES) prefetch_value_row(vc, rows + j, sh);
    if (j < next_n) prefetch_into_l2(kc + next_rows[j], row_bytes);
    const uint16_t* row = kc + rows[j];
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      __m512bh k[C];
      for (int c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_loadu_si512(row + h * D + 32 * c);
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qi = q + (h * G + g) * D;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qi), k[0]);
        for (int c = 1; c < C; ++c)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qi + 32 * c), k[c]);
        _mm512_storeu_ps(part + ((h * G + g) * STEP + j) * 16, a);
      }
    }
  }
  for (int64_t i = 0; n < STEP && i < sh.heads; ++i)
    for (int64_t j = n; j < STEP; ++j)
      _mm512_storeu_ps(part + (i * STEP + j) * 16, _mm512_setzero_ps());
}
#endif

// exp(x) of one float (x <= 0) by the vector exp the weights take, not a call into libm
inline float exp_one(float x) { return _mm512_cvtss_f32(vexp(_mm512_set1_ps(x))); }

// How far a score may pass a head's running max before the max moves: a weight is then at most
// e^8 (about 3000), well inside float32, and the sums keep their relative precision. After a
// row's first keys most steps move no head's max, and skip the rescaling with its horizontal
// max and scalar exp (the prefill kernel's AMX path does the same).
constexpr float MAX_SLACK = 8.f;

// The step's scores folded into each head's running max m and its 16 lane sums (lanes + 16 i,
// reduced once the range ends, not at every step); p[i * STEP + j] = the weight of key j (0
// past n), correction[i] = what head i's sums so far are multiplied by (1 where m stayed).
// scores(i, s0, s1) gives head i's scores of keys 0-15 and 16-31 (lanes past n are ignored).
template <typename Scores>
inline void softmax_update(const Scores& scores, int64_t n, const Shape& sh, float* m,
                           float* lanes, float* p, float* correction) {
  const __mmask16 live0 = static_cast<__mmask16>(n >= KEYS ? 0xffffu : (1u << n) - 1);
  const __mmask16 live1 =
      static_cast<__mmask16>(n >= STEP ? 0xffffu : n > KEYS ? (1u << (n - KEYS)) - 1 : 0u);
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
  for (int64_t i = 0; i < sh.heads; ++i) {
    __m512 raw0, raw1;
    scores(i, raw0, raw1);
    // keys past n, and NaN scores (vmaxps passes its second operand on NaN), count as -inf
    const __m512 s0 = _mm512_max_ps(_mm512_mask_mov_ps(neg_inf, live0, raw0), neg_inf);
    const __m512 s1 = _mm512_max_ps(_mm512_mask_mov_ps(neg_inf, live1, raw1), neg_inf);
    const __m512 slack = _mm512_set1_ps(m[i] + MAX_SLACK);
    correction[i] = 1.f;
    if (_mm512_cmp_ps_mask(s0, slack, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, slack, _CMP_GT_OQ)) {
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      correction[i] = m[i] == NEG_INF ? 0.f : exp_one(m[i] - mx);
      const __m512 sums = _mm512_loadu_ps(lanes + 16 * i);
      _mm512_storeu_ps(lanes + 16 * i, _mm512_mul_ps(sums, _mm512_set1_ps(correction[i])));
      m[i] = mx;
    }
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
    if (m[i] != NEG_INF) {  // else every score so far is -inf: no weight yet
      const __m512 top = _mm512_set1_ps(m[i]);
      e0 = _mm512_maskz_mov_ps(live0, vexp(_mm512_sub_ps(s0, top)));
      e1 = _mm512_maskz_mov_ps(live1, vexp(_mm512_sub_ps(s1, top)));
      _mm512_storeu_ps(lanes + 16 * i,
                       _mm512_add_ps(_mm512_loadu_ps(lanes + 16 * i), _mm512_add_ps(e0, e1)));
    }
    _mm512_storeu_ps(p + i * STEP, e0);
    _mm512_storeu_ps(p + i * STEP + KEYS, e1);
  }
}

// softmax_update over float32 products left unreduced (part: 16 lanes a head and key)
inline void softmax_step(const float* part, int64_t n, const Shape& sh, float* m, float* lanes,
                         float* p, float* correction) {
  const __m512 scale = _mm512_set1_ps(sh.scale);
  const auto scores = [&](int64_t i, __m512& s0, __m512& s1) {
    const float* pi = part + i * STEP * 16;
    s0 = _mm512_mul_ps(hsum16(pi), scale);
    s1 = _mm512_mul_ps(hsum16(pi + KEYS * 16), scale);
  };
  softmax_update(scores, n, sh, m, lanes, p, correction);
}

// acc (GS heads of one KV head, each 32 * C floats as even/odd halves of every 32 dims) times
// their correction, plus the weighted value rows of the step's n keys: the sums stay in
// registers over the keys, each key's weight broadcast once for all its dims
template <int C, int GS>
inline void add_values(const float* p, const float* correction, const uint16_t* vc,
                       const int64_t* rows, int64_t n, int64_t offset, float* acc) {
  constexpr int64_t D = 32 * C;
  __m512 even[GS][C], odd[GS][C];
  for (int g = 0; g < GS; ++g) {
    const __m512 cg = _mm512_set1_ps(correction[g]);
    for (int c = 0; c < C; ++c) {
      even[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c), cg);
      odd[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c + 16), cg);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* v = vc + rows[j] + offset;
    __m512 w[GS];
    for (int g = 0; g < GS; ++g) w[g] = _mm512_set1_ps(p[g * STEP + j]);
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v + 32 * c);
      const __m512 ve = even_half(x), vo = odd_half(x);
      for (int g = 0; g < GS; ++g) {
        even[g][c] = _mm512_fmadd_ps(w[g], ve, even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(w[g], vo, odd[g][c]);
      }
    }
  }
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + g * D + 32 * c, even[g][c]);
      _mm512_storeu_ps(acc + g * D + 32 * c + 16, odd[g][c]);
    }
}

#if KILN_DECODE_PAIR_VALUES
// add_values by AVX512-BF16 pair products over two keys at a time: each weight rounded to bf16
// (as FlashAttention rounds its probabilities for the value product), the sums float32. Two
// keys' value rows are interleaved (one unpack each for the low and high halves of every 128
// bits), so a lane holds one dim of both keys and one instruction adds both keys' terms for 16
// dims: half the instructions of widened rows and FMAs, the unpacks shared by the G heads. A sum
// vector's lanes hold dims 8L + e (lo) and 8L + 4 + e (hi) of each 32 (pair_order puts them
// back). `pairs` holds each head's weights as bf16 pairs: 32-bit lane k is keys 2k and 2k + 1.
// The next step's value rows of this KV head (next_rows, given to one head group of it) are
// asked for into L2 as this step's are added.
// On a 2-core Zen 4 (benchmarks/decode_kernel_ab.py --layers 30, 1 to 64 rows, 512 to 16k keys,
// against float32 FMAs with the value rows asked for as keys are scored): 1.17-1.24x on
// SmolLM2's heads, 1.15-1.24x on Qwen3's with the key prefetch; with the cache in L2, 1.10-1.16x.
template <int C, int GS>
inline void add_value_pairs(const uint32_t* pairs, const float* correction, const uint16_t* vc,
                            const int64_t* rows, int64_t n, int64_t offset, float* acc,
                            const int64_t* next_rows, int64_t next_n) {
  constexpr int64_t D = 32 * C;
  __m512 lo[GS][C], hi[GS][C];
  for (int g = 0; g < GS; ++g) {
    const __m512 cg = _mm512_set1_ps(correction[g]);
    for (int c = 0; c < C; ++c) {
      lo[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c), cg);
      hi[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 32 * c + 16), cg);
    }
  }
  for (int64_t j = 0; j < n; j += 2) {
    // an odd last key pairs with itself: its partner's weight is 0 (p is 0 past n)
    const uint16_t* v0 = vc + rows[j] + offset;
    const uint16_t* v1 = vc + rows[j + 1 < n ? j + 1 : j] + offset;
    for (int64_t b = j; b < j + 2 && b < next_n; ++b)
      prefetch_into_l2(vc + next_rows[b] + offset, D * 2);
    __m512bh w[GS];
    for (int g = 0; g < GS; ++g)
      w[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g * KEYS + j / 2]));
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      const __m512bh x = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh y = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < GS; ++g) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], x, w[g]);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], y, w[g]);
      }
    }
  }
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + g * D + 32 * c, lo[g][c]);
      _mm512_storeu_ps(acc + g * D + 32 * c + 16, hi[g][c]);
    }
}

// Each head's step weights p (STEP floats a head) as bf16 pairs for add_value_pairs
inline void weight_pairs(const float* p, int64_t heads, uint32_t* pairs) {
  for (int64_t i = 0; i < heads; ++i) {
    const __m512bh both =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + i * STEP + KEYS), _mm512_loadu_ps(p + i * STEP));
    _mm512_storeu_si512(pairs + i * KEYS, (__m512i)both);
  }
}
#endif

// One register group of GS heads of a KV head: add_value_pairs where values take pair products
// (p as bf16 pairs in `pairs`), else add_values (p as float32)
template <int C, int GS>
inline void add_group(const float* p, const uint32_t* pairs, const float* correction,
                      const uint16_t* vc, const int64_t* rows, int64_t n, int64_t offset,
                      float* acc, const int64_t* next_rows, int64_t next_n) {
#if KILN_DECODE_PAIR_VALUES
  (void)p;
  add_value_pairs<C, GS>(pairs, correction, vc, rows, n, offset, acc, next_rows, next_n);
#else
  (void)pairs, (void)next_rows, (void)next_n;
  add_values<C, GS>(p, correction, vc, rows, n, offset, acc);
#endif
}

// The heads sharing each KV head in register groups: at most 16 sums (GS x 2C vectors) a group.
// The next step's value rows are asked for by each KV head's first group.
template <int C>
inline void values_for(const float* p, const float* correction, const uint16_t* vc,
                       const int64_t* rows, int64_t n, const Shape& sh, float* acc,
                       const int64_t* next_rows, int64_t next_n) {
  constexpr int MAX_GS = C >= 8 ? 1 : 8 / C;
  const int64_t G = sh.heads / sh.kv_heads;
  alignas(64) uint32_t pairs[MAX_HEADS * KEYS];
#if KILN_DECODE_PAIR_VALUES
  weight_pairs(p, sh.heads, pairs);
#endif
  for (int64_t h = 0; h < sh.kv_heads; ++h)
    for (int64_t g = 0; g < G; g += MAX_GS) {
      const int64_t i = h * G + g, offset = h * 32 * C, ahead = g == 0 ? next_n : 0;
      const auto group = [&](auto size) {
        add_group<C, decltype(size)::value>(p + i * STEP, pairs + i * KEYS, correction + i, vc,
                                            rows, n, offset, acc + i * 32 * C, next_rows, ahead);
      };
      switch (std::min<int64_t>(MAX_GS, G - g)) {
        case 8: group(std::integral_constant<int, std::min(8, MAX_GS)>()); break;
        case 7: group(std::integral_constant<int, std::min(7, MAX_GS)>()); break;
        case 6: group(std::integral_constant<int, std::min(6, MAX_GS)>()); break;
        case 5: group(std::integral_constant<int, std::min(5, MAX_GS)>()); break;
        case 4: group(std::integral_constant<int, std::min(4, MAX_GS)>()); break;
        case 3: group(std::integral_constant<int, std::min(3, MAX_GS)>()); break;
        case 2: group(std::integral_constant<int, std::min(2, MAX_GS)>()); break;
        default: group(std::integral_constant<int, 1>()); break;
      }
    }
}

// Every head's sums back into dimension order: each 32 dims' two vectors (a, b) become
// permutex2var(a, first, b) and permutex2var(a, second, b)
inline void to_dim_order(float* acc, int64_t count, const int32_t* first, const int32_t* second) {
  const __m512i lanes0 = _mm512_load_si512(first), lanes1 = _mm512_load_si512(second);
  for (int64_t c = 0; c < count; c += 32) {
    const __m512 a = _mm512_loadu_ps(acc + c), b = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(a, lanes0, b));
    _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(a, lanes1, b));
  }
}

// add_values' order (even and odd dims of each 32) back into dimension order
inline void interleave_halves(float* acc, int64_t count) {
  alignas(64) static constexpr int32_t LOW[16] = {0, 16, 1, 17, 2, 18, 3, 19,
                                                  4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static constexpr int32_t HIGH[16] = {8, 24, 9, 25, 10, 26, 11, 27,
                                                   12, 28, 13, 29, 14, 30, 15, 31};
  to_dim_order(acc, count, LOW, HIGH);
}

// add_value_pairs' order back into dimension order: of each 32, lo lane 4L + e is dim 8L + e
// and hi lane 4L + e is dim 8L + 4 + e
inline void pair_order(float* acc, int64_t count) {
  alignas(64) static constexpr int32_t FIRST[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                    4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t SECOND[16] = {8, 9, 10, 11, 24, 25, 26, 27,
                                                     12, 13, 14, 15, 28, 29, 30, 31};
  to_dim_order(acc, count, FIRST, SECOND);
}

inline bool bf16_decode_supported(int64_t head_dim) {
  return head_dim > 0 && head_dim % 32 == 0 && head_dim <= 256;
}

// attend_range for bf16 queries over a bf16 cache, head_dim = 32 * C
template <int C>
void attend_range_chunks(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                         const int32_t* table, int64_t t0, int64_t t1, const Shape& sh,
                         float* acc, float* m, float* l) {
  const int64_t H = sh.heads, row_elems = sh.kv_heads * sh.head_stride;
  // a thread's buffers kept between calls: heads x 32 vectors of products is up to 128 KiB
  thread_local std::vector<float> part_buffer;
  thread_local std::vector<float> query_buffer;
  if (part_buffer.size() < static_cast<size_t>(H * STEP * 16)) part_buffer.resize(H * STEP * 16);
  if (query_buffer.size() < static_cast<size_t>(H * sh.head_dim)) query_buffer.resize(H * sh.head_dim);
  float* part = part_buffer.data();
  float* qs = query_buffer.data();
  alignas(64) float p[MAX_HEADS * STEP];
  alignas(64) float lanes[MAX_HEADS * 16] = {};
  float correction[MAX_HEADS];
  int64_t rows_buffer[2][STEP];
  int64_t* rows = rows_buffer[0];
  int64_t* next_rows = rows_buffer[1];
  if (!KILN_DECODE_PAIR_SCORES) split_query(q, H * sh.head_dim, qs);
  std::fill(m, m + H, NEG_INF);
  std::fill(acc, acc + H * sh.head_dim, 0.f);
  if (t0 < t1) tile_rows(table, t0, std::min(STEP, t1 - t0), sh.block_size, row_elems, rows);
  for (int64_t t = t0; t < t1; t += STEP) {
    const int64_t n = std::min(STEP, t1 - t);
    const int64_t next_n = std::max<int64_t>(0, std::min(STEP, t1 - t - STEP));
    if (next_n) tile_rows(table, t + STEP, next_n, sh.block_size, row_elems, next_rows);
#if KILN_DECODE_PAIR_SCORES
    score_pair_products<C>(q, kc, vc, rows, n, sh, part, next_rows, next_n);
#else
    score_products<C>(qs, kc, vc, rows, n, sh, part);
#endif
    softmax_step(part, n, sh, m, lanes, p, correction);
    values_for<C>(p, correction, vc, rows, n, sh, acc, next_rows, next_n);
    std::swap(rows, next_rows);
  }
  for (int64_t i = 0; i < H; ++i) l[i] = _mm512_reduce_add_ps(_mm512_load_ps(lanes + 16 * i));
#if KILN_DECODE_PAIR_VALUES
  pair_order(acc, H * sh.head_dim);
#else
  interleave_halves(acc, H * sh.head_dim);
#endif
}

inline void attend_range_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                              const int32_t* table, int64_t t0, int64_t t1, const Shape& sh,
                              float* acc, float* m, float* l) {
  switch (sh.head_dim / 32) {  // 1 to 8: bf16_decode_supported
    case 1: return attend_range_chunks<1>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 2: return attend_range_chunks<2>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 3: return attend_range_chunks<3>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 4: return attend_range_chunks<4>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 5: return attend_range_chunks<5>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 6: return attend_range_chunks<6>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    case 7: return attend_range_chunks<7>(q, kc, vc, table, t0, t1, sh, acc, m, l);
    default: return attend_range_chunks<8>(q, kc, vc, table, t0, t1, sh, acc, m, l);
  }
}

}  // namespace

#endif
