// The grouped 4-bit linear of routed experts (W4A16: GPTQ, AWQ): expert e's rows of x,
// [offsets[e], offsets[e + 1]) (sorted by expert), times expert e's weight, every expert in
// one call. Part of int4_linear.cpp (included at its end: it runs that file's tiles and
// panels), kept apart as the expert side of it.
//
// Why: the per-expert path made one dense call per active expert and projection, each
// waking the threads over a few rows of one expert, after reading the offsets on the host
// (a sync); a decode step's experts have a handful of rows each, so the cores mostly waited
// on dispatch. Here the offsets are read where they lie, every (expert, panel of output
// rows) pair with rows is a work item the threads share (expert_items.h), and each thread
// claims its next item before it computes the current one (claim_ahead), prefetching that
// item's codes into L2 a share at a time as it goes, so its weight stream does not stop
// between items.
//
// Each item runs the dense kernel's own code over the expert's rows (f32_tile, bf16_panel),
// chosen by the expert's row count as the dense call chooses by its batch: the same
// weights, bit for bit, and the same sums in the same order as a dense call on that
// expert's rows at that batch, whatever its row count (the dense Python side hands batches
// past kernel_rows to dequantize-then-GEMM instead; ``grouped_linear`` in int4_linear.py
// sends batches averaging that many rows an expert, prefill, to the per-expert calls).

#pragma once

#include <cstdlib>
#include <memory>
#include <type_traits>

#include "expert_items.h"

