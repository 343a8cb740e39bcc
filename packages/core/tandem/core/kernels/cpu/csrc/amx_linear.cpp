// out[M, N] = x[M, K] . W[N, K]^T in bfloat16 on AMX tiles, for decode-size M, reading the
// weight where oneDNN packed it.
//
// Why: at decode batch sizes a step streams every weight once, and oneDNN's AMX kernels at
// M = 48 read 16-18 GB/s of weight on a 2-core host whose memory gives ~28; this kernel keeps
// the weight stream one sequential read per thread (the packed layout is already in tile
// order), software-prefetched a block ahead: 19 GB/s on the same weights, and 1.7 ms less
// per decode step of the 111M-parameter bench model (benchmarks/attention_step.py).
// Prefill-size M stays with oneDNN, which reuses each weight tile over many rows better.
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
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if (defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)) || \
    defined(TANDEM_AMX_EMULATE)

#include "amx_tiles.h"
#include "vec_math.h"

namespace {

// Every tile 16 rows of 64 bytes: A (x) 16 rows x 32 bf16, B (weight) 16 k-pairs x 16 n x 2,
// C 16 x 16 float32. Short M tiles are zero-padded in the packed x instead of reconfigured.
inline void configure_tiles() {
  const tandem::amx::TileConfig cfg = tandem::amx::uniform_config(8, 16, 64);
  TANDEM_TILE_LOADCONFIG(&cfg);
}

constexpr int64_t kBlock = 1024;     // elements of one packed 32 x 32 block
constexpr int64_t kTile = 512;       // elements of one 16 x 32 x tile
constexpr int64_t kBStride = 128;    // bytes between the rows of a B tile within a block

// rows [0, valid) of a 16 x 16 float32 tile, rounded to bfloat16, into out (row stride ldo).
inline void store_rows(uint16_t* out, int64_t ldo, const float* c, int64_t valid) {
  for (int64_t m = 0; m < valid; ++m) {
#if defined(TANDEM_AMX_EMULATE)
    // VCVTNEPS2BF16's rounding: nearest even, denormal inputs read as zero.
    for (int n = 0; n < 16; ++n) {
      uint32_t bits;
      std::memcpy(&bits, c + m * 16 + n, 4);
      if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
      float v;
      std::memcpy(&v, &bits, 4);
      out[m * ldo + n] = tandem::float_to_bf16(v);
    }
#else
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(c + m * 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo), reinterpret_cast<const __m256i&>(b));
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

// Two x tiles against one 32-column unit over all of K: C0..C3. `fetch`: the first pass
// over the unit, which reads its weight from memory, a block ahead of the tiles (later passes
// find it in L2).
inline void pass_2x2(const uint16_t* xp, int64_t x_step, const uint16_t* w, int64_t steps,
                     uint16_t* out, int64_t ldo, int64_t rows_hi, bool fetch) {
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  TANDEM_TILE_ZERO(2);
  TANDEM_TILE_ZERO(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + s * kBlock;
    if (fetch) {
      const char* ahead = reinterpret_cast<const char*>(b + kBlock);
      for (int line = 0; line < 2 * kBlock; line += 64) __builtin_prefetch(ahead + line, 0, 3);
    }
    const uint16_t* a = xp + s * x_step;
    TANDEM_TILE_LOADD(6, b, kBStride);
    TANDEM_TILE_LOADD(7, b + 32, kBStride);
    TANDEM_TILE_LOADD(4, a, 64);
    TANDEM_TILE_LOADD(5, a + kTile, 64);
    TANDEM_TILE_DPBF16PS(0, 4, 6);
    TANDEM_TILE_DPBF16PS(1, 4, 7);
    TANDEM_TILE_DPBF16PS(2, 5, 6);
    TANDEM_TILE_DPBF16PS(3, 5, 7);
  }
  alignas(64) float c[256];
  TANDEM_TILE_STORED(0, c, 64);
  store_rows(out, ldo, c, 16);
  TANDEM_TILE_STORED(1, c, 64);
  store_rows(out + 16, ldo, c, 16);
  TANDEM_TILE_STORED(2, c, 64);
  store_rows(out + 16 * ldo, ldo, c, rows_hi);
  TANDEM_TILE_STORED(3, c, 64);
  store_rows(out + 16 * ldo + 16, ldo, c, rows_hi);
}

// One x tile against one unit: C0, C1; `fetch` as for pass_2x2.
inline void pass_1x2(const uint16_t* xp, int64_t x_step, const uint16_t* w, int64_t steps,
                     uint16_t* out, int64_t ldo, int64_t rows, bool fetch) {
  TANDEM_TILE_ZERO(0);
  TANDEM_TILE_ZERO(1);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + s * kBlock;
    if (fetch) {
      const char* ahead = reinterpret_cast<const char*>(b + kBlock);
      for (int line = 0; line < 2 * kBlock; line += 64) __builtin_prefetch(ahead + line, 0, 3);
    }
    TANDEM_TILE_LOADD(6, b, kBStride);
    TANDEM_TILE_LOADD(7, b + 32, kBStride);
    TANDEM_TILE_LOADD(4, xp + s * x_step, 64);
    TANDEM_TILE_DPBF16PS(0, 4, 6);
    TANDEM_TILE_DPBF16PS(1, 4, 7);
  }
  alignas(64) float c[256];
  TANDEM_TILE_STORED(0, c, 64);
  store_rows(out, ldo, c, rows);
  TANDEM_TILE_STORED(1, c, 64);
  store_rows(out + 16, ldo, c, rows);
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
  if (M < 1 || M > 64 || N % 32 != 0 || K % 32 != 0 || N <= 0 || K <= 0) return 1;
  const int64_t steps = K / 32;
  const int64_t x_tiles = (M + 15) / 16;
  const int64_t units = N / 32;
  const int64_t x_step = x_tiles * kTile;  // elements of packed x per K step
  // x in tile order, [K / 32][x_tiles][16 rows][32], zero rows past M: each A tile one
  // contiguous KiB that stays in L2 across the units.
  thread_local std::vector<uint16_t> packed_x;
  packed_x.resize(steps * x_step + 32);
  uint16_t* xp = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(packed_x.data()) + 63) & ~static_cast<uintptr_t>(63));
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  const uint16_t* wp = static_cast<const uint16_t*>(w);
  uint16_t* o = static_cast<uint16_t*>(out);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t m = 0; m < x_tiles * 16; ++m) {
        pack_row(xp + s * x_step + (m / 16) * kTile + (m % 16) * 32,
                 m < M ? xs + m * ldx + s * 32 : nullptr);
      }
    }
    configure_tiles();
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = units * id / team;
    const int64_t hi = units * (id + 1) / team;
    for (int64_t u = lo; u < hi; ++u) {
      const uint16_t* wu = wp + u * steps * kBlock;
      uint16_t* ou = o + u * 32;
      int64_t t = 0;
      for (; t + 2 <= x_tiles; t += 2) {
        const int64_t rows_hi = std::min<int64_t>(16, M - (t + 1) * 16);
        pass_2x2(xp + t * kTile, x_step, wu, steps, ou + t * 16 * ldo, ldo, rows_hi, t == 0);
      }
      if (t < x_tiles) {
        pass_1x2(xp + t * kTile, x_step, wu, steps, ou + t * 16 * ldo, ldo,
                 std::min<int64_t>(16, M - t * 16), t == 0);
      }
    }
    TANDEM_TILE_RELEASE();
  }
  return 0;
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
}  // extern "C"

#endif
