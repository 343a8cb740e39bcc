// out[M, N] = x[M, K] . W[N, K]^T in float32 with AVX2 FMAs, reading the weight where oneDNN
// packed it, for CPUs without AVX-512 (most cloud CPUs and laptops: AMD Zen 1-3, Intel
// before Ice Lake).
//
// Why: on a 2-core AMD EPYC with AVX2 (FMA peak measured at 174 GFLOP/s over both cores,
// memory 24.5 GB/s) oneDNN's packed float32 kernels reach 65 GFLOP/s at a decode step's
// M = 48 and 74 at prefill sizes: the step is bound by arithmetic, not by the weight
// stream, and oneDNN leaves more than half the FMA issue slots empty. This kernel keeps
// both FMA pipes busy with the classic register block: 6 rows x 16 columns, 12 ymm
// accumulators, per k two weight loads and six broadcasts of x for twelve FMAs.
//
// The packed layouts (what torch.ops.mkldnn._reorder_linear_weight gives on AVX2 CPUs):
// [N / P][Kp][P] with panels of P = 64 columns for most shapes (as on AVX-512 CPUs) and
// P = 16 for some (N = 192 here), Kp = K rounded up to 16 (rows past K zero): each panel is
// one step of P floats per k, P / 16 cache lines of 16 columns. oneDNN does not promise
// these layouts, so the Python side checks each weight against oneDNN's own product (and
// its 64-byte alignment: aligned loads) before it hands it here, with the panel width.
//
// Loop order per thread (its own contiguous range of panels): for each group of at most
// 512 rows, each panel, each K chunk of 256 steps (64 KiB of weights: L2), each 16-column
// quarter of the panel (the 16 KiB of it the chunk holds stays in L1), each 6-row block of
// x. The partial sums live in out itself between chunks. While it computes a chunk, the
// thread prefetches the next one, a few lines per step, so the stream from memory overlaps
// the arithmetic instead of stalling the first pass over each chunk.
//
// Rounding: each output is one float32 chain of FMAs over K in order; oneDNN sums in
// another order, so outputs differ from its by float32 roundings.
//
// Plain C entry points; pointers with row strides (elements).

#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "expert_items.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)

