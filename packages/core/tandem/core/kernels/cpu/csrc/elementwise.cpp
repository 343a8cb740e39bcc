// Fused elementwise kernels of the decoder layers on CPU: a residual add with the RMSNorm that
// follows it, q/k RMSNorm with the rotary embedding (in place; Qwen3's, or Qwen3.5's
// zero-centred norm with partial rotary), the gated SiLU, and Qwen3.5's
// linear-attention gates and the gated RMSNorm of its output.
//
// Why: done op by op in torch, a decoder layer runs about sixty small ops per step (each a
// dispatch, an allocation, and on two threads a parallel region costing more than the
// arithmetic), and each op makes a pass over memory. Here each fused kernel is one call and
// one pass. Rounding follows the torch ops they replace step for step (a bfloat16 result is
// rounded to nearest-even wherever torch would store one; compiled without FMA contraction so
// float products are rounded where torch rounds them); sums of squares and exp are computed
// in another order and by another polynomial than torch's, so a result may differ from the
// reference path by a unit in its last place.
//
// Plain C entry points (no torch headers); tensors arrive as pointers with row strides.
// dtype: 0 = float32, 1 = bfloat16 (uint16 storage).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "vec_math.h"

namespace {

using tandem::bf16_to_float;
using tandem::fast_exp;
using tandem::float_to_bf16;
// A value as torch stores it in the tensor's dtype (rounded to bfloat16, or left as is), read
// as float, and stored in the dtype.
using tandem::rounded;
using tandem::store_as;
using tandem::to_float;

// A parallel region costs a few microseconds inside a forward, whose kernels follow one
// another while the team's other threads spin, and tens where it must wake a sleeping one
// (the first region of a step pays that, whichever kernel it is): only inputs big enough to
// pay for it go parallel: a decode step's dozens of tokens do, a handful stays on one. On
// the AMX Xeon (2 cores), bfloat16 at 48 tokens: the residual add and norm of 512-wide rows
// 19.0 -> 14.6 us a call, the bench dense model's q/k norm and rotary (16/8 heads of 64)
// 73.8 -> 43.0 us, the bench hybrid's gated norm (8 heads of 64) 59.2 -> 32.6 us.
constexpr int64_t kParallelElements = 1 << 14;

inline int threads_for(int64_t elements, int threads) {
  return elements >= kParallelElements && threads > 1 ? threads : 1;
}

// One row of RMSNorm: out = w * round(h * rsqrt(mean(h^2) + eps)), h in float; or, with
// `centered` (Qwen3.5's zero-centred norm, whose weight is an offset from one),
// out = round(h * rsqrt(mean(h^2) + eps) * (1 + w)), rounded once as its reference does.
template <typename T>
inline void norm_row(const float* h, const T* weight, T* out, int64_t dim, float eps,
                     bool centered) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < dim; ++i) sumsq += h[i] * h[i];
  float inv = 1.f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
  if (centered) {
    for (int64_t i = 0; i < dim; ++i) store_as(out + i, h[i] * inv * (1.f + to_float(weight[i])));
    return;
  }
  for (int64_t i = 0; i < dim; ++i) {
    float normalized = rounded<T>(h[i] * inv);
    store_as(out + i, to_float(weight[i]) * normalized);
  }
}

template <typename T>
void add_rms_norm(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t dim,
                  int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps,
                  bool centered, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, threads)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float h[8192];
    const T* xr = x + r * x_stride;
    if (residual != nullptr) {
      // The residual stream becomes x + residual, stored in the model's dtype as torch's
      // add would store it; the norm reads the stored value.
      T* rr = residual + r * residual_stride;
      for (int64_t i = 0; i < dim; ++i) {
        float sum = rounded<T>(to_float(xr[i]) + to_float(rr[i]));
        store_as(rr + i, sum);
        h[i] = sum;
      }
    } else {
      for (int64_t i = 0; i < dim; ++i) h[i] = to_float(xr[i]);
    }
    norm_row<T>(h, weight, out + r * out_stride, dim, eps, centered);
  }
}

