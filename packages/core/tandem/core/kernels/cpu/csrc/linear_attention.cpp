// The decode step of Gated DeltaNet's two stateful parts, fused, each state updated in place
// in its slot of the pool; and the same over runs of tokens of one sequence in order (a
// sequence verifying drafts), the state after each but the last also kept in a scratch row.
//
// The causal conv1d update (the reference: kernels/reference/causal_conv1d.py,
// causal_conv1d_update): per sequence and channel, the K - 1 inputs kept in the state and the
// new one times the channel's K taps, summed in float32 and rounded to the input dtype, then
// SiLU; the state shifted by one. The reference gathers, concatenates and widens the batch's
// states and windows into new tensors first.
//
// The one-step gated delta rule (kernels/reference/gated_delta_rule.py,
// recurrent_gated_delta_rule): per (sequence, value head) the float32 state S [Dk, Dv] is read
// once and written once,
//
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
//
// with q and k L2-normalised in float32 (q also scaled by Dk^-1/2), key head h / (Hv / Hk)
// serving value head h. The torch reference materialises the gathered states five times
// over (select, decay, update, matmuls, copy back), a dozen MiB per layer at a 48-sequence
// decode step, where this reads 16 KiB per head from memory and does the rest in L1.
//
// Arithmetic in float32, 32 columns of the state at a time in vectors the compiler makes for
// the target (``delta_columns``: both products from one read of the state, then the update);
// outputs rounded to the output dtype once. Built by
// tandem.core.kernels.cpu.gated_delta_rule with the system C++ compiler and -march=native;
// called through ctypes. Padding entries may share the null slot 0, whose contents nothing
// reads: their writes race there and only there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

using namespace tandem;

constexpr int64_t kMaxDim = 256;
constexpr float kNormEps = 1e-6f;

// a * b + c, fused where the CPU has FMA (one rounding), two operations where it has not.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// sum(a[i] b[i]) in kLanes partial sums, then those summed: a reduction the compiler
// vectorizes without reassociating. Any order is within the same gamma_n bound.
constexpr int64_t kLanes = 16;
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] = madd(a[i + l], b[i + l], part[l]);
  }
  for (int64_t l = 0; i < n; ++i, ++l) part[l] = madd(a[i], b[i], part[l]);
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

// x * rsqrt(sum(x^2) + eps) * scale, as the reference's l2norm (times the q scale).
template <typename T>
inline void l2_normalised(const T* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  const float r = 1.0f / std::sqrt(dot(dst, dst, n) + kNormEps);
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] * r * scale;
}

// Columns [j0, j0 + W) of one token's step on the state s [Dk, Dv]. A column's update
// involves that column only, so the state is read once for both products, then read and
// written once for the update, with W columns' sums held in registers:
//
//   S^T k and S^T q (before the decay);  delta = beta (v - e^g S^T k);
//   o = e^g S^T q + (k^T q) delta  (= (e^g S + k delta^T)^T q);  S <- e^g S + k delta^T.
// The next item's state, read and written next: asked for into L1 with the intent to write.
using Ahead = tandem::Ahead</*write=*/true, /*locality=*/3>;

// `ahead`: lines to ask for meanwhile, a few a row of the state (see ``recurrent``).
template <int64_t W, typename T>
inline void delta_columns(float* o, const T* v_row, const float* kf, const float* qf,
                          float kq, float decay, float bt, float* s, int64_t Dk, int64_t Dv,
                          int64_t j0, Ahead ahead = {}) {
  float sk[W] = {}, sq[W] = {}, delta[W];
  const int64_t per = ahead.per(Dk);
  for (int64_t i = 0; i < Dk; ++i) {
    ahead.fetch(per);
    const float* row = s + i * Dv + j0;
    const float ki = kf[i], qi = qf[i];
    for (int64_t c = 0; c < W; ++c) {
      sk[c] = madd(ki, row[c], sk[c]);
      sq[c] = madd(qi, row[c], sq[c]);
    }
  }
  for (int64_t c = 0; c < W; ++c) {
    delta[c] = (to_float(v_row[j0 + c]) - decay * sk[c]) * bt;
    o[j0 + c] = madd(kq, delta[c], decay * sq[c]);
  }
  for (int64_t i = 0; i < Dk; ++i) {
    float* row = s + i * Dv + j0;
    const float ki = kf[i];
    for (int64_t c = 0; c < W; ++c) row[c] = madd(ki, delta[c], row[c] * decay);
  }
}

