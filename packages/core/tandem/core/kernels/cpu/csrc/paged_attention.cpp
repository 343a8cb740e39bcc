// Decode attention on CPU, reading K/V from the paged cache in place (prefill chunks,
// bound by arithmetic rather than by reading the cache, have prefill_attention.cpp).
//
// A work item is a query token with all its heads (`run_rows`, for batches of at least
// 4 tokens per thread) or a (query token, KV head) pair (`run`, for fewer tokens, so every
// thread has work). Either way the query heads that share a KV head (GQA) are handled
// together, so every cached K/V row is read once per query token and used by all of them.
// The cache layout is the engine's own, [num_blocks, block_size, kv_heads, head_dim], so
// writing new tokens and the torch reference path need no change.
//
// Per item, exact softmax in two passes over a row of scores kept in a per-thread buffer:
// scores = (q * scale) . k over the item's keys (one pass over K, tracking the maximum),
// p = exp(s - max) and its sum, then out = (sum_t p_t v_t) / sum (one pass over V).
// Arithmetic is float32 throughout; bfloat16 rows are widened on load and the output is
// rounded to nearest-even once, as torch rounds. Decode attention is bound by reading the
// cache, so the point is to touch each K/V row exactly once and never copy it, and to spend
// few instructions per row so that two cores keep up with memory: `run_rows` scores 16 keys
// per query row at once (dot products finished by one transposing reduction, on CPUs with
// AVX512-BF16 as bfloat16 pair products, which are exact in float32) and keeps a KV head's
// output accumulators in registers across the rows of a block. CPUs with AVX2 and no
// AVX-512 get the same plan on 8-lane vectors (8 keys per reduction; measured on a 2-core
// Zen 1, 48 queries x 384 tokens, one layer: 9.1 -> 6.0 ms against the plain loops, where
// only reading that layer's scattered K/V blocks takes 3.9 ms).
//
// On CPUs with AMX, bfloat16 decode batches put the scores on tiles instead (run_rows_tiles,
// where its comment says why).
//
// Built by tandem.core.kernels.cpu.paged_attention with the system C++ compiler and
// -march=native; called through ctypes (no torch headers, so the build takes seconds).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

// The tile scores (run_rows_tiles) where the CPU has AMX for bfloat16, or in the test build
// whose tile instructions are emulated (amx_tiles.h); both around the AVX-512 vector code.
#if defined(__AVX512F__) && \
    (defined(TANDEM_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define TANDEM_PA_TILES 1
#include "amx_tiles.h"
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using namespace tandem;

#if defined(__AVX512F__)

// p[i] = exp(s[i] - max); returns the sum of p.
inline float exp_and_sum(float* s, int64_t n, float max) {
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vmax));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(s + i, m, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// Scores of `g` query rows (float32, pre-scaled, D apart) against one key row.
template <typename T, int D>
inline void score_rows(const float* q, const T* k, int64_t g, float* out, int64_t out_stride) {
  __m512 kv[D / 16];
  for (int c = 0; c < D / 16; ++c) kv[c] = load16(k + 16 * c);
  for (int64_t r = 0; r < g; ++r) {
    const float* qr = q + r * D;
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(qr + 16), kv[1]);
    for (int c = 2; c + 1 < D / 16; c += 2) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * (c + 1)), kv[c + 1], a1);
    }
    out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
}

// The same with G fixed at compile time (the per-(token, KV head) items' loop).
template <typename T, int D, int G>
inline void score_row(const float* q, const T* k, float* out, int64_t out_stride) {
  score_rows<T, D>(q, k, G, out, out_stride);
}

// acc[r] += p[r * p_stride] * v for G rows of D floats; acc stays in registers when the
// compiler can keep G * D / 16 vectors there.
template <typename T, int D, int G>
inline void accumulate_row(__m512 (&acc)[G][D / 16], const float* p, int64_t p_stride,
                           const T* v) {
  __m512 vv[D / 16];
  for (int c = 0; c < D / 16; ++c) vv[c] = load16(v + 16 * c);
  for (int r = 0; r < G; ++r) {
    const __m512 w = _mm512_set1_ps(p[r * p_stride]);
    for (int c = 0; c < D / 16; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
  }
}

template <int D, int G>
struct Accumulator {
  __m512 v[G][D / 16];
  void zero() {
    for (int r = 0; r < G; ++r)
      for (int c = 0; c < D / 16; ++c) v[r][c] = _mm512_setzero_ps();
  }
  void save(int r, float* dst) const {
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + 16 * c, v[r][c]);
  }
  template <typename T>
  void add(const float* p, int64_t p_stride, const T* v_row) {
    accumulate_row<T, D, G>(v, p, p_stride, v_row);
  }
};

#else  // portable path: plain loops the compiler vectorizes as the target allows

#if defined(__AVX2__) && defined(__FMA__)
// p[i] = exp(s[i] - max), 8 at a time (the tail through a padded copy); returns the sum.
inline float exp_and_sum(float* s, int64_t n, float max) {
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {
    alignas(32) float tail[8];
    const int64_t rest = n - i;
    for (int64_t t = 0; t < 8; ++t) tail[t] = t < rest ? s[i + t] : -1e30f;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(tail), vmax));
    _mm256_store_ps(tail, e);
    for (int64_t t = 0; t < rest; ++t) s[i + t] = tail[t];
    acc = _mm256_add_ps(acc, e);  // padded lanes are exp(-1e30) = 0
  }
  return reduce_add8(acc);
}
#else
inline float exp_and_sum(float* s, int64_t n, float max) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}
#endif

template <typename T, int D>
inline void score_rows(const float* q, const T* k, int64_t g, float* out, int64_t out_stride) {
  float kf[D];
  load_row(k, kf, D, 1.0f);
  for (int64_t r = 0; r < g; ++r) {
    const float* qr = q + r * D;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < D; ++i) s += qr[i] * kf[i];
    out[r * out_stride] = s;
  }
}