// The RMSNorm of one row as norm_row stores it, as floats into `dst` (which may be `h`).
template <typename T>
inline void norm_row_values(const float* h, const T* weight, float* dst, int64_t dim, float eps,
                            bool centered) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < dim; ++i) sumsq += h[i] * h[i];
  float inv = 1.f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
  if (centered) {
    for (int64_t i = 0; i < dim; ++i) dst[i] = rounded<T>(h[i] * inv * (1.f + to_float(weight[i])));
    return;
  }
  for (int64_t i = 0; i < dim; ++i) {
    dst[i] = rounded<T>(to_float(weight[i]) * rounded<T>(h[i] * inv));
  }
}

// Rotate-half rotary of one head of D values `h` at table row `pos` (cos/sin [*, D/2]) into
// `x`: o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, each product and sum stored as torch
// stores it. Reading a float copy, not `x` itself, lets the loop vectorize.
template <typename T>
inline void rotate_head(const float* h, T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    float x1 = h[i], x2 = h[i + half];
    float c = to_float(cos[i]), s = to_float(sin[i]);
    store_as(x + i, rounded<T>(x1 * c) - rounded<T>(x2 * s));
    store_as(x + i + half, rounded<T>(x2 * c) + rounded<T>(x1 * s));
  }
}

// The shape of a q/k norm + rotary call. Each head of `head_dim` values has its first
// `rotary_dim` rotated (the rest, partial rotary's pass-through, only normalised); heads lie
// at `*_head_stride` apart (2 head_dim where each query sits beside its output gate, as in
// Qwen3.5's projection), tokens at `*_stride`. `centered`: the zero-centred norm.
struct QkShape {
  int64_t tokens, q_heads, k_heads, head_dim, rotary_dim;
  int64_t q_stride, q_head_stride, k_stride, k_head_stride, table_stride;
  float eps;
  bool centered;
};

template <typename T>
void qk_norm_rotary(T* q, T* k, const T* q_weight, const T* k_weight, const T* cos_table,
                    const T* sin_table, const int64_t* positions, const QkShape& s,
                    int threads) {
  const int64_t dim = s.head_dim, rot = s.rotary_dim;
  const int64_t heads = s.q_heads + s.k_heads;
#pragma omp parallel for num_threads(threads_for(s.tokens * heads * dim, threads)) \
    schedule(static)
  for (int64_t t = 0; t < s.tokens; ++t) {
    float h[1024];
    const int64_t pos = positions[t];
    const T* cos = cos_table + pos * s.table_stride;
    const T* sin = sin_table + pos * s.table_stride;
    for (int64_t j = 0; j < heads; ++j) {
      const bool is_q = j < s.q_heads;
      T* x = is_q ? q + t * s.q_stride + j * s.q_head_stride
                  : k + t * s.k_stride + (j - s.q_heads) * s.k_head_stride;
      const T* w = is_q ? q_weight : k_weight;
      for (int64_t i = 0; i < dim; ++i) h[i] = to_float(x[i]);
      if (w != nullptr) {
        norm_row_values<T>(h, w, h, dim, s.eps, s.centered);
        // The pass-through dims, already rounded: stored as they are.
        for (int64_t i = rot; i < dim; ++i) store_as(x + i, h[i]);
      }
      rotate_head<T>(h, x, cos, sin, rot / 2);
    }
  }
}

