// out[M, N] = x[M, K] . W[N, K]^T in bfloat16 on AMX tiles, for decode-size M, reading the
// weight where oneDNN packed it.
//
// Why: at decode batch sizes a step streams every weight once, and oneDNN's AMX kernels at
// M = 48 read 16-18 GB/s of weight on a 2-core host whose memory gives ~28; this kernel keeps
// the weight stream one sequential read per thread (the packed layout is already in tile
// order), software-prefetched ahead of the tiles (a block ahead when this was measured; now
// kAhead, spread): 19 GB/s on the same weights, and 1.7 ms less per decode step of the
// 111M-parameter bench model (benchmarks/attention_step.py).
// Prefill-size M stays with oneDNN, which reuses each weight tile over many rows better.
//
// The routed experts of MoE models have a grouped form (tandem_amx_grouped_linear, and
// _silu with SiLU-and-mul in the epilogue): every expert's rows through its own weight in
// one call at any M, (expert, 32-column unit) pairs the items the threads share (and, for
// experts with many rows, (expert, 32 rows, chunk of units) ones; see kRowBlockRows), where
// oneDNN would run a GEMM per active expert with a dozen decode rows each. Measured on the
// bench MoE's experts (8 of 640, hidden 512, top 2), 12 layers from memory, ms a layer
// against that per-expert path: 0.80 / 2.00 at 48 tokens, 6.42 / 10.03 at 2048
// (benchmarks/moe_experts.py; benchmarks/results/2026-12-06-xeon-amx-row-blocks).
//
// The packed layout (what torch.ops.mkldnn._reorder_linear_weight gives for bfloat16 on AMX
// CPUs when N and K are multiples of 32): [N / 32][K / 32][16 k-pairs][32 n][2 k], i.e. per
// 32-column unit and 32-deep K step one 2 KiB block whose two 16-column halves are AMX B
// tiles (64-byte rows 128 bytes apart). oneDNN does not promise this layout, so the Python
// side checks each weight against oneDNN's own product before it hands the weight here.
//
// Rounding: products are exact in float32 and summed in float32 (in another order than
// oneDNN's), the result rounded to nearest-even bfloat16 as oneDNN rounds it.
//
// Plain C entry points; pointers with row strides (elements).
//
// TANDEM_AMX_EMULATE (a test-only define) builds the kernel on tiles emulated in software as
// Intel documents the instructions (amx_tiles.h), and its x packing and bfloat16 stores in
// plain C++, so any CPU runs and checks the kernel's walk of the layout.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if (defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)) || \
    defined(TANDEM_AMX_EMULATE)

#include "amx_tiles.h"
#include "expert_items.h"
#include "vec_math.h"

namespace {

// Every tile 16 rows of 64 bytes (TileScope below): A (x) 16 rows x 32 bf16, B (weight) 16
// k-pairs x 16 n x 2, C 16 x 16 float32. Short M tiles are zero-padded in the packed x
// instead of reconfigured.

constexpr int64_t kBlock = 1024;     // elements of one packed 32 x 32 block
constexpr int64_t kTile = 512;       // elements of one 16 x 32 x tile
constexpr int64_t kBStride = 128;    // bytes between the rows of a B tile within a block

// Rows [0, valid) of a unit's float32 sums (32 a row), rounded to bfloat16, into out (row
// stride ldo).
inline void store_rows(uint16_t* out, int64_t ldo, const float* c, int64_t valid) {
  for (int64_t m = 0; m < valid; ++m) {
#if defined(TANDEM_AMX_EMULATE)
    // VCVTNEPS2BF16's rounding: nearest even, denormal inputs read as zero.
    for (int n = 0; n < 32; ++n) {
      uint32_t bits;
      std::memcpy(&bits, c + m * 32 + n, 4);
      if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
      float v;
      std::memcpy(&v, &bits, 4);
      out[m * ldo + n] = tandem::float_to_bf16(v);
    }
#else
    // Columns 0-15 from the second operand, 16-31 from the first.
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + m * 32 + 16),
                                              _mm512_loadu_ps(c + m * 32));
    _mm512_storeu_si512(out + m * ldo, reinterpret_cast<const __m512i&>(both));
#endif
  }
}