template <typename T, int D, int G>
inline void score_row(const float* q, const T* k, float* out, int64_t out_stride) {
  score_rows<T, D>(q, k, G, out, out_stride);
}
template <int D, int G>
struct Accumulator {
  float v[G][D];
  void zero() { std::memset(v, 0, sizeof(v)); }
  void save(int r, float* dst) const { std::memcpy(dst, v[r], sizeof(float) * D); }
  template <typename T>
  void add(const float* p, int64_t p_stride, const T* v_row) {
    float vf[D];
    load_row(v_row, vf, D, 1.0f);
    for (int r = 0; r < G; ++r) {
      const float w = p[r * p_stride];
#pragma omp simd
      for (int i = 0; i < D; ++i) v[r][i] += w * vf[i];
    }
  }
};

#endif

// Ask for the next block's rows of one head while this block is being worked on: blocks
// are scattered over the cache, so the hardware prefetchers (which follow strides within a
// page) lose the stream at every block boundary and the core would wait on DRAM latency.
template <typename T, int D>
inline void prefetch_block(const T* rows, int64_t n, int64_t token_stride) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < D; e += kLine) __builtin_prefetch(rows + t * token_stride + e, 0, 3);
  }
}

// Cache lines asked for a few at a time between the arithmetic (vec_math.h's Ahead, into
// L2): 16/8 heads of 64, 384 tokens, ms a layer, two interleaved pairs: the AVX-512 vector
// path float32 3.49-3.60 -> 3.23-3.24, bfloat16 2.08-2.14 -> 1.81-1.84; the tile path
// 1.73-1.75 -> 1.67-1.69; the AVX2 build on the same machine float32 3.49-3.67 -> 3.30-3.39,
// bfloat16 2.31-2.35 -> 2.14-2.23.
using Ahead = tandem::Ahead</*write=*/false, /*locality=*/1>;

// Ask for `n` elements from `p` on (a cache block, or one head's share of one), into L2:
// the block is read once, a head at a time, while the next one arrives.
template <typename T>
inline void prefetch_span(const T* p, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t e = 0; e < n; e += kLine) __builtin_prefetch(p + e, 0, 1);
}

#if defined(__AVX512F__)
// acc[r] += p[r * p_stride] * v for `g` rows of D floats held in memory.
template <typename T, int D>
inline void add_rows(float* acc, const float* p, int64_t p_stride, int64_t g, const T* v) {
  __m512 vv[D / 16];
  for (int c = 0; c < D / 16; ++c) vv[c] = load16(v + 16 * c);
  for (int64_t r = 0; r < g; ++r) {
    const __m512 w = _mm512_set1_ps(p[r * p_stride]);
    float* ar = acc + r * D;
    for (int c = 0; c < D / 16; ++c) {
      _mm512_storeu_ps(ar + 16 * c, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(ar + 16 * c)));
    }
  }
}
#else
template <typename T, int D>
inline void add_rows(float* acc, const float* p, int64_t p_stride, int64_t g, const T* v) {
  float vf[D];
  load_row(v, vf, D, 1.0f);
  for (int64_t r = 0; r < g; ++r) {
    const float w = p[r * p_stride];
    float* ar = acc + r * D;
#pragma omp simd
    for (int i = 0; i < D; ++i) ar[i] += w * vf[i];
  }
}
#endif

struct Args {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int64_t* block_tables;
  const int64_t* table_row;
  const int64_t* kv_lens;
  int64_t num_queries;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t q_stride;
  int64_t out_stride;
  int64_t table_stride;
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  float scale;
  // Whether the scores may go to AMX tiles (this process holds the tile state).
  bool tiles;

  // The longest context of the call's queries (the rows of a thread's score buffer).
  int64_t longest_context() const {
    int64_t longest = 0;
    for (int64_t i = 0; i < num_queries; ++i) longest = kv_lens[i] > longest ? kv_lens[i] : longest;
    return longest;
  }
};

// G: query heads handled together (a divisor of the GQA group small enough that their
// accumulators stay in registers). A group larger than G is done in chunks of G heads; the
// chunks after the first find the sequence's K/V rows in L2.
template <typename T, int D, int G>
void run(const Args& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t items = a.num_queries * a.num_kv_heads;
  const int64_t max_len = a.longest_context();
  const int64_t stride = max_len > 0 ? max_len : 1;
  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k_cache);
  const T* v_all = static_cast<const T*>(a.v_cache);
  T* out_all = static_cast<T*>(a.out);

#pragma omp parallel
  {
    // Per thread: G pre-scaled queries, their scores [G, max_len], one output row.
    std::vector<float> qbuf(G * D);
    std::vector<float> scores(G * stride);
    std::vector<float> row(D);
    Accumulator<D, G> acc;

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item / a.num_kv_heads;
      const int64_t h = item % a.num_kv_heads;
      const int64_t len = a.kv_lens[i];
      const int64_t* table = a.block_tables + a.table_row[i] * a.table_stride;
      const int64_t num_blocks = (len + a.block_size - 1) / a.block_size;
      for (int64_t head0 = h * group; head0 < (h + 1) * group; head0 += G) {
        T* out = out_all + i * a.out_stride + head0 * D;
        if (len <= 0) {
          // Nothing to attend to: a zero output.
          std::memset(out, 0, sizeof(T) * G * D);
          continue;
        }
        for (int r = 0; r < G; ++r) {
          load_row(q_all + i * a.q_stride + (head0 + r) * D, qbuf.data() + r * D, D, a.scale);
        }
        for (int64_t b = 0; b < num_blocks; ++b) {
          const T* kb = k_all + table[b] * a.cache_block_stride + h * D;
          const int64_t t0 = b * a.block_size;
          const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
          if (b + 1 < num_blocks) {
            const int64_t next = len - t0 - n < a.block_size ? len - t0 - n : a.block_size;
            prefetch_block<T, D>(k_all + table[b + 1] * a.cache_block_stride + h * D, next,
                                 a.cache_token_stride);
          } else {
            prefetch_block<T, D>(v_all + table[0] * a.cache_block_stride + h * D,
                                 len < a.block_size ? len : a.block_size, a.cache_token_stride);
          }
          for (int64_t t = 0; t < n; ++t) {
            score_row<T, D, G>(qbuf.data(), kb + t * a.cache_token_stride,
                               scores.data() + t0 + t, stride);
          }
        }
        float sums[G];
        for (int r = 0; r < G; ++r) {
          float* s = scores.data() + r * stride;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
          sums[r] = exp_and_sum(s, len, m);
        }
        acc.zero();
        for (int64_t b = 0; b < num_blocks; ++b) {
          const T* vb = v_all + table[b] * a.cache_block_stride + h * D;
          const int64_t t0 = b * a.block_size;
          const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
          if (b + 1 < num_blocks) {
            const int64_t next = len - t0 - n < a.block_size ? len - t0 - n : a.block_size;
            prefetch_block<T, D>(v_all + table[b + 1] * a.cache_block_stride + h * D, next,
                                 a.cache_token_stride);
          }
          for (int64_t t = 0; t < n; ++t) {
            acc.add(scores.data() + t0 + t, stride, vb + t * a.cache_token_stride);
          }
        }
        for (int r = 0; r < G; ++r) {
          acc.save(r, row.data());
          store_row(row.data(), out + r * D, D, 1.0f / sums[r]);
        }
      }
    }
  }
}

