// Causal attention of prefill chunks in bfloat16, both products on AMX tiles, keys and values
// read from the paged cache (a chunk's own written there last, as for prefill_attention.cpp).
//
// Why a kernel of its own: the vector kernel (prefill_attention.cpp) multiplies on vdpbf16ps,
// and torch's CPU flash attention, which multiplies on tiles, pays per call (K/V packed per
// call, a call per prompt) more than its arithmetic at prompt lengths of a few hundred: on an
// AMX Xeon, 8 prompts of 256 tokens of the bench MoE model (8 query / 2 KV heads of 64) took
// ~2 ms a layer, ~275 GFLOP/s. Here one call takes every chunk it is given:
// - each KV head's keys and values are packed once per chunk as B tiles (keys: 16 keys x 16
//   head-dim pairs; values: 16 key pairs x 16 head dims), shared by the heads of its group;
// - a work item is 16 query rows (tokens) of one head against the keys they see (a chunk
//   after cached tokens: those and its own up to each row's position); its queries are A
//   tiles read where the fused projection wrote them (16 rows x 32 dims);
// - all of an item's scores are kept, row-major (16 rows x its keys, float32), so the
//   softmax takes each row's maximum first and exponentiates once, with no rescaling
//   (AVX-512 where the build has it); the probabilities, rounded to bfloat16 as torch's flash
//   attention rounds them, are the A tiles of out = P . V (16 rows x 32 keys), which sums
//   every key block in four tile accumulators of 16 dims;
// - out = P . V / (sum of the unrounded probabilities), rounded to bfloat16 once.
// Items go prompt by prompt and KV head by KV head, the most keys first, on a dynamic
// schedule (see run()). The same 8 x 256 layer: 1.2 ms against flash attention's 2.0-2.1
// (benchmarks/prefill_chunk_attention.py).
//
// The tile instructions are the CPU's where it has AMX-BF16, or software in the test build
// (TANDEM_AMX_EMULATE, amx_tiles.h); elsewhere the library holds no kernel and says so.
// Built by tandem.core.kernels.cpu.amx_prefill with -march=native; called through ctypes.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "vec_math.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(TANDEM_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#define TANDEM_TILE_KERNEL 1
#include "amx_tiles.h"
#endif

