// out[M, N] = x[M, K] . W[N, K]^T with AVX-512 FMAs (float32) or AVX512-BF16 dot products
// (bfloat16), reading the weight where oneDNN packed it.
//
// Why: on a 2-core AVX-512 host (AMD Zen 5) oneDNN's kernels leave the FMA units idle part
// of the time at decode sizes: they pull each weight panel from memory in one burst, in the
// first pass over it, and then compute from cache while nothing streams. This kernel cuts
// each 64-column panel into K chunks and, while it computes one chunk for every row block of
// a group of rows, prefetches the next chunk, spread over those passes: the weight stream
// and the FMAs overlap. Groups of at most 512 rows bound the x chunk a group re-reads per
// panel at prefill sizes (without them M = 4096 fell 10% behind oneDNN; with them it is
// ahead). Measured on all 33 weights of the bench model at M = 48 (2 threads, medians of
// interleaved runs): float32 28.9 against oneDNN's 36.8 ms (FMA peak ~460 GFLOP/s, memory
// ~37 GB/s), bfloat16 14.3 against 18.9 ms. At M = 2048 it is level with oneDNN shape by
// shape.
//
// The packed layouts (what torch.ops.mkldnn._reorder_linear_weight gives on AVX-512 CPUs
// without AMX when N is a multiple of 64), per 64-column panel, one 256-byte step after the
// other, each step four zmm vectors of weights for 16 columns each:
//   float32:  [N / 64][Kp][64] with Kp = K rounded up to 16 (rows past K zero);
//   bfloat16: [N / 64][K / 2][64][2], the VNNI pairs VDPBF16PS multiplies (K a multiple
//             of 32 here: no padding).
// oneDNN does not promise these layouts, so the Python side checks each weight against
// oneDNN's own product (and its 64-byte alignment: aligned loads) before it hands it here.
//
// Rounding: each output is one float32 chain of FMAs (or pair dot products) over K in
// order; oneDNN sums in another order. bfloat16 outputs are rounded to nearest-even once,
// at the end, as oneDNN rounds them.
//
// Plain C entry points; pointers with row strides (elements).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "expert_items.h"
#include "vec_math.h"

#if defined(__AVX512F__)