// Every head of one query token per work item, for batches with enough tokens to keep
// every thread busy (decode batches, prefill chunks). A block of the cache holds all KV
// heads of its tokens side by side, so walking it block by block reads it front to back:
// one contiguous stream per block that the hardware prefetchers follow and the software
// prefetch keeps a block ahead of, where an item per (token, KV head) reads one 2-line row
// every cache_token_stride and leaves the rest of each page to other items.
#if defined(__AVX512F__)

// Lane t of the result is the sum of the 16 lanes of a[t]: sixteen dot products finished
// together in 45 shuffles and adds, where one horizontal reduction each costs ~8 dependent
// operations (what a score per key row used to pay).
inline __m512 transpose_sum16(const __m512 (&a)[16]) {
  __m512 b[8];
  for (int k = 0; k < 8; ++k) {
    // Per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] for x = a[2k], y = a[2k+1].
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                         _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  }
  __m512 c[4];
  for (int m = 0; m < 4; ++m) {
    // Per 128-bit lane: partial sums of rows 4m .. 4m+3, in order.
    c[m] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Fold the four 128-bit lanes of each c[m] together.
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The query rows as the score pass reads them. float32 (and bfloat16 on CPUs without
// AVX512-BF16): widened, times the scale, scores need no further scaling. bfloat16 with
// AVX512-BF16: the rows as they are (bfloat16 products are exact in float32, so
// vdpbf16ps sums the same products the widening path would) and the scale applied to
// each finished score.
template <typename T, int D>
struct Queries {
  std::vector<float> rows;
  explicit Queries(int64_t heads) : rows(heads * D) {}
  void load(const T* q, int64_t heads, float scale) {
    for (int64_t h = 0; h < heads; ++h) load_row(q + h * D, rows.data() + h * D, D, scale);
  }
  // Row `r` in registers, for many keys.
  struct Row {
    __m512 v[D / 16];
    // 16 lanes whose sum is this row . key row `k`.
    inline __m512 partial(const T* k) const {
      __m512 a0 = _mm512_mul_ps(v[0], load16(k));
      __m512 a1 = _mm512_mul_ps(v[1], load16(k + 16));
      for (int c = 2; c + 1 < D / 16; c += 2) {
        a0 = _mm512_fmadd_ps(v[c], load16(k + 16 * c), a0);
        a1 = _mm512_fmadd_ps(v[c + 1], load16(k + 16 * (c + 1)), a1);
      }
      return _mm512_add_ps(a0, a1);
    }
    inline __m512 finish(__m512 s) const { return s; }
  };
  inline Row row(int64_t r) const {
    Row out;
    for (int c = 0; c < D / 16; ++c) out.v[c] = _mm512_loadu_ps(rows.data() + r * D + 16 * c);
    return out;
  }
};

#if defined(__AVX512BF16__)
template <int D>
struct Queries<uint16_t, D> {
  std::vector<uint16_t> rows;
  float scale = 1.0f;
  explicit Queries(int64_t heads) : rows(heads * D) {}
  void load(const uint16_t* q, int64_t heads, float s) {
    std::memcpy(rows.data(), q, sizeof(uint16_t) * heads * D);
    scale = s;
  }
  struct Row {
    __m512bh v[D / 32];
    __m512 scale;
    inline __m512 partial(const uint16_t* k) const {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0],
                                    (__m512bh)_mm512_loadu_si512(k));
      for (int c = 1; c < D / 32; ++c) {
        acc = _mm512_dpbf16_ps(acc, v[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      return acc;
    }
    inline __m512 finish(__m512 s) const { return _mm512_mul_ps(s, scale); }
  };
  inline Row row(int64_t r) const {
    Row out;
    for (int c = 0; c < D / 32; ++c) {
      out.v[c] = (__m512bh)_mm512_loadu_si512(rows.data() + r * D + 32 * c);
    }
    out.scale = _mm512_set1_ps(scale);
    return out;
  }
};
#endif

// Scores of query rows [r0, r0 + g) against keys t0 .. t0 + n (n <= 16) of one head in
// one block, into scores[(r - r0) * stride ..]; `ahead`'s lines asked for along the way.
template <typename T, int D>
inline void score_tile(const Queries<T, D>& q, int64_t r0, int64_t g, const T* keys,
                       int64_t token_stride, int64_t n, float* scores, int64_t stride,
                       Ahead ahead = {}) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
  const int64_t per = ahead.per(16 * g);
  for (int64_t r = r0; r < r0 + g; ++r) {
    const auto row = q.row(r);
    __m512 part[16];
    if (n == 16) {
      for (int t = 0; t < 16; ++t) {
        part[t] = row.partial(keys + t * token_stride);
        ahead.fetch(per);
      }
    } else {
      for (int t = 0; t < 16; ++t) {
        part[t] = t < n ? row.partial(keys + t * token_stride) : _mm512_setzero_ps();
      }
    }
    _mm512_mask_storeu_ps(scores + (r - r0) * stride, mask, row.finish(transpose_sum16(part)));
  }
  ahead.rest();
}

// acc[r] += p[r * p_stride + t * p_step] * v_t for GC query rows and n value rows of one
// head; the GC * D / 16 accumulators stay in registers across the rows. p_step: 1 for the
// head-major scores of run_rows, G for the key-major ones of run_rows_tiles. `ahead`'s
// lines asked for along the way.
template <typename T, int D, int GC>
inline void accumulate_tile(float* acc, const float* p, int64_t p_stride, int64_t p_step,
                            const T* values, int64_t token_stride, int64_t n,
                            Ahead ahead = {}) {
  __m512 sum[GC][D / 16];
  for (int r = 0; r < GC; ++r)
    for (int c = 0; c < D / 16; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
  const int64_t per = ahead.per(n);
  for (int64_t t = 0; t < n; ++t) {
    ahead.fetch(per);
    const T* v = values + t * token_stride;
    __m512 vv[D / 16];
    for (int c = 0; c < D / 16; ++c) vv[c] = load16(v + 16 * c);
    for (int r = 0; r < GC; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * p_stride + t * p_step]);
      for (int c = 0; c < D / 16; ++c) sum[r][c] = _mm512_fmadd_ps(w, vv[c], sum[r][c]);
    }
  }
  for (int r = 0; r < GC; ++r)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, sum[r][c]);
  ahead.rest();
}

inline float row_max(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    m = _mm512_mask_max_ps(m, mask, m, _mm512_maskz_loadu_ps(mask, s + i));
  }
  return _mm512_reduce_max_ps(m);
}

