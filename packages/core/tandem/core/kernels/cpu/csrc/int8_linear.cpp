// The int8 linear (W8A8) on CPU: activations quantized per token (or with a static scale),
// an exact int32 product with int8 weights packed once at load, and the dequantize, in one
// pass or as separate steps (row-parallel ranks sum their int32 products in between).
//
// Every step reproduces the torch reference (kernels/reference/int8_linear.py) bit for bit:
// the int32 sums are exact whatever their order; the quantize divides by the scale (no
// reciprocal), rounds half to even and saturates; the dequantize is ((acc * s) * ws) + b in
// float32, two roundings each (built with -ffp-contract=off so no FMA fuses them).
//
// Packed weight layout (made by int8_gemm.py): [Np/P][Kp/4][P][4] int8 — panels of P output
// columns; in each, for every group of 4 consecutive k, the 4 values of column 0, then
// column 1, ... So one 64-byte load gives 16 columns' 4 k each: the 32-bit lanes vpdpbusd
// multiplies against 4 activation bytes broadcast. P is 64 (four zmm of columns) except on
// the AVX2 and AVX-VNNI paths, whose 16 columns a pass fill their registers: a panel of 16
// is then one contiguous stream; and on AMX, 32: two B tiles, each 16 rows (64 k) of one
// 16-column half of the panel's 128-byte rows. Np, Kp: N, K padded with zero weights to
// multiples of P and 4 (of 64 on AMX: whole A tile rows). comp[n] = 128 * sum_k w[n, k].
//
// Code paths: AMX-INT8 (TANDEM_INT8_AMX, which the Python side defines where the CPU has
// AMX-INT8 and Linux grants the tile state: tdpbssd, signed x signed, no compensation);
// AVX512-VNNI (vpdpbusd takes unsigned x signed bytes: activations go in as
// q + 128 and comp is subtracted, exact in int32); AVX-VNNI (the same on ymm, for the CPUs
// with AVX-VNNI but no AVX-512: Alder/Raptor/Arrow Lake clients, Sierra Forest); AVX2
// (vpmaddubsw would saturate the int16 pair sums of u8 x s8, so weights and activations are
// sign-extended to int16 and multiplied with vpmaddwd, exact); plain loops elsewhere.
//
// TANDEM_INT8_YMM_VNNI (a test-only define) forces the AVX-VNNI path where the compiler has
// AVX512-VNNI + AVX512-VL instead: the same ymm vpdpbusd in its EVEX encoding (same
// semantics, same registers), so a machine without AVX-VNNI runs and checks that path.
// TANDEM_AMX_EMULATE (test-only too) builds the AMX path on tiles emulated in software as
// Intel documents the instructions (amx_tiles.h), so every machine runs and checks it.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_math.h"
#if defined(TANDEM_INT8_AMX) || defined(TANDEM_AMX_EMULATE)
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kGroup = 4;    // consecutive k of one 32-bit lane
constexpr int64_t kRowTask = 64; // rows of one parallel task at prefill sizes

#if defined(TANDEM_INT8_AMX) || defined(TANDEM_AMX_EMULATE)
#define TANDEM_INT8_PATH 4
#elif defined(TANDEM_INT8_YMM_VNNI)
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
#error "TANDEM_INT8_YMM_VNNI needs AVX512-VNNI with AVX512-VL, or AVX-VNNI"
#endif
#define TANDEM_INT8_PATH 3
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TANDEM_INT8_PATH 2
#elif defined(__AVXVNNI__)
#define TANDEM_INT8_PATH 3
#elif defined(__AVX2__)
#define TANDEM_INT8_PATH 1
#else
#define TANDEM_INT8_PATH 0
#endif

// Output columns of a panel: 16 where a pass over them fills the 16 ymm registers, 32 (two
// B tiles) on AMX.
constexpr int64_t kPanel = TANDEM_INT8_PATH == 1 || TANDEM_INT8_PATH == 3 ? 16
                           : TANDEM_INT8_PATH == 4                        ? 32
                                                                          : 64;
// K is padded to a multiple of this: one A tile row (64 k) on AMX, a group elsewhere.
constexpr int64_t kKAlign = TANDEM_INT8_PATH == 4 ? 64 : kGroup;
// Rows of zeros past the activations' last row: an AMX A tile reads 16 rows from any start.
constexpr int64_t kSlackRows = TANDEM_INT8_PATH == 4 ? 16 : 0;

