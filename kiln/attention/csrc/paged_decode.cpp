// Decode attention over kiln's paged KV cache on the CPU, read in place.
//
// One query token per request, its keys and values where they lie in the cache
// ([blocks * block_size, kv_heads, head_dim], float32 or bfloat16; or int8, each head row
// head_dim values and then its float32 scale: kiln/attention/kv_int8.py), found through the
// request's block table. A work item is one request over one range of its keys, every head at
// once: a token's keys for all KV heads are one contiguous run of the cache, read once and in
// order, which is what lets the hardware prefetchers stream it. Scores and the softmax are
// float32 (bfloat16 products accumulate in float32); a request's ranges are merged by their
// running max and sum (online softmax), as flash-decoding splits a long context.
//
// Built at first use by kiln/attention/cpu_kernel.py with the machine's compiler
// (-O3 -march=native -fopenmp); AVX-512 (and AVX512-BF16) where the CPU has them, else AVX2
// with FMA, else portable loops. bf16 queries over a bf16 cache on AVX-512 take
// decode_bf16.h's arrangement of the same arithmetic. Prefill chunks have their own kernel,
// prefill.h.

#include <vector>

#include "vector.h"

namespace {

constexpr int64_t TILE = 32;       // keys scored per softmax update
constexpr int64_t MAX_HEADS = 64;  // query heads x head dim bounded by the caller

// q . k over head_dim d, in float32 (keys widened as they are loaded)
template <typename KV>
inline float dot_f32(const float* qf, const KV* k, int64_t d) {
#if defined(KILN_SIMD)
  if (d % W == 0) {
    vf acc = vzero();
    for (int64_t i = 0; i < d; i += W) acc = vfmadd(vload(qf + i), vload(k + i), acc);
    return vsum(acc);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += qf[i] * to_float(k[i]);
  return s;
}

// The scale of a head row of d values: an int8 row's float32 after its values, else 1
template <typename KV>
inline float row_scale(const KV* row, int64_t d) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    float scale;
    std::memcpy(&scale, row + d, 4);
    return scale;
  }
  (void)row, (void)d;
  return 1.f;
}
// A row of d values quantized to int8 (kiln/attention/kv_int8.py's quantize, bit for bit: the
// same float32 division and rounding to nearest even); returns its scale, max|x| / 127
template <typename T>
inline float quantize_row(const T* row, int64_t d, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
  const float scale = amax / 127.f;
  for (int64_t i = 0; i < d; ++i) {
    const float q = scale > 0.f ? std::nearbyint(to_float(row[i]) / scale) : 0.f;
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  return scale;
}

// acc[g] += p[g * TILE] * v for the g query heads sharing one KV head's value row v
template <typename KV>
inline void add_weighted(const float* p, float* acc, const KV* v, int64_t group, int64_t d) {
  const float vs = row_scale(v, d);
#if defined(KILN_SIMD)
  if (d % W == 0) {
    for (int64_t i = 0; i < d; i += W) {
      const vf vv = vload(v + i);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * d + i;
        vstore(a, vfmadd(vset(p[g * TILE] * vs), vv, vload(a)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) acc[g * d + i] += p[g * TILE] * vs * to_float(v[i]);
}

// s[j] = exp(s[j] - mx) for j < n, returns their sum
inline float exp_sum(float* s, int64_t n, float mx) {
  int64_t j = 0;
  float total = 0.f;
#if defined(KILN_SIMD)
  const vf m = vset(mx);
  vf sum = vzero();
  for (; j + W <= n; j += W) {
    const vf p = vexp(vload(s + j) - m);
    vstore(s + j, p);
    sum = sum + p;
  }
  total = vsum(sum);
#endif
  // a NaN score (a NaN in the key) gets no weight, as vexp's clamp gives it in the vector loop
  for (; j < n; ++j) total += (s[j] = std::isnan(s[j]) ? 0.f : std::exp(s[j] - mx));
  return total;
}

// The cache rows (element offsets) of keys [t, t + n) of a request with block table `table`.
inline void tile_rows(const int32_t* table, int64_t t, int64_t n, int64_t block_size,
                      int64_t row_elems, int64_t* rows) {
  int64_t block = t / block_size, offset = t - block * block_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = (static_cast<int64_t>(table[block]) * block_size + offset) * row_elems;
    if (++offset == block_size) offset = 0, ++block;
  }
}

// Asks for the n cache rows (row_elems elements from each offset in rows) to be brought into
// the cache. A tile's keys and values are asked for a phase ahead: each key's value row while
// the key is scored, the next tile's key rows while this tile's values are added. That gave
// the rows about a tile's time to arrive, where asking for values 8 keys ahead left the kernel
// waiting on memory: 1.19-1.38x on SmolLM2's shapes with a bf16 cache (1 to 64 rows, 600 to
// 16k keys; benchmarks/decode_kernel_ab.py --layers 30), 1.03-1.07x on Qwen3's longer rows,
// 1.05-1.26x with an int8 cache.
template <typename KV>
inline void prefetch_rows(const KV* base, const int64_t* rows, int64_t n, int64_t row_elems) {
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(base + rows[j]);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t head_stride;  // elements from one head row to the next: head_dim, + 4 for int8
};

// The value row at `row` asked for while its key is scored (prefetch_rows). Not for float32
// rows, twice a bf16 row's bytes: asking for them measured 0.83x on Qwen3's shapes.
template <typename KV>
inline void prefetch_value_row(const KV* vc, const int64_t* row, const Shape& sh) {
  if constexpr (!std::is_same_v<KV, float>) prefetch_rows(vc, row, 1, sh.kv_heads * sh.head_stride);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KILN_INT8_DOTS 1
// An int8 cache's keys scored by integer dot products (AVX512-VNNI), as llama.cpp scores its
// q8_0 cache: the query is quantized per head as the cache is (q = qs * q8, qs = max|q| / 127)
// and q8 . k summed exactly in int32, 32 products a vector instruction, where widening every
// key vector to float32 for each query head was half the kernel's time. vpdpbusd multiplies
// unsigned by signed bytes, so keys go in as k + 128 (their sign bit flipped) and 128 * sum(q8)
// is taken off the sum.
struct QuantizedQuery {
  alignas(64) int8_t values[MAX_HEADS * 256];
  float scale[MAX_HEADS];   // qs times the softmax scale
  float offset[MAX_HEADS];  // 128 * sum(q8)
};

inline bool int8_dots(int64_t head_dim) { return head_dim % 32 == 0; }

// qq from the float32 query qf (all heads), quantized per head as the cache's rows are
inline void quantize_query(const float* qf, const Shape& sh, QuantizedQuery& qq) {
  const int64_t D = sh.head_dim;
  for (int64_t i = 0; i < sh.heads; ++i) {
    qq.scale[i] = quantize_row(qf + i * D, D, qq.values + i * D) * sh.scale;
    int32_t total = 0;
    for (int64_t c = 0; c < D; ++c) total += qq.values[i * D + c];
    qq.offset[i] = 128.f * static_cast<float>(total);
  }
}

// part[g * 64 + lane] = the 8 int32 lanes of (k + 128) . q8_g for GS query heads of one KV head
template <int GS>
inline void int8_dot_group(const int8_t* q, const int8_t* k, int64_t d, float* part) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i acc[GS];
  for (int g = 0; g < GS; ++g) acc[g] = _mm256_setzero_si256();
  for (int64_t c = 0; c < d; c += 32) {
    const __m256i kv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + c)), flip);
    for (int g = 0; g < GS; ++g)
      acc[g] = _mm256_dpbusd_epi32(acc[g], kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * d + c)));
  }
  for (int g = 0; g < GS; ++g) _mm256_storeu_ps(part + g * 64, _mm256_cvtepi32_ps(acc[g]));
}