namespace {

#if defined(TANDEM_TILE_KERNEL)

using tandem::fast_exp;
using tandem::float_to_bf16;

constexpr int64_t kRows = 16;      // query rows per item: one B tile's 16 columns
constexpr int64_t kKeyTile = 16;   // keys per score tile (A rows)
constexpr int64_t kKeyBlock = 32;  // keys per value product (A columns of V^T)
constexpr int64_t kTileElems = 512;  // bfloat16 elements of one 16 x 64-byte tile

struct Args {
  uint16_t* out;
  const uint16_t* q;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  const int64_t* block_tables;
  const int64_t* q_starts;
  const int64_t* q_lens;
  const int64_t* kv_lens;
  int64_t spans;
  int64_t heads;
  int64_t kv_heads;
  int64_t dim;
  int64_t block_size;
  int64_t q_stride;  // elements between tokens
  int64_t out_stride;
  int64_t table_stride;
  int64_t cache_block_stride;
  int64_t cache_token_stride;
  float scale;
};

struct Item {
  int64_t span;
  int64_t head;
  int64_t first_row;  // the item's first query row within its chunk
};

// Where key `key` of chunk s's sequence sits in a cache, for KV head kvh.
inline const uint16_t* cached_row(const Args& a, const uint16_t* cache, int64_t s, int64_t key,
                                  int64_t kvh) {
  const int64_t block = a.block_tables[s * a.table_stride + key / a.block_size];
  return cache + block * a.cache_block_stride + (key % a.block_size) * a.cache_token_stride +
         kvh * a.dim;
}

inline int64_t key_blocks(int64_t len) { return (len + kKeyBlock - 1) / kKeyBlock; }

// One KV head's keys and values of chunk s's sequence, keys [32 b, 32 b + 32), read from the
// paged caches, as the B tiles of the two products (keys past the sequence's zero: their
// probabilities are zero too, and zero times zero is zero where a NaN in memory would not be):
// - keys: [key tile][dim / 32][16 dim pairs][16 keys][2], key tile 2 b and 2 b + 1;
// - values: [block b][dim / 16][16 key pairs][16 dims][2].
void pack_block(const Args& a, int64_t s, int64_t kvh, int64_t b, uint32_t* keys,
                uint32_t* values) {
  const int64_t D = a.dim;
  const int64_t steps = D / 32;
  const int64_t chunks = D / 16;
  const int64_t len = a.kv_lens[s];
  const int64_t tile_words = kTileElems / 2;
  uint32_t* kt = keys + 2 * b * steps * tile_words;
  for (int64_t kk = 0; kk < kKeyBlock; ++kk) {
    const int64_t key = b * kKeyBlock + kk;
    uint32_t* dst = kt + (kk / kKeyTile) * steps * tile_words + kk % kKeyTile;
    if (key >= len) {
      for (int64_t w = 0; w < D / 2; ++w) dst[(w / 16) * tile_words + (w % 16) * 16] = 0;
      continue;
    }
    const uint16_t* row = cached_row(a, a.k_cache, s, key, kvh);
    for (int64_t w = 0; w < D / 2; ++w) {
      uint32_t pair;
      std::memcpy(&pair, row + 2 * w, sizeof(pair));
      dst[(w / 16) * tile_words + (w % 16) * 16] = pair;
    }
  }
  uint32_t* vt = values + b * chunks * tile_words;
  const uint16_t zeros[256] = {};
  for (int64_t kp = 0; kp < kKeyBlock / 2; ++kp) {
    const int64_t key = b * kKeyBlock + 2 * kp;
    const uint16_t* even = key < len ? cached_row(a, a.v_cache, s, key, kvh) : zeros;
    const uint16_t* odd = key + 1 < len ? cached_row(a, a.v_cache, s, key + 1, kvh) : zeros;
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* dst = vt + c * tile_words + kp * 16;
      for (int64_t n = 0; n < 16; ++n) {
        dst[n] = static_cast<uint32_t>(even[c * 16 + n]) |
                 (static_cast<uint32_t>(odd[c * 16 + n]) << 16);
      }
    }
  }
}

// Per-thread scratch of the items.
struct Scratch {
  std::vector<uint16_t> tail;   // the last query rows of a prompt, zero past its end
  std::vector<float> scores;    // [16 rows][keys, padded to a block]
  std::vector<uint16_t> probs;  // [key blocks] A tiles: [16 rows][32 keys]
  alignas(64) float sums[4][256];  // out tiles [16 rows][16 dims]
};

template <typename T>
T* sized(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// Keys past a row's last tile are not set; a mask, not the value, leaves them out.
inline uint32_t first_lanes(int32_t n) {
  return n >= 16 ? 0xFFFFu : (n <= 0 ? 0u : (1u << n) - 1u);
}

// One row of scores (`n` keys seen, `blocks` blocks of 32 written or padded): its
// probabilities exp((score - max) * scale), zero past n, rounded to bfloat16 at `probs` +
// b * kTileElems for block b (the row's 32 keys of each P tile); returns their sum, unrounded.
inline float softmax_row(const float* scores, int32_t n, int64_t blocks, float scale,
                         uint16_t* probs) {
#if defined(__AVX512F__)
  __m512 high = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int32_t k0 = 0; k0 < n; k0 += 16) {
    const __mmask16 seen = static_cast<__mmask16>(first_lanes(n - k0));
    high = _mm512_mask_max_ps(high, seen, high, _mm512_loadu_ps(scores + k0));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(high));
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int32_t k0 = 0; k0 < blocks * kKeyBlock; k0 += 16) {
    uint16_t* dst = probs + (k0 / kKeyBlock) * kTileElems + k0 % kKeyBlock;
    if (k0 >= n) {
      // Past the row's last key (the causal corner of its block): zeros, no exps.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_setzero_si256());
      continue;
    }
    const __mmask16 seen = static_cast<__mmask16>(first_lanes(n - k0));
    // Degree 5: the probabilities are rounded to bfloat16 (8 x 256 tokens, 8 / 2 and 16 / 8
    // heads: 1.22 -> 1.11 and 2.86 -> 2.56 ms a layer against degree 7).
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + k0), top), factor);
    const __m512 p = _mm512_maskz_mov_ps(seen, tandem::exp16<5>(x));
    sum = _mm512_add_ps(sum, p);
