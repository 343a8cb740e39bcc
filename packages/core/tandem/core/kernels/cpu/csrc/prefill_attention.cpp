// Causal attention of prefill chunks on CPU, reading every key and value from the paged
// cache in place: the tokens cached before a chunk and the chunk's own (the layer writes
// those into the cache before attending), in one pass.
//
// Why a kernel of its own: a chunk is many query rows against the same keys, so unlike a
// decode step it is bound by arithmetic, and the generic CPU SDPA reaches a tenth of the
// machine's GEMM rate at these shapes (small per-head matrices, bfloat16 products through
// a library GEMM per tile). Here a work item is up to 32 query rows (query tokens times the
// heads sharing one KV head) against the sequence's keys, walked 16 keys at a time with an
// online softmax (flash attention):
// - scores are computed transposed, one vector per key holding 16 rows: the queries are
//   repacked once per item (rows in lanes), each key element is broadcast, so there is no
//   horizontal reduction and no repacking of the cache; masks, maxima, exps and sums are
//   plain vector operations over rows;
// - with AVX512-BF16, bfloat16 scores are vdpbf16ps of query pairs and key pairs (exact
//   products, float32 sums), and the probabilities are rounded to bfloat16 for the value
//   product as torch's CPU flash attention rounds them; float32 is fused multiply-adds.
// - the output of each row stays in float32 until the end and is rounded once.
//
// Items are ordered by the keys they read, longest first, for the dynamic schedule to end
// evenly. Built by tandem.core.kernels.cpu.prefill_attention with -march=native; called
// through ctypes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using namespace tandem;

constexpr int kRows = 32;  // query rows per item: two 16-lane vectors
constexpr int kKeys = 16;  // keys per tile

struct Args {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int64_t* block_tables;
  const int64_t* q_starts;
  const int64_t* q_lens;
  const int64_t* kv_lens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t q_stride;
  int64_t out_stride;
  int64_t table_stride;
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  float scale;
};

// One work item: tokens [j0, j0 + tokens) of sequence `seq`, query heads
// [kv_head * group + g0, + heads) of one KV head; row r is token r / heads, head r % heads.
struct Item {
  int64_t seq;
  int64_t j0;
  int64_t tokens;
  int64_t kv_head;
  int64_t g0;
  int64_t heads;
  int64_t keys;  // keys the last row reads (the work, for ordering)
};

std::vector<Item> plan(const Args& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t chunk = std::min<int64_t>(group, kRows);
  const int64_t tokens_per_item = std::max<int64_t>(1, kRows / chunk);
  std::vector<Item> items;
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t qlen = a.q_lens[b];
    const int64_t cached = a.kv_lens[b] - qlen;
    for (int64_t j0 = 0; j0 < qlen; j0 += tokens_per_item) {
      const int64_t tokens = std::min(tokens_per_item, qlen - j0);
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        for (int64_t g0 = 0; g0 < group; g0 += chunk) {
          items.push_back({b, j0, tokens, h, g0, std::min(chunk, group - g0),
                           cached + j0 + tokens});
        }
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.keys > y.keys; });
  return items;
}

// Per-thread scratch of one item, rows in the minor dimension where vectors run over rows.
template <int D>
struct Scratch {
  // Queries, transposed: float32 [D][kRows] (pre-scaled), or bfloat16 pairs [D/2][kRows].
  alignas(64) float qf[D * kRows];
  alignas(64) uint32_t qp[D / 2 * kRows];
  alignas(64) float o[kRows * D];  // output accumulators, [row][D]
  alignas(64) float p[kKeys * kRows];  // probabilities of a tile, [key][row]
  alignas(64) uint32_t pp[kKeys / 2 * kRows];  // the same as bfloat16 pairs of keys
  alignas(64) uint32_t vp[kKeys / 2 * D];  // values as bfloat16 pairs of keys, [pair][D]
  alignas(64) float alpha[kRows];  // per-row rescale of o for this tile
  alignas(64) float m[kRows];      // running maximum per row
  alignas(64) float l[kRows];      // running sum per row
  alignas(64) int32_t pos[kRows];  // absolute position of each row's token
};

#if defined(__AVX512F__)

constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    true;
#else
    false;
#endif