namespace {

constexpr int64_t kPanel = 64;       // columns of one packed panel
constexpr int64_t kStepBytes = 256;  // bytes of one panel step: four zmm vectors
constexpr int64_t kRows = 6;         // rows of one register block: 6 x 4 accumulators
constexpr int64_t kLine = 64;        // bytes of a cache line
constexpr int64_t kGroupRows = 512;  // rows of x passed through all panels at once

constexpr int64_t kChunk = 384;      // panel steps computed for every row block at once

// How the weight stream is asked for, by CPU vendor (the Python side defines
// TANDEM_STREAM_TO_L2 on Intel). On AMD (Zen 4, Zen 5, where this kernel was tuned): chunks of
// kChunk steps, the dense product's next chunk prefetched into L1, and a pass with a single
// row block PREFETCHNTA (kNtaSteps). On the AMX Xeon guest (2 threads, float32, the bench
// model's 33 weights from memory, ms): PREFETCHNTA lines are held by the core's few L1 fill
// buffers until they arrive, and a single-block pass read 15 GB/s of the 25 the machine
// gives: M = 1 29.0 -> 16.9 with the chunk prefetched into L2 instead. Decode-size groups
// there also run chunks of kShortChunk steps (32 KiB, which the row blocks re-read from L1)
// and the dense product prefetches into L2: M = 48 42.2 -> 38.5, M = 12 22.9 -> 20.2, the
// bench MoE's experts at 256 tokens 3.82 -> 3.65 ms a layer (128 steps measured against 64,
// 192 and 384); from M = 192 on, kChunk steps again (144.8 against 140.1 ms at 192).
#if defined(TANDEM_STREAM_TO_L2)
constexpr bool kStreamToL2 = true;
#else
constexpr bool kStreamToL2 = false;
#endif
constexpr int64_t kShortChunk = 128;
constexpr int64_t kShortChunkBlocks = 16;  // row blocks a group has at most for short chunks

// The most panel steps a chunk of a pass of `blocks` row blocks takes.
inline int64_t chunk_limit(int64_t blocks) {
  return kStreamToL2 && blocks <= kShortChunkBlocks ? kShortChunk : kChunk;
}

// The same, every chunk of a panel of `steps` the same length (the last one of a panel is
// then long enough to prefetch the next).
inline int64_t chunk_steps_for(int64_t steps, int64_t blocks) {
  const int64_t most = chunk_limit(blocks);
  const int64_t chunks = (steps + most - 1) / most;
  return (steps + chunks - 1) / chunks;
}

// Rows of a dense product's groups (each passes through all the thread's panels before the
// next): all M up to kGroupRows. With L2 streaming (Intel), batches of more than
// kWholeGroupRows go in equal groups of about kShortGroupRows, whose x chunk a panel re-reads
// stays nearer: on the AMX Xeon guest (float32, the bench model's 33 weights, ms) M = 1024
// 809 -> 758, M = 2048 1595 -> 1513; groups of 256 gave 781 and 1514; below 384 rows, where
// a second group streams the weights from memory again, one group (M = 192: 147 against
// 167 in groups of 128).
constexpr int64_t kWholeGroupRows = 384;
constexpr int64_t kShortGroupRows = 128;

inline int64_t group_rows_for(int64_t M) {
  if (!kStreamToL2 || M <= kWholeGroupRows) return std::min(M, kGroupRows);
  const int64_t groups = (M + kShortGroupRows - 1) / kShortGroupRows;
  return (M + groups - 1) / groups;
}

// Row blocks of the largest expert's group of rows (offsets already checked).
inline int64_t expert_blocks(const int64_t* offsets, int64_t experts) {
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
  return (std::min(most, kGroupRows) + kRows - 1) / kRows;
}

// The thread's next weight bytes to prefetch, up to `end`, `lines` cache lines per step;
// into L2 only where `l2`, else into L1 too.
struct Prefetch {
  const char* next;
  const char* end;
  int lines;
  bool l2 = false;
  // Each weight line is read once (one row block): instead of the next chunk, the lines
  // kNtaSteps ahead, non-temporal (see kNtaSteps); past this chunk's end, those of the chunk
  // at `next` (nullptr: none).
  bool nta = false;
};

// A step's four lines, this many steps (2 KiB) ahead, PREFETCHNTA: near enough that the
// lines are still in the core's caches when read, and marked so that they do not displace
// the L3. A decode step streams every weight once; with ordinary loads the stream evicts
// from the L3 the code and state of everything run between the GEMVs, and each of those
// calls then starts cold (on Zen 4, a decode-attention call took 110 us after 128 MiB of
// plain loads and 65 us after the same under PREFETCHNTA).
constexpr int64_t kNtaSteps = 8;

// How a chunk pass prefetches: with one row block every weight line is read once, so the
// stream goes non-temporal, kNtaSteps ahead; otherwise `lines` a step of the chunk at
// `next`, into L2 only where `l2`.
inline Prefetch plan_prefetch(const char* next, const char* end, int64_t blocks, int lines,
                              bool l2) {
  return blocks == 1 && !kStreamToL2 ? Prefetch{next, end, 0, l2, /*nta=*/true}
                                     : Prefetch{next, end, lines, l2, /*nta=*/false};
}

struct Float32 {
  using Elem = float;
  static constexpr int64_t kPerStep = 1;  // k values one panel step holds per column
  static constexpr int64_t kPad = 16;     // oneDNN pads K to a multiple of this
  static __m512 a(const float* x, int64_t step) { return _mm512_set1_ps(x[step]); }
  static __m512 fma(__m512 acc, __m512 a, const char* w) {
    return _mm512_fmadd_ps(a, _mm512_load_ps(reinterpret_cast<const float*>(w)), acc);
  }
};

#if defined(__AVX512BF16__)
struct BFloat16 {
  using Elem = uint16_t;
  static constexpr int64_t kPerStep = 2;
  static constexpr int64_t kPad = 2;
  static __m512 a(const uint16_t* x, int64_t step) {
    int32_t pair;  // x[2 step], x[2 step + 1]: one 32-bit lane, in every lane
    std::memcpy(&pair, x + 2 * step, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 acc, __m512 a, const char* w) {
    const __m512i b = _mm512_load_si512(reinterpret_cast<const void*>(w));
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};

// 16 float32 -> bfloat16, rounded to nearest-even.
inline void store_bf16(uint16_t* out, __m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  std::memcpy(out, &h, sizeof(h));
}
#endif

// Rows [0, MR) x 64 columns: sums (float32, row stride lds) (+)= x rows [0, MR) (row stride
// ldx) . `steps` panel steps from w. FIRST starts the sums at zero; FINAL (bfloat16) rounds
// them into out (row stride ldo) instead of keeping them.
template <class Kind, int MR, bool FIRST, bool FINAL>
inline void block(float* sums, int64_t lds, typename Kind::Elem* out, int64_t ldo,
                  const typename Kind::Elem* x, int64_t ldx, const char* w, int64_t steps,
                  Prefetch& fetch) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) {
      acc[m][j] = FIRST ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + m * lds + 16 * j);
    }
  }
  // The cursor in a local, not stored back through the reference every step.
  const char* next = fetch.next;
  for (int64_t s = 0; s < steps; ++s) {
    if (fetch.nta) {
      const int64_t a = s + kNtaSteps;
      const char* ahead = a < steps           ? w + a * kStepBytes
                          : next != nullptr ? next + (a - steps) * kStepBytes
                                            : nullptr;
      if (ahead != nullptr) {
        for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + l * kLine, _MM_HINT_NTA);
      }
    }
    for (int l = 0; l < fetch.lines && next < fetch.end; ++l) {
      if (fetch.l2) {
        _mm_prefetch(next, _MM_HINT_T1);
      } else {
        _mm_prefetch(next, _MM_HINT_T0);
      }
      next += kLine;
    }
    const char* ws = w + s * kStepBytes;
    for (int m = 0; m < MR; ++m) {
      const __m512 a = Kind::a(x + m * ldx, s);
      for (int j = 0; j < 4; ++j) acc[m][j] = Kind::fma(acc[m][j], a, ws + 64 * j);
    }
  }
  fetch.next = next;
  if constexpr (FINAL && !std::is_same_v<Kind, Float32>) {
#if defined(__AVX512BF16__)
    for (int m = 0; m < MR; ++m) {
      for (int j = 0; j < 4; ++j) store_bf16(out + m * ldo + 16 * j, acc[m][j]);
    }
#endif
  } else {
    for (int m = 0; m < MR; ++m) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + m * lds + 16 * j, acc[m][j]);
    }
  }
}