#if defined(__AVX512BF16__)
    // Round to nearest even as float_to_bf16; p is never NaN, and one below 2^-126 (a key
    // e^-87 below the row's best) becomes zero, not a bfloat16 subnormal.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(p));
#else
    const __m512i bits = _mm512_castps_si512(p);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
#endif
  }
  return _mm512_reduce_add_ps(sum);
#else
  float top = -std::numeric_limits<float>::infinity();
  for (int32_t key = 0; key < n; ++key) top = top > scores[key] ? top : scores[key];
  float sum = 0.f;
  for (int32_t key = 0; key < blocks * kKeyBlock; ++key) {
    const float p = key < n ? fast_exp((scores[key] - top) * scale) : 0.f;
    sum += p;
    probs[(key / kKeyBlock) * kTileElems + key % kKeyBlock] = float_to_bf16(p);
  }
  return sum;
#endif
}

// Query rows [i0, i0 + 16) of one head of one chunk; `keys`/`values`: its KV head's packed
// tiles. Row j of a chunk after `offset` cached tokens is position offset + j.
void run_item(const Args& a, const Item& it, const uint16_t* keys, const uint16_t* values,
              Scratch& w) {
  const int64_t D = a.dim;
  const int64_t steps = D / 32;
  const int64_t chunks = D / 16;
  const int64_t len = a.q_lens[it.span];
  const int64_t start = a.q_starts[it.span];
  const int64_t offset = a.kv_lens[it.span] - len;
  const int64_t i0 = it.first_row;
  const int64_t rows = std::min(kRows, len - i0);
  const int64_t seen = offset + i0 + rows;  // keys the item's last row reads
  const int64_t key_tiles = (seen + kKeyTile - 1) / kKeyTile;
  const int64_t blocks = key_blocks(seen);
  const int64_t ld = blocks * kKeyBlock;  // floats between score rows

  // Queries as A tiles, read where they are; a tile reads 16 rows, past the chunk's end
  // another chunk's or past the tensor's, so a short item's come from a zeroed copy.
  const uint16_t* qp = a.q + (start + i0) * a.q_stride + it.head * D;
  int64_t qstride = a.q_stride * 2;
  if (rows < kRows) {
    uint16_t* tail = sized(w.tail, kRows * D);
    std::memset(tail, 0, kRows * D * sizeof(uint16_t));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(tail + r * D, qp + r * a.q_stride, D * sizeof(uint16_t));
    }
    qp = tail;
    qstride = D * 2;
  }

  // Scores, row-major: tile t holds the 16 rows x keys [16 t, 16 t + 16).
  float* sc = sized(w.scores, kRows * ld);
  for (int64_t t = 0; t < key_tiles; ++t) {
    TANDEM_TILE_ZERO(0);
    for (int64_t s = 0; s < steps; ++s) {
      TANDEM_TILE_LOADD(1, qp + s * 32, qstride);
      TANDEM_TILE_LOADD(2, keys + (t * steps + s) * kTileElems, 64);
      TANDEM_TILE_DPBF16PS(0, 1, 2);
    }
    TANDEM_TILE_STORED(0, sc + t * kKeyTile, ld * 4);
  }

  // Row r (position offset + i0 + r) sees keys [0, offset + i0 + r]; rows past the chunk
  // what its last does, so nothing they read is unset. Probabilities exp((score - max) *
  // scale), zero where not seen, rounded to bfloat16 into P's A tiles; the sums of the
  // unrounded ones.
  float total[kRows];
  uint16_t* pp = sized(w.probs, blocks * kTileElems);
  for (int64_t r = 0; r < kRows; ++r) {
    const int32_t n = static_cast<int32_t>(offset + i0 + std::min(r, rows - 1) + 1);
    total[r] = softmax_row(sc + r * ld, n, blocks, a.scale, pp + r * kKeyBlock);
  }

  // out = P . V, four 16-dim chunks at a time in tiles 0-3, divided by the sums.
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    TANDEM_TILE_ZERO(0);
    TANDEM_TILE_ZERO(1);
    TANDEM_TILE_ZERO(2);
    TANDEM_TILE_ZERO(3);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* vt = values + (b * chunks + c0) * kTileElems;
      TANDEM_TILE_LOADD(4, pp + b * kTileElems, 64);
      TANDEM_TILE_LOADD(5, vt, 64);
      TANDEM_TILE_DPBF16PS(0, 4, 5);
      TANDEM_TILE_LOADD(6, vt + kTileElems, 64);
      TANDEM_TILE_DPBF16PS(1, 4, 6);
      TANDEM_TILE_LOADD(5, vt + 2 * kTileElems, 64);
      TANDEM_TILE_DPBF16PS(2, 4, 5);
      TANDEM_TILE_LOADD(6, vt + 3 * kTileElems, 64);
      TANDEM_TILE_DPBF16PS(3, 4, 6);
    }
    TANDEM_TILE_STORED(0, w.sums[0], 64);
    TANDEM_TILE_STORED(1, w.sums[1], 64);
    TANDEM_TILE_STORED(2, w.sums[2], 64);
    TANDEM_TILE_STORED(3, w.sums[3], 64);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* o = a.out + (start + i0 + r) * a.out_stride + it.head * D + c0 * 16;
      const float inv = 1.f / total[r];
      for (int64_t c = 0; c < 4; ++c) {
        const float* src = w.sums[c] + r * 16;
#pragma omp simd
        for (int64_t d = 0; d < 16; ++d) o[c * 16 + d] = float_to_bf16(src[d] * inv);
      }
    }
  }
}

