// Numeric helpers shared by the CPU attention kernels: bfloat16 <-> float32 conversions
// as torch rounds them, row loads and stores in either dtype, and (with AVX-512) a 16-lane
// exp for softmax. Header-only; each kernel library compiles its own copy.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Which of a kernel's code paths this build compiled (2: AVX-512, 1: AVX2 with FMA, 0: the
// plain loops), so the loader can say what serves, and tests can check that an ISA level
// they asked for (TANDEM_CPU_ISA) is the one they got.
#if defined(__AVX512F__)
#define TANDEM_COMPILED_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define TANDEM_COMPILED_ISA 1
#else
#define TANDEM_COMPILED_ISA 0
#endif

extern "C" int tandem_compiled_isa() { return TANDEM_COMPILED_ISA; }

namespace tandem {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to nearest even, as c10::BFloat16 does; NaN becomes torch's quiet NaN. A select,
// not a branch, so loops over rows vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  uint32_t bias = ((bits >> 16) & 1u) + 0x7FFFu;
  uint16_t rounded = static_cast<uint16_t>((bits + bias) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : rounded;
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

// `v` as dtype T holds it (float32: itself; bfloat16: rounded to nearest-even), kept in
// float, for arithmetic that must round where torch's ops on T round; and stored as T.
template <typename T>
inline float rounded(float v);
template <>
inline float rounded<float>(float v) {
  return v;
}
template <>
inline float rounded<uint16_t>(float v) {
  return bf16_to_float(float_to_bf16(v));
}
inline void store_as(float* p, float v) { *p = v; }
inline void store_as(uint16_t* p, float v) { *p = float_to_bf16(v); }

// exp(x) in float: x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n by exponent bits.
// Written without calls so loops over rows vectorize; within 2 ulp of expf.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out rows [0, rows) x `width` columns (row stride ldo) = silu(gate) * up of the float32 sums
// of a gate panel and its up panel ([rows][width] each), the epilogue of the linear kernels'
// fused gate/up products: elementwise.cpp's silu_mul to the bit (the same operations, both
// built without FMA contraction), the sums first rounded to the dtype as the unfused GEMM
// rounds its output.
template <typename Elem>
inline void silu_rows(Elem* out, int64_t ldo, const float* gate, const float* up, int64_t rows,
                      int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    Elem* o = out + r * ldo;
    const float* g = gate + r * width;
    const float* u = up + r * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float x = rounded<Elem>(g[c]);
      const float silu = rounded<Elem>(x / (1.f + fast_exp(-x)));
      store_as(o + c, silu * rounded<Elem>(u[c]));
    }
  }
}

// Widen `n` elements of a row (float32 or bfloat16) into `dst`, times `scale`.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n, float scale);

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

template <>
inline void store_row<uint16_t>(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i] * scale);
}

#if defined(__AVX512F__)

template <typename T>
inline __m512 load16(const T* p);

template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (scores minus their maximum). Range reduction x = n ln2 + r with
// |r| <= ln2 / 2, a Taylor polynomial, and scalef for 2^n, which also flushes very negative
// x to 0 instead of wrapping. Degree 7 by default (truncation below 1e-8 relative); degree 5
// (below r^6 / 720 <= 2.4e-6) where every result is rounded to bfloat16 anyway (2^-9).
template <int Degree = 7>
inline __m512 exp16(__m512 x) {
  static_assert(Degree == 5 || Degree == 7, "exp16 has degree 5 or 7");
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 120.0f);
  if constexpr (Degree == 7) {
    p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  }
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)

template <typename T>
inline __m256 load8(const T* p);

template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}

template <>
inline __m256 load8<uint16_t>(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0, as exp16 computes it (the same reduction and polynomial); AVX2 has no
// scalef, so 2^n is built in the exponent bits, and x below -87 (where that would leave the
// normal range) gives 0, as exp16's flush does.
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 floor = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Lane t of the result is the sum of the 8 lanes of a[t]: eight dot products finished
// together (4 + 2 horizontal adds, 2 lane permutes, 1 add) instead of a reduction each.
inline __m256 transpose_sum8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  // Per 128-bit half: the four-lane partial sums of rows 0-3 (u0) and 4-7 (u1).
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#endif  // __AVX2__ && __FMA__

// Cache lines asked for a few at a time between a kernel's arithmetic, rather than in one
// burst before it. On the AMX Xeon guest the burst's misses wait for the core's fill buffers
// and the arithmetic waits behind them, so a memory-bound kernel paid for both; spread out,
// the reads overlap the arithmetic (a scratch read of scattered 16 KiB blocks with 0.94 ms of
// arithmetic over 1.49 ms of reads: 2.39 ms with a block asked for in one burst, 1.50 ms a
// line at a time). Write: the lines will be written (PREFETCHW); locality as
// __builtin_prefetch's (1: into L2, 3: into L1).
template <bool Write, int Locality>
struct Ahead {
  const char* lines = nullptr;  // null: nothing to ask for
  int64_t count = 0;
  int64_t done = 0;
  // The cache lines of `elems` elements of T from p, part k of `parts` of them (null p:
  // nothing).
  template <typename T>
  static Ahead part(const T* p, int64_t elems, int64_t k, int64_t parts) {
    const int64_t all = (elems * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const int64_t first = all * k / parts;
    const char* base = reinterpret_cast<const char*>(p);
    return {p == nullptr ? nullptr : base + 64 * first, all * (k + 1) / parts - first};
  }
  // Lines a step when spread over `steps` steps.
  int64_t per(int64_t steps) const { return steps > 0 ? (count + steps - 1) / steps : 0; }
  // The next `n` lines (of those not yet asked for).
  void fetch(int64_t n) {
    if (lines == nullptr) return;
    for (const int64_t end = done + n < count ? done + n : count; done < end; ++done) {
      __builtin_prefetch(lines + 64 * done, Write ? 1 : 0, Locality);
    }
  }
  void rest() { fetch(count - done); }
};

}  // namespace tandem