namespace tandem {
namespace {

// Output rows of a float32 item: whole tiles, enough codes (K / 2 bytes a row) for the
// prefetch of the next item to run beside a few tiles of compute.
constexpr int64_t kGroupedTiles = 8;

// A buffer of at least n elements on a 64-byte boundary: the rows the kernels read a vector
// at a time (64 bytes on AVX-512) then never straddle two cache lines. Measured (one
// thread, 512 rows of one expert, N = 1280, K = 512, bfloat16): 99 GFLOP/s from a plain
// vector against 128 aligned; the dense call's buffers land either way from run to run.
template <class T>
class Aligned {
 public:
  T* fit(size_t n) {
    if (n > size_) {
      const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
      memory_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
      size_ = n;
    }
    return memory_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> memory_;
  size_t size_ = 0;
};

// Expert e's layer: the experts' codes, scales and zero points lie back to back.
inline Layer expert_layer(const Layer& L, int64_t e) {
  Layer out = L;
  const int64_t entries = L.n * L.groups;
  const int64_t scale_bytes = L.dtype == kFloat32 ? 4 : 2;
  out.codes = L.codes + e * L.n * L.words;
  out.scales = static_cast<const char*>(L.scales) + e * entries * scale_bytes;
  out.zeros = L.zeros + e * entries;
  return out;
}

// The rows of every expert through its weight (tandem_int4_grouped_linear's arguments, the
// layer L that of expert 0); `Dot`: bfloat16 on the AVX512-BF16 dot products.
template <bool Dot>
int grouped_linear(const Layer& L, void* y, const void* x, const int64_t* offsets,
                   int64_t experts, int64_t m, int64_t ldx, int64_t ldy, int threads) {
  // Every row is some expert's: rows left out would be returned unwritten.
  if (offsets[0] != 0 || offsets[experts] != m) return 4;
#ifdef TANDEM_INT4_BF16_DOT
  // Fixed across items (an item is an expert and a panel), so the panel of the batches
  // that buffer their weights; a batch that does not runs the panel's tiles one by one.
  // Sized as for one thread: the experts already give the threads items to share.
  const int64_t panel_rows =
      Dot ? bf16_panel_rows(L, kDotFusedRows + 1, 1) : kGroupedTiles * kTileOutputs;
#else
  const int64_t panel_rows = kGroupedTiles * kTileOutputs;
#endif
  const int64_t panels = (L.n + panel_rows - 1) / panel_rows;
  std::vector<int64_t> items;
  if (!expert_items(offsets, experts, m, panels, items)) return 4;
  const int64_t count = static_cast<int64_t>(items.size());
  if (count == 0) return 0;
  const std::vector<int32_t> word_group = word_groups(L);
  using Elem = std::conditional_t<Dot, uint16_t, float>;
  Aligned<Elem> xp_buffer;
  Elem* xp = xp_buffer.fit(static_cast<size_t>(m * L.padded));
  if (xp == nullptr) return 6;  // out of memory
#ifdef TANDEM_INT4_BF16_DOT
  if constexpr (Dot) {
    permute_rows_bf16(static_cast<const uint16_t*>(x), m, ldx, L, xp, threads);
  } else {
    permute_rows(x, m, ldx, L, xp, threads);
  }
#else
  permute_rows(x, m, ldx, L, xp, threads);
#endif
  const int64_t elem_bytes = L.dtype == kFloat32 ? 4 : 2;
  // An item's codes: its panel's rows, contiguous.
  const auto codes_of = [&](int64_t item, int64_t* bytes) {
    const int64_t e = item / panels, first = item % panels * panel_rows;
    *bytes = std::min(panel_rows, L.n - first) * L.words * 4;
    return reinterpret_cast<const char*>(L.codes + (e * L.n + first) * L.words);
  };
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  claim_ahead(count, threads, [&](int64_t i, int64_t following) {
    const int64_t e = items[i] / panels;
    const int64_t first = items[i] % panels * panel_rows;
    const int64_t outputs = std::min(panel_rows, L.n - first);
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    const Layer le = expert_layer(L, e);
    const Elem* xs = xp + r0 * L.padded;
    char* ye = static_cast<char*>(y) + r0 * ldy * elem_bytes;
    const int64_t tiles = (outputs + kTileOutputs - 1) / kTileOutputs;
    // One step a tile, or a weight row where the dot path buffers the panel's rows.
    int64_t steps = tiles;
#ifdef TANDEM_INT4_BF16_DOT
    if (Dot && rows > kDotFusedRows) steps = outputs;
#endif
    Ahead ahead;
    if (following >= 0) {
      int64_t bytes = 0;
      ahead.next = codes_of(items[following], &bytes);
      ahead.end = ahead.next + bytes;
      ahead.lines = (bytes / 64 + steps - 1) / steps;
    }
#ifdef TANDEM_INT4_BF16_DOT
    if constexpr (Dot) {
      thread_local Aligned<uint16_t> wrows;
      thread_local std::vector<float> s, z;
      s.resize(static_cast<size_t>(panel_rows * L.groups));
      z.resize(s.size());
      bf16_panel(le, first, outputs, xs, rows, reinterpret_cast<uint16_t*>(ye), ldy, nullptr,
                 word_group.data(), s.data(), z.data(),
                 wrows.fit(static_cast<size_t>(bf16_panel_elems(L))), ahead);
      return;
    }
#endif
    if constexpr (!Dot) {
      thread_local TileScratch scratch;
      scratch.fit(L);
      for (int64_t t0 = 0; t0 < outputs; t0 += kTileOutputs) {
        ahead.step();
        const int n = static_cast<int>(std::min<int64_t>(kTileOutputs, outputs - t0));
        f32_tile(le, first + t0, n, xs, rows, ye, ldy, nullptr, word_group.data(), scratch);
      }
    }
  });
  return 0;
}

}  // namespace
}  // namespace tandem

extern "C" {

// y [m, n] (row stride ldy): rows [offsets[e], offsets[e + 1]) of x [m, k] (row stride ldx)
// times expert e's dequantized weight transposed, for every expert e < experts; codes int32
// [experts, n, k / 8], scales (in `dtype`, as x and y) and zero points uint8
// [experts, n, groups], each expert's laid out as tandem_int4_linear's. offsets int64
// [experts + 1], read here: out of order, or not spanning exactly the m rows, is refused
// (4) before anything is read past them. 0 on success.
int tandem_int4_grouped_linear(void* y, const void* x, const int32_t* codes, const void* scales,
                               const uint8_t* zeros, const int64_t* offsets, int64_t experts,
                               int64_t m, int64_t n, int64_t k, int64_t groups, int64_t ldx,
                               int64_t ldy, int32_t dtype, int32_t threads) {
  const tandem::Layer L = tandem::make_layer(codes, scales, zeros, n, k, groups, dtype);
  if (const int code = tandem::check(L)) return code;
  if (experts < 1 || m < 0 || n < 1 || ldx < k || ldy < n) return 5;
  threads = std::max(1, threads);
#ifdef TANDEM_INT4_BF16_DOT
  if (dtype == tandem::kBFloat16) {
    return tandem::grouped_linear<true>(L, y, x, offsets, experts, m, ldx, ldy, threads);
  }
#endif
  return tandem::grouped_linear<false>(L, y, x, offsets, experts, m, ldx, ldy, threads);
}

}  // extern "C"