void run(const Args& a, int threads) {
  const int64_t group = a.heads / a.kv_heads;
  // Packed keys and values: chunk s's sequence, KV head h at base[s] + h * per_head(s)
  // elements, the keys first. A block of 32 keys is 2 * dim / 32 key tiles and dim / 16 value
  // tiles.
  const int64_t block_elems = (2 * (a.dim / 32) + a.dim / 16) * kTileElems;
  std::vector<int64_t> base(a.spans + 1, 0);
  for (int64_t s = 0; s < a.spans; ++s) {
    base[s + 1] = base[s] + a.kv_heads * key_blocks(a.kv_lens[s]) * block_elems;
  }
  struct Unit {
    int64_t span, kvh, block;
  };
  std::vector<Unit> packing;
  for (int64_t s = 0; s < a.spans; ++s) {
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t b = 0; b < key_blocks(a.kv_lens[s]); ++b) packing.push_back({s, h, b});
    }
  }
  // Items in the order the packed keys and values stay in cache: the most work first,
  // then KV head by KV head, row tiles from the last down (the most keys first), the heads
  // of the group side by side. A chunk's items end with its shortest, so the threads
  // finish within an item or two of each other. (Row tiles first across every prompt and
  // head balanced no better and read the packs from L3: 3.38-3.46 against 2.71-2.86 ms a
  // layer of 8 prompts x 256 tokens, 16 / 8 heads of 64.)
  std::vector<int64_t> order(a.spans);
  for (int64_t s = 0; s < a.spans; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return a.q_lens[x] * a.kv_lens[x] > a.q_lens[y] * a.kv_lens[y];
  });
  std::vector<Item> items;
  for (const int64_t s : order) {
    for (int64_t kvh = 0; kvh < a.kv_heads; ++kvh) {
      for (int64_t t = (a.q_lens[s] + kRows - 1) / kRows - 1; t >= 0; --t) {
        for (int64_t g = 0; g < group; ++g) items.push_back({s, kvh * group + g, t * kRows});
      }
    }
  }
  // Not zeroed first: the packing writes every element, zeros past each sequence included.
  const std::unique_ptr<uint16_t[]> packed(new uint16_t[static_cast<size_t>(base[a.spans])]);
  const auto keys_of = [&](int64_t s, int64_t kvh) {
    return packed.get() + base[s] + kvh * key_blocks(a.kv_lens[s]) * block_elems;
  };
  const auto values_of = [&](int64_t s, int64_t kvh) {
    return keys_of(s, kvh) + key_blocks(a.kv_lens[s]) * 2 * (a.dim / 32) * kTileElems;
  };
  const int64_t n_pack = static_cast<int64_t>(packing.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n_pack; ++u) {
      const Unit& p = packing[u];
      pack_block(a, p.span, p.kvh, p.block, reinterpret_cast<uint32_t*>(keys_of(p.span, p.kvh)),
                 reinterpret_cast<uint32_t*>(values_of(p.span, p.kvh)));
    }
    [[maybe_unused]] const tandem::amx::TileScope tiles;
    thread_local Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& it = items[i];
      const int64_t kvh = it.head / group;
      run_item(a, it, keys_of(it.span, kvh), values_of(it.span, kvh), scratch);
    }
  }
}