#if defined(__AVX512F__)
// The same per head, 16 elements per vector, for head sizes the compiler cannot be trusted
// to vectorize through the per-element rounding (a bfloat16 result rounded wherever torch
// stores one, as above, with the same round-to-nearest-even and NaN).
template <typename T>
inline __m512 vload(const T* p);
template <>
inline __m512 vload<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 vload<uint16_t>(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline __m512 vstored(__m512 x);
template <>
inline __m512 vstored<float>(__m512 x) { return x; }
template <>
inline __m512 vstored<uint16_t>(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan,
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

// Stores a value vstored<T> already rounded.
template <typename T>
inline void vstore(T* p, __m512 x);
template <>
inline void vstore<float>(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
template <>
inline void vstore<uint16_t>(uint16_t* p, __m512 x) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

// R: the rotated dims (D, or fewer with partial rotary), R / 2 a whole number of vectors.
template <typename T, int D, int R>
void qk_norm_rotary_vec(T* q, T* k, const T* q_weight, const T* k_weight, const T* cos_table,
                        const T* sin_table, const int64_t* positions, const QkShape& s,
                        int threads) {
  constexpr int C = D / 16;
  constexpr int RC = R / 16;
  constexpr int HC = RC / 2;
  static_assert(R <= D && R % 32 == 0, "the rotated half must be whole vectors");
  const int64_t heads = s.q_heads + s.k_heads;
  const float eps = s.eps;
  const bool centered = s.centered;
  // The scale: w, or (zero-centred) 1 + w, computed in float as the reference computes it.
  const auto scale = [centered](const T* w, int c) {
    if (w == nullptr) return _mm512_setzero_ps();
    const __m512 v = vload(w + 16 * c);
    return centered ? _mm512_add_ps(_mm512_set1_ps(1.f), v) : v;
  };
  __m512 wq[C], wk[C];
  for (int c = 0; c < C; ++c) {
    wq[c] = scale(q_weight, c);
    wk[c] = scale(k_weight, c);
  }
#pragma omp parallel for num_threads(threads_for(s.tokens * heads * D, threads)) \
    schedule(static)
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int64_t pos = positions[t];
    __m512 cv[HC], sv[HC];
    for (int c = 0; c < HC; ++c) {
      cv[c] = vload(cos_table + pos * s.table_stride + 16 * c);
      sv[c] = vload(sin_table + pos * s.table_stride + 16 * c);
    }
    for (int64_t j = 0; j < heads; ++j) {
      const bool is_q = j < s.q_heads;
      T* x = is_q ? q + t * s.q_stride + j * s.q_head_stride
                  : k + t * s.k_stride + (j - s.q_heads) * s.k_head_stride;
      const bool norm = (is_q ? q_weight : k_weight) != nullptr;
      const __m512* w = is_q ? wq : wk;
      __m512 h[C];
      for (int c = 0; c < C; ++c) h[c] = vload(x + 16 * c);
      if (norm) {
        __m512 acc = _mm512_mul_ps(h[0], h[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_add_ps(acc, _mm512_mul_ps(h[c], h[c]));
        const float sumsq = _mm512_reduce_add_ps(acc);
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sumsq / static_cast<float>(D) + eps));
        for (int c = 0; c < C; ++c) {
          // round(h inv (1 + w)) zero-centred, round(w round(h inv)) otherwise.
          h[c] = centered ? vstored<T>(_mm512_mul_ps(_mm512_mul_ps(h[c], inv), w[c]))
                          : vstored<T>(_mm512_mul_ps(w[c], vstored<T>(_mm512_mul_ps(h[c], inv))));
        }
        for (int c = RC; c < C; ++c) vstore(x + 16 * c, h[c]);
      }
      for (int c = 0; c < HC; ++c) {
        const __m512 x1 = h[c], x2 = h[c + HC];
        const __m512 o1 = vstored<T>(_mm512_sub_ps(vstored<T>(_mm512_mul_ps(x1, cv[c])),
                                                   vstored<T>(_mm512_mul_ps(x2, sv[c]))));
        const __m512 o2 = vstored<T>(_mm512_add_ps(vstored<T>(_mm512_mul_ps(x2, cv[c])),
                                                   vstored<T>(_mm512_mul_ps(x1, sv[c]))));
        vstore(x + 16 * c, o1);
        vstore(x + 16 * (c + HC), o2);
      }
    }
  }
}

// The vectorized kernel for the head sizes models use (whole or a half, quarter or eighth of
// the head rotated, as partial rotary does); false for others.
template <typename T>
bool qk_norm_rotary_fast(T* q, T* k, const T* q_weight, const T* k_weight, const T* cos_table,
                         const T* sin_table, const int64_t* positions, const QkShape& s,
                         int threads) {
  using Kernel = void (*)(T*, T*, const T*, const T*, const T*, const T*, const int64_t*,
                          const QkShape&, int);
  struct Variant {
    int64_t dim, rotary;
    Kernel run;
  };
  static constexpr Variant kVariants[] = {
      {64, 64, qk_norm_rotary_vec<T, 64, 64>},     {64, 32, qk_norm_rotary_vec<T, 64, 32>},
      {128, 128, qk_norm_rotary_vec<T, 128, 128>}, {128, 64, qk_norm_rotary_vec<T, 128, 64>},
      {128, 32, qk_norm_rotary_vec<T, 128, 32>},   {256, 256, qk_norm_rotary_vec<T, 256, 256>},
      {256, 128, qk_norm_rotary_vec<T, 256, 128>}, {256, 64, qk_norm_rotary_vec<T, 256, 64>},
      {256, 32, qk_norm_rotary_vec<T, 256, 32>},
  };
  for (const Variant& v : kVariants) {
    if (v.dim == s.head_dim && v.rotary == s.rotary_dim) {
      v.run(q, k, q_weight, k_weight, cos_table, sin_table, positions, s, threads);
      return true;
    }
  }
  return false;
}
#else
template <typename T>
bool qk_norm_rotary_fast(T*, T*, const T*, const T*, const T*, const T*, const int64_t*,
                         const QkShape&, int) {
  return false;
}
#endif

template <typename T>
void silu_mul(T* out, const T* gate_up, int64_t rows, int64_t inter, int64_t in_stride,
              int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter, threads)) \
    schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * in_stride;
    const T* u = g + inter;
    T* o = out + r * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      float x = to_float(g[i]);
      float silu = rounded<T>(x / (1.f + fast_exp(-x)));
      store_as(o + i, silu * to_float(u[i]));
    }
  }
}