template <typename T, int D, int GC>
void run_rows(const Args& a) {
  const int64_t heads = a.num_heads;
  const int64_t kv_heads = a.num_kv_heads;
  const int64_t group = heads / kv_heads;
  const int64_t max_len = a.longest_context();
  const int64_t stride = max_len > 0 ? max_len : 1;
  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k_cache);
  const T* v_all = static_cast<const T*>(a.v_cache);
  T* out_all = static_cast<T*>(a.out);
  // Elements of one block that hold this layer's tokens (the caches are contiguous).
  const int64_t block_elems = a.block_size * a.cache_token_stride;
  const int64_t share = block_elems / kv_heads;
  const int64_t ts = a.cache_token_stride;

#pragma omp parallel
  {
    Queries<T, D> queries(heads);
    std::vector<float> scores(heads * stride);
    // Output accumulators of all heads: H * D floats (4 KiB for 16 heads of 64), in L1.
    std::vector<float> acc(heads * D);
    std::vector<float> sums(heads);

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.num_queries; ++i) {
      const int64_t len = a.kv_lens[i];
      const int64_t* table = a.block_tables + a.table_row[i] * a.table_stride;
      const int64_t num_blocks = (len + a.block_size - 1) / a.block_size;
      T* out = out_all + i * a.out_stride;
      if (len <= 0) {
        std::memset(out, 0, sizeof(T) * heads * D);
        continue;
      }
      queries.load(q_all + i * a.q_stride, heads, a.scale);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* kb = k_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const T* next = b + 1 < num_blocks ? k_all + table[b + 1] * a.cache_block_stride
                                           : v_all + table[0] * a.cache_block_stride;
        for (int64_t h = 0; h < kv_heads; ++h) {
          // The next block's share of this head, spread over the block's 16-key tiles.
          const int64_t chunks = (n + 15) / 16;
          for (int64_t s0 = 0, k = 0; s0 < n; s0 += 16, ++k) {
            score_tile<T, D>(queries, h * group, group, kb + s0 * ts + h * D, ts,
                             n - s0 < 16 ? n - s0 : 16,
                             scores.data() + h * group * stride + t0 + s0, stride,
                             Ahead::part(next + h * share, share, k, chunks));
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * stride;
        const float m = row_max(s, len);
        sums[h] = exp_and_sum(s, len, m);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vb = v_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const T* next = b + 1 < num_blocks ? v_all + table[b + 1] * a.cache_block_stride : nullptr;
        for (int64_t r = 0; r < heads; r += GC) {
          const int64_t h = r / group;
          // The next block's share of this head, over the head's first row chunk.
          const T* mine = next != nullptr && r % group == 0 ? next + h * share : nullptr;
          accumulate_tile<T, D, GC>(acc.data() + r * D, scores.data() + r * stride + t0, stride,
                                    1, vb + h * D, ts, n, Ahead::part(mine, share, 0, 1));
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        store_row(acc.data() + h * D, out + h * D, D, 1.0f / sums[h]);
      }
    }
  }
}

#if defined(TANDEM_PA_TILES)

// Decode attention with the scores on AMX tiles (bfloat16 caches, G = 2, 4, 8 or 16 query
// heads a KV head). Where the vector path above finishes every score with a 16-lane
// transposing reduction (~3 shuffles and adds a score, times G for the G heads sharing each
// key row), one tile product takes 16 keys of a KV head as A (16 rows of 32 bfloat16, read
// in place from the cache, a row a token) against the group's queries as B (16 dimension
// pairs x G), and writes the 16 x G scores at once. Products of bfloat16 are exact in
// float32, so the scores differ from the vector path's only in the order of their sums.
// The rest is the vector path's plan with the scores kept key-major ([token][G] per KV
// head): the maximum and the exponentials lane-wise (lane l belongs to head l mod G), the
// value pass with the same register accumulators. Measured on an AMX Xeon (2 cores, 48
// queries of ~384 tokens, benchmarks/decode_attention.py, before the spread prefetches):
// 16/8 heads of 64 1.95 -> 1.63 ms a layer, 8/2 of 64 0.45 -> 0.34, 32/8 of 128 5.07 ->
// 4.03; reading the same K/V with no arithmetic takes ~1.5 ms at 16/8.
// Tiles: 0 the scores (16 x G float32), 1 and 2 key rows (16 x 64 bytes), 3 and 4 the
// queries (16 x 4G bytes).
inline tandem::amx::TileConfig score_tiles(int g) {
  tandem::amx::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(t == 1 || t == 2 ? 64 : 4 * g);
  }
  return cfg;
}