// s[i * TILE + j] = scale * qs_i * ks_j * (q8_i . k_j) over the tile's n keys of an int8 cache.
// Every sum is an integer below 2^24, so its float32 is exact and the vector and scalar loops
// give the same scores.
inline void score_tile_int8(const QuantizedQuery& qq, const int8_t* kc, const int8_t* vc,
                            const int64_t* rows, int64_t n, const Shape& sh, float* s) {
  const int64_t H = sh.heads, D = sh.head_dim, G = H / sh.kv_heads, HS = sh.head_stride;
  alignas(64) float part[MAX_HEADS * 64];  // head i, key b: 8 lanes at (i * 8 + b) * 8
  alignas(32) float kscale[MAX_HEADS * 8];  // KV head h, key b
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int b = 0; b < 8; ++b) {
      prefetch_value_row(vc, rows + j + b, sh);
      const int8_t* row = kc + rows[j + b];
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const int8_t* k = row + h * HS;
        kscale[h * 8 + b] = row_scale(k, D);
        for (int64_t g = 0; g < G; g += 4) {
          const int8_t* q = qq.values + (h * G + g) * D;
          float* pg = part + ((h * G + g) * 8 + b) * 8;
          switch (std::min<int64_t>(4, G - g)) {
            case 4: int8_dot_group<4>(q, k, D, pg); break;
            case 3: int8_dot_group<3>(q, k, D, pg); break;
            case 2: int8_dot_group<2>(q, k, D, pg); break;
            default: int8_dot_group<1>(q, k, D, pg); break;
          }
        }
      }
    }
    for (int64_t i = 0; i < H; ++i) {
      __m256 sum[8];
      for (int b = 0; b < 8; ++b) sum[b] = _mm256_loadu_ps(part + (i * 8 + b) * 8);
      const __m256 dots = _mm256_sub_ps(hsum8(sum), _mm256_set1_ps(qq.offset[i]));
      const __m256 scaled = _mm256_mul_ps(dots, _mm256_set1_ps(qq.scale[i]));
      _mm256_storeu_ps(s + i * TILE + j, _mm256_mul_ps(scaled, _mm256_load_ps(kscale + (i / G) * 8)));
    }
  }
  for (; j < n; ++j)
    for (int64_t i = 0; i < H; ++i) {
      const int8_t* k = kc + rows[j] + (i / G) * HS;
      const int8_t* q = qq.values + i * D;
      int32_t dot = 0;
      for (int64_t c = 0; c < D; ++c) dot += int32_t(q[c]) * int32_t(k[c]);
      s[i * TILE + j] = static_cast<float>(dot) * qq.scale[i] * row_scale(k, D);
    }
}
#endif