// Qwen3.5's gated RMSNorm of the Gated DeltaNet output, one head of `dim` values per row:
// out = round(round(w * round(x * inv)) * silu(gate)), the normalised value rounded to the
// input dtype before the weight and the weighted value rounded again (a multiply in that
// dtype, as the reference's), the gate product taken in float and rounded once. SiLU through
// fast_exp, as silu_mul. Each token's row holds `heads` rows of `dim` back to back, so x and
// gate can be [tokens, heads, dim] views of wider projections (token strides x_stride and
// gate_stride); out is contiguous.
template <typename T>
void rms_norm_gated(T* out, const T* x, const T* gate, const T* weight, int64_t tokens,
                    int64_t heads, int64_t dim, int64_t x_stride, int64_t gate_stride,
                    float eps, int threads) {
  const int64_t rows = tokens * heads;
#pragma omp parallel for num_threads(threads_for(rows * dim, threads)) \
    schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / heads, j = r % heads;
    const T* xr = x + t * x_stride + j * dim;
    const T* gr = gate + t * gate_stride + j * dim;
    T* o = out + r * dim;
    float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = 0; i < dim; ++i) {
      const float h = to_float(xr[i]);
      sumsq += h * h;
    }
    const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float weighted = rounded<T>(to_float(weight[i]) * rounded<T>(to_float(xr[i]) * inv));
      const float g = to_float(gr[i]);
      store_as(o + i, weighted * (g / (1.f + fast_exp(-g))));
    }
  }
}

// log(u) for finite u >= 1: u = m 2^k with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
// s = (m - 1) / (m + 1), |s| < 0.172, by its odd series to s^9 (truncation below 1e-8
// relative), k ln 2 in two parts as fast_exp splits it. Written without calls, as fast_exp,
// so that loops over rows vectorize; within a few ulp of logf.
inline float fast_log(float u) {
  int32_t bits;
  std::memcpy(&bits, &u, sizeof(bits));
  int32_t k = ((bits >> 23) & 0xFF) - 127;
  const int32_t mantissa = (bits & 0x7FFFFF) | 0x3F800000;
  float m;
  std::memcpy(&m, &mantissa, sizeof(m));
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  k = high ? k + 1 : k;
  const float s = (m - 1.f) / (m + 1.f);
  const float s2 = s * s;
  float p = 1.f / 9.f;
  p = p * s2 + 1.f / 7.f;
  p = p * s2 + 1.f / 5.f;
  p = p * s2 + 1.f / 3.f;
  p = p * s2 + 1.f;
  const float kf = static_cast<float>(k);
  return kf * 0.693145751953125f + (kf * 1.428606765330187045e-06f + 2.f * s * p);
}

// softplus(x) as torch computes it: x above the threshold 20, else log1p(exp(x)); log1p(e)
// as log(1 + e) * e / ((1 + e) - 1), which cancels the rounding of 1 + e (Goldberg), and e
// itself where 1 + e rounds to 1. Without selects between computed values (GCC turns those
// into branches, and a loop with branches does not vectorize): the mask adds e where
// log(1) * e is 0; and since log1p(exp(x)) > x, max(x, .) is log1p(exp(x)) up to (x, 20],
// where the two agree to its last place, and x beyond, where exp(20) caps the other.
constexpr float kSoftplusThreshold = 20.f;