template <class Kind, bool FIRST, bool FINAL>
inline void rows(int64_t mr, float* sums, int64_t lds, typename Kind::Elem* out, int64_t ldo,
                 const typename Kind::Elem* x, int64_t ldx, const char* w, int64_t steps,
                 Prefetch& fetch) {
  switch (mr) {
    case 6: block<Kind, 6, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
    case 5: block<Kind, 5, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
    case 4: block<Kind, 4, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
    case 3: block<Kind, 3, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
    case 2: block<Kind, 2, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
    default: block<Kind, 1, FIRST, FINAL>(sums, lds, out, ldo, x, ldx, w, steps, fetch); break;
  }
}

// One chunk of one panel for every row block. float32 keeps its partial sums in out itself;
// bfloat16 in a float32 scratch panel [M][64], rounded into out in the last chunk.
template <class Kind>
inline void chunk(int64_t first, int64_t last, int64_t M, float* sums, int64_t lds,
                  typename Kind::Elem* out, int64_t ldo, const typename Kind::Elem* x,
                  int64_t ldx, const char* w, int64_t steps, Prefetch& fetch) {
  constexpr bool kSumsInOut = std::is_same_v<Kind, Float32>;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int64_t mr = std::min(kRows, M - m0);
    float* s = sums + m0 * lds;
    typename Kind::Elem* o = out + m0 * ldo;
    const typename Kind::Elem* xr = x + m0 * ldx;
    if (first && (kSumsInOut || !last)) {
      rows<Kind, true, false>(mr, s, lds, o, ldo, xr, ldx, w, steps, fetch);
    } else if (first) {
      rows<Kind, true, true>(mr, s, lds, o, ldo, xr, ldx, w, steps, fetch);
    } else if (kSumsInOut || !last) {
      rows<Kind, false, false>(mr, s, lds, o, ldo, xr, ldx, w, steps, fetch);
    } else {
      rows<Kind, false, true>(mr, s, lds, o, ldo, xr, ldx, w, steps, fetch);
    }
  }
}