struct Gemm {
  const int8_t* a;       // activations [M][Kp], q (or q + 128 on the VNNI paths), padded
  const int8_t* packed;  // [Np/kPanel][Kp/4][kPanel][4]
  const int32_t* comp;   // [Np]
  int64_t m, n, kp;
};

// panel_dots<MR>: the exact signed dots of rows [r0, r0 + MR) with the kPanel columns of
// panel p, into tile[MR][kPanel].
#if TANDEM_INT8_PATH == 2 || TANDEM_INT8_PATH == 3

// Named accumulators, one set per row (TANDEM_ROW_ACC / _ZERO / _DOTS / _STORE, per path
// below): GCC spills an array of vector accumulators to the stack on every step (an array
// in a loop is not promoted to registers).
#if TANDEM_INT8_PATH == 2

using Vec = __m512i;
inline Vec broadcast(int32_t lane) { return _mm512_set1_epi32(lane); }

// acc += u8 x s8 dots, in asm: GCC 12 copies the accumulator around each
// _mm512_dpbusd_epi32 (two extra moves a step) and spills the copies past 4 rows.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

#define TANDEM_ROW_ACC(r) __m512i c##r##0, c##r##1, c##r##2, c##r##3;
#define TANDEM_ROW_ZERO(r) \
  if constexpr (MR > r) c##r##0 = c##r##1 = c##r##2 = c##r##3 = _mm512_setzero_si512();