// One 32-element row of x (64 bytes) into the packed x, or zeros where row is null.
inline void pack_row(uint16_t* dst, const uint16_t* row) {
#if defined(TANDEM_AMX_EMULATE)
  if (row != nullptr) {
    std::memcpy(dst, row, 64);
  } else {
    std::memset(dst, 0, 64);
  }
#else
  _mm512_store_si512(dst, row != nullptr ? _mm512_loadu_si512(row) : _mm512_setzero_si512());
#endif
}

// The float32 sums of a pass: c[row * 32 + column], the unit's 32 columns a row (the
// tiles stored 128 bytes a row), so the epilogue walks whole rows.
constexpr int64_t kSumRow = 32;
constexpr int64_t kSumStride = kSumRow * 4;  // bytes

// How far ahead of its tiles a streaming pass asks for the weight, in 2 KiB blocks, and how:
// each step asks for one block's 32 lines into L2, in four groups of eight between its tile
// instructions. On the AMX Xeon guest a step's arithmetic and its reads add up unless the reads are
// asked for along the way: the whole next block in one burst before the tiles (what this
// did first) left them in series. 60 weights of 10240 x 512 at 48 rows, ms each, two
// interleaved runs: 0.59-0.60 one block ahead in a burst, 0.52 four blocks ahead spread;
// at 16 rows, the memory rate either way.
constexpr int64_t kAhead = 4;

// The block kAhead steps past step s of a unit of `steps` blocks at w, on into the unit
// `after` (as many blocks); null where `after` is (the unit is in cache from an earlier
// pass: nothing to ask for).
// Near: the unit comes from L2 (a row-block item's units after its chunk's first block on
// this core), so the block after the current one is asked for, into L1, as before kAhead.
template <bool Near>
inline const char* block_ahead(const uint16_t* w, int64_t s, int64_t steps,
                               const uint16_t* after) {
  if (after == nullptr) return nullptr;
  // Never past `after`'s blocks, where K is only a few blocks deep.
  const int64_t ahead = Near ? 1 : kAhead;
  const int64_t i = s + (ahead < steps ? ahead : steps);
  if (i < steps) return reinterpret_cast<const char*>(w + i * kBlock);
  return reinterpret_cast<const char*>(after + (i - steps) * kBlock);
}

// Lines [8 * part, 8 * part + 8) of a 2 KiB block into L2 (Near: into L1), if there is a
// block. Fixed parts rather than vec_math.h's Ahead: its count of lines asked for, carried
// between the tile instructions, measured slower (the bench MoE's grouped gate/up at 2048
// tokens, 3 interleaved pairs: 3.70-3.74 ms a layer against 3.48-3.56).
template <bool Near>
inline void fetch_part(const char* block, int part) {
  if (block == nullptr) return;
  for (int line = 8 * part; line < 8 * part + 8; ++line) {
    __builtin_prefetch(block + 64 * line, 0, Near ? 3 : 1);
  }
}

// Where a pass finds its x tiles in the packed x: step s of the first x tile at
// xp + s * step, the second x tile `next` elements after the first.
struct XTiles {
  const uint16_t* xp;
  int64_t step;
  int64_t next;
};

// Two x tiles against one 32-column unit over all of K: four tiles of sums into c.
// `after`: where the weight stream goes once this unit is read (null: nowhere, the unit is
// in L2 from an earlier pass); each step then asks for the block kAhead ahead of its tiles.
template <bool Near>
inline void pass_2x2(XTiles x, const uint16_t* w, int64_t steps, const uint16_t* after,
                     float* c) {
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  TANDEM_TILE_ZERO(2);
  TANDEM_TILE_ZERO(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + s * kBlock;
    const char* ahead = block_ahead<Near>(w, s, steps, after);
    const uint16_t* a = x.xp + s * x.step;
    fetch_part<Near>(ahead, 0);
    TANDEM_TILE_LOADD(6, b, kBStride);
    TANDEM_TILE_LOADD(7, b + 32, kBStride);
    fetch_part<Near>(ahead, 1);
    TANDEM_TILE_LOADD(4, a, 64);
    TANDEM_TILE_LOADD(5, a + x.next, 64);
    TANDEM_TILE_DPBF16PS(0, 4, 6);
    fetch_part<Near>(ahead, 2);
    TANDEM_TILE_DPBF16PS(1, 4, 7);
    fetch_part<Near>(ahead, 3);
    TANDEM_TILE_DPBF16PS(2, 5, 6);
    TANDEM_TILE_DPBF16PS(3, 5, 7);
  }
  TANDEM_TILE_STORED(0, c, kSumStride);
  TANDEM_TILE_STORED(1, c + 16, kSumStride);
  TANDEM_TILE_STORED(2, c + 16 * kSumRow, kSumStride);
  TANDEM_TILE_STORED(3, c + 16 * kSumRow + 16, kSumStride);
}