// s[t][v] = scores of keys t (rows of `keys`) for rows v * 16 .. v * 16 + 15.
template <typename T, int D>
inline void score_tile(const Scratch<D>& sc, const T* const* keys, __m512 (&s)[kKeys][2]) {
  for (int k0 = 0; k0 < kKeys; k0 += 8) {
    __m512 acc[8][2];
    for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      for (int p = 0; p < D / 2; ++p) {
        const __m512bh q0 = (__m512bh)_mm512_load_si512(sc.qp + p * kRows);
        const __m512bh q1 = (__m512bh)_mm512_load_si512(sc.qp + p * kRows + 16);
        for (int t = 0; t < 8; ++t) {
          int32_t pair;
          std::memcpy(&pair, keys[k0 + t] + 2 * p, sizeof(pair));
          const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
          acc[t][0] = _mm512_dpbf16_ps(acc[t][0], q0, kb);
          acc[t][1] = _mm512_dpbf16_ps(acc[t][1], q1, kb);
        }
      }
      for (int t = 0; t < 8; ++t) {
        s[k0 + t][0] = acc[t][0];
        s[k0 + t][1] = acc[t][1];
      }
      continue;
    }
#endif
    for (int d = 0; d < D; ++d) {
      const __m512 q0 = _mm512_load_ps(sc.qf + d * kRows);
      const __m512 q1 = _mm512_load_ps(sc.qf + d * kRows + 16);
      for (int t = 0; t < 8; ++t) {
        const __m512 kb = _mm512_set1_ps(to_float(keys[k0 + t][d]));
        acc[t][0] = _mm512_fmadd_ps(q0, kb, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(q1, kb, acc[t][1]);
      }
    }
    for (int t = 0; t < 8; ++t) {
      s[k0 + t][0] = acc[t][0];
      s[k0 + t][1] = acc[t][1];
    }
  }
}

// Mask keys past each row's position and past the tile's end, take the tile into the
// running maximum and sum, and leave the probabilities (and each row's rescale) in `sc`.
template <typename T, int D>
inline void softmax_tile(Scratch<D>& sc, __m512 (&s)[kKeys][2], int64_t kpos0, int64_t n,
                         float post_scale, bool causal) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 ps = _mm512_set1_ps(post_scale);
  for (int v = 0; v < 2; ++v) {
    const __m512i pos = _mm512_load_si512(sc.pos + 16 * v);
    __m512 tile_max = neg_inf;
    for (int t = 0; t < kKeys; ++t) {
      __mmask16 keep = t < n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0);
      if (causal) {
        keep &= _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(kpos0 + t)));
      }
      s[t][v] = _mm512_mask_mul_ps(neg_inf, keep, s[t][v], ps);
      tile_max = _mm512_max_ps(tile_max, s[t][v]);
    }
    const __m512 old_max = _mm512_load_ps(sc.m + 16 * v);
    const __m512 new_max = _mm512_max_ps(old_max, tile_max);
    // exp(-inf - finite) is 0: the first tile finds nothing to rescale.
    const __m512 alpha = exp16(_mm512_sub_ps(old_max, new_max));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < kKeys; ++t) {
      const __mmask16 live = _mm512_cmp_ps_mask(s[t][v], neg_inf, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s[t][v], new_max)));
      s[t][v] = e;
      sum = _mm512_add_ps(sum, e);
      if constexpr (!(kBf16Dot && sizeof(T) == 2)) {
        _mm512_store_ps(sc.p + t * kRows + 16 * v, e);
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      for (int t = 0; t < kKeys; t += 2) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[t][v]));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s[t + 1][v]));
        _mm512_store_si512(sc.pp + (t / 2) * kRows + 16 * v,
                           _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
#endif
    _mm512_store_ps(sc.l + 16 * v,
                    _mm512_fmadd_ps(_mm512_load_ps(sc.l + 16 * v), alpha, sum));
    _mm512_store_ps(sc.m + 16 * v, new_max);
    _mm512_store_ps(sc.alpha + 16 * v, alpha);
  }
}

// o[r] = o[r] * alpha[r] + sum_t p[t][r] v_t for the item's rows.
template <typename T, int D>
inline void value_tile(Scratch<D>& sc, const T* const* values, int64_t n, int64_t rows) {
  constexpr int C = D / 16;
  constexpr int RG = 16 / C > 0 ? 16 / C : 1;  // rows whose accumulators fit 16 registers
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == 2) {
    const int64_t pairs = (n + 1) / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      const T* v0 = values[2 * i];
      const T* v1 = values[2 * i + 1];
      for (int c = 0; c < C; ++c) {
        const __m512i lo = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
        const __m512i hi = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)));
        _mm512_store_si512(sc.vp + i * D + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RG) {
      const int g = static_cast<int>(std::min<int64_t>(RG, rows - r0));
      __m512 acc[RG][C];
      for (int r = 0; r < g; ++r) {
        const __m512 al = _mm512_set1_ps(sc.alpha[r0 + r]);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_mul_ps(_mm512_load_ps(sc.o + (r0 + r) * D + 16 * c), al);
        }
      }
      for (int64_t i = 0; i < pairs; ++i) {
        __m512bh vv[C];
        for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_load_si512(sc.vp + i * D + 16 * c);
        for (int r = 0; r < g; ++r) {
          const __m512bh w =
              (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(sc.pp[i * kRows + r0 + r]));
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], w);
        }
      }
      for (int r = 0; r < g; ++r) {
        for (int c = 0; c < C; ++c) _mm512_store_ps(sc.o + (r0 + r) * D + 16 * c, acc[r][c]);
      }
    }
    return;
  }