// Columns per pass: two AVX-512 vectors (four AVX2 ones), so that each product has two
// independent chains of sums in flight.
constexpr int64_t kColumns = 32;

// One token's delta-rule step for value head h on the state s [Dk, Dv] (updated in place),
// its output row written to o_out.
// `next`, if not null: a state of the same size to ask the caches for meanwhile, spread over
// this step's reads of its own (see ``recurrent``).
template <typename T>
inline void delta_token(T* o_out, const T* q_row, const T* k_row, const T* v_row, float g,
                        float bt, float* s, int64_t Dk, int64_t Dv, float q_scale,
                        const float* next = nullptr) {
  float qf[kMaxDim], kf[kMaxDim], o[kMaxDim];
  l2_normalised(q_row, qf, Dk, q_scale);
  l2_normalised(k_row, kf, Dk, 1.0f);
  const float decay = std::exp(g);
  const float kq = dot(kf, qf, Dk);
  const int64_t passes = Dv / kColumns;
  int64_t j = 0;
  for (int64_t p = 0; j + kColumns <= Dv; j += kColumns, ++p) {
    delta_columns<kColumns>(o, v_row, kf, qf, kq, decay, bt, s, Dk, Dv, j,
                            Ahead::part(next, Dk * Dv, p, passes));
  }
  for (; j < Dv; ++j) delta_columns<1>(o, v_row, kf, qf, kq, decay, bt, s, Dk, Dv, j);
  store_row<T>(o, o_out, Dv, 1.0f);
}

// Tokens [starts[r], starts[r + 1]) of run r share the state row slots[r] and run in order;
// after token b the state is also kept in row keep[b] where keep[b] >= 0. Decode steps are
// runs of one token (starts == nullptr: token b is run b, keep == nullptr: nothing kept).
template <typename T>
void recurrent(T* out, const T* q, const T* k, const T* v, const float* g, const T* beta,
               float* states, const int64_t* slots, const uint8_t* has_initial,
               const int64_t* starts, const int64_t* keep, int64_t R, int64_t Hk, int64_t Hv,
               int64_t Dk, int64_t Dv, int64_t q_stride, int64_t k_stride, int64_t v_stride,
               int32_t threads) {
  const int64_t group = Hv / Hk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  const int64_t head_floats = Dk * Dv;
  // Heads outermost: a static split then gives each thread whole heads of every run, so
  // prefill runs of unequal lengths still share the work evenly.
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t h = 0; h < Hv; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t kh = h / group;
      float* s = states + (slots[r] * Hv + h) * head_floats;
      if (has_initial != nullptr && has_initial[r] == 0) {
        std::memset(s, 0, sizeof(float) * head_floats);
      }
      const int64_t first = starts == nullptr ? r : starts[r];
      const int64_t end = starts == nullptr ? r + 1 : starts[r + 1];
      // The state this thread most likely takes next (the static split's next pair), asked
      // for during this run's last token: a decode step's states (16 KiB apiece at 64 x 64)
      // come from memory, and arithmetic and reads overlap only where the reads are asked
      // for along the way (see vec_math.h's Ahead). Bench hybrid's 8 heads of 64
      // at 48 sequences, 9 layers: 0.22 -> 0.19 ms a layer.
      const int64_t after = h * R + r + 1;
      const float* next = after < Hv * R
                              ? states + (slots[after % R] * Hv + after / R) * head_floats
                              : nullptr;
      for (int64_t b = first; b < end; ++b) {
        delta_token<T>(out + (b * Hv + h) * Dv, q + b * q_stride + kh * Dk,
                       k + b * k_stride + kh * Dk, v + b * v_stride + h * Dv, g[b * Hv + h],
                       to_float(beta[b * Hv + h]), s, Dk, Dv, q_scale,
                       b + 1 == end ? next : nullptr);
        if (keep != nullptr && keep[b] >= 0) {
          std::memcpy(states + (keep[b] * Hv + h) * head_floats, s,
                      sizeof(float) * head_floats);
        }
      }
    }
  }
}

// SiLU as the conv kernels apply it (fast_exp, so that prefill rows vectorize; the decode
// step uses the same function so that both give a token the same output).
inline float silu(float y) { return y / (1.0f + fast_exp(-y)); }