// One x tile against one unit: two tiles of sums into c; `after` as for pass_2x2.
template <bool Near>
inline void pass_1x2(XTiles x, const uint16_t* w, int64_t steps, const uint16_t* after,
                     float* c) {
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + s * kBlock;
    const char* ahead = block_ahead<Near>(w, s, steps, after);
    fetch_part<Near>(ahead, 0);
    TANDEM_TILE_LOADD(6, b, kBStride);
    fetch_part<Near>(ahead, 1);
    TANDEM_TILE_LOADD(7, b + 32, kBStride);
    TANDEM_TILE_LOADD(4, x.xp + s * x.step, 64);
    fetch_part<Near>(ahead, 2);
    TANDEM_TILE_DPBF16PS(0, 4, 6);
    fetch_part<Near>(ahead, 3);
    TANDEM_TILE_DPBF16PS(1, 4, 7);
  }
  TANDEM_TILE_STORED(0, c, kSumStride);
  TANDEM_TILE_STORED(1, c + 16, kSumStride);
}

// Three x tiles against one unit: six tiles of sums into c (pass_2x2's layout, 48 rows), in
// one pass over the weight where two (2 x 2, then 1 x 2) read it from memory and again from
// L2. Eight tiles hold no more than the six sums, one x tile and one weight half, so each
// step loads five x tiles for its three (the last of one column half is the first of the
// next): seven loads and six products a step, as the two passes took. A decode step of 48
// rows (the bench model's 33 weights from memory, AMX Xeon guest, four interleaved runs):
// 13.6-15.1 -> 12.5-14.1 ms; one 1024 x 1024 weight in L2: 57.5 -> 53.1 us.
template <bool Near>
inline void pass_3x2(XTiles x, const uint16_t* w, int64_t steps, const uint16_t* after,
                     float* c) {
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  TANDEM_TILE_ZERO(2);
  TANDEM_TILE_ZERO(3);
  TANDEM_TILE_ZERO(4);
  TANDEM_TILE_ZERO(5);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + s * kBlock;
    const char* ahead = block_ahead<Near>(w, s, steps, after);
    const uint16_t* a = x.xp + s * x.step;
    fetch_part<Near>(ahead, 0);
    TANDEM_TILE_LOADD(7, b, kBStride);
    TANDEM_TILE_LOADD(6, a, 64);
    TANDEM_TILE_DPBF16PS(0, 6, 7);
    TANDEM_TILE_LOADD(6, a + x.next, 64);
    TANDEM_TILE_DPBF16PS(2, 6, 7);
    fetch_part<Near>(ahead, 1);
    TANDEM_TILE_LOADD(6, a + 2 * x.next, 64);
    TANDEM_TILE_DPBF16PS(4, 6, 7);
    TANDEM_TILE_LOADD(7, b + 32, kBStride);
    TANDEM_TILE_DPBF16PS(5, 6, 7);
    fetch_part<Near>(ahead, 2);
    TANDEM_TILE_LOADD(6, a + x.next, 64);
    TANDEM_TILE_DPBF16PS(3, 6, 7);
    fetch_part<Near>(ahead, 3);
    TANDEM_TILE_LOADD(6, a, 64);
    TANDEM_TILE_DPBF16PS(1, 6, 7);
  }
  TANDEM_TILE_STORED(0, c, kSumStride);
  TANDEM_TILE_STORED(1, c + 16, kSumStride);
  TANDEM_TILE_STORED(2, c + 16 * kSumRow, kSumStride);
  TANDEM_TILE_STORED(3, c + 16 * kSumRow + 16, kSumStride);
  TANDEM_TILE_STORED(4, c + 32 * kSumRow, kSumStride);
  TANDEM_TILE_STORED(5, c + 32 * kSumRow + 16, kSumStride);
}