// s[i * TILE + j] = scale * q_i . k_j for every query head i and the tile's n keys (key j's
// heads at kc + rows[j]). With vectors, keys go in blocks of 8: each key row is read whole and in
// order (what the hardware prefetchers stream from memory), each head's products left unreduced
// in `part`, and one transposing add tree then reduces a head's 8 keys together, where reducing
// every key and head alone was most of the kernel's time on AVX2.
template <typename KV>
inline void score_tile(const float* qf, const KV* kc, const KV* vc,
                       const int64_t* rows, int64_t n, const Shape& sh, float* s) {
  const int64_t H = sh.heads, D = sh.head_dim, G = H / sh.kv_heads, HS = sh.head_stride;
  int64_t j = 0;
#if defined(KILN_SIMD)
  if (D % W == 0) {
    const __m256 scale = _mm256_set1_ps(sh.scale);
    alignas(64) float part[MAX_HEADS * 8 * W];  // each head's 8 unreduced sums
    for (; j + 8 <= n; j += 8) {
      for (int b = 0; b < 8; ++b) {  // one key row after another, every head of it
        prefetch_value_row(vc, rows + j + b, sh);
        const KV* row = kc + rows[j + b];
        for (int64_t i = 0; i < H; ++i) {
          // int8 rows widen as they load, for each query head: widening a KV head's row once
          // into a buffer for its G query heads measured 0.9x (the round trip costs more)
          const KV* k = row + (i / G) * HS;
          const float* qi = qf + i * D;
          vf a0 = vzero(), a1 = vzero();
          int64_t c = 0;
          for (; c + 2 * W <= D; c += 2 * W) {
            a0 = vfmadd(vload(qi + c), vload(k + c), a0);
            a1 = vfmadd(vload(qi + c + W), vload(k + c + W), a1);
          }
          if (c < D) a0 = vfmadd(vload(qi + c), vload(k + c), a0);
          if constexpr (std::is_same_v<KV, int8_t>) a0 = (a0 + a1) * vset(row_scale(k, D));
          else a0 = a0 + a1;
          vstore(part + (i * 8 + b) * W, a0);
        }
      }
      for (int64_t i = 0; i < H; ++i) {
        vf sum[8];
        for (int b = 0; b < 8; ++b) sum[b] = vload(part + (i * 8 + b) * W);
        _mm256_storeu_ps(s + i * TILE + j, _mm256_mul_ps(vsum8(sum), scale));
      }
    }
  }
#endif
  for (; j < n; ++j) {
    prefetch_value_row(vc, rows + j, sh);
    for (int64_t i = 0; i < H; ++i) {
      const KV* k = kc + rows[j] + (i / G) * HS;
      s[i * TILE + j] = sh.scale * row_scale(k, D) * dot_f32(qf + i * D, k, D);
    }
  }
}