namespace {

constexpr int64_t kPad = 16;         // oneDNN pads K to a multiple of this
constexpr int64_t kRows = 6;         // rows of one register block: 6 x 2 accumulators
constexpr int64_t kQuarter = 16;     // columns of one register block
constexpr int64_t kChunk = 256;      // K steps computed for every row block at once
constexpr int64_t kLine = 64;        // bytes of a cache line
constexpr int64_t kGroupRows = 512;  // rows of x passed through all panels at once

// Weight bytes to prefetch, up to `end`: into L2 only where `l2`, else into L1 too.
struct Prefetch {
  const char* next;
  const char* end;
  int lines;  // per 8 k steps of a register block
  bool l2 = false;
};

// Rows [0, MR) x 16 columns: out (row stride ldo) (+)= x rows (row stride ldx) . `steps`
// steps of 16 columns of a panel (w points at their first float, steps `step` floats apart).
// The twelve accumulators are named variables, not an array: with an array GCC kept them in
// memory as well (__m256 may alias anything) and wrote all twelve back every step, which
// halved the FMA rate where stores are scarce (measured on a Zen 1 guest: 20 against
// oneDNN's 40 GFLOP/s a core).
template <int MR, bool FIRST>
inline void block(float* out, int64_t ldo, const float* x, int64_t ldx, const float* w,
                  int64_t step, int64_t steps, Prefetch& fetch) {
  static_assert(MR >= 1 && MR <= 6, "a register block has 1 to 6 rows");
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  const float *x0 = x, *x1 = x, *x2 = x, *x3 = x, *x4 = x, *x5 = x;
#define TANDEM_INIT(m)                                                          \
  if constexpr (MR > m) {                                                       \
    x##m = x + m * ldx;                                                         \
    c##m##0 = FIRST ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * ldo);     \
    c##m##1 = FIRST ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * ldo + 8); \
  }
  TANDEM_INIT(0) TANDEM_INIT(1) TANDEM_INIT(2) TANDEM_INIT(3) TANDEM_INIT(4) TANDEM_INIT(5)
#undef TANDEM_INIT
  const char* next = fetch.next;
  const char* const end = fetch.end;
  const int lines = fetch.lines;
  for (int64_t s = 0; s < steps; ++s) {
    if ((s & 7) == 0) {
      for (int l = 0; l < lines && next < end; ++l) {
        if (fetch.l2) {
          _mm_prefetch(next, _MM_HINT_T1);
        } else {
          _mm_prefetch(next, _MM_HINT_T0);
        }
        next += kLine;
      }
    }
    const __m256 b0 = _mm256_load_ps(w + s * step);
    const __m256 b1 = _mm256_load_ps(w + s * step + 8);
#define TANDEM_FMA(m)                                  \
  if constexpr (MR > m) {                              \
    const __m256 a = _mm256_broadcast_ss(x##m + s);    \
    c##m##0 = _mm256_fmadd_ps(a, b0, c##m##0);         \
    c##m##1 = _mm256_fmadd_ps(a, b1, c##m##1);         \
  }
    TANDEM_FMA(0) TANDEM_FMA(1) TANDEM_FMA(2) TANDEM_FMA(3) TANDEM_FMA(4) TANDEM_FMA(5)
#undef TANDEM_FMA
  }
  fetch.next = next;
#define TANDEM_STORE(m)                              \
  if constexpr (MR > m) {                            \
    _mm256_storeu_ps(out + m * ldo, c##m##0);        \
    _mm256_storeu_ps(out + m * ldo + 8, c##m##1);    \
  }
  TANDEM_STORE(0) TANDEM_STORE(1) TANDEM_STORE(2) TANDEM_STORE(3) TANDEM_STORE(4) TANDEM_STORE(5)
#undef TANDEM_STORE
}

template <bool FIRST>
inline void rows(int64_t mr, float* out, int64_t ldo, const float* x, int64_t ldx,
                 const float* w, int64_t step, int64_t steps, Prefetch& fetch) {
  switch (mr) {
    case 6: block<6, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
    case 5: block<5, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
    case 4: block<4, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
    case 3: block<3, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
    case 2: block<2, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
    default: block<1, FIRST>(out, ldo, x, ldx, w, step, steps, fetch); break;
  }
}

// One chunk of one panel: each 16 columns for every row block.
inline void chunk(bool first, int64_t M, float* out, int64_t ldo, const float* x, int64_t ldx,
                  const float* w, int64_t panel, int64_t steps, Prefetch& fetch) {
  for (int64_t q = 0; q < panel / kQuarter; ++q) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t mr = std::min(kRows, M - m0);
      float* o = out + m0 * ldo + q * kQuarter;
      const float* xr = x + m0 * ldx;
      if (first) {
        rows<true>(mr, o, ldo, xr, ldx, w + q * kQuarter, panel, steps, fetch);
      } else {
        rows<false>(mr, o, ldo, xr, ldx, w + q * kQuarter, panel, steps, fetch);
      }
    }
  }
}

int linear(float* out, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
           int64_t ldx, int64_t ldo, int32_t max_rows, int32_t panel, int32_t num_threads) {
  if (M < 1 || M > max_rows || N <= 0 || (panel != 16 && panel != 64) || N % panel != 0 ||
      K < 1) {
    return 1;
  }
  const int64_t panels = N / panel;
  const int64_t panel_floats = (K + kPad - 1) / kPad * kPad * panel;
  const int64_t group_rows = std::min(M, kGroupRows);
  const int64_t blocks = (group_rows + kRows - 1) / kRows;
  // A chunk is panel / 16 lines a step, computed in panel / 16 x `blocks` register-block
  // passes of `steps` / 8 prefetch turns each: spread the next chunk over them.
  const int lines = static_cast<int>(std::max<int64_t>(1, (8 + blocks - 1) / blocks));
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels)));
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = panels * id / team;
    const int64_t hi = panels * (id + 1) / team;
    const char* stream_end = reinterpret_cast<const char*>(w + hi * panel_floats);
    for (int64_t g0 = 0; g0 < M; g0 += group_rows) {
      const int64_t gm = std::min(group_rows, M - g0);
      const float* xg = x + g0 * ldx;
      Prefetch fetch{reinterpret_cast<const char*>(w + lo * panel_floats), stream_end, lines};
      for (int64_t p = lo; p < hi; ++p) {
        float* op = out + g0 * ldo + p * panel;
        for (int64_t s0 = 0; s0 < K; s0 += kChunk) {
          const int64_t n = std::min(kChunk, K - s0);
          const float* wc = w + p * panel_floats + s0 * panel;
          const char* following = reinterpret_cast<const char*>(wc + n * panel);
          fetch.next = std::max(fetch.next, following);
          fetch.end = std::min(stream_end, following + kChunk * panel * sizeof(float));
          chunk(s0 == 0, gm, op, ldo, xg + s0, ldx, wc, panel, n, fetch);
        }
      }
    }
  }
  return 0;
}