#endif
  for (int64_t r0 = 0; r0 < rows; r0 += RG) {
    const int g = static_cast<int>(std::min<int64_t>(RG, rows - r0));
    __m512 acc[RG][C];
    for (int r = 0; r < g; ++r) {
      const __m512 al = _mm512_set1_ps(sc.alpha[r0 + r]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(sc.o + (r0 + r) * D + 16 * c), al);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(values[t] + 16 * c);
      for (int r = 0; r < g; ++r) {
        const __m512 w = _mm512_set1_ps(sc.p[t * kRows + r0 + r]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < g; ++r) {
      for (int c = 0; c < C; ++c) _mm512_store_ps(sc.o + (r0 + r) * D + 16 * c, acc[r][c]);
    }
  }
}

#else  // portable path: loops over rows the compiler vectorizes as the target allows

template <typename T, int D>
inline void score_tile(const Scratch<D>& sc, const T* const* keys, float (&s)[kKeys][kRows]) {
  for (int t = 0; t < kKeys; ++t) {
    float acc[kRows] = {};
    for (int d = 0; d < D; ++d) {
      const float kd = to_float(keys[t][d]);
      const float* qd = sc.qf + d * kRows;
#pragma omp simd
      for (int r = 0; r < kRows; ++r) acc[r] += qd[r] * kd;
    }
    std::memcpy(s[t], acc, sizeof(acc));
  }
}

template <typename T, int D>
inline void softmax_tile(Scratch<D>& sc, float (&s)[kKeys][kRows], int64_t kpos0, int64_t n,
                         float post_scale, bool causal) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < kRows; ++r) {
    float tile_max = neg_inf;
    for (int t = 0; t < kKeys; ++t) {
      const bool keep = t < n && (!causal || sc.pos[r] >= kpos0 + t);
      s[t][r] = keep ? s[t][r] * post_scale : neg_inf;
      tile_max = std::max(tile_max, s[t][r]);
    }
    const float new_max = std::max(sc.m[r], tile_max);
    const float alpha = sc.m[r] == neg_inf ? 0.0f : std::exp(sc.m[r] - new_max);
    float sum = 0.0f;
    for (int t = 0; t < kKeys; ++t) {
      const float e = s[t][r] == neg_inf ? 0.0f : std::exp(s[t][r] - new_max);
      sc.p[t * kRows + r] = e;
      sum += e;
    }
    sc.l[r] = sc.l[r] * alpha + sum;
    sc.m[r] = new_max;
    sc.alpha[r] = alpha;
  }
}

template <typename T, int D>
inline void value_tile(Scratch<D>& sc, const T* const* values, int64_t n, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = sc.o + r * D;
    const float al = sc.alpha[r];
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] *= al;
    for (int64_t t = 0; t < n; ++t) {
      const float w = sc.p[t * kRows + r];
      const T* v = values[t];
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += w * to_float(v[d]);
    }
  }
}

#endif

