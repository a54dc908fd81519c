// The AMX half of bf16_mm.cpp, included by it inside its namespace after the vector path's
// helpers it shares (Problem, Columns, store_row, store_gated): batches of rows on AMX tiles.
#pragma once

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

// A gated product's gate sums `gate` and up sums `up` (rows x 16 float32 each) combined into
// columns n0.. of out
void amx_store_gated(const Problem& p, const float* gate, const float* up, int64_t m0,
                     int64_t rows, int64_t n0) {
  const Columns cols = columns(p, n0);
  for (int64_t r = 0; r < rows; ++r)
    store_gated(p, cols, m0 + r, _mm512_load_ps(gate + r * 16), _mm512_load_ps(up + r * 16));
}

// Rows m0.. (one or two blocks of up to 16) by the weight vectors w0 and w1 over all of k, into
// tiles 0-3; w1 is w0 where the item has one vector. Tile numbers are instruction immediates,
// hence the unrolled blocks.
void amx_sums(const Problem& p, int64_t m0, int64_t rows, const uint16_t* w0, const uint16_t* w1) {
  const int64_t stride = p.k * 2;
  const uint16_t* x0 = p.x + m0 * p.k;
  const uint16_t* x1 = x0 + 16 * p.k;
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
}

// A gated product's output vector v0 for rows m0..: the gate's sums in tiles 0 and 2, the up
// projection's in 1 and 3
void amx_gated_item(const Problem& p, int64_t m0, int64_t rows, int64_t v0) {
  const int64_t pairs = p.k / 2;
  const uint16_t* w0 = p.packed + v0 * pairs * 32;
  amx_sums(p, m0, rows, w0, w0 + p.gate_vectors * pairs * 32);
  alignas(64) float gate[16 * 16], up[16 * 16];
  _tile_stored(0, gate, 64);
  _tile_stored(1, up, 64);
  amx_store_gated(p, gate, up, m0, rows > 16 ? 16 : rows, v0 * 16);
  if (rows > 16) {
    _tile_stored(2, gate, 64);
    _tile_stored(3, up, 64);
    amx_store_gated(p, gate, up, m0 + 16, rows - 16, v0 * 16);
  }
}

// Rows m0.. (two blocks of up to 16) by vectors v0, v0 + 1 over all of k
void amx_item(const Problem& p, int64_t m0, int64_t rows, int64_t v0, int64_t vectors) {
  if (p.gate_vectors) return amx_gated_item(p, m0, rows, v0);
  const int64_t pairs = p.k / 2;
  const uint16_t* w0 = p.packed + v0 * pairs * 32;
  amx_sums(p, m0, rows, w0, vectors > 1 ? w0 + pairs * 32 : w0);
  const bool two = rows > 16;
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
  // a gated item's two weight vectors are the gate's and up projection's for one output vector
  const int64_t per_item = p.gate_vectors ? 1 : AMX_VECTORS;
  const int64_t vectors = (p.n + 15) / 16, column_tiles = (vectors + per_item - 1) / per_item;
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
      const int64_t v0 = (item / row_tiles) * per_item, m0 = (item % row_tiles) * ROWS_PER_ITEM;
      const int64_t rows = p.m - m0 < ROWS_PER_ITEM ? p.m - m0 : ROWS_PER_ITEM;
      const int64_t vs = vectors - v0 < per_item ? vectors - v0 : per_item;
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