// The G query rows of one KV head ([G][D] bfloat16, back to back) as B tiles, one per
// 32-column chunk c: 16 rows (dimension pairs k) of G pairs, b[c][k][n] = the pair of
// q[n][32c + 2k], moved as 32-bit words.
template <int D, int G>
inline void pack_queries(const uint16_t* q, uint32_t* b) {
  for (int c = 0; c < D / 32; ++c)
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < G; ++n) {
        std::memcpy(b + (c * 16 + k) * G + n, q + n * D + 32 * c + 2 * k, sizeof(uint32_t));
      }
}

// Scores [16][G] (rows G floats apart) of 16 key rows, `ts` elements apart, against one KV
// head's packed queries.
template <int D, int G>
inline void score16_tiles(const uint16_t* keys, int64_t ts, const uint32_t* b, float* out) {
  TANDEM_TILE_ZERO(0);
  for (int c = 0; c < D / 32; c += 2) {
    TANDEM_TILE_LOADD(1, keys + 32 * c, ts * 2);
    TANDEM_TILE_LOADD(3, b + c * 16 * G, G * 4);
    TANDEM_TILE_DPBF16PS(0, 1, 3);
    TANDEM_TILE_LOADD(2, keys + 32 * (c + 1), ts * 2);
    TANDEM_TILE_LOADD(4, b + (c + 1) * 16 * G, G * 4);
    TANDEM_TILE_DPBF16PS(0, 2, 4);
  }
  TANDEM_TILE_STORED(0, out, G * 4);
}

// v combined with itself rotated by w, 8, 4 .. G lanes: every lane then holds the result
// over all lanes of its class modulo G (one head's, in the key-major layout).
template <int G, typename Op>
inline __m512 fold_classes(__m512 v, Op op) {
  for (int w = 8; w >= G; w /= 2) {
    const __m512i rotate = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(w));
    v = op(v, _mm512_permutexvar_ps(_mm512_and_si512(rotate, _mm512_set1_epi32(15)), v));
  }
  return v;
}

// In place over one KV head's key-major scores s [len][G]: p = exp(scale * s - max), the
// maximum per head; the G sums into sums[0 .. G).
template <int G>
inline void softmax_classes(float* s, int64_t len, float scale, float* sums) {
  const int64_t count = len * G;
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) m = _mm512_max_ps(m, _mm512_mul_ps(_mm512_loadu_ps(s + i), vs));
  const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1u);
  if (i < count) {
    m = _mm512_mask_max_ps(m, tail, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), vs));
  }
  m = fold_classes<G>(m, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
  __m512 acc = _mm512_setzero_ps();
  for (i = 0; i + 16 <= count; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i), vs), m));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < count) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), vs), m));
    e = _mm512_maskz_mov_ps(tail, e);
    _mm512_mask_storeu_ps(s + i, tail, e);
    acc = _mm512_add_ps(acc, e);
  }
  acc = fold_classes<G>(acc, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (int r = 0; r < G; ++r) sums[r] = lanes[r];
}

// A query token with all its heads per work item, as run_rows; blocks of a multiple of 16
// tokens (a tile reads 16 key rows; past a sequence's last token, those of its own block).
template <int D, int G>
void run_rows_tiles(const Args& a) {
  const int64_t heads = a.num_heads;
  const int64_t kv_heads = a.num_kv_heads;
  const int64_t max_len = a.longest_context();
  // Whole tiles of rows: the last tile of a sequence stores all 16 of its rows.
  const int64_t stride = (max_len + 15) / 16 * 16;
  const auto* q_all = static_cast<const uint16_t*>(a.q);
  const auto* k_all = static_cast<const uint16_t*>(a.k_cache);
  const auto* v_all = static_cast<const uint16_t*>(a.v_cache);
  auto* out_all = static_cast<uint16_t*>(a.out);
  const int64_t block_elems = a.block_size * a.cache_token_stride;
  const int64_t share = block_elems / kv_heads;
  const int64_t ts = a.cache_token_stride;
  // Query rows per value pass: as many of a KV head's as keep their accumulators (GC * D
  // floats) within 16 vector registers.
  constexpr int GC = G * D <= 256 ? G : 256 / D;

#pragma omp parallel
  {
    const tandem::amx::TileScope tiles(score_tiles(G));
    std::vector<uint32_t> packed(heads * D / 2);
    std::vector<float> scores(kv_heads * stride * G);
    std::vector<float> acc(heads * D);
    std::vector<float> sums(heads);

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.num_queries; ++i) {
      const int64_t len = a.kv_lens[i];
      const int64_t* table = a.block_tables + a.table_row[i] * a.table_stride;
      const int64_t num_blocks = (len + a.block_size - 1) / a.block_size;
      uint16_t* out = out_all + i * a.out_stride;
      if (len <= 0) {
        std::memset(out, 0, sizeof(uint16_t) * heads * D);
        continue;
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        pack_queries<D, G>(q_all + i * a.q_stride + h * G * D, packed.data() + h * G * D / 2);
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint16_t* kb = k_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const uint16_t* next = b + 1 < num_blocks ? k_all + table[b + 1] * a.cache_block_stride
                                                  : v_all + table[0] * a.cache_block_stride;
        for (int64_t h = 0; h < kv_heads; ++h) {
          // In one burst: a head's tile products are a handful of instructions, and the
          // share spread between them measured no faster.
          prefetch_span(next + h * share, share);
          for (int64_t s0 = 0; s0 < n; s0 += 16) {
            score16_tiles<D, G>(kb + s0 * ts + h * D, ts, packed.data() + h * G * D / 2,
                                scores.data() + (h * stride + t0 + s0) * G);
          }
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        softmax_classes<G>(scores.data() + h * stride * G, len, a.scale, sums.data() + h * G);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint16_t* vb = v_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const uint16_t* next =
            b + 1 < num_blocks ? v_all + table[b + 1] * a.cache_block_stride : nullptr;
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int r0 = 0; r0 < G; r0 += GC) {
            const uint16_t* mine = next != nullptr && r0 == 0 ? next + h * share : nullptr;
            accumulate_tile<uint16_t, D, GC>(acc.data() + (h * G + r0) * D,
                                             scores.data() + (h * stride + t0) * G + r0, 1, G,
                                             vb + h * D, ts, n, Ahead::part(mine, share, 0, 1));
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        store_row(acc.data() + h * D, out + h * D, D, 1.0f / sums[h]);
      }
    }
  }
}