// The sums of a unit's rows [0, rows) (at most 48: x's first tile and, past 16 and 32 rows,
// its second and third) into c (pass_2x2's layout), whichever pass the row count needs.
template <bool Near = false>
inline void unit_rows(XTiles x, const uint16_t* w, int64_t steps, int64_t rows,
                      const uint16_t* after, float* c) {
  if (rows > 32) {
    pass_3x2<Near>(x, w, steps, after, c);
  } else if (rows > 16) {
    pass_2x2<Near>(x, w, steps, after, c);
  } else {
    pass_1x2<Near>(x, w, steps, after, c);
  }
}

// The tiles of a thread for the life of one parallel region: 8 tiles of 16 rows x 64 bytes.
using TileScope = tandem::amx::TileScope;

// `n` elements of `buffer` from its first cache line boundary on (the tiles' aligned
// stores); the buffer, a thread's own, keeps the largest size asked of it.
template <typename T>
T* aligned_buffer(std::vector<T>& buffer, int64_t n) {
  buffer.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                              ~static_cast<uintptr_t>(63));
}

// x's rows in tile order for the grouped kernels: [tiles][K / 32][16 rows][32], each
// expert's rows from a tile of their own (base[e], zero rows up to the next expert's), so
// an x tile never holds two experts' rows. Tile-major (one x tile's K steps one contiguous
// run), where the dense kernel's few tiles are step-major: a prefill's hundreds of tiles
// step-major would put a tile's steps hundreds of KiB apart, on the same few L1 sets.
struct GroupedX {
  std::vector<int64_t> base;  // first tile of each expert; base[experts]: the tile count
  std::vector<int64_t> expert;  // the expert of each tile
  uint16_t* xp = nullptr;
};

inline void plan_grouped_x(const int64_t* offsets, int64_t experts, int64_t steps,
                           GroupedX& g) {
  g.base.assign(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    g.base[e + 1] = g.base[e] + (offsets[e + 1] - offsets[e] + 15) / 16;
  }
  g.expert.resize(g.base[experts]);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t t = g.base[e]; t < g.base[e + 1]; ++t) g.expert[t] = e;
  }
  thread_local std::vector<uint16_t> packed_x;
  g.xp = aligned_buffer(packed_x, g.base[experts] * steps * kTile);
}

// x tile t into the packed layout: its 16 rows (zeros past its expert's), every K step.
inline void pack_grouped_tile(const uint16_t* x, int64_t ldx, const int64_t* offsets,
                              const GroupedX& g, int64_t steps, int64_t t) {
  const int64_t e = g.expert[t];
  const int64_t r0 = offsets[e] + (t - g.base[e]) * 16;
  uint16_t* dst = g.xp + t * steps * kTile;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t m = 0; m < 16; ++m) {
      const int64_t row = r0 + m;
      pack_row(dst + s * kTile + m * 32, row < offsets[e + 1] ? x + row * ldx + s * 32 : nullptr);
    }
  }
}

// Rows of one fused gate/up block: the gate unit's passes over them, then the up unit's,
// each unit's weight (32 KiB at K = 512) staying in L1 across its passes where the two
// units alternating pass by pass would not fit together.
constexpr int64_t kSiluRows = 128;

// The plain product takes an expert with at least this many rows 32 rows at a time, its x
// tiles in L1 while its units stream past from L2, instead of unit by unit over all its
// rows: at prefill sizes a unit held in cache over every row made the x tiles the stream,
// two tiles from L2 a step. The bench MoE's down projection (512 rows an expert, 2
// cores): ~1.3 TF/s unit by unit, ~2.0 in row blocks (benchmarks/results/2026-12-06-xeon-
// amx-row-blocks). Below it, a decode step's few rows an expert read each unit once, from
// memory. The fused gate/up product stays unit by unit: in row blocks it measured no
// faster (its SiLU epilogue then runs per 32 x 32 block).
constexpr int64_t kRowBlockRows = 64;
// The most weight a row-block item walks (its chunk of the expert's units): the chunk
// stays in the L2 of each core that takes its row blocks, where a whole expert's weight
// (3 MiB for Qwen3-30B-A3B's 2048 x 768 down projection) would be read from memory again
// for every block.
constexpr int64_t kChunkBytes = 1024 * 1024;

// One work item of the grouped product: units [first, first + count) of an expert over up
// to 32 of its rows, from x tile `tile` on (tile >= 0); or unit `first` (fused: gate unit,
// with its up unit) over all its rows (tile < 0, count 1).
struct GroupedItem {
  int64_t expert;
  int64_t first;
  int64_t count;
  int64_t tile;
};