#if defined(KILN_SIMD)
// acc[g] += sum_b p[g * TILE + b] * v[b] for GS query heads sharing the value rows v of 8 keys:
// the sums stay in registers over the 8 keys (loaded and stored once, not once per key)
template <int GS, typename KV>
inline void add_keys(const float* p, float* acc, const KV* const* v, int64_t d) {
  alignas(32) float w[GS * 8];  // the weights, int8 rows' scales folded in
  for (int g = 0; g < GS; ++g)
    for (int b = 0; b < 8; ++b) w[g * 8 + b] = p[g * TILE + b] * row_scale(v[b], d);
  for (int64_t c = 0; c < d; c += W) {
    vf a[GS];
    for (int g = 0; g < GS; ++g) a[g] = vload(acc + g * d + c);
    for (int b = 0; b < 8; ++b) {
      const vf vv = vload(v[b] + c);
      for (int g = 0; g < GS; ++g) a[g] = vfmadd(vset(w[g * 8 + b]), vv, a[g]);
    }
    for (int g = 0; g < GS; ++g) vstore(acc + g * d + c, a[g]);
  }
}
#endif

// acc[i] += sum_j p[i * TILE + j] * v_j (v_j the value row of head i's KV head) over the tile's
// n keys. With vectors and a bf16 cache, 8 keys at a time, heads in register groups of up to 4,
// the next tile's key rows asked for (rows[n, known)); float32 rows (twice as long) one key at
// a time, as that streamed faster from memory (benchmarks/decode_kernel_ab.py --layers 30).
template <typename KV>
inline void add_tile(const float* p, float* acc, const KV* kc, const KV* vc, const int64_t* rows,
                     int64_t n, int64_t known, const Shape& sh) {
  const int64_t D = sh.head_dim, G = sh.heads / sh.kv_heads, HS = sh.head_stride;
  int64_t j = 0;
#if defined(KILN_SIMD)
  if (!std::is_same_v<KV, float> && D % W == 0) {
    for (; j + 8 <= n; j += 8) {
      prefetch_rows(kc, rows + n + j, std::min<int64_t>(8, known - n - j), sh.kv_heads * HS);
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const KV* v[8];
        for (int b = 0; b < 8; ++b) v[b] = vc + rows[j + b] + h * HS;
        for (int64_t g = 0; g < G; g += 4) {
          const float* pg = p + (h * G + g) * TILE + j;
          float* ag = acc + (h * G + g) * D;
          switch (std::min<int64_t>(4, G - g)) {
            case 4: add_keys<4>(pg, ag, v, D); break;
            case 3: add_keys<3>(pg, ag, v, D); break;
            case 2: add_keys<2>(pg, ag, v, D); break;
            default: add_keys<1>(pg, ag, v, D); break;
          }
        }
      }
    }
  }
#endif
  for (; j < n; ++j)
    for (int64_t h = 0; h < sh.kv_heads; ++h)
      add_weighted(p + h * G * TILE + j, acc + h * G * D, vc + rows[j] + h * HS, G, D);
}

}  // namespace

#include "decode_bf16.h"
#include "decode_int8.h"