#define TANDEM_ROW_DOTS(r)   \
  dpbusd(c##r##0, av, w0);   \
  dpbusd(c##r##1, av, w1);   \
  dpbusd(c##r##2, av, w2);   \
  dpbusd(c##r##3, av, w3);
#define TANDEM_ROW_STORE(r)                                                        \
  if constexpr (MR > r) {                                                          \
    int32_t* t = tile + r * kPanel;                                                \
    _mm512_storeu_si512(t, _mm512_sub_epi32(c##r##0, k0));                         \
    _mm512_storeu_si512(t + 16, _mm512_sub_epi32(c##r##1, k1));                    \
    _mm512_storeu_si512(t + 32, _mm512_sub_epi32(c##r##2, k2));                    \
    _mm512_storeu_si512(t + 48, _mm512_sub_epi32(c##r##3, k3));                    \
  }
#define TANDEM_ROWS(op) op(0) op(1) op(2) op(3)
#define TANDEM_LOAD_WEIGHTS(wq)                                                      \
  const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 64);       \
  const __m512i w2 = _mm512_loadu_si512(wq + 128), w3 = _mm512_loadu_si512(wq + 192);
#define TANDEM_LOAD_COMP(comp)                                                          \
  const __m512i k0 = _mm512_loadu_si512(comp), k1 = _mm512_loadu_si512(comp + 16);     \
  const __m512i k2 = _mm512_loadu_si512(comp + 32), k3 = _mm512_loadu_si512(comp + 48);

// Four rows of four accumulators: measured on Zen 4 (one thread, CPU time, [2048, 1024]),
// 4 or 5 rows reach 390-430 GOP/s at M = 8 to 256, 6 rows 350-390 (torch._int_mm: 115-380).
constexpr int kRowBlock = 4;

#else  // TANDEM_INT8_PATH == 3

using Vec = __m256i;
inline Vec broadcast(int32_t lane) { return _mm256_set1_epi32(lane); }

// acc += u8 x s8 dots on ymm, in asm for the reason the zmm path gives. "x": ymm0-15 only,
// the registers the VEX form can name; the EVEX test build is held to them too, so its
// register allocation (and spills, if any) are the real build's.
inline void dpbusd(__m256i& acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
#else
  // GAS encodes the bare mnemonic as EVEX (AVX512-VNNI); {vex} asks for AVX-VNNI's form
  // (written %{ %} in asm: bare braces there delimit assembler dialects).
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
#endif
}

#define TANDEM_ROW_ACC(r) __m256i c##r##0, c##r##1;
#define TANDEM_ROW_ZERO(r) \
  if constexpr (MR > r) c##r##0 = c##r##1 = _mm256_setzero_si256();
#define TANDEM_ROW_DOTS(r) \
  dpbusd(c##r##0, av, w0); \
  dpbusd(c##r##1, av, w1);
#define TANDEM_ROW_STORE(r)                                                   \
  if constexpr (MR > r) {                                                     \
    __m256i* t = reinterpret_cast<__m256i*>(tile + r * kPanel);               \
    _mm256_storeu_si256(t, _mm256_sub_epi32(c##r##0, k0));                    \
    _mm256_storeu_si256(t + 1, _mm256_sub_epi32(c##r##1, k1));                \
  }
#define TANDEM_ROWS(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define TANDEM_LOAD_WEIGHTS(wq)                                                  \
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));   \
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32));
#define TANDEM_LOAD_COMP(comp)                                                    \
  const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp));  \
  const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + 8));

// The panel's 16 columns are two ymm of weights (8 columns x 4 k each); a row takes two
// accumulators and one broadcast, so 6 rows use 12 + 2 + 1 = 15 of the 16 ymm registers
// with no spill (7 would need 17; a 32-column panel, 4 weight registers, fits only 2 rows,
// 13 registers, and loads 3 vectors per 4 vpdpbusd against 8 per 12 here). The panel of
// 16 is also the AVX2 path's layout. Measured with the EVEX test build on Zen 4 (one
// thread, fused linear, interleaved): 6 rows 4-6% faster than 4 at M = 64 and 256, even at
// M = 8 (no AVX-VNNI CPU was at hand to time the VEX build). GCC 12 leaves ymm15 unused
// and round-trips the last accumulator through a spare register (two register moves a
// step, no memory; checked with objdump: the intrinsic spills every accumulator instead).
constexpr int kRowBlock = 6;

#endif

#define TANDEM_ROW_STEP(r)                            \
  if constexpr (MR > r) {                             \
    int32_t lane;                                     \
    std::memcpy(&lane, a + r * lda + q * kGroup, 4);  \
    const Vec av = broadcast(lane);                   \
    TANDEM_ROW_DOTS(r)                                \
  }

template <int MR>
void panel_dots(const Gemm& g, int64_t r0, int64_t p, int32_t* tile) {
  static_assert(MR >= 1 && MR <= kRowBlock, "the macros above name kRowBlock rows");
  const int64_t groups = g.kp / kGroup;
  const int8_t* w = g.packed + p * groups * kPanel * kGroup;
  const int8_t* a = g.a + r0 * g.kp;
  const int64_t lda = g.kp;
  TANDEM_ROWS(TANDEM_ROW_ACC)
  TANDEM_ROWS(TANDEM_ROW_ZERO)
  for (int64_t q = 0; q < groups; ++q) {
    const int8_t* wq = w + q * kPanel * kGroup;
    // No software prefetch: the panel is one sequential stream the hardware prefetcher
    // follows. Measured on Zen 4 (one thread, 256 MiB of [2048, 1024] weights, CPU time):
    // M = 1 at 15-16 GB/s without, 14-15 with prefetches 1 KiB ahead; M = 8 at 13 against 11.
    TANDEM_LOAD_WEIGHTS(wq)
    TANDEM_ROWS(TANDEM_ROW_STEP)
  }
  const int32_t* comp = g.comp + p * kPanel;
  TANDEM_LOAD_COMP(comp)
  TANDEM_ROWS(TANDEM_ROW_STORE)
}

#elif TANDEM_INT8_PATH == 1

// acc += the pair sums of a x w (int16 lanes), in asm: GCC 12 spills and copies the
// accumulators of the intrinsics here, as it does for vpdpbusd.
inline void madd_add(__m256i& acc, __m256i a, __m256i w) {
  __m256i t;
  asm("vpmaddwd %2, %1, %0" : "=&v"(t) : "v"(a), "v"(w));
  asm("vpaddd %1, %0, %0" : "+v"(acc) : "v"(t));
}

// The panel's 16 columns: a 4-column x 4-k slice widened to 16 int16 is one ymm; vpmaddwd
// against the activations' (k0 k1)(k2 k3) pairs gives each column's two half sums in
// adjacent lanes, added together at the end.
template <int MR>
void panel_dots(const Gemm& g, int64_t r0, int64_t p, int32_t* tile) {
  static_assert(kPanel == 16 && MR >= 1 && MR <= 2, "one pass covers the panel; 2 rows fit");
  const int64_t groups = g.kp / kGroup;
  const int8_t* w = g.packed + p * groups * kPanel * kGroup;
  const int8_t* a0 = g.a + r0 * g.kp;
  const int8_t* a1 = a0 + (MR > 1 ? g.kp : 0);
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00;
  __m256i c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  for (int64_t q = 0; q < groups; ++q) {
    const int8_t* wq = w + q * kPanel * kGroup;
    int32_t lane0, lane1;
    std::memcpy(&lane0, a0 + q * kGroup, sizeof(lane0));
    std::memcpy(&lane1, a1 + q * kGroup, sizeof(lane1));
    const __m256i v0 = _mm256_cvtepi8_epi16(_mm_set1_epi32(lane0));
    const __m256i v1 = _mm256_cvtepi8_epi16(_mm_set1_epi32(lane1));
    const __m128i* ws = reinterpret_cast<const __m128i*>(wq);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(ws));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(ws + 1));
    const __m256i w2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(ws + 2));
    const __m256i w3 = _mm256_cvtepi8_epi16(_mm_loadu_si128(ws + 3));
    madd_add(c00, v0, w0);
    madd_add(c01, v0, w1);
    madd_add(c02, v0, w2);
    madd_add(c03, v0, w3);
    if constexpr (MR > 1) {
      madd_add(c10, v1, w0);
      madd_add(c11, v1, w1);
      madd_add(c12, v1, w2);
      madd_add(c13, v1, w3);
    }
  }
  // Lanes (c, k01)(c, k23) per column; hadd pairs them within 128-bit halves:
  // [c0 c1 c4 c5 | c2 c3 c6 c7], put in order by the permute.
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  auto store = [&](int32_t* t, __m256i x0, __m256i x1, __m256i x2, __m256i x3) {
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(x0, x1), order);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(x2, x3), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 8), hi);
  };
  store(tile, c00, c01, c02, c03);
  if constexpr (MR > 1) store(tile + kPanel, c10, c11, c12, c13);
}

constexpr int kRowBlock = 2;

#elif TANDEM_INT8_PATH == 4

// AMX-INT8 (TDPBSSD: signed x signed bytes, so activations go in as they are and no
// compensation is subtracted). Tiles 4, 5: two A tiles of 16 rows x 64 k, read straight
// from the activations (row stride Kp); 6, 7: the panel's two 16-column B tiles, 16 groups
// of 4 k each, which the packed layout holds as 128-byte rows (the panel's 32 columns x 4
// k), so B tile j starts 64 j bytes in, stride 128; 0-3: the C tiles, 16 x 16 int32.
// A block of 32 rows and 32 columns does 4 TDPBSSD per 4 tile loads.
constexpr int kRowBlock = 32;
constexpr int64_t kTileK = 64;

// The tiles of a thread, configured when a parallel region of the GEMM starts and released
// when it ends (TileScope): oneDNN's AMX kernels run on these threads too, with
// configurations of their own, but never inside our regions.
template <bool TwoRowTiles>
void amx_block(const Gemm& g, int64_t r0, int64_t p, int32_t* tile) {
  const int64_t steps = g.kp / kTileK;
  const int8_t* w = g.packed + p * (g.kp / kGroup) * kPanel * kGroup;
  const int8_t* a = g.a + r0 * g.kp;
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  if constexpr (TwoRowTiles) {
    TANDEM_TILE_ZERO(2);
    TANDEM_TILE_ZERO(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* b = w + s * (kTileK / kGroup) * kPanel * kGroup;
    TANDEM_TILE_LOADD(6, b, kPanel * kGroup);
    TANDEM_TILE_LOADD(7, b + 16 * kGroup, kPanel * kGroup);
    TANDEM_TILE_LOADD(4, a + s * kTileK, g.kp);
    TANDEM_TILE_DPBSSD(0, 4, 6);
    TANDEM_TILE_DPBSSD(1, 4, 7);
    if constexpr (TwoRowTiles) {
      TANDEM_TILE_LOADD(5, a + 16 * g.kp + s * kTileK, g.kp);
      TANDEM_TILE_DPBSSD(2, 5, 6);
      TANDEM_TILE_DPBSSD(3, 5, 7);
    }
  }
  // tile[32][kPanel]: C tile (i, j) holds rows 16 i.., columns 16 j..
  constexpr int64_t ldt = kPanel * sizeof(int32_t);
  TANDEM_TILE_STORED(0, tile, ldt);
  TANDEM_TILE_STORED(1, tile + 16, ldt);
  if constexpr (TwoRowTiles) {
    TANDEM_TILE_STORED(2, tile + 16 * kPanel, ldt);
    TANDEM_TILE_STORED(3, tile + 16 * kPanel + 16, ldt);
  }
}

#else

template <int MR>
void panel_dots(const Gemm& g, int64_t r0, int64_t p, int32_t* tile) {
  const int64_t groups = g.kp / kGroup;
  const int8_t* w = g.packed + p * groups * kPanel * kGroup;
  for (int r = 0; r < MR; ++r) {
    int32_t* out = tile + r * kPanel;
    for (int64_t c = 0; c < kPanel; ++c) out[c] = 0;
    const int8_t* a = g.a + (r0 + r) * g.kp;
    for (int64_t q = 0; q < groups; ++q) {
      const int8_t* wq = w + q * kPanel * kGroup;
      for (int64_t c = 0; c < kPanel; ++c) {
        int32_t s = 0;
        for (int64_t j = 0; j < kGroup; ++j) s += int32_t(a[q * kGroup + j]) * wq[c * kGroup + j];
        out[c] += s;
      }
    }
  }
}

constexpr int kRowBlock = 4;

#endif

void block_dots(const Gemm& g, int64_t r0, int rows, int64_t p, int32_t* tile) {
#if TANDEM_INT8_PATH == 4
  // Rows past `rows` come out of the tiles too (zeros, or the next rows' dots); the
  // epilogue reads only the block's own.
  return rows > 16 ? amx_block<true>(g, r0, p, tile) : amx_block<false>(g, r0, p, tile);
#else
  switch (rows) {
#if TANDEM_INT8_PATH == 3
    case 6: return panel_dots<6>(g, r0, p, tile);
    case 5: return panel_dots<5>(g, r0, p, tile);
#endif
#if TANDEM_INT8_PATH != 1
    case 4: return panel_dots<4>(g, r0, p, tile);
    case 3: return panel_dots<3>(g, r0, p, tile);
#endif
    case 2: return panel_dots<2>(g, r0, p, tile);
    default: return panel_dots<1>(g, r0, p, tile);
  }
#endif
}

// Runs `epilogue(row, panel, tile, rows)` on each block of exact dots of rows [m0, m1) with
// panel p, in blocks of even size (with blocks of 4 rows, 7 rows: 4 3, 10 rows: 4 3 3, not
// 4 4 2): a short block pays the weight loads of a full one for fewer products. On AMX a
// block costs whole 16-row tiles, so blocks are full ones and the rest (48 rows: 32 16, not
// 24 24, which would load four A tiles instead of three).
template <typename Epilogue>
void row_task(const Gemm& g, int64_t m0, int64_t m1, int64_t p, Epilogue& epilogue) {
  alignas(64) int32_t tile[kRowBlock * kPanel];
  const int64_t blocks = (m1 - m0 + kRowBlock - 1) / kRowBlock;
  const int64_t base = (m1 - m0) / blocks, longer = (m1 - m0) % blocks;
  for (int64_t b = 0, r = m0; b < blocks; ++b) {
    const int rows = TANDEM_INT8_PATH == 4
                         ? static_cast<int>(std::min<int64_t>(kRowBlock, m1 - r))
                         : static_cast<int>(base + (b < longer ? 1 : 0));
    block_dots(g, r, rows, p, tile);
    epilogue(r, p, tile, rows);
    r += rows;
  }
}

// A thread's tiles for the life of one parallel region of a GEMM (AMX: 8 tiles of 16 rows x
// 64 bytes, released at the end); nothing on the other paths. Declared first thing inside
// each `omp parallel`.
#if TANDEM_INT8_PATH == 4
using TileScope = tandem::amx::TileScope;
#else
struct TileScope {};
#endif

// Runs `epilogue(row, panel, tile, rows)` on every block of exact dots, the blocks spread
// over the threads: by panel at decode sizes, by (row task, panel) at prefill sizes.
template <typename Epilogue>
void run_gemm(const Gemm& g, int threads, Epilogue epilogue) {
  const int64_t panels = (g.n + kPanel - 1) / kPanel;
  const int64_t row_tasks = (g.m + kRowTask - 1) / kRowTask;
  const int64_t tasks = panels * row_tasks;
#pragma omp parallel num_threads(threads)
  {
    [[maybe_unused]] const TileScope tiles;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t m0 = (t / panels) * kRowTask;
      row_task(g, m0, std::min(g.m, m0 + kRowTask), t % panels, epilogue);
    }
  }
}

// Activations as the kernels read them: [M][Kp], zero padded, + 128 on the VNNI paths.
inline int8_t as_kernel_byte(int8_t q) {
#if TANDEM_INT8_PATH == 2 || TANDEM_INT8_PATH == 3
  return static_cast<int8_t>(static_cast<uint8_t>(q) ^ 0x80u);
#else
  return q;
#endif
}

template <typename T>
inline float load_value(const T* p, int64_t i) {
  return tandem::to_float(p[i]);
}

inline void store_value(float* p, int64_t i, float v) { p[i] = v; }
inline void store_value(uint16_t* p, int64_t i, float v) { p[i] = tandem::float_to_bf16(v); }

// One row quantized as the reference does: s = absmax / 127 (1 where 0), or the static
// scale; q = clamp(round_half_even(x / s), -128, 127).
template <typename T>
float quantize_row(const T* x, int64_t k, const float* absmax, const float* fixed, int8_t* q) {
  float s;
  if (fixed != nullptr) {
    s = *fixed;
  } else if (absmax != nullptr) {
    s = *absmax / 127.0f;
  } else {
    float m = 0.0f;
    for (int64_t i = 0; i < k; ++i) m = std::max(m, std::fabs(load_value(x, i)));
    s = m / 127.0f;
  }
  if (fixed == nullptr && s == 0.0f) s = 1.0f;
  for (int64_t i = 0; i < k; ++i) {
    float v = std::nearbyint(load_value(x, i) / s);
    v = std::min(127.0f, std::max(-128.0f, v));
    q[i] = static_cast<int8_t>(v);
  }
  return s;
}

// out[r][c] = ((float(acc) * s_r) * ws_c) + b_c, in the output dtype.
template <typename T>
void dequantize_row(const int32_t* acc, float s, const float* ws, const float* bias, T* out,
                    int64_t n) {
  if (bias != nullptr) {
    for (int64_t c = 0; c < n; ++c)
      store_value(out, c, static_cast<float>(acc[c]) * s * ws[c] + bias[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) store_value(out, c, static_cast<float>(acc[c]) * s * ws[c]);
  }
}

// Rows [0, m) of x quantized as the kernels read them into a [m][kp] (zero padded, + 128 on
// the VNNI paths), each row's scale into scales: per token, or the static scale fixed_of(r)
// returns (null: per token).
template <typename T, typename FixedOf>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int64_t ldx, FixedOf fixed_of,
                   int8_t* a, float* scales, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int64_t r = 0; r < m; ++r) {
    int8_t* row = a + r * kp;
    scales[r] = quantize_row(x + r * ldx, k, nullptr, fixed_of(r), row);
    for (int64_t i = 0; i < k; ++i) row[i] = as_kernel_byte(row[i]);
  }
}

// The epilogue that dequantizes a block of dots into out, with the weight scales ws and bias
// (may be null) of the weight's columns.
template <typename T>
auto dequantize_into(T* out, int64_t ldo, int64_t n, const float* scales, const float* ws,
                     const float* bias) {
  return [=](int64_t r0, int64_t p, const int32_t* tile, int rows) {
    const int64_t c0 = p * kPanel;
    const int64_t cols = std::min(kPanel, n - c0);
    for (int r = 0; r < rows; ++r)
      dequantize_row(tile + r * kPanel, scales[r0 + r], ws + c0, bias ? bias + c0 : nullptr,
                     out + (r0 + r) * ldo + c0, cols);
  };
}

template <typename T>
void linear(T* out, const T* x, const Gemm& shape, const float* ws, const float* bias,
            const float* fixed, int64_t k, int64_t ldx, int64_t ldo, int threads) {
  std::vector<int8_t> a(static_cast<size_t>((shape.m + kSlackRows) * shape.kp),
                         as_kernel_byte(0));
  std::vector<float> scales(static_cast<size_t>(shape.m));
  quantize_rows(x, shape.m, k, shape.kp, ldx, [fixed](int64_t) { return fixed; }, a.data(),
                scales.data(), threads);
  Gemm g = shape;
  g.a = a.data();
  run_gemm(g, threads, dequantize_into(out, ldo, g.n, scales.data(), ws, bias));
}

// Every routed expert's rows through its own packed weight in one call (the grouped
// linear): rows [offsets[e], offsets[e + 1]) of x belong to expert e. Each row is quantized
// as the dense linear quantizes it (per token, or with its expert's static scale), and every
// (expert, row task, panel) triple is one work item the threads share, so a decode step's
// few rows per expert still keep every core busy.
template <typename T>
void grouped_linear(T* out, const T* x, const int8_t* packed, const int32_t* comp,
                    const float* ws, const float* fixed, const int64_t* offsets, int64_t experts,
                    int64_t m, int64_t n, int64_t k, int64_t kp, int64_t ldx, int64_t ldo,
                    int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t np = panels * kPanel;
  std::vector<int8_t> a(static_cast<size_t>((m + kSlackRows) * kp), as_kernel_byte(0));
  std::vector<float> scales(static_cast<size_t>(m));
  std::vector<int64_t> row_expert(static_cast<size_t>(m), 0);
  // (expert, first row, end row) of every row task; items are its tasks times the panels.
  std::vector<int64_t> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) row_expert[r] = e;
    for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += kRowTask) {
      tasks.insert(tasks.end(), {e, m0, std::min(offsets[e + 1], m0 + kRowTask)});
    }
  }
  const auto fixed_of = [&](int64_t r) { return fixed ? fixed + row_expert[r] : nullptr; };
  quantize_rows(x, m, k, kp, ldx, fixed_of, a.data(), scales.data(), threads);
  const int64_t items = static_cast<int64_t>(tasks.size() / 3) * panels;