// One token of one run: each channel's K taps over its K - 1 kept inputs and the new one,
// the kept inputs shifted by one. KT > 0: the tap count known at compile time, so that the
// loop over channels vectorizes (the state's and the taps' interleaved rows included); KT ==
// 0: ``K`` at run time. The same sums, in the same order, either way.
template <int64_t KT, typename T>
inline void conv_token(T* ob, const T* xb, const T* weight, T* state, int64_t C,
                       int64_t K_runtime) {
  const int64_t K = KT > 0 ? KT : K_runtime;
  for (int64_t c = 0; c < C; ++c) {
    T* sc = state + c * (K - 1);
    const T* wc = weight + c * K;
    float acc = 0.0f;
    for (int64_t t = 0; t < K - 1; ++t) acc += to_float(sc[t]) * to_float(wc[t]);
    acc += to_float(xb[c]) * to_float(wc[K - 1]);
    // Rounded to the input dtype before SiLU, as the reference's conv output is.
    store_as(ob + c, silu(rounded<T>(acc)));
    for (int64_t t = 0; t + 1 < K - 1; ++t) sc[t] = sc[t + 1];
    sc[K - 2] = xb[c];
  }
}

// Runs as in ``recurrent``, each channel's K - 1 kept inputs shifted token by token (a run
// without an initial state starts from zeros).
template <typename T>
void conv_update(T* out, const T* x, const T* weight, T* states, const int64_t* slots,
                 const uint8_t* has_initial, const int64_t* starts, const int64_t* keep,
                 int64_t R, int64_t C, int64_t K, int64_t x_stride, int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < R; ++r) {
    T* state = states + slots[r] * C * (K - 1);
    if (has_initial != nullptr && has_initial[r] == 0) {
      std::memset(state, 0, sizeof(T) * C * (K - 1));  // all-zero bits: 0.0 in both dtypes
    }
    const int64_t first = starts == nullptr ? r : starts[r];
    const int64_t end = starts == nullptr ? r + 1 : starts[r + 1];
    for (int64_t b = first; b < end; ++b) {
      if (K == 4) {  // Qwen3.5's and Qwen3-Next's kernel size
        conv_token<4>(out + b * C, x + b * x_stride, weight, state, C, K);
      } else {
        conv_token<0>(out + b * C, x + b * x_stride, weight, state, C, K);
      }
      if (keep != nullptr && keep[b] >= 0) {
        std::memcpy(states + keep[b] * C * (K - 1), state, sizeof(T) * C * (K - 1));
      }
    }
  }
}