namespace {

// One request's query q (all heads) over its keys [t0, t1): unnormalised output acc [H, D],
// running max m [H] and sum l [H]. Q is the query's type, KV the cache's (float32 or bf16).
template <typename Q, typename KV>
void attend_range(const Q* q, const KV* kc, const KV* vc, const int32_t* table, int64_t t0,
                  int64_t t1, const Shape& sh, float* acc, float* m, float* l) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Q, uint16_t> && std::is_same_v<KV, uint16_t>)
    if (bf16_decode_supported(sh.head_dim))
      return attend_range_bf16(q, kc, vc, table, t0, t1, sh, acc, m, l);
#endif
#if KILN_DECODE_INT8_VALUES
  if constexpr (std::is_same_v<KV, int8_t>)
    if (int8_decode_supported(sh.head_dim))
      return attend_range_int8(q, kc, vc, table, t0, t1, sh, acc, m, l);
#endif
  const int64_t H = sh.heads, D = sh.head_dim, row_elems = sh.kv_heads * sh.head_stride;
  float qf[MAX_HEADS * 256];
  float s[MAX_HEADS * TILE];
  int64_t rows[2 * TILE];
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]);
#if defined(KILN_INT8_DOTS)
  QuantizedQuery qq;
  const bool by_int8 = std::is_same_v<KV, int8_t> && int8_dots(D);
  if (by_int8) quantize_query(qf, sh, qq);
#endif
  std::fill(m, m + H, NEG_INF);
  std::fill(l, l + H, 0.f);
  std::fill(acc, acc + H * D, 0.f);
  if (t0 < t1) tile_rows(table, t0, std::min(TILE, t1 - t0), sh.block_size, row_elems, rows);
  for (int64_t t = t0; t < t1; t += TILE) {
    const int64_t n = std::min(TILE, t1 - t);
    // the next tile's rows follow this one's, so the loops can ask for keys 8 ahead across tiles
    const int64_t n_next = t + TILE < t1 ? std::min(TILE, t1 - t - TILE) : 0;
    if (n_next) tile_rows(table, t + TILE, n_next, sh.block_size, row_elems, rows + n);
    bool scored = false;
#if defined(KILN_INT8_DOTS)
    if constexpr (std::is_same_v<KV, int8_t>)
      if (by_int8) score_tile_int8(qq, kc, vc, rows, n, sh, s), scored = true;
#endif
    if (!scored) score_tile(qf, kc, vc, rows, n, sh, s);
    for (int64_t i = 0; i < H; ++i) {
      float mx = m[i];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[i * TILE + j]);
      const float correction = std::exp(m[i] - mx);  // 0 on the first tile (m = -inf)
      l[i] = l[i] * correction + exp_sum(s + i * TILE, n, mx);
      m[i] = mx;
      if (correction != 1.f)
        for (int64_t k = 0; k < D; ++k) acc[i * D + k] *= correction;
    }
    add_tile(s, acc, kc, vc, rows, n, n + n_next, sh);
    std::copy(rows + n, rows + n + n_next, rows);
  }
}

// The ranges of request r merged into its output row.
template <typename T>
void merge_ranges(const float* work, int64_t splits, const Shape& sh, T* out) {
  const int64_t H = sh.heads, D = sh.head_dim, item = H * D + 2 * H;
  for (int64_t i = 0; i < H; ++i) {
    float mx = NEG_INF;
    for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, work[sp * item + H * D + i]);
    float o[256] = {0.f};
    float total = 0.f;
    for (int64_t sp = 0; sp < splits; ++sp) {
      const float* w = work + sp * item;
      if (w[H * D + i] == NEG_INF) continue;  // an empty range
      const float c = std::exp(w[H * D + i] - mx);
      total += w[H * D + H + i] * c;
      for (int64_t k = 0; k < D; ++k) o[k] += w[i * D + k] * c;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t k = 0; k < D; ++k) from_float(out + i * D + k, o[k] * inv);
  }
}

template <typename T, typename KV>
void decode(const T* q, const KV* kc, const KV* vc, const int32_t* tables, const int32_t* lens,
            T* out, float* work, int64_t rows, int64_t splits, const Shape& sh, int threads) {
  const int64_t H = sh.heads, D = sh.head_dim, item = H * D + 2 * H;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < rows * splits; ++it) {
    const int64_t r = it / splits, sp = it % splits, len = lens[r];
    const int64_t per = (len + splits - 1) / splits;
    const int64_t t0 = std::min(len, sp * per), t1 = std::min(len, t0 + per);
    float* w = work + it * item;
    attend_range(q + r * H * D, kc, vc, tables + r * sh.table_width, t0, t1, sh, w, w + H * D,
                 w + H * D + H);
  }
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) merge_ranges(work + r * splits * item, splits, sh, out + r * H * D);
}