#pragma omp parallel num_threads(threads)
  {
    [[maybe_unused]] const TileScope tiles;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < items; ++t) {
      const int64_t* task = tasks.data() + (t / panels) * 3;
      const int64_t e = task[0];
      const Gemm g{a.data(), packed + e * np * kp, comp + e * np, m, n, kp};
      auto epilogue = dequantize_into(out, ldo, n, scales.data(), ws + e * n, nullptr);
      row_task(g, task[1], task[2], t % panels, epilogue);
    }
  }
}

}  // namespace

extern "C" {

// 3: AVX-VNNI, 2: AVX512-VNNI, 1: AVX2, 0: plain loops.
int tandem_int8_path() { return TANDEM_INT8_PATH; }

// The output columns of a panel of the packed layout this build reads.
int tandem_int8_panel() { return static_cast<int>(kPanel); }

// The multiple of which the packed layout's K (Kp) must be.
int tandem_int8_k_align() { return static_cast<int>(kKAlign); }

#if TANDEM_INT8_PATH != 4
// No tiles in this build; the AMX builds export it with amx_tiles.h.
int tandem_amx_emulated() { return 0; }
#endif

// out int32 [M, N] (row stride ldo) = a int8 [M, K] (row stride lda) times the packed
// weight, exact.
int tandem_int8_matmul(int32_t* out, const int8_t* a, const int8_t* packed, const int32_t* comp,
                       int64_t m, int64_t n, int64_t k, int64_t kp, int64_t lda, int64_t ldo,
                       int32_t threads) {
  if (m < 0 || n <= 0 || k <= 0 || kp < k || kp % kKAlign || lda < k || ldo < n) return 1;
  std::vector<int8_t> buf(static_cast<size_t>((m + kSlackRows) * kp), as_kernel_byte(0));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) buf[r * kp + i] = as_kernel_byte(a[r * lda + i]);
  Gemm g{buf.data(), packed, comp, m, n, kp};
  run_gemm(g, threads, [&](int64_t r0, int64_t p, const int32_t* tile, int rows) {
    const int64_t c0 = p * kPanel;
    const int64_t cols = std::min(kPanel, n - c0);
    for (int r = 0; r < rows; ++r)
      std::copy(tile + r * kPanel, tile + r * kPanel + cols, out + (r0 + r) * ldo + c0);
  });
  return 0;
}