// A prefill: run r's tokens [starts[r], starts[r + 1]) continue the K - 1 inputs kept in its
// state row slots[r] (zeros where has_initial[r] == 0). A token's output depends on inputs
// only, not on the outputs before it, so the tokens of all runs are shared among threads and
// each token's channels are one vectorized pass per tap; the same sums, in the same order,
// as ``conv_update`` makes for that token. Afterwards each state row holds its run's last
// K - 1 inputs.
template <typename T>
void conv_prefill(T* out, const T* x, const T* weight, T* states, const int64_t* slots,
                  const uint8_t* has_initial, const int64_t* starts, int64_t R, int64_t C,
                  int64_t K, int64_t x_stride, int32_t threads) {
  const int64_t N = starts[R];
  const int64_t H = K - 1;  // inputs a state keeps
  std::vector<float> taps(K * C);  // [K, C]: one tap's weights contiguous over channels
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) taps[j * C + c] = to_float(weight[c * K + j]);
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> acc(C), kept(C);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < N; ++b) {
      const int64_t r = std::upper_bound(starts + 1, starts + R + 1, b) - (starts + 1);
      const int64_t pos = b - starts[r];
      const T* state = states + slots[r] * C * H;
      const bool zero = has_initial != nullptr && has_initial[r] == 0;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = pos + j - H;  // the input tap j reads, from the run's first
        const float* w = taps.data() + j * C;
        if (src >= 0) {
          const T* row = x + (starts[r] + src) * x_stride;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) acc[c] += to_float(row[c]) * w[c];
        } else if (!zero) {
          for (int64_t c = 0; c < C; ++c) kept[c] = to_float(state[c * H + H + src]);
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) acc[c] += kept[c] * w[c];
        }
      }
      T* ob = out + b * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        // Rounded to the input dtype before SiLU, as the reference's conv output is.
        store_as(ob + c, silu(rounded<T>(acc[c])));
      }
    }
    // The implicit barrier above: every token has read the old states.
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      T* state = states + slots[r] * C * H;
      const bool zero = has_initial != nullptr && has_initial[r] == 0;
      const int64_t len = starts[r + 1] - starts[r];
      // Column t takes input len - H + t; reading old column t + len > t, so ascending t
      // never reads a column it already rewrote.
      for (int64_t t = 0; t < H; ++t) {
        const int64_t src = len - H + t;
        for (int64_t c = 0; c < C; ++c) {
          T* sc = state + c * H;
          sc[t] = src >= 0 ? x[(starts[r] + src) * x_stride + c] : (zero ? T(0) : sc[t + len]);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// Codes: 0 ok, 1 unsupported dtype, 2 fewer than two taps. ``starts`` [runs + 1] and
// ``keep`` [tokens] may be null: one token a run, nothing kept (the decode step).
int tandem_causal_conv1d_update(void* out, const void* x, const void* weight, void* states,
                                const int64_t* slots, const uint8_t* has_initial,
                                const int64_t* starts, const int64_t* keep, int64_t runs,
                                int64_t channels, int64_t taps, int64_t x_stride, int32_t dtype,
                                int32_t threads) {
  if (taps < 2) return 2;
  if (dtype == kFloat32) {
    conv_update<float>(static_cast<float*>(out), static_cast<const float*>(x),
                       static_cast<const float*>(weight), static_cast<float*>(states), slots,
                       has_initial, starts, keep, runs, channels, taps, x_stride, threads);
  } else if (dtype == kBFloat16) {
    conv_update<uint16_t>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                          static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(states),
                          slots, has_initial, starts, keep, runs, channels, taps, x_stride,
                          threads);
  } else {
    return 1;
  }
  return 0;
}

// Codes as for the update. ``starts`` [runs + 1], from 0: each run's tokens in ``x``.
int tandem_causal_conv1d_prefill(void* out, const void* x, const void* weight, void* states,
                                 const int64_t* slots, const uint8_t* has_initial,
                                 const int64_t* starts, int64_t runs, int64_t channels,
                                 int64_t taps, int64_t x_stride, int32_t dtype,
                                 int32_t threads) {
  if (taps < 2) return 2;
  if (dtype == kFloat32) {
    conv_prefill<float>(static_cast<float*>(out), static_cast<const float*>(x),
                        static_cast<const float*>(weight), static_cast<float*>(states), slots,
                        has_initial, starts, runs, channels, taps, x_stride, threads);
  } else if (dtype == kBFloat16) {
    conv_prefill<uint16_t>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x),
                           static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(states),
                           slots, has_initial, starts, runs, channels, taps, x_stride, threads);
  } else {
    return 1;
  }
  return 0;
}

// Codes: 0 ok, 1 unsupported dtype, 2 a head size over kMaxDim or value heads that are not a
// multiple of the key heads. ``starts`` and ``keep`` as for the conv update.
int tandem_recurrent_gated_delta_rule(void* out, const void* q, const void* k, const void* v,
                                      const float* g, const void* beta, float* states,
                                      const int64_t* slots, const uint8_t* has_initial,
                                      const int64_t* starts, const int64_t* keep, int64_t runs,
                                      int64_t k_heads, int64_t v_heads,
                                      int64_t k_dim, int64_t v_dim, int64_t q_stride,
                                      int64_t k_stride, int64_t v_stride, int32_t dtype,
                                      int32_t threads) {
  if (k_dim < 1 || v_dim < 1 || k_dim > kMaxDim || v_dim > kMaxDim || k_heads < 1 ||
      v_heads % k_heads != 0) {
    return 2;
  }
  if (dtype == kFloat32) {
    recurrent<float>(static_cast<float*>(out), static_cast<const float*>(q),
                     static_cast<const float*>(k), static_cast<const float*>(v), g,
                     static_cast<const float*>(beta), states, slots, has_initial, starts, keep,
                     runs, k_heads, v_heads, k_dim, v_dim, q_stride, k_stride, v_stride,
                     threads);
  } else if (dtype == kBFloat16) {
    recurrent<uint16_t>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(q),
                        static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), g,
                        static_cast<const uint16_t*>(beta), states, slots, has_initial, starts,
                        keep, runs, k_heads, v_heads, k_dim, v_dim, q_stride, k_stride, v_stride,
                        threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