// The sums (row stride lds, started at zero) of rows [0, gm) of x with one panel (at wp),
// in K chunks of equal length: while a chunk computes, the next one streams into L2, after
// the last one the panel at `after` (the thread's next; nullptr: none). Equal chunks, so
// the last one of a panel is long enough to prefetch the first one of the next. A chunk is
// panel / 16 x `blocks` register-block passes of n / 8 prefetch turns each.
inline void panel_sums(const float* wp, const float* after, int64_t K, int64_t panel,
                       int64_t gm, float* sums, int64_t lds, const float* x, int64_t ldx) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  const int64_t chunk_steps = (K + chunks - 1) / chunks;
  const int64_t blocks = (gm + kRows - 1) / kRows;
  for (int64_t s0 = 0; s0 < K; s0 += chunk_steps) {
    const int64_t n = std::min(chunk_steps, K - s0);
    const float* wc = wp + s0 * panel;
    const float* next = wc + n * panel;
    int64_t next_steps = std::min(chunk_steps, K - s0 - n);
    if (next_steps == 0) {
      next = after;
      next_steps = after == nullptr ? 0 : std::min(chunk_steps, K);
    }
    const char* from = reinterpret_cast<const char*>(next);
    Prefetch fetch{from, from + next_steps * panel * sizeof(float),
                   static_cast<int>((8 * next_steps + blocks * n - 1) / (blocks * n)),
                   /*l2=*/true};
    chunk(s0 == 0, gm, sums, lds, x + s0, ldx, wc, panel, n, fetch);
  }
}

// Expert e's rows [offsets[e], offsets[e + 1]) of x times expert e's weight, for every
// expert at once: the (expert, panel) pairs with rows are the work items the threads share,
// so a step's few rows per expert still keep every core busy, with one call per projection.
// The weight stream runs on from item to item as in avx512_linear.cpp's grouped kernel
// (each thread's next item claimed ahead, equal chunks, prefetches into L2): on Zen 4 at
// TANDEM_CPU_ISA=avx2, 12 bench MoE layers at 48 tokens, the two GEMMs of a layer took
// 2.0-2.1 ms before and 1.1-1.2 after.
int grouped(float* out, const float* x, const float* w, const int64_t* offsets,
            int64_t experts, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo,
            int32_t panel, int32_t num_threads) {
  if (experts < 1 || N <= 0 || (panel != 16 && panel != 64) || N % panel != 0 || K < 1) {
    return 1;
  }
  const int64_t panels = N / panel;
  const int64_t panel_floats = (K + kPad - 1) / kPad * kPad * panel;
  const int64_t expert_floats = panels * panel_floats;
  std::vector<int64_t> items;
  if (!tandem::expert_items(offsets, experts, M, panels, items)) return 1;
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  const auto panel_of = [&](int64_t item) {
    return w + item / panels * expert_floats + item % panels * panel_floats;
  };
  tandem::claim_ahead(count, threads, [&](int64_t i, int64_t following) {
    const int64_t e = items[i] / panels;
    const int64_t p = items[i] % panels;
    const float* wp = panel_of(items[i]);
    // Where the stream goes after this panel: the thread's next item, already claimed (or
    // this panel again for the next group of rows, from cache).
    const float* after = following < 0 ? nullptr : panel_of(items[following]);
    for (int64_t g0 = offsets[e]; g0 < offsets[e + 1]; g0 += kGroupRows) {
      const int64_t gm = std::min(kGroupRows, offsets[e + 1] - g0);
      panel_sums(wp, g0 + gm == offsets[e + 1] ? after : wp, K, panel, gm,
                 out + g0 * ldo + p * panel, ldo, x + g0 * ldx, ldx);
    }
  });
  return 0;
}