#endif  // TANDEM_PA_TILES

#elif defined(__AVX2__) && defined(__FMA__)

// AVX2 (CPUs without AVX-512): the same plan as above with 8-lane vectors. Scores of 8 keys
// per query row at once, finished by one transposing reduction; the value pass keeps a
// head's output accumulators for 64 columns in 8 registers across the rows of a block.
// bfloat16 rows are widened on load (no bfloat16 arithmetic on these CPUs).

template <typename T, int D>
struct Queries {
  std::vector<float> rows;
  explicit Queries(int64_t heads) : rows(heads * D) {}
  void load(const T* q, int64_t heads, float scale) {
    for (int64_t h = 0; h < heads; ++h) load_row(q + h * D, rows.data() + h * D, D, scale);
  }
};

// The scores of query row `q` against 8 key rows: 32 columns at a time, the query's four
// vectors in registers for all 8 keys (one load per FMA, the key's) and 8 independent
// accumulator chains, finished by one transposing reduction.
template <typename T, int D>
inline __m256 score8(const float* q, const T* keys, int64_t ts) {
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, p4 = p0, p5 = p0, p6 = p0, p7 = p0;
  for (int c0 = 0; c0 < D; c0 += 32) {
    const __m256 q0 = _mm256_loadu_ps(q + c0), q1 = _mm256_loadu_ps(q + c0 + 8);
    const __m256 q2 = _mm256_loadu_ps(q + c0 + 16), q3 = _mm256_loadu_ps(q + c0 + 24);
#define TANDEM_KEY(t, acc)                                          \
  {                                                                 \
    const T* k = keys + (t) * ts + c0;                              \
    acc = _mm256_fmadd_ps(q0, load8(k), acc);                       \
    acc = _mm256_fmadd_ps(q1, load8(k + 8), acc);                   \
    acc = _mm256_fmadd_ps(q2, load8(k + 16), acc);                  \
    acc = _mm256_fmadd_ps(q3, load8(k + 24), acc);                  \
  }
    TANDEM_KEY(0, p0) TANDEM_KEY(1, p1) TANDEM_KEY(2, p2) TANDEM_KEY(3, p3)
    TANDEM_KEY(4, p4) TANDEM_KEY(5, p5) TANDEM_KEY(6, p6) TANDEM_KEY(7, p7)
#undef TANDEM_KEY
  }
  const __m256 part[8] = {p0, p1, p2, p3, p4, p5, p6, p7};
  return transpose_sum8(part);
}

// One score (a block's last keys, fewer than 8).
template <typename T, int D>
inline float score1(const float* q, const T* k) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), load8(k + 8));
  for (int c = 2; c + 1 < D / 8; c += 2) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(k + 8 * c), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * (c + 1)), load8(k + 8 * (c + 1)), a1);
  }
  return reduce_add8(_mm256_add_ps(a0, a1));
}

// Scores of query rows [r0, r0 + g) against keys t0 .. t0 + n (n <= 8) of one head in one
// block, into scores[(r - r0) * stride ..].
template <typename T, int D>
inline void score_tile(const Queries<T, D>& q, int64_t r0, int64_t g, const T* keys,
                       int64_t token_stride, int64_t n, float* scores, int64_t stride,
                       Ahead ahead = {}) {
  const int64_t per = ahead.per(g);
  for (int64_t r = r0; r < r0 + g; ++r) {
    const float* qr = q.rows.data() + r * D;
    float* dst = scores + (r - r0) * stride;
    if (n == 8) {
      _mm256_storeu_ps(dst, score8<T, D>(qr, keys, token_stride));
    } else {
      for (int64_t t = 0; t < n; ++t) dst[t] = score1<T, D>(qr, keys + t * token_stride);
    }
    ahead.fetch(per);
  }
  ahead.rest();
}