// out [M, N] in `dtype` = x [M, K] quantized (static scale `fixed`, or per token when null),
// times the packed weight, dequantized with the weight scales `ws` [N] (float32) and `bias`
// [N] (float32, may be null).
int tandem_int8_linear(void* out, const void* x, const int8_t* packed, const int32_t* comp,
                       const float* ws, const float* bias, const float* fixed, int64_t m,
                       int64_t n, int64_t k, int64_t kp, int64_t ldx, int64_t ldo, int32_t dtype,
                       int32_t threads) {
  if (m < 0 || n <= 0 || k <= 0 || kp < k || kp % kKAlign || ldx < k || ldo < n) return 1;
  Gemm g{nullptr, packed, comp, m, n, kp};
  if (dtype == tandem::kFloat32) {
    linear(static_cast<float*>(out), static_cast<const float*>(x), g, ws, bias, fixed, k, ldx,
           ldo, threads);
  } else if (dtype == tandem::kBFloat16) {
    linear(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), g, ws, bias, fixed, k,
           ldx, ldo, threads);
  } else {
    return 2;
  }
  return 0;
}

// The grouped linear (see grouped_linear above): out [M, N] in `dtype`, rows
// [offsets[e], offsets[e + 1]) of x [M, K] times expert e's packed weight (the experts'
// layouts back to back: packed [E][Np/P][Kp/4][P][4], comp [E][Np]), dequantized with its
// scales ws [E][N]; `fixed` [E]: each expert's static activation scale, or null (per
// token). Offsets out of order or past M are refused.
int tandem_int8_grouped_linear(void* out, const void* x, const int8_t* packed,
                               const int32_t* comp, const float* ws, const float* fixed,
                               const int64_t* offsets, int64_t experts, int64_t m, int64_t n,
                               int64_t k, int64_t kp, int64_t ldx, int64_t ldo, int32_t dtype,
                               int32_t threads) {
  if (experts <= 0 || m < 0 || n <= 0 || k <= 0 || kp < k || kp % kKAlign || ldx < k || ldo < n)
    return 1;
  if (offsets[0] != 0 || offsets[experts] != m) return 1;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] < offsets[e]) return 1;
  if (dtype == tandem::kFloat32) {
    grouped_linear(static_cast<float*>(out), static_cast<const float*>(x), packed, comp, ws,
                   fixed, offsets, experts, m, n, k, kp, ldx, ldo, threads);
  } else if (dtype == tandem::kBFloat16) {
    grouped_linear(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), packed, comp,
                   ws, fixed, offsets, experts, m, n, k, kp, ldx, ldo, threads);
  } else {
    return 2;
  }
  return 0;
}

