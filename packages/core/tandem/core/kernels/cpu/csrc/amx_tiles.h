// The AMX tile operations the int8 and bfloat16 kernels use (LDTILECFG, TILELOADD,
// TILESTORED, TILEZERO, TDPBSSD, TDPBF16PS, TILERELEASE), as the hardware's instructions or,
// where a test build defines TANDEM_AMX_EMULATE, as software that follows Intel's documented
// semantics.
//
// Why an emulation: AMX exists only on Intel Xeon (Sapphire Rapids on), and the kernels
// that use it must not reach users untested. The emulated build runs the kernel's own code
// (tile shapes, strides, layouts, row blocks, the epilogue) on any CPU, so a wrong stride or
// a tile read past its rows fails a test here. What it cannot check is the hardware itself.
//
// The rules, transcribed from the Intel SDM (LDTILECFG, TILELOADD, TILESTORED, TILEZERO,
// TDPBSSD, TILERELEASE) and the intrinsics guide, not from this kernel's needs:
// - LDTILECFG reads 64 bytes: byte 0 palette, byte 1 start_row, 2-15 reserved (zero),
//   16 + 2t tile t's bytes per row (colsb, uint16), 32-47 reserved, 48 + t tile t's rows,
//   56-63 reserved. Palette 0 is the INIT state (tiles unconfigured); the only other legal
//   palette is 1: 8 tiles of at most 16 rows x 64 bytes. A tile's rows and colsb are both
//   zero (unused) or both set. Anything else is a #GP.
// - Every other tile instruction is a #UD while the tiles are not configured (INIT).
// - TILELOADD / TILESTORED move `rows` rows of `colsb` bytes, row r at base + r * stride;
//   a load zeroes the rest of each row and the rows past `rows`.
// - TDPBSSD(c, a, b): for m < c.rows, k < a.colsb / 4, n < c.colsb / 4,
//   c.dword[m][n] += sum_i sx(a.byte[m][4k + i]) * sx(b.byte[k][4n + i]), i < 4, each
//   addition in 32-bit two's complement (it wraps). #UD unless c.rows == a.rows,
//   c.colsb == b.colsb and a.colsb / 4 == b.rows (and the tiles are configured).
// - TDPBF16PS(c, a, b): the same shapes and checks, on pairs of bfloat16. Per row m, two
//   float32 sums per column n start at zero: over k in order, even += fp32(a.bf16[m][2k]) *
//   fp32(b.bf16[k][2n]) and odd += the same of elements 2k + 1 and 2n + 1 (fused
//   multiply-adds); then c.fp32[m][n] += (even + odd). Every operation rounds to nearest
//   even with denormal inputs read as zero and denormal results written as zero (DAZ, FTZ:
//   the instruction ignores MXCSR). Products of two bfloat16 are exact in float32, so each
//   fused multiply-add rounds only its sum.
// - TILERELEASE returns the tiles to INIT.
// A fault here prints what the hardware would have raised and aborts, as the instruction's
// exception would end the process.
//
// Linux grants the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it
// the first tile instruction kills the process. The Python side asks before it uses a real
// build (native_build.amx_tiles_granted).
//
// Every library that includes this header exports tandem_amx_emulated() (1 in a test build)
// and, in a test build, one probe per dot product for the emulation's own tests and
// tandem_amx_emulated_dot_products() (how many its kernels have run).

#pragma once

#include <cstdint>
#include <cstring>

namespace tandem::amx {

// The 64-byte LDTILECFG operand.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved0[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Palette 1 with tiles [0, tiles) of `rows` x `colsb`, the others unused.
inline TileConfig uniform_config(int tiles, int rows, int colsb) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < tiles; ++t) {
    cfg.colsb[t] = static_cast<uint16_t>(colsb);
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  return cfg;
}

}  // namespace tandem::amx