template <class Kind>
int linear(typename Kind::Elem* out, const typename Kind::Elem* x, const void* w, int64_t M,
           int64_t N, int64_t K, int64_t ldx, int64_t ldo, int32_t max_rows,
           int32_t num_threads) {
  if (M < 1 || M > max_rows || N <= 0 || N % kPanel != 0 || K < 1 ||
      K % Kind::kPerStep != 0) {
    return 1;
  }
  const int64_t panels = N / kPanel;
  const int64_t steps = K / Kind::kPerStep;
  const int64_t panel_bytes = (K + Kind::kPad - 1) / Kind::kPad * Kind::kPad / Kind::kPerStep *
                              kStepBytes;
  // Row groups (group_rows_for): every panel of the thread passes a group's x before the
  // next group starts (each group streams the weights once more).
  const int64_t group_rows = group_rows_for(M);
  const int64_t blocks = (group_rows + kRows - 1) / kRows;
  const int64_t chunk_steps = chunk_limit(blocks);
  // One chunk is 4 lines a step; the row blocks together prefetch the next one.
  const int lines = static_cast<int>((4 + blocks - 1) / blocks);
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels)));
  const char* wb = static_cast<const char*>(w);
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = panels * id / team;
    const int64_t hi = panels * (id + 1) / team;
    thread_local std::vector<float> scratch;
    if constexpr (!std::is_same_v<Kind, Float32>) scratch.resize(group_rows * kPanel);
    // The thread's panels are one contiguous stream of weight bytes.
    const char* stream_end = wb + hi * panel_bytes;
    for (int64_t g0 = 0; g0 < M; g0 += group_rows) {
      const int64_t gm = std::min(group_rows, M - g0);
      const typename Kind::Elem* xg = x + g0 * ldx;
      Prefetch fetch = plan_prefetch(wb + lo * panel_bytes, stream_end, blocks, lines,
                                     /*l2=*/kStreamToL2);
      for (int64_t p = lo; p < hi; ++p) {
        typename Kind::Elem* op = out + g0 * ldo + p * kPanel;
        float* sums = reinterpret_cast<float*>(op);
        int64_t lds = ldo;
        if constexpr (!std::is_same_v<Kind, Float32>) {
          sums = scratch.data();
          lds = kPanel;
        }
        for (int64_t s0 = 0; s0 < steps; s0 += chunk_steps) {
          const int64_t n = std::min(chunk_steps, steps - s0);
          const char* wc = wb + p * panel_bytes + s0 * kStepBytes;
          const char* following = wc + n * kStepBytes;
          fetch.next = std::max(fetch.next, following);
          fetch.end = std::min(stream_end, following + chunk_steps * kStepBytes);
          chunk<Kind>(s0 == 0, s0 + n == steps, gm, sums, lds, op, ldo,
                      xg + s0 * Kind::kPerStep, ldx, wc, n, fetch);
        }
      }
    }
  }
  return 0;
}