// Rows of x a fused gate/up call sums at once: the gate and up sums of a panel for them,
// 2 x 128 x 64 floats, are 64 KiB of scratch, in L2 on every AVX2 CPU.
constexpr int64_t kSiluRows = 128;

// The gate/up projection of a dense MLP with SiLU-and-mul as its epilogue: w [N, K] (gate
// rows, then up rows, each half whole panels) packed as above, out [M, N / 2] =
// silu(x . gate) * (x . up). Each thread takes a run of gate panels and, for each, the up
// panel N / 2 columns on, both summed into scratch, then the activation (silu_rows, in
// vec_math.h): the [M, N] product is never written out and read back.
int linear_silu(float* out, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                int64_t ldx, int64_t ldo, int32_t max_rows, int32_t panel, int32_t num_threads) {
  if (M < 1 || M > max_rows || N <= 0 || (panel != 16 && panel != 64) || N % (2 * panel) != 0 ||
      K < 1) {
    return 1;
  }
  const int64_t half = N / panel / 2;
  const int64_t panel_floats = (K + kPad - 1) / kPad * kPad * panel;
  const int64_t group_rows = std::min(M, kSiluRows);
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, half)));
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = half * id / team;
    const int64_t hi = half * (id + 1) / team;
    thread_local std::vector<float> scratch;
    scratch.resize(2 * kSiluRows * panel);
    float* gate = scratch.data();
    float* up = gate + kSiluRows * panel;
    for (int64_t g0 = 0; g0 < M; g0 += group_rows) {
      const int64_t gm = std::min(group_rows, M - g0);
      const float* xg = x + g0 * ldx;
      for (int64_t q = lo; q < hi; ++q) {
        const float* gate_w = w + q * panel_floats;
        const float* up_w = w + (half + q) * panel_floats;
        // The thread's stream: gate q, up q, gate q + 1, ...; after its last up panel its
        // first gate panel again for the next group of rows (none after the last).
        const float* after = q + 1 < hi      ? w + (q + 1) * panel_floats
                             : g0 + gm < M ? w + lo * panel_floats
                                           : nullptr;
        panel_sums(gate_w, up_w, K, panel, gm, gate, panel, xg, ldx);
        panel_sums(up_w, after, K, panel, gm, up, panel, xg, ldx);
        tandem::silu_rows(out + g0 * ldo + q * panel, ldo, gate, up, gm, panel);
      }
    }
  }
  return 0;
}

// The gate/up projection of grouped experts with SiLU-and-mul as its epilogue: each
// expert's weight [N, K] (gate rows, then up rows) packed as above, out [M, N / 2]. An item
// is an expert's gate panel and the up panel N / 2 columns on (claimed ahead, as `grouped`
// does), summed for the expert's rows into scratch, then activated (silu_rows).
int grouped_silu(float* out, const float* x, const float* w, const int64_t* offsets,
                 int64_t experts, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                 int32_t panel, int32_t num_threads) {
  if (experts < 1 || N <= 0 || (panel != 16 && panel != 64) || N % (2 * panel) != 0 || K < 1) {
    return 1;
  }
  const int64_t half = N / panel / 2;
  const int64_t panel_floats = (K + kPad - 1) / kPad * kPad * panel;
  const int64_t expert_floats = 2 * half * panel_floats;
  std::vector<int64_t> items;
  if (!tandem::expert_items(offsets, experts, M, half, items)) return 1;
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  const auto gate_of = [&](int64_t item) {
    return w + item / half * expert_floats + item % half * panel_floats;
  };
  tandem::claim_ahead(count, threads, [&](int64_t i, int64_t following) {
    thread_local std::vector<float> scratch;
    scratch.resize(2 * kSiluRows * panel);
    float* gate = scratch.data();
    float* up = gate + kSiluRows * panel;
    const int64_t e = items[i] / half;
    const int64_t q = items[i] % half;
    const float* gate_w = gate_of(items[i]);
    const float* up_w = gate_w + half * panel_floats;
    const float* after = following < 0 ? nullptr : gate_of(items[following]);
    for (int64_t g0 = offsets[e]; g0 < offsets[e + 1]; g0 += kSiluRows) {
      const int64_t gm = std::min(kSiluRows, offsets[e + 1] - g0);
      const float* xg = x + g0 * ldx;
      panel_sums(gate_w, up_w, K, panel, gm, gate, panel, xg, ldx);
      panel_sums(up_w, g0 + gm == offsets[e + 1] ? after : gate_w, K, panel, gm, up, panel, xg,
                 ldx);
      tandem::silu_rows(out + g0 * ldo + q * panel, ldo, gate, up, gm, panel);
    }
  });
  return 0;
}

}  // namespace