inline float softplus(float x) {
  const float e = fast_exp(x < kSoftplusThreshold ? x : kSoftplusThreshold);
  const float u = 1.f + e;
  const float d = u - 1.f;
  const float ratio = e / (d == 0.f ? 1.f : d);
  const float log1p = fast_log(u) * ratio + static_cast<float>(d == 0.f) * e;
  return std::max(x, log1p);
}

// Gated DeltaNet's gates per (token, value head): beta = sigmoid(b) in the input dtype, and
// the decay g = -exp(A_log) * softplus(a + dt_bias) in float32 (exp(A_log) overflows half
// precision), each step in float as the reference's torch ops round them. exp(A_log) is the
// C library's (once per head); the per-element exps and logs are fast_exp and fast_log.
// a and b are [tokens, heads] columns of one projection (token strides a_stride and
// b_stride); g and beta are contiguous. A model has a few heads per rank, too few for a
// vector: each block of the flattened [tokens * heads] is gathered first, then computed
// as one vectorized run.
constexpr int64_t kMaxGatingHeads = 4096;
constexpr int64_t kGatingBlock = 256;

template <typename T>
void gdn_gating(float* g, T* beta, const T* a, const T* b, const T* a_log, const T* dt_bias,
                int64_t tokens, int64_t heads, int64_t a_stride, int64_t b_stride,
                int threads) {
  float decay[kMaxGatingHeads];
  float bias[kMaxGatingHeads];
  for (int64_t j = 0; j < heads; ++j) {
    decay[j] = -std::exp(to_float(a_log[j]));
    bias[j] = to_float(dt_bias[j]);
  }
  const int64_t total = tokens * heads;
  const int64_t blocks = (total + kGatingBlock - 1) / kGatingBlock;
#pragma omp parallel for num_threads(threads_for(total, threads)) \
    schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t first = block * kGatingBlock;
    const int64_t n = total - first < kGatingBlock ? total - first : kGatingBlock;
    float xa[kGatingBlock], xb[kGatingBlock], scale[kGatingBlock];
    int64_t t = first / heads, j = first % heads;
    for (int64_t i = 0; i < n; ++i) {
      xa[i] = to_float(a[t * a_stride + j]) + bias[j];
      xb[i] = to_float(b[t * b_stride + j]);
      scale[i] = decay[j];
      if (++j == heads) {
        j = 0;
        ++t;
      }
    }
    float* gb = g + first;
    T* betab = beta + first;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      gb[i] = scale[i] * softplus(xa[i]);
      store_as(betab + i, 1.f / (1.f + fast_exp(-xb[i])));
    }
  }
}

// The vectorized kernel where it has the shape, else the plain loops; 0 (ok).
template <typename T>
int qk_norm_rotary_call(void* q, void* k, const void* q_weight, const void* k_weight,
                        const void* cos_table, const void* sin_table, const int64_t* positions,
                        const QkShape& shape, int threads) {
  auto* qt = static_cast<T*>(q);
  auto* kt = static_cast<T*>(k);
  const auto* qw = static_cast<const T*>(q_weight);
  const auto* kw = static_cast<const T*>(k_weight);
  const auto* c = static_cast<const T*>(cos_table);
  const auto* s = static_cast<const T*>(sin_table);
  if (!qk_norm_rotary_fast<T>(qt, kt, qw, kw, c, s, positions, shape, threads)) {
    qk_norm_rotary<T>(qt, kt, qw, kw, c, s, positions, shape, threads);
  }
  return 0;
}

}  // namespace

extern "C" {

// Codes: 0 ok, 1 unsupported dtype, 2 a dimension over the kernel's row buffer.
int tandem_add_rms_norm(void* out, void* residual, const void* x, const void* weight,
                        int64_t rows, int64_t dim, int64_t x_stride, int64_t out_stride,
                        int64_t residual_stride, float eps, int32_t centered, int32_t dtype,
                        int32_t threads) {
  if (dim > 8192) return 2;
  if (dtype == 0) {
    add_rms_norm<float>(static_cast<float*>(out), static_cast<float*>(residual),
                        static_cast<const float*>(x), static_cast<const float*>(weight), rows,
                        dim, x_stride, out_stride, residual_stride, eps, centered != 0,
                        threads);
  } else if (dtype == 1) {
    add_rms_norm<uint16_t>(static_cast<uint16_t*>(out), static_cast<uint16_t*>(residual),
                           static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight),
                           rows, dim, x_stride, out_stride, residual_stride, eps, centered != 0,
                           threads);
  } else {
    return 1;
  }
  return 0;
}