// acc += p[t] * v_t over n value rows of one head, for one query row: 64 columns at a time
// in registers (8 accumulators, the value vector loaded as it is used).
template <typename T, int D>
inline void accumulate_tile(float* acc, const float* p, const T* values, int64_t token_stride,
                            int64_t n, Ahead ahead = {}) {
  // Spread over every (64 columns, row) step, not only the first 64 columns' rows.
  const int64_t per = ahead.per(n * (D / 64));
  for (int c0 = 0; c0 < D; c0 += 64) {
    __m256 sum[8];
    for (int c = 0; c < 8; ++c) sum[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      ahead.fetch(per);
      const T* v = values + t * token_stride + c0;
      const __m256 w = _mm256_set1_ps(p[t]);
      for (int c = 0; c < 8; ++c) sum[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), sum[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, sum[c]);
  }
  ahead.rest();
}

inline float row_max(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
  float out = reduce_max8(m);
  for (; i < n; ++i) out = s[i] > out ? s[i] : out;
  return out;
}

template <typename T, int D, int GC>
void run_rows(const Args& a) {
  const int64_t heads = a.num_heads;
  const int64_t kv_heads = a.num_kv_heads;
  const int64_t group = heads / kv_heads;
  const int64_t max_len = a.longest_context();
  const int64_t stride = max_len > 0 ? max_len : 1;
  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k_cache);
  const T* v_all = static_cast<const T*>(a.v_cache);
  T* out_all = static_cast<T*>(a.out);
  const int64_t block_elems = a.block_size * a.cache_token_stride;
  const int64_t share = block_elems / kv_heads;
  const int64_t ts = a.cache_token_stride;

#pragma omp parallel
  {
    Queries<T, D> queries(heads);
    std::vector<float> scores(heads * stride);
    std::vector<float> acc(heads * D);
    std::vector<float> sums(heads);

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.num_queries; ++i) {
      const int64_t len = a.kv_lens[i];
      const int64_t* table = a.block_tables + a.table_row[i] * a.table_stride;
      const int64_t num_blocks = (len + a.block_size - 1) / a.block_size;
      T* out = out_all + i * a.out_stride;
      if (len <= 0) {
        std::memset(out, 0, sizeof(T) * heads * D);
        continue;
      }
      queries.load(q_all + i * a.q_stride, heads, a.scale);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* kb = k_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const T* next = b + 1 < num_blocks ? k_all + table[b + 1] * a.cache_block_stride
                                           : v_all + table[0] * a.cache_block_stride;
        for (int64_t h = 0; h < kv_heads; ++h) {
          // The next block's share of this head, spread over the block's 8-key tiles.
          const int64_t chunks = (n + 7) / 8;
          for (int64_t s0 = 0, k = 0; s0 < n; s0 += 8, ++k) {
            score_tile<T, D>(queries, h * group, group, kb + s0 * ts + h * D, ts,
                             n - s0 < 8 ? n - s0 : 8,
                             scores.data() + h * group * stride + t0 + s0, stride,
                             Ahead::part(next + h * share, share, k, chunks));
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * stride;
        sums[h] = exp_and_sum(s, len, row_max(s, len));
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vb = v_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const T* next = b + 1 < num_blocks ? v_all + table[b + 1] * a.cache_block_stride : nullptr;
        for (int64_t r = 0; r < heads; ++r) {
          const int64_t h = r / group;
          // The next block's share of this head, over the head's first query row.
          const T* mine = next != nullptr && r % group == 0 ? next + h * share : nullptr;
          accumulate_tile<T, D>(acc.data() + r * D, scores.data() + r * stride + t0, vb + h * D,
                                ts, n, Ahead::part(mine, share, 0, 1));
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        store_row(acc.data() + h * D, out + h * D, D, 1.0f / sums[h]);
      }
    }
  }
}

#else  // portable path

template <typename T, int D, int GC>
void run_rows(const Args& a) {
  const int64_t heads = a.num_heads;
  const int64_t kv_heads = a.num_kv_heads;
  const int64_t group = heads / kv_heads;
  const int64_t max_len = a.longest_context();
  const int64_t stride = max_len > 0 ? max_len : 1;
  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k_cache);
  const T* v_all = static_cast<const T*>(a.v_cache);
  T* out_all = static_cast<T*>(a.out);
  const int64_t block_elems = a.block_size * a.cache_token_stride;

#pragma omp parallel
  {
    std::vector<float> qbuf(heads * D);
    std::vector<float> scores(heads * stride);
    std::vector<float> acc(heads * D);
    std::vector<float> sums(heads);

#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.num_queries; ++i) {
      const int64_t len = a.kv_lens[i];
      const int64_t* table = a.block_tables + a.table_row[i] * a.table_stride;
      const int64_t num_blocks = (len + a.block_size - 1) / a.block_size;
      T* out = out_all + i * a.out_stride;
      if (len <= 0) {
        std::memset(out, 0, sizeof(T) * heads * D);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        load_row(q_all + i * a.q_stride + h * D, qbuf.data() + h * D, D, a.scale);
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* kb = k_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        const T* next = b + 1 < num_blocks ? k_all + table[b + 1] * a.cache_block_stride
                                           : v_all + table[0] * a.cache_block_stride;
        prefetch_span(next, block_elems);
        for (int64_t t = 0; t < n; ++t) {
          const T* row = kb + t * a.cache_token_stride;
          for (int64_t h = 0; h < kv_heads; ++h) {
            score_rows<T, D>(qbuf.data() + h * group * D, row + h * D, group,
                             scores.data() + h * group * stride + t0 + t, stride);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * stride;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        sums[h] = exp_and_sum(s, len, m);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vb = v_all + table[b] * a.cache_block_stride;
        const int64_t t0 = b * a.block_size;
        const int64_t n = (len - t0) < a.block_size ? (len - t0) : a.block_size;
        if (b + 1 < num_blocks) {
          prefetch_span(v_all + table[b + 1] * a.cache_block_stride, block_elems);
        }
        for (int64_t t = 0; t < n; ++t) {
          const T* row = vb + t * a.cache_token_stride;
          for (int64_t h = 0; h < kv_heads; ++h) {
            add_rows<T, D>(acc.data() + h * group * D,
                           scores.data() + h * group * stride + t0 + t, stride, group, row + h * D);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        store_row(acc.data() + h * D, out + h * D, D, 1.0f / sums[h]);
      }
    }
  }
}

#endif

// Whether a call takes a work item per query token (run_rows, run_rows_tiles): enough
// tokens to keep every thread busy.
inline bool item_per_token(int64_t num_queries, int32_t threads) {
  return num_queries >= 4 * static_cast<int64_t>(threads > 0 ? threads : 1);
}

// Whether such a call scores on tiles (run_rows_tiles): bfloat16, G = 2, 4, 8 or 16 query
// heads a KV head, whole 16-row tiles of keys within every block.
inline bool tile_scores(bool tiles, int32_t dtype, int64_t group, int64_t head_dim,
                        int64_t block_size) {
#if defined(TANDEM_PA_TILES)
  return tiles && dtype == kBFloat16 && block_size % 16 == 0 && head_dim % 64 == 0 &&
         (group == 2 || group == 4 || group == 8 || group == 16);
#else
  (void)tiles;
  (void)dtype;
  (void)group;
  (void)head_dim;
  (void)block_size;
  return false;
#endif
}

// The largest head chunk G dividing the group whose G * D accumulators fit in 16 vector
// registers (32 float32 lanes each... of 16), leaving the rest for the K/V row.
template <typename T, int D>
int dispatch_group(const Args& a, int32_t threads) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  if (item_per_token(a.num_queries, threads)) {
#if defined(TANDEM_PA_TILES)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (tile_scores(a.tiles, kBFloat16, group, D, a.block_size)) {
        switch (group) {
          case 2: run_rows_tiles<D, 2>(a); return 0;
          case 4: run_rows_tiles<D, 4>(a); return 0;
          case 8: run_rows_tiles<D, 8>(a); return 0;
          case 16: run_rows_tiles<D, 16>(a); return 0;
          default: break;
        }
      }
    }
#endif
    // Query rows per value pass: as many of a KV head's as keep their accumulators (GC * D
    // floats) within 16 vector registers.
    if (group % 4 == 0 && 4 * D <= 256) {
      run_rows<T, D, (4 * D <= 256 ? 4 : 1)>(a);
    } else if (group % 2 == 0 && 2 * D <= 256) {
      run_rows<T, D, (2 * D <= 256 ? 2 : 1)>(a);
    } else {
      run_rows<T, D, 1>(a);
    }
    return 0;
  }
  constexpr int kMaxFloats = 256;
  if (group % 8 == 0 && 8 * D <= kMaxFloats) {
    run<T, D, (8 * D <= kMaxFloats ? 8 : 1)>(a);
  } else if (group % 4 == 0 && 4 * D <= kMaxFloats) {
    run<T, D, (4 * D <= kMaxFloats ? 4 : 1)>(a);
  } else if (group % 2 == 0 && 2 * D <= kMaxFloats) {
    run<T, D, (2 * D <= kMaxFloats ? 2 : 1)>(a);
  } else {
    run<T, D, 1>(a);
  }
  return 0;
}