// All K chunks of one panel (at wp) for gm rows of x: each chunk prefetches the next into
// L2, the last one the first chunk at `after` (the thread's next panel; nullptr: none).
// `round_last`: bfloat16 rounds the sums into out in the last chunk; otherwise they stay
// float32 in `sums` (float32 always keeps them there, `out` being `sums`).
template <class Kind>
inline void panel_pass(const char* wp, const char* after, int64_t steps, int64_t chunk_steps,
                       int64_t gm, float* sums, int64_t lds, typename Kind::Elem* out,
                       int64_t ldo, const typename Kind::Elem* x, int64_t ldx, bool round_last) {
  const int64_t blocks = (gm + kRows - 1) / kRows;
  for (int64_t s0 = 0; s0 < steps; s0 += chunk_steps) {
    const int64_t n = std::min(chunk_steps, steps - s0);
    const char* wc = wp + s0 * kStepBytes;
    const char* next = wc + n * kStepBytes;
    int64_t next_steps = std::min(chunk_steps, steps - s0 - n);
    if (next_steps == 0) {
      next = after;
      next_steps = after == nullptr ? 0 : std::min(chunk_steps, steps);
    }
    Prefetch fetch = plan_prefetch(
        next, next + next_steps * kStepBytes, blocks,
        static_cast<int>((4 * next_steps + n * blocks - 1) / (n * blocks)), /*l2=*/true);
    chunk<Kind>(s0 == 0, round_last && s0 + n == steps, gm, sums, lds, out, ldo,
                x + s0 * Kind::kPerStep, ldx, wc, n, fetch);
  }
}

// The gate/up projection of a dense MLP with SiLU-and-mul as its epilogue: w [N, K] (gate
// rows, then up rows, N a multiple of 128) packed as above, out [M, N / 2] = silu(x . gate)
// * (x . up). Each thread takes a run of gate panels and, for each, the up panel N / 128
// panels on, both summed into float32 scratch in L2, then the activation (silu_rows, in
// vec_math.h): the [M, N] product is never written out and read back, which at prefill
// sizes is tens of MB.
template <class Kind>
int linear_silu(typename Kind::Elem* out, const typename Kind::Elem* x, const void* w,
                int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int32_t max_rows,
                int32_t num_threads) {
  using Elem = typename Kind::Elem;
  if (M < 1 || M > max_rows || N <= 0 || N % (2 * kPanel) != 0 || K < 1 ||
      K % Kind::kPerStep != 0) {
    return 1;
  }
  const int64_t half = N / kPanel / 2;
  const int64_t steps = K / Kind::kPerStep;
  const int64_t panel_bytes = (K + Kind::kPad - 1) / Kind::kPad * Kind::kPad / Kind::kPerStep *
                              kStepBytes;
  const int64_t group_rows = group_rows_for(M);
  const int64_t chunk_steps = chunk_steps_for(steps, (group_rows + kRows - 1) / kRows);
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, half)));
  const char* wb = static_cast<const char*>(w);
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = half * id / team;
    const int64_t hi = half * (id + 1) / team;
    thread_local std::vector<float> gate_up;
    gate_up.resize(2 * group_rows * kPanel);
    float* sums[2] = {gate_up.data(), gate_up.data() + group_rows * kPanel};
    for (int64_t g0 = 0; g0 < M; g0 += group_rows) {
      const int64_t gm = std::min(group_rows, M - g0);
      for (int64_t q = lo; q < hi; ++q) {
        for (int64_t which = 0; which < 2; ++which) {
          // The thread's stream: gate q, up q, gate q + 1, ...; after its last up panel
          // its first gate panel again for the next group of rows (none after the last).
          const char* after = which == 0        ? wb + (half + q) * panel_bytes
                              : q + 1 < hi      ? wb + (q + 1) * panel_bytes
                              : g0 + gm < M     ? wb + lo * panel_bytes
                                                : nullptr;
          panel_pass<Kind>(wb + (which * half + q) * panel_bytes, after, steps, chunk_steps, gm,
                           sums[which], kPanel, reinterpret_cast<Elem*>(sums[which]), kPanel,
                           x + g0 * ldx, ldx, /*round_last=*/false);
        }
        tandem::silu_rows(out + g0 * ldo + q * kPanel, ldo, sums[0], sums[1], gm, kPanel);
      }
    }
  }
  return 0;
}