template <typename T, int D>
void run(const Args& a) {
  const std::vector<Item> items = plan(a);
  const int64_t group = a.num_heads / a.num_kv_heads;
  const T* q_all = static_cast<const T*>(a.q);
  const T* k_all = static_cast<const T*>(a.k_cache);
  const T* v_all = static_cast<const T*>(a.v_cache);
  T* out_all = static_cast<T*>(a.out);
  const int64_t n_items = static_cast<int64_t>(items.size());
#if defined(__AVX512BF16__)
  const bool pairs = sizeof(T) == 2;
#else
  const bool pairs = false;
#endif

#pragma omp parallel
  {
    std::vector<Scratch<D>> scratch_holder(1);
    Scratch<D>& sc = scratch_holder[0];
    // A key row of zeros stands in for keys past the end of a tile (0 * garbage could be
    // NaN; 0 * 0 never is).
    std::vector<T> zero_row(D, T{});
    const T* keys[kKeys];
    const T* values[kKeys];
#if defined(__AVX512F__)
    __m512 s[kKeys][2];
#else
    float s[kKeys][kRows];
#endif

#pragma omp for schedule(dynamic, 1)
    for (int64_t idx = 0; idx < n_items; ++idx) {
      const Item& it = items[idx];
      const int64_t rows = it.tokens * it.heads;
      const int64_t cached = a.kv_lens[it.seq] - a.q_lens[it.seq];
      const int64_t* table = a.block_tables + it.seq * a.table_stride;
      auto q_row = [&](int64_t r) {
        const int64_t j = it.j0 + r / it.heads;
        const int64_t head = it.kv_head * group + it.g0 + r % it.heads;
        return q_all + (a.q_starts[it.seq] + j) * a.q_stride + head * D;
      };
      // Rows past the item's real ones repeat its last row: finite, never stored.
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t real = std::min(r, rows - 1);
        const T* src = q_row(real);
        sc.pos[r] = static_cast<int32_t>(cached + it.j0 + real / it.heads);
        if (pairs) {
          for (int p = 0; p < D / 2; ++p) {
            uint32_t pair;
            std::memcpy(&pair, src + 2 * p, sizeof(pair));
            sc.qp[p * kRows + r] = pair;
          }
        } else {
          for (int d = 0; d < D; ++d) sc.qf[d * kRows + r] = to_float(src[d]) * a.scale;
        }
        sc.m[r] = -std::numeric_limits<float>::infinity();
        sc.l[r] = 0.0f;
      }
      std::fill(sc.o, sc.o + rows * D, 0.0f);
      const float post_scale = pairs ? a.scale : 1.0f;
      const int64_t first_pos = cached + it.j0;  // the earliest row's position
      const int64_t num_keys = it.keys;
      for (int64_t k0 = 0; k0 < num_keys;) {
        const int64_t block = k0 / a.block_size;
        const int64_t offset = k0 % a.block_size;
        const int64_t n = std::min<int64_t>({kKeys, a.block_size - offset, num_keys - k0});
        const int64_t base = table[block] * a.cache_block_stride + it.kv_head * D;
        for (int64_t t = 0; t < kKeys; ++t) {
          if (t < n) {
            keys[t] = k_all + base + (offset + t) * a.cache_token_stride;
            values[t] = v_all + base + (offset + t) * a.cache_token_stride;
          } else {
            keys[t] = values[t] = zero_row.data();
          }
        }
        score_tile<T, D>(sc, keys, s);
        softmax_tile<T, D>(sc, s, k0, n, post_scale, k0 + n - 1 > first_pos);
        value_tile<T, D>(sc, values, n, rows);
        k0 += n;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = it.j0 + r / it.heads;
        const int64_t head = it.kv_head * group + it.g0 + r % it.heads;
        T* dst = out_all + (a.q_starts[it.seq] + j) * a.out_stride + head * D;
        store_row(sc.o + r * D, dst, D, 1.0f / sc.l[r]);
      }
    }
  }
}

template <typename T>
int dispatch(const Args& a, int64_t head_dim) {
  switch (head_dim) {
    case 64:
      run<T, 64>(a);
      return 0;
    case 128:
      run<T, 128>(a);
      return 0;
    case 256:
      run<T, 256>(a);
      return 0;
    default:
      return 2;
  }
}

}  // namespace

extern "C" {

int tandem_prefill_supports(int64_t head_dim, int32_t dtype) {
  const bool dim_ok = head_dim == 64 || head_dim == 128 || head_dim == 256;
  return dim_ok && (dtype == kFloat32 || dtype == kBFloat16) ? 1 : 0;
}

// Causal attention of prefill chunks. Sequence b's chunk is q rows
// [q_starts[b], q_starts[b] + q_lens[b]) of q ([rows, num_heads, head_dim], q_stride
// elements apart; out likewise with out_stride); its keys are the first kv_lens[b] tokens
// of the sequence whose blocks are row b of block_tables (the chunk's own tokens last,
// already written), and chunk token j (position kv_lens[b] - q_lens[b] + j) attends keys
// [0, its position]. Caches [num_blocks, block_size, num_kv_heads, head_dim] with the
// given block and token strides (elements); kv_lens[b] >= q_lens[b] >= 1. Returns 0, or
// non-zero for arguments this build does not handle.
int tandem_prefill_attention(void* out, const void* q, const void* k_cache, const void* v_cache,
                             const int64_t* block_tables, const int64_t* q_starts,
                             const int64_t* q_lens, const int64_t* kv_lens, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t q_stride, int64_t out_stride,
                             int64_t table_stride, int64_t cache_block_stride,
                             int64_t cache_token_stride, float scale, int32_t dtype,
                             int32_t num_threads) {
#if defined(_OPENMP)
  if (num_threads > 0) omp_set_num_threads(num_threads);
#else
  (void)num_threads;
#endif
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (q_lens[b] < 1 || kv_lens[b] < q_lens[b]) return 4;
  }
  Args a{out,       q,          k_cache,   v_cache,      block_tables, q_starts,
         q_lens,    kv_lens,    num_seqs,  num_heads,    num_kv_heads, block_size,
         q_stride,  out_stride, table_stride, cache_block_stride, cache_token_stride, scale};
  if (dtype == kFloat32) return dispatch<float>(a, head_dim);
  if (dtype == kBFloat16) return dispatch<uint16_t>(a, head_dim);
  return 3;
}

}  // extern "C"