// The items of every expert with rows, in order (offsets already checked). An expert's
// units split into equal chunks of at most kChunkBytes, and the row-block items go chunk
// by chunk, each chunk's row blocks together, so a core's L2 takes a chunk from memory
// once for the blocks it claims.
inline void grouped_items(const int64_t* offsets, int64_t experts, int64_t per_expert,
                          int64_t unit_bytes, bool row_blocks, const GroupedX& g,
                          std::vector<GroupedItem>& items) {
  const int64_t most = std::max<int64_t>(1, kChunkBytes / unit_bytes);
  const int64_t chunks = (per_expert + most - 1) / most;
  const int64_t chunk = (per_expert + chunks - 1) / chunks;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    if (!row_blocks || rows < kRowBlockRows) {
      for (int64_t q = 0; q < per_expert; ++q) items.push_back({e, q, 1, -1});
      continue;
    }
    for (int64_t q = 0; q < per_expert; q += chunk) {
      const int64_t count = std::min(chunk, per_expert - q);
      for (int64_t t = g.base[e]; t < g.base[e + 1]; t += 2) items.push_back({e, q, count, t});
    }
  }
}

// The grouped product (SILU: the fused gate/up one): gate unit q and up unit units / 2 + q
// give output columns [32 q, 32 q + 32) of silu(gate) * up. A unit-wise item goes through
// its expert's rows in passes of up to 32 (two x tiles), the unit's weight read from memory
// in the first and from cache after it; a row-block item (plain product only) runs its up
// to 32 rows through each of its units in turn.
template <bool SILU>
int grouped(uint16_t* out, const uint16_t* x, const uint16_t* w, const int64_t* offsets,
            int64_t experts, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo,
            int32_t num_threads) {
  if (experts < 1 || N <= 0 || K <= 0 || K % 32 != 0 || N % (SILU ? 64 : 32) != 0) return 1;
  if (!tandem::offsets_in_order(offsets, experts, M)) return 1;
  const int64_t steps = K / 32;
  const int64_t units = N / 32;
  const int64_t per_expert = SILU ? units / 2 : units;  // (gate) units an expert
  GroupedX g;
  plan_grouped_x(offsets, experts, steps, g);
  std::vector<GroupedItem> items;
  const int64_t unit_bytes = steps * kBlock * static_cast<int64_t>(sizeof(uint16_t));
  grouped_items(offsets, experts, per_expert, unit_bytes, /*row_blocks=*/!SILU, g, items);
  const int64_t count = static_cast<int64_t>(items.size());
  const auto unit_of = [&](int64_t e, int64_t q, int64_t which) {
    return w + (e * units + q + which * (units / 2)) * steps * kBlock;
  };
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(threads)
  {
#pragma omp for
    for (int64_t t = 0; t < g.base[experts]; ++t) pack_grouped_tile(x, ldx, offsets, g, steps, t);
    [[maybe_unused]] const TileScope tiles;
    // Sums of up to kSiluRows rows of the gate unit and of the up unit (one pass's 32
    // rows unfused).
    thread_local std::vector<float> scratch;
    float* gate = aligned_buffer(scratch, 2 * kSiluRows * kSumRow);
    float* up = gate + kSiluRows * kSumRow;
    // Rows [r0, r0 + rows) of the expert, x tiles from t0, through unit q: passes of up to
    // 32 rows into the sums, then the epilogue. With `stream`, the first pass over each
    // unit asks for its blocks ahead of its tiles, and on into the unit read next (fused: the gate
    // unit's the up unit, the up unit's `after`); without, the unit is in cache already.
    const auto block = [&](int64_t e, int64_t q, int64_t t0, int64_t r0, int64_t rows,
                           bool stream, const uint16_t* after, bool near) {
      const auto passes = [&](int64_t which, const uint16_t* then, float* sums) {
        for (int64_t p = 0; p * 32 < rows; ++p) {
          const XTiles xt{g.xp + (t0 + 2 * p) * steps * kTile, kTile, steps * kTile};
          const int64_t part = std::min<int64_t>(32, rows - p * 32);
          const uint16_t* unit = unit_of(e, q, which);
          float* c = sums + p * 32 * kSumRow;
          if (near) {
            unit_rows<true>(xt, unit, steps, part, p == 0 ? then : nullptr, c);
          } else {
            unit_rows<false>(xt, unit, steps, part, p == 0 ? then : nullptr, c);
          }
        }
      };
      uint16_t* o = out + r0 * ldo + q * 32;
      if constexpr (SILU) {
        passes(0, stream ? unit_of(e, q, 1) : nullptr, gate);
        passes(1, stream ? after : nullptr, up);
        tandem::silu_rows(o, ldo, gate, up, rows, kSumRow);
      } else {
        passes(0, stream ? after : nullptr, gate);
        store_rows(o, ldo, gate, rows);
      }
    };
    // Up to 32 rows through each unit of the item's chunk in turn, each unit fetched into
    // L1 as it is read (from L2 after the chunk's first row block on this core), and on
    // into the one after it: the chunk's next unit, then `next`.
    const auto row_block_item = [&](const GroupedItem& it, const uint16_t* next) {
      const int64_t e = it.expert;
      const int64_t r0 = offsets[e] + (it.tile - g.base[e]) * 16;
      const int64_t rows = std::min<int64_t>(32, offsets[e + 1] - r0);
      const int64_t end = it.first + it.count;
      for (int64_t q = it.first; q < end; ++q) {
        const uint16_t* after = q + 1 < end ? unit_of(e, q + 1, 0) : next;
        block(e, q, it.tile, r0, rows, /*stream=*/true, after, /*near=*/true);
      }
    };
    // All the expert's rows through one unit, block by block; the first block streams the
    // unit from memory, on into `next`.
    const auto unit_item = [&](const GroupedItem& it, const uint16_t* next) {
      const int64_t e = it.expert;
      const int64_t block_tiles = SILU ? kSiluRows / 16 : 2;
      for (int64_t t0 = g.base[e]; t0 < g.base[e + 1]; t0 += block_tiles) {
        const int64_t r0 = offsets[e] + (t0 - g.base[e]) * 16;
        const int64_t rows = std::min<int64_t>(block_tiles * 16, offsets[e + 1] - r0);
        block(e, it.first, t0, r0, rows, /*stream=*/t0 == g.base[e], next, /*near=*/false);
      }
    };
    auto body = [&](int64_t i, int64_t following) {
      const GroupedItem* then = following < 0 ? nullptr : &items[following];
      const uint16_t* next = then == nullptr ? nullptr : unit_of(then->expert, then->first, 0);
      if (items[i].tile >= 0) {
        row_block_item(items[i], next);
      } else {
        unit_item(items[i], next);
      }
    };
    tandem::claim_items(counter, count, body);
  }
  return 0;
}