// Codes: 0 ok, 1 unsupported dtype, 2 a head size over the kernel's buffer or odd, or a
// rotated part that is odd or wider than the head.
int tandem_qk_norm_rotary(void* q, void* k, const void* q_weight, const void* k_weight,
                          const void* cos_table, const void* sin_table, const int64_t* positions,
                          int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                          int64_t rotary_dim, int64_t q_stride, int64_t q_head_stride,
                          int64_t k_stride, int64_t k_head_stride, int64_t table_stride,
                          float eps, int32_t centered, int32_t dtype, int32_t threads) {
  if (head_dim > 1024 || head_dim % 2 != 0) return 2;
  if (rotary_dim <= 0 || rotary_dim > head_dim || rotary_dim % 2 != 0) return 2;
  const QkShape shape{tokens,   q_heads,       k_heads,  head_dim,      rotary_dim,
                      q_stride, q_head_stride, k_stride, k_head_stride, table_stride,
                      eps,      centered != 0};
  if (dtype == 0) {
    return qk_norm_rotary_call<float>(q, k, q_weight, k_weight, cos_table, sin_table, positions,
                                      shape, threads);
  }
  if (dtype == 1) {
    return qk_norm_rotary_call<uint16_t>(q, k, q_weight, k_weight, cos_table, sin_table,
                                         positions, shape, threads);
  }
  return 1;
}

int tandem_rms_norm_gated(void* out, const void* x, const void* gate, const void* weight,
                          int64_t tokens, int64_t heads, int64_t dim, int64_t x_stride,
                          int64_t gate_stride, float eps, int32_t dtype, int32_t threads) {
  if (dtype == 0) {
    rms_norm_gated<float>(static_cast<float*>(out), static_cast<const float*>(x),
                          static_cast<const float*>(gate), static_cast<const float*>(weight),
                          tokens, heads, dim, x_stride, gate_stride, eps, threads);
  } else if (dtype == 1) {
    rms_norm_gated<uint16_t>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                             static_cast<const uint16_t*>(gate),
                             static_cast<const uint16_t*>(weight), tokens, heads, dim, x_stride,
                             gate_stride, eps, threads);
  } else {
    return 1;
  }
  return 0;
}

// Codes: 0 ok, 1 unsupported dtype, 2 more heads than kMaxGatingHeads.
int tandem_gdn_gating(float* g, void* beta, const void* a, const void* b, const void* a_log,
                      const void* dt_bias, int64_t tokens, int64_t heads, int64_t a_stride,
                      int64_t b_stride, int32_t dtype, int32_t threads) {
  if (heads > kMaxGatingHeads) return 2;
  if (dtype == 0) {
    gdn_gating<float>(g, static_cast<float*>(beta), static_cast<const float*>(a),
                      static_cast<const float*>(b), static_cast<const float*>(a_log),
                      static_cast<const float*>(dt_bias), tokens, heads, a_stride, b_stride,
                      threads);
  } else if (dtype == 1) {
    gdn_gating<uint16_t>(g, static_cast<uint16_t*>(beta), static_cast<const uint16_t*>(a),
                         static_cast<const uint16_t*>(b), static_cast<const uint16_t*>(a_log),
                         static_cast<const uint16_t*>(dt_bias), tokens, heads, a_stride,
                         b_stride, threads);
  } else {
    return 1;
  }
  return 0;
}

int tandem_silu_mul(void* out, const void* gate_up, int64_t rows, int64_t inter,
                    int64_t in_stride, int64_t out_stride, int32_t dtype, int32_t threads) {
  if (dtype == 0) {
    silu_mul<float>(static_cast<float*>(out), static_cast<const float*>(gate_up), rows, inter,
                    in_stride, out_stride, threads);
  } else if (dtype == 1) {
    silu_mul<uint16_t>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(gate_up), rows,
                       inter, in_stride, out_stride, threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