// The head sizes dispatch_dim has code for.
inline bool head_dim_handled(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

template <typename T>
int dispatch_dim(const Args& a, int64_t head_dim, int32_t threads) {
  switch (head_dim) {
    case 64:
      return dispatch_group<T, 64>(a, threads);
    case 128:
      return dispatch_group<T, 128>(a, threads);
    case 256:
      return dispatch_group<T, 256>(a, threads);
    default:
      return 2;
  }
}

}  // namespace

extern "C" {

// Whether this build can put the scores on AMX tiles: 0 no, 1 on the CPU's own, 2 on
// emulated ones (the test build).
int tandem_pa_tiles() {
#if defined(TANDEM_PA_TILES)
  return tandem_amx_emulated() ? 2 : 1;
#else
  return 0;
#endif
}

// Whether tandem_paged_attention with these arguments scores on tiles (what the tests ask
// of the shapes they check).
int tandem_pa_scores_on_tiles(int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int32_t dtype,
                              int32_t num_threads, int32_t use_tiles) {
  if (!head_dim_handled(head_dim) || block_size <= 0 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0) {
    return 0;
  }
  return item_per_token(num_queries, num_threads) &&
                 tile_scores(use_tiles != 0, dtype, num_heads / num_kv_heads, head_dim,
                             block_size)
             ? 1
             : 0;
}

// Which head sizes and dtypes this build handles (the Python side asks before using it).
int tandem_pa_supports(int64_t head_dim, int32_t dtype) {
  return head_dim_handled(head_dim) && (dtype == kFloat32 || dtype == kBFloat16) ? 1 : 0;
}

// Attention of each query token over the first kv_lens[i] tokens of the sequence whose
// block table is row table_row[i]. q: [num_queries, num_heads, head_dim] rows q_stride
// apart; out likewise with out_stride; caches [num_blocks, block_size, num_kv_heads,
// head_dim] with the given block and token strides (elements). A query with no tokens to
// attend gets a zero output.
// num_threads: the OpenMP threads to use (torch.get_num_threads()). Returns 0, or non-zero
// for arguments this build does not handle.
int tandem_paged_attention(void* out, const void* q, const void* k_cache,
                           const void* v_cache, const int64_t* block_tables,
                           const int64_t* table_row, const int64_t* kv_lens,
                           int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t q_stride,
                           int64_t out_stride, int64_t table_stride,
                           int64_t cache_block_stride, int64_t cache_token_stride,
                           float scale, int32_t dtype, int32_t num_threads,
                           int32_t use_tiles) {
#if defined(_OPENMP)
  // The calling thread's OpenMP team size, as torch sets it for its own operators (torch's
  // libgomp is the one loaded, so the pool is shared with torch's kernels).
  if (num_threads > 0) omp_set_num_threads(num_threads);
#else
  (void)num_threads;
#endif
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  Args a{out,          q,          k_cache,  v_cache,     block_tables,
         table_row,    kv_lens,    num_queries, num_heads, num_kv_heads,
         block_size,   q_stride,   out_stride, table_stride, cache_block_stride,
         cache_token_stride, scale, use_tiles != 0};
  if (dtype == kFloat32) return dispatch_dim<float>(a, head_dim, num_threads);
  if (dtype == kBFloat16) return dispatch_dim<uint16_t>(a, head_dim, num_threads);
  return 3;
}

// The step's new K and V rows into their cache slots: token t's row (row_bytes, its heads
// back to back) of k and v, rows k_stride / v_stride bytes apart, to slot slots[t] of
// caches whose slots are slot_bytes apart. Plain copies, one thread unless the step moves
// many megabytes: a small parallel copy costs more in the team's wake-up than it saves.
// Every slot is checked first (1 for one outside [0, num_slots)): nothing is written then.
int tandem_write_kv_cache(void* k_cache, void* v_cache, const void* k, const void* v,
                          const int64_t* slots, int64_t num_tokens, int64_t row_bytes,
                          int64_t k_stride, int64_t v_stride, int64_t slot_bytes,
                          int64_t num_slots, int32_t num_threads) {
  if (num_tokens < 0 || row_bytes <= 0 || slot_bytes < row_bytes) return 2;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return 1;
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  constexpr int64_t kParallelBytes = int64_t{4} << 20;
  const bool parallel = 2 * num_tokens * row_bytes >= kParallelBytes && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(kc + slots[t] * slot_bytes, ks + t * k_stride, static_cast<size_t>(row_bytes));
    std::memcpy(vc + slots[t] * slot_bytes, vs + t * v_stride, static_cast<size_t>(row_bytes));
  }
  return 0;
}

}  // extern "C"