#if defined(TANDEM_AMX_EMULATE)

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace tandem::amx::emulated {

constexpr int kTiles = 8, kMaxRows = 16, kMaxColsb = 64;

struct Tile {
  int rows = 0, colsb = 0;
  uint8_t data[kMaxRows][kMaxColsb];
};

struct State {
  bool configured = false;
  Tile tiles[kTiles];
};

// The tile registers are per thread, as the hardware's are.
inline State& state() {
  thread_local State s;
  return s;
}

[[noreturn]] inline void fault(const char* exception, const char* why) {
  std::fprintf(stderr, "emulated AMX: %s: %s\n", exception, why);
  std::fflush(stderr);
  std::abort();
}

inline Tile& tile(int t) {
  State& s = state();
  if (!s.configured) fault("#UD", "a tile instruction while the tiles are not configured");
  if (t < 0 || t >= kTiles) fault("#UD", "no such tile register");
  return s.tiles[t];
}

inline void load_config(const void* memory) {
  uint8_t raw[64];
  std::memcpy(raw, memory, 64);
  State& s = state();
  if (raw[0] == 0) {
    s = State{};
    return;
  }
  if (raw[0] != 1) fault("#GP", "palette other than 0 or 1");
  for (int i = 2; i < 16; ++i)
    if (raw[i] != 0) fault("#GP", "reserved bytes 2-15 not zero");
  for (int i = 32; i < 48; ++i)
    if (raw[i] != 0) fault("#GP", "tiles past palette 1's 8 (or bytes 32-47) set");
  for (int i = 56; i < 64; ++i)
    if (raw[i] != 0) fault("#GP", "tiles past palette 1's 8 (or bytes 56-63) set");
  // A non-zero start_row restarts an interrupted load midway; no kernel here sets it, and
  // the emulation does not model it.
  if (raw[1] != 0) fault("unsupported", "start_row not zero (a restarted load)");
  for (int t = 0; t < kTiles; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, raw + 16 + 2 * t, 2);
    const int rows = raw[48 + t];
    if (rows > kMaxRows || colsb > kMaxColsb) fault("#GP", "a tile larger than 16 x 64 bytes");
    if ((rows == 0) != (colsb == 0)) fault("#GP", "a tile with rows but no columns, or back");
    s.tiles[t].rows = rows;
    s.tiles[t].colsb = colsb;
    // The data a configuration leaves is not relied on: poison it, so a kernel that reads a
    // tile it never wrote fails here.
    std::memset(s.tiles[t].data, 0xA5, sizeof(s.tiles[t].data));
  }
  s.configured = true;
}

inline void zero_rest(Tile& d, int from_row) {
  for (int r = 0; r < kMaxRows; ++r) {
    const int keep = r < from_row ? d.colsb : 0;
    std::memset(d.data[r] + keep, 0, kMaxColsb - keep);
  }
}

inline void load(int t, const void* base, int64_t stride) {
  Tile& d = tile(t);
  const auto* p = static_cast<const uint8_t*>(base);
  for (int r = 0; r < d.rows; ++r) std::memcpy(d.data[r], p + r * stride, d.colsb);
  zero_rest(d, d.rows);
}

inline void store(int t, void* base, int64_t stride) {
  Tile& d = tile(t);
  auto* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < d.rows; ++r) std::memcpy(p + r * stride, d.data[r], d.colsb);
}

inline void zero(int t) {
  Tile& d = tile(t);
  std::memset(d.data, 0, sizeof(d.data));
}

// Dot-product instructions run on emulated tiles, all threads together (an inline
// function's static: the emulated libraries of one process may share it): what a test
// reads, before and after a call, to know that a kernel took its tile path at all.
inline std::atomic<int64_t>& dot_products() {
  static std::atomic<int64_t> count{0};
  return count;
}

inline void check_shapes(const Tile& dst, const Tile& x, const Tile& y, const char* what) {
  dot_products().fetch_add(1, std::memory_order_relaxed);
  if (dst.rows != x.rows || dst.colsb != y.colsb || x.colsb / 4 != y.rows) fault("#UD", what);
}