extern "C" {

int tandem_avx2_built() { return 1; }

// out [M, N / 2] (row stride ldo) = silu(x . gate) * (x . up), w [N, K] packed as above with
// the gate rows first; returns 0, or 1 for arguments the kernel does not take (as
// tandem_avx2_linear_f32, and halves off whole panels).
int tandem_avx2_linear_silu_f32(float* out, const float* x, const void* w, int64_t M,
                                int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                int32_t max_rows, int32_t panel, int32_t num_threads) {
  return linear_silu(out, x, static_cast<const float*>(w), M, N, K, ldx, ldo, max_rows, panel,
                     num_threads);
}

// The grouped gate/up projection with SiLU-and-mul fused (grouped_silu): out [M, N / 2].
int tandem_avx2_grouped_silu_f32(float* out, const float* x, const void* w,
                                 const int64_t* offsets, int64_t experts, int64_t M, int64_t N,
                                 int64_t K, int64_t ldx, int64_t ldo, int32_t panel,
                                 int32_t num_threads) {
  return grouped_silu(out, x, static_cast<const float*>(w), offsets, experts, M, N, K, ldx, ldo,
                      panel, num_threads);
}

// Grouped experts: out rows [offsets[e], offsets[e + 1]) = x rows of the same range times
// expert e's weight [N, K], the experts' weights packed one after another, each as above
// ([N / panel][Kp][panel]); x has M rows. Returns 0, or 1 for arguments it does not take.
int tandem_avx2_grouped_linear_f32(float* out, const float* x, const void* w,
                                   const int64_t* offsets, int64_t experts, int64_t M,
                                   int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                   int32_t panel, int32_t num_threads) {
  return grouped(out, x, static_cast<const float*>(w), offsets, experts, M, N, K, ldx, ldo,
                 panel, num_threads);
}

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) w[n, k], w packed as above in
// panels of `panel` (16 or 64) columns. Returns 0, or 1 for shapes this kernel does not take
// (M outside 1..max_rows, another panel width, N not a multiple of it, K < 1).
int tandem_avx2_linear_f32(float* out, const float* x, const void* w, int64_t M, int64_t N,
                           int64_t K, int64_t ldx, int64_t ldo, int32_t max_rows,
                           int32_t panel, int32_t num_threads) {
  return linear(out, x, static_cast<const float*>(w), M, N, K, ldx, ldo, max_rows, panel,
                num_threads);
}

}  // extern "C"

#else  // no AVX2 with FMA in this build's target

extern "C" {
int tandem_avx2_built() { return 0; }
int tandem_avx2_grouped_linear_f32(float*, const float*, const void*, const int64_t*, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, int32_t,
                                   int32_t) {
  return 1;
}
int tandem_avx2_linear_f32(float*, const float*, const void*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int32_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx2_linear_silu_f32(float*, const float*, const void*, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int32_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx2_grouped_silu_f32(float*, const float*, const void*, const int64_t*, int64_t,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int32_t,
                                 int32_t) {
  return 1;
}
}  // extern "C"

#endif