// Expert e's rows [offsets[e], offsets[e + 1]) of x times expert e's weight, for every
// expert at once, each weight packed as above and the experts one after another: the
// (expert, panel) pairs with rows are the work items the threads share, so a decode step's
// dozen rows per expert still keep every core busy, with one call per projection.
//
// A decode step's item is a dozen rows over one panel: little compute per weight byte, so
// the stream must not stop between items. Each thread claims its next item before it
// computes the current one, and the current one's last chunk prefetches the next one's
// first; chunks are of equal length so that last chunk is long enough to cover it; and the
// prefetches go to L2 only (a chunk is 64-128 KiB, beyond L1: into L1 they evicted the lines
// the row blocks still read). Measured on Zen 4 (2 threads, bench MoE shape, 12 layers in
// sequence, 48 tokens, float32): 1.48-1.75 ms a layer before, 1.23-1.37 after.
template <class Kind>
int grouped(typename Kind::Elem* out, const typename Kind::Elem* x, const void* w,
            const int64_t* offsets, int64_t experts, int64_t M, int64_t N, int64_t K,
            int64_t ldx, int64_t ldo, int32_t num_threads) {
  if (experts < 1 || N <= 0 || N % kPanel != 0 || K < 1 || K % Kind::kPerStep != 0) return 1;
  const int64_t panels = N / kPanel;
  const int64_t steps = K / Kind::kPerStep;
  const int64_t panel_bytes = (K + Kind::kPad - 1) / Kind::kPad * Kind::kPad / Kind::kPerStep *
                              kStepBytes;
  std::vector<int64_t> items;
  if (!tandem::expert_items(offsets, experts, M, panels, items)) return 1;
  // Chunks of equal length, so the last one of a panel is long enough to prefetch the
  // first one of the next item.
  const int64_t chunk_steps = chunk_steps_for(steps, expert_blocks(offsets, experts));
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  const char* wb = static_cast<const char*>(w);
  tandem::claim_ahead(count, threads, [&](int64_t i, int64_t following) {
    const int64_t e = items[i] / panels;
    const int64_t p = items[i] % panels;
    const char* wp = wb + items[i] * panel_bytes;
    // Where the stream goes after this panel: the thread's next item, already claimed.
    const char* after = following < 0 ? nullptr : wb + items[following] * panel_bytes;
    thread_local std::vector<float> scratch;
    for (int64_t g0 = offsets[e]; g0 < offsets[e + 1]; g0 += kGroupRows) {
      const int64_t gm = std::min(kGroupRows, offsets[e + 1] - g0);
      typename Kind::Elem* op = out + g0 * ldo + p * kPanel;
      float* sums = reinterpret_cast<float*>(op);
      int64_t lds = ldo;
      if constexpr (!std::is_same_v<Kind, Float32>) {
        scratch.resize(kGroupRows * kPanel);
        sums = scratch.data();
        lds = kPanel;
      }
      // After the last group the stream goes on to the next item; before it, this panel
      // again for the next group of rows, from cache.
      const char* next = g0 + gm == offsets[e + 1] ? after : wp;
      panel_pass<Kind>(wp, next, steps, chunk_steps, gm, sums, lds, op, ldo, x + g0 * ldx, ldx,
                       /*round_last=*/true);
    }
  });
  return 0;
}