// q int8 [M, K] and scale float32 [M] (one value where `fixed` is given) of x [M, K]:
// per token from each row (or from `absmax` [M], all ranks' columns), or the static scale.
int tandem_int8_quantize(int8_t* q, float* scale, const void* x, const float* absmax,
                         const float* fixed, int64_t m, int64_t k, int64_t ldx, int32_t dtype,
                         int32_t threads) {
  if (m < 0 || k <= 0 || ldx < k || (dtype != tandem::kFloat32 && dtype != tandem::kBFloat16))
    return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int64_t r = 0; r < m; ++r) {
    const float* row_max = absmax ? absmax + r : nullptr;
    int8_t* row = q + r * k;
    const float s =
        dtype == tandem::kFloat32
            ? quantize_row(static_cast<const float*>(x) + r * ldx, k, row_max, fixed, row)
            : quantize_row(static_cast<const uint16_t*>(x) + r * ldx, k, row_max, fixed, row);
    if (fixed == nullptr) scale[r] = s;
  }
  if (fixed != nullptr) scale[0] = *fixed;
  return 0;
}

// out [M, N] in `dtype` = ((float(acc) * scale) * ws) + bias; scale [M] per token, or one
// value when scale_step is 0.
int tandem_int8_dequantize(void* out, const int32_t* acc, const float* scale, int64_t scale_step,
                           const float* ws, const float* bias, int64_t m, int64_t n, int64_t ldacc,
                           int64_t ldo, int32_t dtype, int32_t threads) {
  if (m < 0 || n <= 0 || ldacc < n || ldo < n) return 1;
  if (dtype != tandem::kFloat32 && dtype != tandem::kBFloat16) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
  for (int64_t r = 0; r < m; ++r) {
    const float s = scale[r * scale_step];
    if (dtype == tandem::kFloat32)
      dequantize_row(acc + r * ldacc, s, ws, bias, static_cast<float*>(out) + r * ldo, n);
    else
      dequantize_row(acc + r * ldacc, s, ws, bias, static_cast<uint16_t*>(out) + r * ldo, n);
  }
  return 0;
}

}  // extern "C"