// The dense product at decode sizes (SILU: of a gate/up weight, gate rows then up rows, with
// SiLU-and-mul as the epilogue: out[m, q] = silu(x . gate_q) * (x . up_q), elementwise.cpp's
// silu_mul of the plain product to the bit). Output units are split evenly between the
// threads.
template <bool SILU>
int dense(uint16_t* o, const uint16_t* xs, const uint16_t* wp, int64_t M, int64_t N, int64_t K,
          int64_t ldx, int64_t ldo, int32_t num_threads) {
  if (M < 1 || M > 64 || N % (SILU ? 64 : 32) != 0 || K % 32 != 0 || N <= 0 || K <= 0) return 1;
  const int64_t steps = K / 32;
  const int64_t x_tiles = (M + 15) / 16;
  const int64_t units = N / 32;
  const int64_t outputs = SILU ? units / 2 : units;  // output units
  const int64_t x_step = x_tiles * kTile;  // elements of packed x per K step
  // x in tile order, [K / 32][x_tiles][16 rows][32], zero rows past M: each A tile one
  // contiguous KiB that stays in L2 across the units.
  thread_local std::vector<uint16_t> packed_x;
  uint16_t* xp = aligned_buffer(packed_x, steps * x_step);
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, outputs)));
  const auto unit = [&](int64_t u) { return wp + u * steps * kBlock; };