// The gate/up projection of the routed experts with SiLU-and-mul as its epilogue: w holds
// each expert's [2 I, K] weight (gate rows, then up rows) packed as above, and out rows get
// silu(x . gate) * (x . up), [M, I]. An item is an expert's gate panel and the up panel 64
// columns of it, both summed into float32 scratch that stays in L2 (never written to memory
// as the [M, 2 I] activation an unfused step writes and reads back), then the activation.
// The activation is elementwise.cpp's silu_mul to the bit: the sums rounded to the dtype as
// the unfused GEMM rounds its output, the same fast_exp and operations (this library is
// built without FMA contraction, as that one is).
template <class Kind>
int grouped_silu(typename Kind::Elem* out, const typename Kind::Elem* x, const void* w,
                 const int64_t* offsets, int64_t experts, int64_t M, int64_t N, int64_t K,
                 int64_t ldx, int64_t ldo, int32_t num_threads) {
  using Elem = typename Kind::Elem;
  if (experts < 1 || N <= 0 || N % (2 * kPanel) != 0 || K < 1 || K % Kind::kPerStep != 0) {
    return 1;
  }
  const int64_t panels = N / kPanel;
  const int64_t half = panels / 2;  // panels of gate (and of up) per expert
  const int64_t steps = K / Kind::kPerStep;
  const int64_t panel_bytes = (K + Kind::kPad - 1) / Kind::kPad * Kind::kPad / Kind::kPerStep *
                              kStepBytes;
  std::vector<int64_t> items;  // expert * half + gate panel
  if (!tandem::expert_items(offsets, experts, M, half, items)) return 1;
  const int64_t chunk_steps = chunk_steps_for(steps, expert_blocks(offsets, experts));
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
  const char* wb = static_cast<const char*>(w);
  const auto panel_of = [&](int64_t item, int64_t which) {
    return wb + ((item / half) * panels + which * half + item % half) * panel_bytes;
  };
  tandem::claim_ahead(count, threads, [&](int64_t i, int64_t following) {
    const int64_t e = items[i] / half;
    const int64_t q = items[i] % half;
    thread_local std::vector<float> gate_up;
    gate_up.resize(2 * kGroupRows * kPanel);
    float* sums[2] = {gate_up.data(), gate_up.data() + kGroupRows * kPanel};
    for (int64_t g0 = offsets[e]; g0 < offsets[e + 1]; g0 += kGroupRows) {
      const int64_t gm = std::min(kGroupRows, offsets[e + 1] - g0);
      const bool last_group = g0 + gm == offsets[e + 1];
      for (int64_t which = 0; which < 2; ++which) {
        // After the gate panel the stream goes on to the up panel, after that to the
        // thread's next item (or this item's gate panel again for its next row group).
        const char* after = which == 0     ? panel_of(items[i], 1)
                            : !last_group  ? panel_of(items[i], 0)
                            : following < 0 ? nullptr
                                           : panel_of(items[following], 0);
        panel_pass<Kind>(panel_of(items[i], which), after, steps, chunk_steps, gm, sums[which],
                         kPanel, reinterpret_cast<Elem*>(sums[which]), kPanel, x + g0 * ldx,
                         ldx, /*round_last=*/false);
      }
      tandem::silu_rows(out + g0 * ldo + q * kPanel, ldo, sums[0], sums[1], gm, kPanel);
    }
  });
  return 0;
}

}  // namespace

extern "C" {

// 1 where the compiler targeted AVX-512F (float32), 2 where AVX512-BF16 too, else 0.
int tandem_avx512_built() {
#if defined(__AVX512BF16__)
  return 2;
#else
  return 1;
#endif
}

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) w[n, k], w packed as above.
// Returns 0, or 1 for shapes this kernel does not take (M outside 1..max_rows, N not a
// multiple of 64, K < 1, odd K for bfloat16).
int tandem_avx512_linear_f32(float* out, const float* x, const void* w, int64_t M, int64_t N,
                             int64_t K, int64_t ldx, int64_t ldo, int32_t max_rows,
                             int32_t num_threads) {
  return linear<Float32>(out, x, w, M, N, K, ldx, ldo, max_rows, num_threads);
}

int tandem_avx512_linear_bf16(uint16_t* out, const uint16_t* x, const void* w, int64_t M,
                              int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                              int32_t max_rows, int32_t num_threads) {
#if defined(__AVX512BF16__)
  return linear<BFloat16>(out, x, w, M, N, K, ldx, ldo, max_rows, num_threads);
#else
  return 1;
#endif
}