// Rows x [n, heads, d] (float32 or bf16) quantized into an int8 cache at their slots: per head
// row d values round(x / scale), scale = max|x| / 127, then the scale's four bytes
// (quantize_row). One call per layer and K/V where the PyTorch ops took about ten.
template <typename T>
void write_int8(const T* x, const int64_t* slots, int64_t n, int64_t heads, int64_t d,
                int8_t* cache) {
  const int64_t stride = d + 4;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = x + (t * heads + h) * d;
      int8_t* dst = cache + (slots[t] * heads + h) * stride;
      const float scale = quantize_row(row, d, dst);
      std::memcpy(dst + d, &scale, 4);
    }
}

// Rows x [n, heads, d] (the model's dtype) copied into a float32 or bf16 cache at their slots,
// as torch's conversion rounds (to nearest even)
template <typename T, typename KV>
void write_rows(const T* x, const int64_t* slots, int64_t n, int64_t heads, int64_t d, KV* cache) {
  const int64_t width = heads * d;
  for (int64_t t = 0; t < n; ++t) {
    KV* dst = cache + slots[t] * width;
    if constexpr (std::is_same_v<T, KV>) {
      std::memcpy(dst, x + t * width, width * sizeof(T));
    } else {
      for (int64_t i = 0; i < width; ++i) from_float(dst + i, to_float(x[t * width + i]));
    }
  }
}

template <typename T, typename KV>
void write_any(const T* x, const int64_t* slots, int64_t n, int64_t heads, int64_t d, KV* cache) {
  if constexpr (std::is_same_v<KV, int8_t>)
    write_int8(x, slots, n, heads, d, cache);
  else
    write_rows(x, slots, n, heads, d, cache);
}

// A step's keys and values [n, heads, d] into the caches (kv_dtype 0 float32, 1 bf16, 2 int8)
template <typename T>
void write_step(int kv_dtype, const T* k, const T* v, const int64_t* slots, int64_t n,
                int64_t heads, int64_t d, void* k_cache, void* v_cache) {
  const auto both = [&](auto* typed_k, auto* typed_v) {
    write_any(k, slots, n, heads, d, typed_k);
    write_any(v, slots, n, heads, d, typed_v);
  };
  if (kv_dtype == 0)
    both(static_cast<float*>(k_cache), static_cast<float*>(v_cache));
  else if (kv_dtype == 2)
    both(static_cast<int8_t*>(k_cache), static_cast<int8_t*>(v_cache));
  else
    both(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache));
}

// Ranges each row's keys are cut into: enough work items for every thread (a few each, as rows
// differ in length), none shorter than about 512 keys
int64_t decode_splits(const int32_t* lens, int64_t rows, int threads) {
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, lens[r]);
  const int64_t by_length = (longest + 511) / 512, by_threads = (4 * threads + rows - 1) / rows;
  return std::max<int64_t>(1, std::min(by_length, by_threads));
}

}  // namespace

#include "prefill.h"

extern "C" {

// x [n, heads, head_dim] (dtype 0 float32, 1 bfloat16) into the int8 cache [slots, heads,
// head_dim + 4] at slots [n]
void kiln_write_int8(int dtype, const void* x, const int64_t* slots, int64_t n, int64_t heads,
                     int64_t head_dim, void* cache) {
  if (dtype == 0)
    write_int8(static_cast<const float*>(x), slots, n, heads, head_dim, static_cast<int8_t*>(cache));
  else
    write_int8(static_cast<const uint16_t*>(x), slots, n, heads, head_dim,
               static_cast<int8_t*>(cache));
}


// A step's keys and values k, v [n, heads, head_dim] (dtype 0 float32, 1 bfloat16) written into
// the caches at slots [n] (kv_dtype 0 float32, 1 bf16, 2 int8), converted or quantized as the
// PyTorch path writes them: a prefill chunk's rows, a memcpy each where index_copy_ took
// ~100 us a layer for a 512-token chunk
void kiln_write_kv(int dtype, int kv_dtype, const void* k, const void* v, const int64_t* slots,
                   int64_t n, int64_t heads, int64_t head_dim, void* k_cache, void* v_cache) {
  if (dtype == 0)
    write_step(kv_dtype, static_cast<const float*>(k), static_cast<const float*>(v), slots, n,
               heads, head_dim, k_cache, v_cache);
  else
    write_step(kv_dtype, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), slots,
               n, heads, head_dim, k_cache, v_cache);
}