#endif  // TANDEM_TILE_KERNEL

}  // namespace

extern "C" {

int tandem_tiles_supports(int64_t head_dim, int32_t dtype) {
  const bool dim_ok = head_dim == 64 || head_dim == 128 || head_dim == 256;
  return dim_ok && dtype == tandem::kBFloat16 ? 1 : 0;
}

// 0: this build has no tile kernel (no AMX-BF16 at its ISA level); 1: the CPU's tiles (usable
// once Linux grants the process their state); 2: the test build's emulated tiles.
int tandem_prefill_tiles() {
#if defined(TANDEM_AMX_EMULATE)
  return 2;
#elif defined(TANDEM_TILE_KERNEL)
  return 1;
#else
  return 0;
#endif
}

// Causal attention of prefill chunks, bfloat16, with the arguments of prefill_attention.cpp's
// tandem_prefill_attention: chunk b is q rows [q_starts[b], q_starts[b] + q_lens[b]) ([rows,
// heads, dim], q_stride elements apart; out likewise with out_stride); its keys and values
// are the first kv_lens[b] tokens of the sequence in row b of block_tables, in caches
// [blocks, block_size, kv_heads, dim] (the chunk's own written last); chunk row j (position
// kv_lens[b] - q_lens[b] + j) attends keys [0, its position]. dim 64, 128 or 256, dtype
// bfloat16 only. Returns 0; 1 for arguments it does not take; 2 where this build has no tile
// kernel.
int tandem_tile_prefill_attention(void* out, const void* q, const void* k_cache,
                                  const void* v_cache, const int64_t* block_tables,
                                  const int64_t* q_starts, const int64_t* q_lens,
                                  const int64_t* kv_lens, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  int64_t q_stride, int64_t out_stride, int64_t table_stride,
                                  int64_t cache_block_stride, int64_t cache_token_stride,
                                  float scale, int32_t dtype, int32_t num_threads) {
#if defined(TANDEM_TILE_KERNEL)
  if (tandem_tiles_supports(head_dim, dtype) == 0) return 1;
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 1;
  if (num_seqs < 0 || block_size < 1) return 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (q_lens[s] < 1 || kv_lens[s] < q_lens[s] || q_starts[s] < 0) return 1;
  }
  const Args a{static_cast<uint16_t*>(out),
               static_cast<const uint16_t*>(q),
               static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache),
               block_tables,
               q_starts,
               q_lens,
               kv_lens,
               num_seqs,
               num_heads,
               num_kv_heads,
               head_dim,
               block_size,
               q_stride,
               out_stride,
               table_stride,
               cache_block_stride,
               cache_token_stride,
               scale};
  run(a, std::max(1, num_threads));
  return 0;
#else
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)q_starts;
  (void)q_lens, (void)kv_lens, (void)num_seqs, (void)num_heads, (void)num_kv_heads;
  (void)head_dim, (void)block_size, (void)q_stride, (void)out_stride, (void)table_stride;
  (void)cache_block_stride, (void)cache_token_stride, (void)scale, (void)dtype;
  (void)num_threads;
  return 2;
#endif
}

}  // extern "C"