// out [M, N / 2] = silu(x . gate) * (x . up), w [N, K] packed as above, gate rows then up
// rows (N a multiple of 128). Returns 0, or 1 for shapes this kernel does not take.
int tandem_avx512_linear_silu_f32(float* out, const float* x, const void* w, int64_t M,
                                  int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                  int32_t max_rows, int32_t num_threads) {
  return linear_silu<Float32>(out, x, w, M, N, K, ldx, ldo, max_rows, num_threads);
}

int tandem_avx512_linear_silu_bf16(uint16_t* out, const uint16_t* x, const void* w, int64_t M,
                                   int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                   int32_t max_rows, int32_t num_threads) {
#if defined(__AVX512BF16__)
  return linear_silu<BFloat16>(out, x, w, M, N, K, ldx, ldo, max_rows, num_threads);
#else
  return 1;
#endif
}

// Grouped experts: out rows [offsets[e], offsets[e + 1]) = x rows of the same range times
// expert e's weight [N, K], the experts' weights packed one after another, each as above;
// x has M rows. Returns 0, or 1 for arguments it does not take.
int tandem_avx512_grouped_linear_f32(float* out, const float* x, const void* w,
                                     const int64_t* offsets, int64_t experts, int64_t M,
                                     int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                     int32_t num_threads) {
  return grouped<Float32>(out, x, w, offsets, experts, M, N, K, ldx, ldo, num_threads);
}

int tandem_avx512_grouped_linear_bf16(uint16_t* out, const uint16_t* x, const void* w,
                                      const int64_t* offsets, int64_t experts, int64_t M,
                                      int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                      int32_t num_threads) {
#if defined(__AVX512BF16__)
  return grouped<BFloat16>(out, x, w, offsets, experts, M, N, K, ldx, ldo, num_threads);
#else
  return 1;
#endif
}

// The gate/up projection of grouped experts with SiLU-and-mul fused (see grouped_silu): w
// holds each expert's [N, K] weight, gate rows then up rows (N a multiple of 128); out
// [M, N / 2]. Returns 0, or 1 for arguments it does not take.
int tandem_avx512_grouped_silu_f32(float* out, const float* x, const void* w,
                                   const int64_t* offsets, int64_t experts, int64_t M, int64_t N,
                                   int64_t K, int64_t ldx, int64_t ldo, int32_t num_threads) {
  return grouped_silu<Float32>(out, x, w, offsets, experts, M, N, K, ldx, ldo, num_threads);
}

int tandem_avx512_grouped_silu_bf16(uint16_t* out, const uint16_t* x, const void* w,
                                    const int64_t* offsets, int64_t experts, int64_t M,
                                    int64_t N, int64_t K, int64_t ldx, int64_t ldo,
                                    int32_t num_threads) {
#if defined(__AVX512BF16__)
  return grouped_silu<BFloat16>(out, x, w, offsets, experts, M, N, K, ldx, ldo, num_threads);
#else
  return 1;
#endif
}

}  // extern "C"

#else  // no AVX-512 in this build's target

extern "C" {
int tandem_avx512_built() { return 0; }
int tandem_avx512_linear_f32(float*, const float*, const void*, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx512_linear_bf16(uint16_t*, const uint16_t*, const void*, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx512_grouped_linear_f32(float*, const float*, const void*, const int64_t*,
                                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     int32_t) {
  return 1;
}
int tandem_avx512_grouped_linear_bf16(uint16_t*, const uint16_t*, const void*,
                                      const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, int32_t) {
  return 1;
}
int tandem_avx512_linear_silu_f32(float*, const float*, const void*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx512_linear_silu_bf16(uint16_t*, const uint16_t*, const void*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int32_t, int32_t) {
  return 1;
}
int tandem_avx512_grouped_silu_f32(float*, const float*, const void*, const int64_t*, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, int32_t) {
  return 1;
}
int tandem_avx512_grouped_silu_bf16(uint16_t*, const uint16_t*, const void*, const int64_t*,
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int32_t) {
  return 1;
}
}  // extern "C"

#endif