#pragma omp parallel num_threads(threads)
  {
#pragma omp for
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t m = 0; m < x_tiles * 16; ++m) {
        pack_row(xp + s * x_step + (m / 16) * kTile + (m % 16) * 32,
                 m < M ? xs + m * ldx + s * 32 : nullptr);
      }
    }
    [[maybe_unused]] const TileScope tiles;
    alignas(64) float sums[2][48 * kSumRow];
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = outputs * id / team;
    const int64_t hi = outputs * (id + 1) / team;
    // x tiles a pass: three tiles in one (pass_3x2), four in two of two.
    const int64_t pass_tiles = x_tiles == 3 ? 3 : 2;
    for (int64_t q = lo; q < hi; ++q) {
      for (int64_t t = 0; t < x_tiles; t += pass_tiles) {
        const int64_t rows = std::min<int64_t>(16 * pass_tiles, M - t * 16);
        const XTiles xt{xp + t * kTile, x_step, kTile};
        uint16_t* out = o + t * 16 * ldo + q * 32;
        // The first pass over a unit streams it from memory and on into the next one read.
        if constexpr (SILU) {
          const int64_t up = outputs + q;
          unit_rows(xt, unit(q), steps, rows, t == 0 ? unit(up) : nullptr, sums[0]);
          unit_rows(xt, unit(up), steps, rows, t == 0 ? unit(q + 1) : nullptr, sums[1]);
          tandem::silu_rows(out, ldo, sums[0], sums[1], rows, kSumRow);
        } else {
          unit_rows(xt, unit(q), steps, rows, t == 0 ? unit(q + 1) : nullptr, sums[0]);
          store_rows(out, ldo, sums[0], rows);
        }
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// The tile state is asked of Linux by the Python side before the kernel is used
// (native_build.amx_tiles_granted); tandem_amx_emulated() comes with amx_tiles.h.
int tandem_amx_built() { return 1; }

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) w[n, k], w packed as above.
// Returns 0, or 1 for shapes this kernel does not take (M outside 1..64, N or K not a
// multiple of 32).
int tandem_amx_linear(void* out, const void* x, const void* w, int64_t M, int64_t N, int64_t K,
                      int64_t ldx, int64_t ldo, int32_t num_threads) {
  return dense<false>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                      static_cast<const uint16_t*>(w), M, N, K, ldx, ldo, num_threads);
}

// out [M, N / 2] = silu(x . gate) * (x . up), w [N, K] packed as above, gate rows then up
// rows (N a multiple of 64). Returns 0, or 1 for shapes this kernel does not take.
int tandem_amx_linear_silu(void* out, const void* x, const void* w, int64_t M, int64_t N,
                           int64_t K, int64_t ldx, int64_t ldo, int32_t num_threads) {
  return dense<true>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                     static_cast<const uint16_t*>(w), M, N, K, ldx, ldo, num_threads);
}

// Routed experts, every expert in one call: rows [offsets[e], offsets[e + 1]) of x (sorted
// by expert) times expert e's weight [N, K], packed as above, the experts one after
// another. Returns 0, or 1 for offsets out of order or past M, N or K off the 32-blocks.
int tandem_amx_grouped_linear(void* out, const void* x, const void* w, const int64_t* offsets,
                              int64_t experts, int64_t M, int64_t N, int64_t K, int64_t ldx,
                              int64_t ldo, int32_t num_threads) {
  return grouped<false>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                        static_cast<const uint16_t*>(w), offsets, experts, M, N, K, ldx, ldo,
                        num_threads);
}

// The gate/up projection with SiLU-and-mul fused: each expert's weight [2 I, K] (gate rows,
// then up rows; I a multiple of 32), out [M, I] = silu(x . gate) * (x . up).
int tandem_amx_grouped_silu(void* out, const void* x, const void* w, const int64_t* offsets,
                            int64_t experts, int64_t M, int64_t N, int64_t K, int64_t ldx,
                            int64_t ldo, int32_t num_threads) {
  return grouped<true>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                       static_cast<const uint16_t*>(w), offsets, experts, M, N, K, ldx, ldo,
                       num_threads);
}

}  // extern "C"

#else  // no AMX in this build's target

extern "C" {
int tandem_amx_built() { return 0; }
int tandem_amx_emulated() { return 0; }
int tandem_amx_linear(void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t,
                      int64_t, int32_t) {
  return 1;
}
int tandem_amx_linear_silu(void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int32_t) {
  return 1;
}
int tandem_amx_grouped_linear(void*, const void*, const void*, const int64_t*, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int32_t) {
  return 1;
}
int tandem_amx_grouped_silu(void*, const void*, const void*, const int64_t*, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int32_t) {
  return 1;
}
}  // extern "C"

#endif
