// out[M, N] = x[M, K] . W[N, K]^T in float32 with AVX-512 FMAs, for decode-size M, reading
// the weight where oneDNN packed it.
//
// Why: at decode batch sizes oneDNN's float32 kernels on a 2-core AVX-512 host (AMD Zen 5)
// reach ~300 GFLOP/s on the packed weights, where its FMA units give ~460 and memory ~37
// GB/s: it pulls each weight panel from memory in one burst, in the first pass over it, and
// computes from cache while nothing streams. This kernel cuts each 64-column panel into
// K chunks and, while it computes one chunk for every row block, prefetches the next chunk,
// spread over those passes: the weight stream and the FMAs overlap. Measured on all 33
// weights of the bench model at M = 48: ~28 ms per decode step against oneDNN's ~32-35.
//
// The packed layout (what torch.ops.mkldnn._reorder_linear_weight gives for float32 on
// AVX-512 CPUs when N is a multiple of 64): [N / 64][Kp][64] with Kp = K rounded up to 16,
// i.e. per 64-column panel Kp rows of 64 floats (the rows past K zero), each row four zmm
// vectors. oneDNN does not promise this layout, so the
// Python side checks each weight against oneDNN's own product before it hands it here.
//
// Rounding: each output is one float32 FMA chain over k in order (oneDNN sums in another
// order; results differ by float32 roundings).
//
// Plain C entry points; pointers with row strides (elements).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <omp.h>

#if defined(__AVX512F__)

namespace {

constexpr int64_t kPanel = 64;    // columns of one packed panel
constexpr int64_t kRows = 6;      // rows of one register block: 6 x 4 accumulators
constexpr int64_t kChunk = 384;   // K rows of a panel computed for every row block at once
constexpr int64_t kLine = 64;     // bytes of a cache line
constexpr int64_t kKPad = 16;     // a panel's K rows are padded to a multiple of this

// The thread's next weight bytes to prefetch, up to `end`, `lines` cache lines per K step.
struct Prefetch {
  const char* next;
  const char* end;
  int lines;
};

// out rows [0, MR) x 64 columns (+)= x rows [0, MR) x chunk [kc] . panel chunk.
template <int MR, bool FIRST>
inline void block(float* out, int64_t ldo, const float* x, int64_t ldx, const float* w,
                  int64_t kc, Prefetch& fetch) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) {
      acc[m][j] = FIRST ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * ldo + 16 * j);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    for (int l = 0; l < fetch.lines && fetch.next < fetch.end; ++l) {
      _mm_prefetch(fetch.next, _MM_HINT_T0);
      fetch.next += kLine;
    }
    const float* wk = w + k * kPanel;
    const __m512 b0 = _mm512_load_ps(wk);
    const __m512 b1 = _mm512_load_ps(wk + 16);
    const __m512 b2 = _mm512_load_ps(wk + 32);
    const __m512 b3 = _mm512_load_ps(wk + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, b2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(a, b3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + m * ldo + 16 * j, acc[m][j]);
  }
}

template <bool FIRST>
inline void rows(int64_t mr, float* out, int64_t ldo, const float* x, int64_t ldx,
                 const float* w, int64_t kc, Prefetch& fetch) {
  switch (mr) {
    case 6: block<6, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
    case 5: block<5, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
    case 4: block<4, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
    case 3: block<3, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
    case 2: block<2, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
    default: block<1, FIRST>(out, ldo, x, ldx, w, kc, fetch); break;
  }
}

}  // namespace

extern "C" {

int tandem_avx512_built() { return 1; }

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) w[n, k], w packed as above.
// Returns 0, or 1 for shapes this kernel does not take (M outside 1..max_rows, N not a
// multiple of 64, K < 1).
int tandem_avx512_linear(float* out, const float* x, const float* w, int64_t M, int64_t N,
                         int64_t K, int64_t ldx, int64_t ldo, int32_t max_rows,
                         int32_t num_threads) {
  if (M < 1 || M > max_rows || N <= 0 || N % kPanel != 0 || K < 1) return 1;
  const int64_t panels = N / kPanel;
  const int64_t kp = (K + kKPad - 1) / kKPad * kKPad;
  const int64_t blocks = (M + kRows - 1) / kRows;
  // One chunk is kc * 4 lines; the row blocks together prefetch the next one.
  const int lines = static_cast<int>((4 + blocks - 1) / blocks);
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels)));
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const int64_t lo = panels * id / team;
    const int64_t hi = panels * (id + 1) / team;
    // The thread's panels are one contiguous stream of weight bytes.
    const char* stream_end = reinterpret_cast<const char*>(w + hi * kp * kPanel);
    Prefetch fetch{reinterpret_cast<const char*>(w + lo * kp * kPanel), stream_end, lines};
    for (int64_t p = lo; p < hi; ++p) {
      const float* panel = w + p * kp * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        const float* chunk = panel + k0 * kPanel;
        const char* following = reinterpret_cast<const char*>(chunk + kc * kPanel);
        fetch.next = std::max(fetch.next, following);
        fetch.end = std::min(stream_end, following + kChunk * kPanel * sizeof(float));
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          float* o = out + m0 * ldo + p * kPanel;
          const float* xr = x + m0 * ldx + k0;
          const int64_t mr = std::min(kRows, M - m0);
          if (k0 == 0) {
            rows<true>(mr, o, ldo, xr, ldx, chunk, kc, fetch);
          } else {
            rows<false>(mr, o, ldo, xr, ldx, chunk, kc, fetch);
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"

#else  // no AVX-512 in this build's target

extern "C" {
int tandem_avx512_built() { return 0; }
int tandem_avx512_linear(float*, const float*, const float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int32_t, int32_t) {
  return 1;
}
}  // extern "C"

#endif