inline void dpbssd(int c, int a, int b) {
  Tile& dst = tile(c);
  const Tile& x = tile(a);
  const Tile& y = tile(b);
  check_shapes(dst, x, y, "TDPBSSD's tile shapes do not match");
  for (int m = 0; m < dst.rows; ++m) {
    for (int n = 0; n < dst.colsb / 4; ++n) {
      uint32_t acc;
      std::memcpy(&acc, dst.data[m] + 4 * n, 4);
      for (int k = 0; k < x.colsb / 4; ++k) {
        for (int i = 0; i < 4; ++i) {
          const int32_t p = static_cast<int32_t>(static_cast<int8_t>(x.data[m][4 * k + i])) *
                            static_cast<int32_t>(static_cast<int8_t>(y.data[k][4 * n + i]));
          acc += static_cast<uint32_t>(p);  // two's complement: wraps
        }
      }
      std::memcpy(dst.data[m] + 4 * n, &acc, 4);
    }
  }
  zero_rest(dst, dst.rows);
}

// A float32 whose denormals (and a bfloat16 widened to one) read as signed zero.
inline float flushed(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

inline float bf16_at(const uint8_t* row, int i) {
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return flushed(v);
}

inline void dpbf16ps(int c, int a, int b) {
  Tile& dst = tile(c);
  const Tile& x = tile(a);
  const Tile& y = tile(b);
  check_shapes(dst, x, y, "TDPBF16PS's tile shapes do not match");
  for (int m = 0; m < dst.rows; ++m) {
    for (int n = 0; n < dst.colsb / 4; ++n) {
      float even = 0.0f, odd = 0.0f;
      for (int k = 0; k < x.colsb / 4; ++k) {
        even = flushed(even + bf16_at(x.data[m], 2 * k) * bf16_at(y.data[k], 2 * n));
        odd = flushed(odd + bf16_at(x.data[m], 2 * k + 1) * bf16_at(y.data[k], 2 * n + 1));
      }
      float acc;
      std::memcpy(&acc, dst.data[m] + 4 * n, 4);
      acc = flushed(flushed(acc) + flushed(even + odd));
      std::memcpy(dst.data[m] + 4 * n, &acc, 4);
    }
  }
  zero_rest(dst, dst.rows);
}

inline void release() { state() = State{}; }

// One dot-product instruction `dp` on tiles 0 (c: `rows` x `c_colsb`), 1 (a: `rows` x
// `a_colsb`) and 2 (b: `b_rows` x `c_colsb`), each loaded from rows packed back to back, c
// stored back; `whole` (if not null) receives all 16 x 64 bytes of tile 0 afterwards, the
// rows and columns past its shape included. What the emulation's own tests call.
inline void probe(void (*dp)(int, int, int), void* c, const void* a, const void* b, int rows,
                  int a_colsb, int c_colsb, int b_rows, void* whole) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  cfg.rows[0] = static_cast<uint8_t>(rows);
  cfg.colsb[0] = static_cast<uint16_t>(c_colsb);
  cfg.rows[1] = static_cast<uint8_t>(rows);
  cfg.colsb[1] = static_cast<uint16_t>(a_colsb);
  cfg.rows[2] = static_cast<uint8_t>(b_rows);
  cfg.colsb[2] = static_cast<uint16_t>(c_colsb);
  load_config(&cfg);
  load(0, c, c_colsb);
  load(1, a, a_colsb);
  load(2, b, c_colsb);
  dp(0, 1, 2);
  store(0, c, c_colsb);
  if (whole != nullptr) std::memcpy(whole, state().tiles[0].data, sizeof(Tile::data));
  release();
}

}  // namespace tandem::amx::emulated