// 1 where an int8 cache's keys of head_dim are scored by integer dot products, the query
// quantized per head to int8 (AVX512-VNNI builds, head_dim a multiple of 32), else 0
int kiln_paged_decode_int8_queries(int64_t head_dim) {
#if defined(KILN_INT8_DOTS)
  return int8_dots(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// 1 where prefill chunks of head_dim can go through the prefill kernel (vectorised builds,
// head_dim a multiple of 8 up to 256), else 0
int kiln_paged_prefill_supported(int64_t head_dim) {
#if defined(KILN_SIMD)
  return prefill_supports(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// Prefill chunks (prefill.h): request r's query tokens [starts[r], starts[r + 1]) of q and out
// [tokens, heads, head_dim] over the first lens[r] keys of its table (tables [reqs, width]),
// the chunk's own keys already in the cache. dtype (q and out): 0 float32, 1 bfloat16;
// kv_dtype (the caches): 0, 1 or 2 (int8 rows of head_dim values and a float32 scale). Only
// where kiln_paged_prefill_supported(head_dim).
void kiln_paged_prefill(int dtype, int kv_dtype, const void* q, const void* k_cache,
                        const void* v_cache, const int32_t* tables, const int32_t* starts,
                        const int32_t* lens, void* out, int64_t reqs, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t table_width, float scale, int threads) {
#if defined(KILN_SIMD)
  const int64_t stride = kv_dtype == 2 ? head_dim + 4 : head_dim;
  const PrefillShape sh{heads, kv_heads, head_dim, block_size, table_width, scale, stride};
  const auto run = [&](const auto* typed_q, auto* typed_out) {
    if (kv_dtype == 0)
      prefill(typed_q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
              tables, starts, lens, typed_out, reqs, sh, threads);
    else if (kv_dtype == 2)
      prefill(typed_q, static_cast<const int8_t*>(k_cache), static_cast<const int8_t*>(v_cache),
              tables, starts, lens, typed_out, reqs, sh, threads);
    else
      prefill(typed_q, static_cast<const uint16_t*>(k_cache),
              static_cast<const uint16_t*>(v_cache), tables, starts, lens, typed_out, reqs, sh,
              threads);
  };
  if (dtype == 0)
    run(static_cast<const float*>(q), static_cast<float*>(out));
  else
    run(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out));
#else
  (void)dtype, (void)kv_dtype, (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)starts;
  (void)lens, (void)out, (void)reqs, (void)heads, (void)kv_heads, (void)head_dim;
  (void)block_size, (void)table_width, (void)scale, (void)threads;
#endif
}

// 1 where bf16 prefill chunks of head_dim over a bf16 cache take AMX tile products (built with
// AMX, head_dim a multiple of 32, and Linux gave this process the tile registers), else 0
int kiln_paged_prefill_amx(int64_t head_dim) {
#if defined(KILN_PREFILL_AMX)
  return prefill_amx(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// 1 where bf16 decode rows of head_dim over a bf16 cache are scored by AVX512-BF16 pair products
// (decode_bf16.h's score_pair_products: a build without AMX, or -DKILN_DECODE_PAIR_SCORES=1),
// 0 where by float32 FMAs on widened rows or by the general path
int kiln_paged_decode_pair_scores(int64_t head_dim) {
#if defined(__AVX512F__) && KILN_DECODE_PAIR_SCORES
  return bf16_decode_supported(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// 1 where those rows add values by AVX512-BF16 pair products, weights rounded to bf16
// (decode_bf16.h's add_value_pairs: with pair scores, or -DKILN_DECODE_PAIR_VALUES=1), else 0
int kiln_paged_decode_pair_values(int64_t head_dim) {
#if defined(__AVX512F__) && KILN_DECODE_PAIR_VALUES
  return bf16_decode_supported(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// 1 where decode rows over an int8 cache of head_dim add values by integer products, the
// step's weights quantized to 8 bits (decode_int8.h: AVX512-VNNI and BW builds, head_dim a
// multiple of 64; -DKILN_DECODE_INT8_VALUES=0 turns it off), else 0
int kiln_paged_decode_int8_values(int64_t head_dim) {
#if KILN_DECODE_INT8_VALUES
  return int8_decode_supported(head_dim) ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// 3 when built with AVX512-BF16, 2 with AVX-512, 1 with AVX2 and FMA, 0 with portable loops
int kiln_paged_decode_isa() {
#if defined(__AVX512BF16__)
  return 3;
#elif defined(__AVX512F__)
  return 2;
#elif defined(KILN_SIMD)
  return 1;
#else
  return 0;
#endif
}

// q, out [rows, heads, head_dim]; caches [slots, kv_heads, head_dim]; tables [rows, width];
// lens [rows]; work: rows * splits * (heads * head_dim + 2 * heads) floats. dtype (q and out)
// and kv_dtype (the caches): 0 float32, 1 bfloat16; kv_dtype 2: int8 rows of head_dim values
// and a float32 scale. Requires heads <= 64 and head_dim <= 256 (checked by the caller).
void kiln_paged_decode(int dtype, int kv_dtype, const void* q, const void* k_cache,
                       const void* v_cache, const int32_t* tables, const int32_t* lens, void* out,
                       float* work, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t block_size, int64_t table_width, int64_t splits,
                       float scale, int threads) {
  const int64_t stride = kv_dtype == 2 ? head_dim + 4 : head_dim;
  const Shape sh{heads, kv_heads, head_dim, block_size, table_width, scale, stride};
  const auto run = [&](const auto* typed_q, auto* typed_out) {
    if (kv_dtype == 0)
      decode(typed_q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
             tables, lens, typed_out, work, rows, splits, sh, threads);
    else if (kv_dtype == 2)
      decode(typed_q, static_cast<const int8_t*>(k_cache), static_cast<const int8_t*>(v_cache),
             tables, lens, typed_out, work, rows, splits, sh, threads);
    else
      decode(typed_q, static_cast<const uint16_t*>(k_cache),
             static_cast<const uint16_t*>(v_cache), tables, lens, typed_out, work, rows, splits,
             sh, threads);
  };
  if (dtype == 0)
    run(static_cast<const float*>(q), static_cast<float*>(out));
  else
    run(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out));
}

// A step of decode rows only, in one call: each row's key and value (k, v [rows, kv_heads,
// head_dim], the model's dtype) written into the caches at slots [rows] (converted, or quantized
// for an int8 cache, as the PyTorch path writes them), then kiln_paged_decode over them, its
// ranges and work space chosen here. One call per layer where the Python side took about
// fifteen tensor operations.
void kiln_paged_decode_step(int dtype, int kv_dtype, const void* q, const void* k, const void* v,
                            const int64_t* slots, void* k_cache, void* v_cache,
                            const int32_t* tables, const int32_t* lens, void* out, int64_t rows,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t table_width, float scale, int threads) {
  if (rows == 0) return;
  if (dtype == 0)
    write_step(kv_dtype, static_cast<const float*>(k), static_cast<const float*>(v), slots, rows,
               kv_heads, head_dim, k_cache, v_cache);
  else
    write_step(kv_dtype, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), slots,
               rows, kv_heads, head_dim, k_cache, v_cache);
  const int64_t splits = decode_splits(lens, rows, threads);
  // grown once to the largest step and kept: a fresh buffer would be a fresh page every call
  thread_local std::vector<float> work;
  const size_t need = static_cast<size_t>(rows * splits * (heads * head_dim + 2 * heads));
  if (work.size() < need) work.resize(need);
  kiln_paged_decode(dtype, kv_dtype, q, k_cache, v_cache, tables, lens, out, work.data(), rows,
                    heads, kv_heads, head_dim, block_size, table_width, splits, scale, threads);
}
}