#define TANDEM_TILE_LOADCONFIG(cfg) ::tandem::amx::emulated::load_config(cfg)
#define TANDEM_TILE_LOADD(t, base, stride) ::tandem::amx::emulated::load(t, base, stride)
#define TANDEM_TILE_STORED(t, base, stride) ::tandem::amx::emulated::store(t, base, stride)
#define TANDEM_TILE_ZERO(t) ::tandem::amx::emulated::zero(t)
#define TANDEM_TILE_DPBSSD(c, a, b) ::tandem::amx::emulated::dpbssd(c, a, b)
#define TANDEM_TILE_DPBF16PS(c, a, b) ::tandem::amx::emulated::dpbf16ps(c, a, b)
#define TANDEM_TILE_RELEASE() ::tandem::amx::emulated::release()

extern "C" {

int tandem_amx_emulated() { return 1; }

// One TDPBSSD (int8 c += a . b) and one TDPBF16PS (float32 c += bfloat16 pairs a . b) of the
// emulation, through probe() above.
int tandem_amx_emulated_dpbssd(int32_t* c, const int8_t* a, const int8_t* b, int32_t rows,
                               int32_t a_colsb, int32_t c_colsb, int32_t b_rows, uint8_t* whole) {
  tandem::amx::emulated::probe(tandem::amx::emulated::dpbssd, c, a, b, rows, a_colsb, c_colsb,
                               b_rows, whole);
  return 0;
}

int tandem_amx_emulated_dpbf16ps(float* c, const uint16_t* a, const uint16_t* b, int32_t rows,
                                 int32_t a_colsb, int32_t c_colsb, int32_t b_rows) {
  tandem::amx::emulated::probe(tandem::amx::emulated::dpbf16ps, c, a, b, rows, a_colsb,
                               c_colsb, b_rows, nullptr);
  return 0;
}

int64_t tandem_amx_emulated_dot_products() {
  return tandem::amx::emulated::dot_products().load();
}

}  // extern "C"

#else

#include <immintrin.h>

#if !defined(__AMX_TILE__)
#error "amx_tiles.h needs AMX-TILE (or TANDEM_AMX_EMULATE)"
#endif

// The intrinsics take the tile numbers as constants, hence macros; each dot product only
// where the build targets its extension (a kernel naming one it lacks fails to compile).
// The same for the 64-byte configuration (a temporary a kernel builds just before).
#define TANDEM_TILE_LOADCONFIG(cfg)    \
  do {                                 \
    __asm__ volatile("" ::: "memory"); \
    _tile_loadconfig(cfg);             \
  } while (0)
// GCC's _tile_loadd names its base as a plain register operand, with no memory input or
// clobber, so nothing would keep the stores that fill a buffer (a packed x, packed queries)
// before the tile load that reads it: the empty asm is that ordering.
#define TANDEM_TILE_LOADD(t, base, stride) \
  do {                                     \
    __asm__ volatile("" ::: "memory");     \
    _tile_loadd(t, base, stride);          \
  } while (0)
#define TANDEM_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define TANDEM_TILE_ZERO(t) _tile_zero(t)
#define TANDEM_TILE_RELEASE() _tile_release()
#if defined(__AMX_INT8__)
#define TANDEM_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif
#if defined(__AMX_BF16__)
#define TANDEM_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

extern "C" int tandem_amx_emulated() { return 0; }

#endif

namespace tandem::amx {

// A thread's tiles configured as `cfg` for the life of a scope (a parallel region: declared
// first thing inside each `omp parallel`) and released at its end. oneDNN's AMX kernels run
// on the same threads with configurations of their own, but never inside our regions.
class TileScope {
 public:
  // The linear kernels' tiles: all 8 of 16 rows x 64 bytes.
  TileScope() : TileScope(uniform_config(8, 16, 64)) {}
  explicit TileScope(const TileConfig& cfg) { TANDEM_TILE_LOADCONFIG(&cfg); }
  ~TileScope() { TANDEM_TILE_RELEASE(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace tandem::amx
