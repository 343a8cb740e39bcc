// The 4-bit weight-only linear (W4A16: GPTQ and AWQ) on the CPU, reading the packed codes
// the layer keeps (``layers/int4_weights.py``): int32 [N, K / 8] output-major, input 8w + i of
// a row in nibble i of word w; scales [N, G] in the activations' dtype, true zero points
// uint8 [N, G], groups of K / G consecutive inputs.
//
// Why this shape: a decode step is bound by reading weights, and the packed codes are a
// quarter of a bfloat16 weight's bytes, so the codes are read as they are and turned into
// floats in registers, four output rows (a tile) at a time so each activation vector loaded
// serves four FMAs. Where a block of 8 kLanes inputs has one group on AVX-512 (group sizes a
// multiple of 128: GPTQ's usual 128), the group's 16 possible weights form a table and each
// nibble picks its lane with one permute; otherwise each lane's weight is (q - z) * s. The
// weights go straight into the FMAs for batches of up to kRowsTogether rows (and for the
// AVX-512 table at any decode batch, the lookup being cheaper than a store and reload);
// larger batches on the other paths dequantize a tile into a buffer that stays in L1 and
// every activation row takes its dot products from there. The weights are the reference's,
// bit for bit: (q - z) is a small exact integer, times s rounded once in float32, and
// rounded to bfloat16 once more for bfloat16 activations, as the reference's bfloat16
// product rounds it. Only the summation order differs (float32 sums, rounded to the output
// dtype at the end).
//
// The vector paths read kLanes words at once (one vector) and take nibble i of every lane
// together, so a block of 8 kLanes inputs comes out in the order i * kLanes + j for input
// 8 j + i; the activations are put in that order once per call, so the dot products are
// plain contiguous loops. Large batches do not come here: ``tandem_int4_dequantize`` writes
// the whole float weight for a GEMM library to take.
//
// bfloat16 activations on a CPU with AVX512-BF16 take another path (its section below):
// bfloat16 weights formed once per panel of output rows and VDPBF16PS outer products (dot
// products straight from the codes for 1 to 3 rows), 32 products an instruction, twice the
// FMAs' 16; the Python side hands it batches of up to BF16_DOT_ROWS rows.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace tandem {
namespace {

// A tile is kTileOutputs weight rows times kRowsTogether activation rows, one accumulator
// each: every vector loaded serves several FMAs, so the activations (re-read for every tile)
// come from L2 half as often as there are FMAs.
constexpr int kTileOutputs = 4;
#if TANDEM_COMPILED_ISA == 2
constexpr int64_t kLanes = 16;
constexpr int kRowsTogether = 4;
#elif TANDEM_COMPILED_ISA == 1
constexpr int64_t kLanes = 8;
// 4 x 2 accumulators, 4 weights and an activation: 13 of the 16 AVX2 registers.
constexpr int kRowsTogether = 2;
#else
constexpr int64_t kLanes = 1;
constexpr int kRowsTogether = 4;
#endif
// Inputs per block: one vector of words, eight codes a word.
constexpr int64_t kBlock = 8 * kLanes;
constexpr int32_t kNibble = 0xF;
// Activation elements from which their permutation runs on every thread.
constexpr int64_t kParallelPermute = 1 << 16;

struct Layer {
  const int32_t* codes;
  const void* scales;
  const uint8_t* zeros;
  int64_t n, k, groups, group_inputs, words;
  // Inputs padded to whole blocks: the length of a permuted row.
  int64_t padded;
  int32_t dtype;
};

// The bytes of a grouped call's next work item (its weight codes), prefetched into L2 a
// share at a time while the current item computes, so a thread's weight stream runs on from
// item to item (expert_items.h); the dense call steps an empty one.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines = 0;  // cache lines a step
  // Whether the rows past the panel are most likely this thread's next ones (the dense
  // call's static schedule; at the end of a thread's run they are the next thread's, and
  // that prefetch is wasted), so a panel's last strip may prefetch them (bf16_panel).
  bool rows_follow = false;
  void step() {
    for (int64_t l = 0; l < lines && next < end; ++l, next += 64) {
      __builtin_prefetch(next, 0, 2);  // locality 2: prefetcht1, L2 and beyond
    }
  }
};

inline float scalar_at(const void* base, int64_t i, int32_t dtype) {
  return dtype == kFloat32 ? static_cast<const float*>(base)[i]
                           : bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// float32 -> the nearest bfloat16, kept as a float32 (weights are finite: no NaN case).
inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// The row's scales and zero points as floats, one per group.
inline void row_groups(const Layer& L, int64_t row, float* s, float* z) {
  for (int64_t g = 0; g < L.groups; ++g) {
    s[g] = scalar_at(L.scales, row * L.groups + g, L.dtype);
    z[g] = static_cast<float>(L.zeros[row * L.groups + g]);
  }
}

// Each word's group, padded with group 0 to the padded inputs' words, whole vectors (the
// padding's codes are masked).
std::vector<int32_t> word_groups(const Layer& L) {
  std::vector<int32_t> word_group(static_cast<size_t>(L.padded / 8), 0);
  for (int64_t w = 0; w < L.words; ++w) word_group[w] = static_cast<int32_t>(8 * w / L.group_inputs);
  return word_group;
}

#if TANDEM_COMPILED_ISA == 2

using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }

inline __m512 round_bf16_vec(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(~0xFFFF)));
}

inline __m512 block_table(const Layer& L, float s, float z) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps(z)), _mm512_set1_ps(s));
  return L.dtype == kBFloat16 ? round_bf16_vec(table) : table;
}

inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }

// The weights of block b of a row, in the permuted order: w[i] holds nibble i of each word.
// Lanes past the last word are zero, so the padding adds exact zeros.
inline void block_weights(const Layer& L, const int32_t* row, const float* s, const float* z,
                          const int32_t* word_group, int64_t b, Vec (&w)[8]) {
  const int64_t first = b * kLanes;
  const int64_t count = std::min<int64_t>(kLanes, L.words - first);
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
  const __m512i words = _mm512_maskz_loadu_epi32(mask, row + first);
  if (L.group_inputs % kBlock == 0) {
    // One group for the whole block: its 16 possible weights in a table, and each nibble
    // picks its lane (vpermps reads the low four bits of each index: no mask needed).
    const int64_t g = b * kBlock / L.group_inputs;
    const __m512 table = block_table(L, s[g], z[g]);
    for (int i = 0; i < 8; ++i) {
      w[i] = _mm512_maskz_permutexvar_ps(mask, _mm512_srli_epi32(words, 4 * i), table);
    }
    return;
  }
  const __m512i idx = _mm512_loadu_si512(word_group + first);
  const __m512 vs = _mm512_i32gather_ps(idx, s, 4);
  const __m512 vz = _mm512_i32gather_ps(idx, z, 4);
  const __m512i nibble = _mm512_set1_epi32(kNibble);
  for (int i = 0; i < 8; ++i) {
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(words, 4 * i), nibble);
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), vz), vs);
    if (L.dtype == kBFloat16) v = round_bf16_vec(v);
    w[i] = _mm512_maskz_mov_ps(mask, v);
  }
}

#elif TANDEM_COMPILED_ISA == 1

using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return reduce_add8(v); }

inline __m256 round_bf16_vec(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(~0xFFFF)));
}

inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }

inline void block_weights(const Layer& L, const int32_t* row, const float* s, const float* z,
                          const int32_t* word_group, int64_t b, Vec (&w)[8]) {
  const int64_t first = b * kLanes;
  const int64_t count = std::min<int64_t>(kLanes, L.words - first);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), lane);
  const __m256i words = _mm256_maskload_epi32(row + first, mask);
  __m256 vs, vz;
  if (L.group_inputs % kBlock == 0) {
    const int64_t g = b * kBlock / L.group_inputs;
    vs = _mm256_set1_ps(s[g]);
    vz = _mm256_set1_ps(z[g]);
  } else {
    const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word_group + first));
    vs = _mm256_i32gather_ps(s, idx, 4);
    vz = _mm256_i32gather_ps(z, idx, 4);
  }
  const __m256i nibble = _mm256_set1_epi32(kNibble);
  for (int i = 0; i < 8; ++i) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * i), nibble);
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), vz), vs);
    if (L.dtype == kBFloat16) v = round_bf16_vec(v);
    w[i] = _mm256_and_ps(v, _mm256_castsi256_ps(mask));
  }
}

#else

using Vec = float;
inline Vec vzero() { return 0.0f; }
inline Vec vload(const float* p) { return *p; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec v) { return v; }

inline void vstore(float* p, Vec v) { *p = v; }

// One word a block: the permuted order is the natural one.
inline void block_weights(const Layer& L, const int32_t* row, const float* s, const float* z,
                          const int32_t* word_group, int64_t b, Vec (&w)[8]) {
  const int32_t g = word_group[b];
  for (int i = 0; i < 8; ++i) {
    const float q = static_cast<float>((row[b] >> (4 * i)) & kNibble);
    const float v = (q - z[g]) * s[g];
    w[i] = L.dtype == kBFloat16 ? round_bf16(v) : v;
  }
}

#endif

// Block b of a row into out[0 .. kBlock), in the permuted order.
inline void dequantize_block(const Layer& L, const int32_t* row, const float* s, const float* z,
                             const int32_t* word_group, int64_t b, float* out) {
  Vec w[8];
  block_weights(L, row, s, z, word_group, b, w);
  for (int i = 0; i < 8; ++i) vstore(out + i * kLanes, w[i]);
}

// The dot products of T dequantized weight rows (`w`, rows `padded` apart) with R activation
// rows (`x`, likewise): sums[t * R + r].
template <int T, int R>
inline void dot_tile(const float* w, const float* x, int64_t padded, float* sums) {
  Vec acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = vzero();
  for (int64_t k = 0; k < padded; k += kLanes) {
    Vec wv[T];
    for (int t = 0; t < T; ++t) wv[t] = vload(w + t * padded + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * padded + k);
      for (int t = 0; t < T; ++t) acc[t][r] = vfma(wv[t], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) sums[t * R + r] = vsum(acc[t][r]);
}

template <int T>
inline void dot_some(int rows, const float* w, const float* x, int64_t padded, float* sums) {
  switch (rows) {
    case 1: return dot_tile<T, 1>(w, x, padded, sums);
#if TANDEM_COMPILED_ISA == 1
    default: return dot_tile<T, 2>(w, x, padded, sums);
#else
    case 2: return dot_tile<T, 2>(w, x, padded, sums);
    case 3: return dot_tile<T, 3>(w, x, padded, sums);
    default: return dot_tile<T, 4>(w, x, padded, sums);
#endif
  }
}

// The products of T weight rows (from `first`) with R activation rows, the weights going
// from the codes straight into the FMAs, never stored: the same weights and products as
// dequantize_block then dot_tile, summed per lane in the same order. `s` and `z` hold each
// row's groups, `L.groups` apart.
template <int T, int R>
void fused_tile(const Layer& L, int64_t first, const float* x, const float* s, const float* z,
                const int32_t* word_group, float* sums) {
  Vec acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = vzero();
  const int64_t blocks = L.padded / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < T; ++t) {
      Vec w[8];
      block_weights(L, L.codes + (first + t) * L.words, s + t * L.groups, z + t * L.groups,
                    word_group, b, w);
      for (int i = 0; i < 8; ++i) {
        for (int r = 0; r < R; ++r) {
          acc[t][r] = vfma(w[i], vload(x + r * L.padded + b * kBlock + i * kLanes), acc[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) sums[t * R + r] = vsum(acc[t][r]);
}

template <int T>
void fused_some(int rows, const Layer& L, int64_t first, const float* x, const float* s,
                const float* z, const int32_t* word_group, float* sums) {
  switch (rows) {
    case 1: return fused_tile<T, 1>(L, first, x, s, z, word_group, sums);
#if TANDEM_COMPILED_ISA == 1
    default: return fused_tile<T, 2>(L, first, x, s, z, word_group, sums);
#else
    case 2: return fused_tile<T, 2>(L, first, x, s, z, word_group, sums);
    case 3: return fused_tile<T, 3>(L, first, x, s, z, word_group, sums);
    default: return fused_tile<T, 4>(L, first, x, s, z, word_group, sums);
#endif
  }
}

// Whether the weights go straight into the FMAs: always for the AVX-512 table (a store and
// reload cost more than the lookup, so it is repeated for every kRowsTogether activation
// rows), else for batches of one row block (larger ones reuse each stored weight).
inline bool fused(const Layer& L, int64_t m) {
  return m <= kRowsTogether || (TANDEM_COMPILED_ISA == 2 && L.group_inputs % kBlock == 0);
}

// Row `row` of the weight, in natural input order, into out[at ..] in the layer's dtype.
inline void dequantize_row_scalar(const Layer& L, const int32_t* row, const float* s,
                                  const float* z, void* out, int64_t at) {
  for (int64_t word = 0; word < L.words; ++word) {
    const int64_t g = 8 * word / L.group_inputs;
    for (int i = 0; i < 8; ++i) {
      const float q = static_cast<float>((row[word] >> (4 * i)) & kNibble);
      const float v = (q - z[g]) * s[g];
      if (L.dtype == kFloat32) {
        static_cast<float*>(out)[at + 8 * word + i] = v;
      } else {
        static_cast<uint16_t*>(out)[at + 8 * word + i] = float_to_bf16(v);
      }
    }
  }
}

#if TANDEM_COMPILED_ISA == 2

// Groups of whole 16-input runs: two words (8 bytes) at a time, low and high nibbles
// interleaved back into input order, then looked up in the group's table.
inline void dequantize_row(const Layer& L, const int32_t* row, const float* s, const float* z,
                           void* out, int64_t at) {
  if (L.group_inputs % 16) return dequantize_row_scalar(L, row, s, z, out, at);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < L.groups; ++g) {
    const __m512 table = block_table(L, s[g], z[g]);
    for (int64_t k = g * L.group_inputs; k < (g + 1) * L.group_inputs; k += 16) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 8));
      const __m128i even = _mm_and_si128(raw, low);
      const __m128i odd = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
      const __m512i q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd));
      const __m512 v = _mm512_permutexvar_ps(q, table);
      if (L.dtype == kFloat32) {
        _mm512_storeu_ps(static_cast<float*>(out) + at + k, v);
      } else {
        // The table holds bfloat16 values already: their top halves are exact.
        const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at + k), top);
      }
    }
  }
}

#else

inline void dequantize_row(const Layer& L, const int32_t* row, const float* s, const float* z,
                           void* out, int64_t at) {
  dequantize_row_scalar(L, row, s, z, out, at);
}

#endif

#if TANDEM_COMPILED_ISA == 2 && defined(__AVX512BF16__)
#define TANDEM_INT4_BF16_DOT 1

// ---- bfloat16 activations with AVX512-BF16: pair dot products on bfloat16 weights ----
//
// The float32 path above is bound by its FMAs (16 products an instruction) and forms the
// weights again for every kRowsTogether activation rows: at 32 rows it took 8.4 ms where
// dense bfloat16 took 4.1 (N = 2816, K = 1024, one thread). Here the activations are put in
// this path's order once per call as bfloat16 (exactly: they are bfloat16 already), each
// weight is formed once per call as bfloat16 (the value the float32 path forms and rounds:
// the reference's, bit for bit) into a panel buffer, and VDPBF16PS takes 32 products an
// instruction from there, as outer products (the section at the end of this one). Batches
// of up to kDotFusedRows rows take the weights from the codes straight into dot-product
// tiles of kDotOutputs weight rows instead (each weight vector serves every row, each
// activation vector four outputs); the sums of a tile are folded into one vector (lane
// 4 r + t), the bias added and rounded there, and each row's four outputs stored at once.
//
// The order of a block of 128 inputs (16 words, four vectors of 32 bfloat16): 16-bit lane l
// of vector s holds input 8 (l / 2) + s + 4 (l % 2): the low half of word w is 16-bit lane
// 2 w and holds nibbles 0..3, the high half nibbles 4..7, so one 16-bit shift by 4 s puts
// nibble s (or s + 4) of every lane at the bottom, and VPERMW looks it up in a table of the
// group's 16 weights (written twice, so the stray fifth index bit, the next nibble's lowest,
// picks the same weight): three shifts and four lookups for 128 weights. Groups smaller than
// a block (or not whole blocks) form each lane's weight as the float32 path does.
//
// Measured with buffered dot tiles (4 weight rows x 4 activation rows, before the outer
// products; AMD Zen 4 EPYC, 2 vCPUs, host otherwise idle: load average 1.4-1.8 with the
// benchmark itself; benchmarks/int4_gemm.py --baseline, medians of 5 interleaved rounds; ms,
// this path / the float32 path with dequantize-then-GEMM above 32 rows / dense bfloat16
// F.linear), one thread:
//   M      qkv 2048 x 1024          gate_up 5632 x 1024        down 1024 x 2816
//   1      0.200 / 0.242 / 0.437    0.559 / 0.618 / 1.143      0.226 / 0.300 / 0.584
//   4      0.254 / 0.383 / 0.465    0.703 / 1.141 / 1.273      0.342 / 0.480 / 0.560
//   8      0.332 / 0.687 / 0.529    0.913 / 1.659 / 1.449      0.449 / 0.794 / 0.659
//   16     0.478 / 1.225 / 0.681    1.338 / 3.362 / 1.852      0.657 / 1.613 / 0.861
//   32     0.789 / 2.385 / 0.965    2.216 / 6.495 / 2.675      1.106 / 3.135 / 1.242
//   48     1.116 / 1.241 / 1.263    3.105 / 3.671 / 3.517      1.527 / 1.692 / 1.650
//   64     1.438 / 1.560 / 1.553    4.001 / 4.592 / 4.377      1.963 / 2.228 / 2.074
//   128    2.718 / 2.779 / 2.726    7.484 / 8.111 / 7.613      3.750 / 3.977 / 3.694
//   256    5.303 / 5.332 / 5.136    15.24 / 15.05 / 14.29      7.189 / 7.257 / 6.888
// two threads: 0.110 / 0.131 / 0.240 ms (qkv, M = 1), 0.442 / 1.253 / 0.516 (qkv, 32),
// 0.623 / 0.668 / 0.670 (qkv, 48), 1.629 / 1.861 / 1.779 (gate_up, 48); at 128 rows
// 1.430 / 1.402, 4.002 / 4.139, 2.145 / 1.992 (this path / dequantize-then-GEMM).
// From 32 rows on it runs at 170-200 GFLOP/s a thread, near VDPBF16PS's one-a-cycle peak
// (the bare 4 x 4 tile loop: ~220), as does the dense bfloat16 GEMM from about 128 rows:
// so the Python side hands it up to BF16_DOT_ROWS = 128 rows, where the three projections
// together are 6% ahead on one thread and level on two; above, dequantize-then-GEMM is
// level with it (256 rows: within 3% either way) and needs no activation copy.
// kDotFusedRows = 3: unbuffered took 0.110 ms at M = 3 against 0.131 buffered, buffered
// 0.124 at M = 4 against 0.149 unbuffered (N = 1536, K = 1024, codes in cache); the outer
// products at M = 4 are level with the dot tiles they replaced (80 us against 80, the
// section at the end).
//
// Rounding: products of two bfloat16 are exact in float32; VDPBF16PS adds them into float32
// lanes rounding to nearest-even, whatever MXCSR says, with denormal inputs and results
// read and written as zero (the test file says why the float32 bound still holds).

constexpr int64_t kDotBlock = 128;
// A register tile of the unbuffered path: kDotOutputs weight rows times up to
// kDotFusedRows activation rows.
constexpr int kDotOutputs = 4;
// Batches up to this many rows skip the weight buffer.
constexpr int kDotFusedRows = 3;

// The 16 weights of a group, bfloat16 bits, twice over: VPERMW's 32-entry table.
inline __m512i dot_table(const Layer& L, float s, float z) {
  const __m512 table = block_table(L, s, z);  // rounded to bfloat16 already: top halves exact
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(table), 16));
  return _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
}

// Block b of a row in the dot order where groups are smaller than a block or not a whole
// number of blocks (the lanes of a block in several groups): each lane's weight as the
// float32 path forms it, the block's two halves (words 0..7, 8..15; lane j of a half is
// 16-bit lane j: word j / 2) widened to float32 lanes and their bfloat16 tops put back
// together. Lanes past the last word are zero.
inline void lane_block(const Layer& L, const int32_t* row, const float* s, const float* z,
                       const int32_t* word_group, int64_t b, __m512i (&w)[4]) {
  const int64_t first = b * 16;
  const int64_t count = std::min<int64_t>(16, L.words - first);
  const __m512i words =
      _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << count) - 1u), row + first);
  const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (2 * count)) - 1u);
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i g_lo = _mm512_permutexvar_epi32(
      pairs, _mm512_castsi256_si512(
                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word_group + first))));
  const __m512i g_hi = _mm512_permutexvar_epi32(
      pairs, _mm512_castsi256_si512(
                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(word_group + first + 8))));
  const __m512 s_lo = _mm512_i32gather_ps(g_lo, s, 4), z_lo = _mm512_i32gather_ps(g_lo, z, 4);
  const __m512 s_hi = _mm512_i32gather_ps(g_hi, s, 4), z_hi = _mm512_i32gather_ps(g_hi, z, 4);
  // The odd 16-bit halves (the bfloat16 tops) of lo's 16 lanes, then of hi's.
  const __m512i tops = _mm512_setr_epi32(
      0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015, 0x001B0019,
      0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D, 0x00330031, 0x00370035,
      0x003B0039, 0x003F003D);
  const __m512i nibble = _mm512_set1_epi16(kNibble);
  for (int i = 0; i < 4; ++i) {
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(words, 4 * i), nibble);
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
    const __m512 q_hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
    const __m512 lo = round_bf16_vec(_mm512_mul_ps(_mm512_sub_ps(q_lo, z_lo), s_lo));
    const __m512 hi = round_bf16_vec(_mm512_mul_ps(_mm512_sub_ps(q_hi, z_hi), s_hi));
    w[i] = _mm512_maskz_permutex2var_epi16(mask, _mm512_castps_si512(lo), tops,
                                           _mm512_castps_si512(hi));
  }
}

// The horizontal sums of 16 accumulators, lane i = the sum of a[i]'s lanes: pairs of
// accumulators folded together, then pairs of those, then the 128-bit quarters.
inline __m512 fold16(const __m512 (&a)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// float32 lanes -> bfloat16 bits as float_to_bf16 rounds them (NaN: torch's quiet NaN).
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(top);
}

// Where a tile's sums go: outputs first .. first + T of y's rows r0 .., plus the bias.
struct TileOut {
  uint16_t* y;
  int64_t ldy;
  const uint16_t* bias;  // may be null
  int64_t first;
  int64_t r0;
};

// The T x R tile's sums, plus the bias, rounded into y. Folded row-major (lane 4 r + t for
// T = 4): four rows' outputs a vector, each row's four a single 8-byte store.
template <int T, int R>
inline void store_tile(const __m512 (&acc)[T][R], const TileOut& o) {
  constexpr int kCount = T * R;
  for (int base = 0; base < kCount; base += 16) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      const int at = base + i;
      a[i] = at < kCount ? acc[at % T][at / T] : _mm512_setzero_ps();
    }
    __m512 sums = fold16(a);
    const int rows = std::min(16, kCount - base) / T;
    const int64_t r0 = o.r0 + base / T;
    if constexpr (T == 4) {
      __m512 add = _mm512_setzero_ps();
      if (o.bias) {
        const __m128i b = _mm_cvtepu16_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o.bias + o.first)));
        add = _mm512_broadcast_f32x4(_mm_castsi128_ps(_mm_slli_epi32(b, 16)));
      }
      sums = _mm512_add_ps(sums, add);
      alignas(32) uint64_t out[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), to_bf16_bits(sums));
      for (int r = 0; r < rows; ++r) std::memcpy(o.y + (r0 + r) * o.ldy + o.first, &out[r], 8);
    } else {
      alignas(64) float out[16];
      _mm512_store_ps(out, sums);
      for (int r = 0; r < rows; ++r) {
        for (int t = 0; t < T; ++t) {
          const float add = o.bias ? bf16_to_float(o.bias[o.first + t]) : 0.0f;
          o.y[(r0 + r) * o.ldy + o.first + t] = float_to_bf16(out[r * T + t] + add);
        }
      }
    }
  }
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// The same products with the weights straight from the codes (rows first .. first + T),
// never stored: `s` and `z` hold each row's groups, `L.groups` apart. Groups of whole
// blocks (K a whole number of blocks then) go group by group, the T tables in registers;
// smaller groups through DotRow.
template <int T, int R>
void fused_bf16_tile(const Layer& L, int64_t first, const uint16_t* x, const float* s,
                     const float* z, const int32_t* word_group, const TileOut& o) {
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const auto dot = [&](int t, const __m512i (&w)[4], int64_t b) {
    for (int i = 0; i < 4; ++i) {
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = as_bh(_mm512_loadu_si512(x + r * L.padded + b * kDotBlock + 32 * i));
        acc[t][r] = _mm512_dpbf16_ps(acc[t][r], as_bh(w[i]), xv);
      }
    }
  };
  const int32_t* codes = L.codes + first * L.words;
  if (L.group_inputs % kDotBlock == 0) {
    const int64_t per_group = L.group_inputs / kDotBlock;
    for (int64_t g = 0; g < L.groups; ++g) {
      __m512i table[T];
      for (int t = 0; t < T; ++t) table[t] = dot_table(L, s[t * L.groups + g], z[t * L.groups + g]);
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        for (int t = 0; t < T; ++t) {
          const __m512i words = _mm512_loadu_si512(codes + t * L.words + 16 * b);
          __m512i w[4];
          for (int i = 0; i < 4; ++i) {
            w[i] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * i), table[t]);
          }
          dot(t, w, b);
        }
      }
    }
  } else {
    for (int64_t b = 0; b < L.padded / kDotBlock; ++b) {
      for (int t = 0; t < T; ++t) {
        __m512i w[4];
        lane_block(L, codes + t * L.words, s + t * L.groups, z + t * L.groups, word_group, b, w);
        dot(t, w, b);
      }
    }
  }
  store_tile<T, R>(acc, o);
}

// A weight row's bfloat16 weights in the dot order into dst[0 .. L.padded).
inline void form_row(const Layer& L, const int32_t* row, const float* s, const float* z,
                     const int32_t* word_group, uint16_t* dst) {
  if (L.group_inputs % kDotBlock == 0) {
    const int64_t per_group = L.group_inputs / kDotBlock;
    for (int64_t g = 0; g < L.groups; ++g) {
      const __m512i table = dot_table(L, s[g], z[g]);
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        const __m512i words = _mm512_loadu_si512(row + 16 * b);
        for (int i = 0; i < 4; ++i) {
          _mm512_storeu_si512(dst + b * kDotBlock + 32 * i,
                              _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * i), table));
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < L.padded / kDotBlock; ++b) {
    __m512i w[4];
    lane_block(L, row, s, z, word_group, b, w);
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + b * kDotBlock + 32 * i, w[i]);
  }
}

template <int T, int R = kDotFusedRows>
inline void fused_bf16_some(int rows, const Layer& L, int64_t first, const uint16_t* x,
                            const float* s, const float* z, const int32_t* word_group,
                            const TileOut& o) {
  if constexpr (R > 1) {
    if (rows < R) return fused_bf16_some<T, R - 1>(rows, L, first, x, s, z, word_group, o);
  }
  fused_bf16_tile<T, R>(L, first, x, s, z, word_group, o);
}

// Activation rows in the dot order, bfloat16 as they came, zero past K. Output vector i of
// a block takes, in 16-bit lane l, input 8 (l / 2) + i + 4 (l % 2): below 64 for l < 16
// (the block's first two vectors), 64 more for l >= 16 (its last two), so one index vector
// (read modulo 64) serves both halves.
void permute_rows_bf16(const uint16_t* x, int64_t m, int64_t ldx, const Layer& L,
                       uint16_t* out, int threads) {
  const int64_t blocks = L.padded / kDotBlock;
  alignas(64) int16_t index[4][32];
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l) index[i][l] = static_cast<int16_t>(8 * (l >> 1) + i + 4 * (l & 1));
#pragma omp parallel for num_threads(threads) schedule(static) if (m * L.padded >= kParallelPermute)
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* src = x + r * ldx;
    uint16_t* dst = out + r * L.padded;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i in[4];
      for (int v = 0; v < 4; ++v) {
        const int64_t at = b * kDotBlock + 32 * v;
        const int64_t count = std::max<int64_t>(0, std::min<int64_t>(32, L.k - at));
        const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << count) - 1u);
        in[v] = _mm512_maskz_loadu_epi16(mask, src + at);
      }
      for (int i = 0; i < 4; ++i) {
        const __m512i idx = _mm512_load_si512(index[i]);
        const __m512i low = _mm512_permutex2var_epi16(in[0], idx, in[1]);
        const __m512i high = _mm512_permutex2var_epi16(in[2], idx, in[3]);
        _mm512_storeu_si512(dst + b * kDotBlock + 32 * i,
                            _mm512_mask_blend_epi16(0xFFFF0000u, low, high));
      }
    }
  }
}

// ---- Batches past kDotFusedRows: outer products on an interleaved panel ----
//
// The dot tiles above sum each output along K in 16 lanes and fold the lanes at the end;
// buffered (4 weight rows x 4 activation rows, 16 accumulators, 4 + 4 vector loads for 16
// VDPBF16PS a step) they ran at 95-130 GFLOP/s a thread on the experts' K = 512-640, where
// the float bfloat16 kernel (avx512_linear.cpp: outer products on weights oneDNN packed)
// reached twice that. Here batches past kDotFusedRows take outer products instead. A panel
// of kOuterColumns output rows is formed once, in strips of 16 rows, each strip laid out
// (interleave_strip) so that one 128-bit broadcast of an activation row's four input pairs
// meets four weight vectors holding 16 outputs' same four pairs (4 outputs x 4 pairs a
// vector): kOuterRows activation rows x 4 accumulators, four weight loads and one broadcast
// a row for 4 kOuterRows VDPBF16PS. Each output's float32 sum runs over the pairs p = u
// (mod 4) in lane u, in order, and the four lanes are added ((u0 + u2) + (u1 + u3)) at the
// end: the same order whatever the row block, strip or panel the output falls in, so a
// grouped call's sums are a dense call's on the same rows. Rounded to bfloat16 with the
// bias as the dot tiles round.
//
// Measured (this Zen 4, one thread, N = 1280, K = 512, groups of 128, codes in L2; us a
// call, dot tiles -> outer products): M = 4 80 -> 80, 12 155-186 -> 128, 48 495-660 ->
// 343-350, 96 900-1190 -> 630-650 (209 GFLOP/s of compute a thread; the panel's forming
// costs some 31 us a call, five rows' products). kOuterRows 4, 6 and 8 were within the
// noise of each other (8 spills: 32 accumulators); 6 fills 29 of the 32 registers. Strips
// formed straight from the codes (form_strip_tables) took the forming from 46 to 31 us
// against form_row then a transpose. Panels of 16, 32 or 64 rows: level. Two threads,
// codes from memory (benchmarks/int4_gemm.py, medians of 5 rounds, two runs of each side
// interleaved; ms, dot tiles -> outer products; qkv 2048 x 1024, gate_up 5632 x 1024,
// down 1024 x 2816):
//   M      qkv                          gate_up                      down
//   4      0.181, 0.209 -> 0.175, 0.212  0.462, 0.545 -> 0.419, 0.412  0.250, 0.293 -> 0.188, 0.234
//   16     0.409, 0.426 -> 0.294, 0.339  1.093, 1.094 -> 0.744, 0.785  0.593, 0.662 -> 0.354, 0.385
//   48     1.064, 1.047 -> 0.589, 0.695  2.739, 2.818 -> 1.608, 1.673  1.587, 1.679 -> 0.761, 0.798
//   128    2.508, 2.752 -> 1.419, 1.627  6.999, 7.321 -> 3.816, 3.934  3.982, 4.427 -> 1.817, 1.861
// The bench MoE model's experts (benchmarks/quantized_moe_experts.py, grouped ms a layer):
// 48 tokens 1.144, 1.065 -> 1.030, 1.021; 512 tokens 8.641, 8.761 -> 6.140, 5.717.

// Output rows of a panel: four strips of 16.
constexpr int64_t kOuterColumns = 64;
// Activation rows of a register block: kOuterRows x 4 accumulators, four weights and a
// broadcast, 29 of the 32 zmm registers.
constexpr int kOuterRows = 6;

// The 128-bit lanes of four vectors transposed: lane t of q[c] is lane c of r[t].
inline void quarters(const __m512i (&r)[4], __m512i (&q)[4]) {
  const __m512i lo01 = _mm512_shuffle_i32x4(r[0], r[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i lo23 = _mm512_shuffle_i32x4(r[2], r[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i hi01 = _mm512_shuffle_i32x4(r[0], r[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i hi23 = _mm512_shuffle_i32x4(r[2], r[3], _MM_SHUFFLE(3, 2, 3, 2));
  q[0] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
  q[1] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
  q[2] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
  q[3] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
}

// A strip's 16 formed rows (`strip`, `padded` apart, the dot order; `rows` of them, zero
// past) into the strip's part of the panel, 16 padded elements: for each step of 16 pairs
// (one 32-bfloat16 vector of a formed row) and each quarter c of it, four vectors j, 128-bit
// lane t of vector j holding row 4 t + j's pairs 4 c .. 4 c + 3. So a quarter's four vectors
// take one 128-bit broadcast of an activation row's same four pairs, and lane 4 t + j of the
// folded sums (four lanes a row) is output 4 t + j: the outputs in order. Two 128-bit
// shuffles a vector.
inline void interleave_strip(const uint16_t* strip, int rows, int64_t padded, uint16_t* dst) {
  for (int64_t k = 0; k < padded; k += 32) {
    for (int j = 0; j < 4; ++j) {
      __m512i r[4];
      for (int t = 0; t < 4; ++t) {
        r[t] = 4 * t + j < rows ? _mm512_loadu_si512(strip + (4 * t + j) * padded + k)
                                : _mm512_setzero_si512();
      }
      __m512i quarter[4];
      quarters(r, quarter);
      uint16_t* out = dst + 16 * k + 32 * j;  // 16 k = 4 quarters x 4 vectors x 32 elements
      for (int c = 0; c < 4; ++c) _mm512_storeu_si512(out + 128 * c, quarter[c]);
    }
  }
}

// The same interleaved strip (rows `first` .. `first` + `rows`, rows <= 16) formed
// straight from the codes where groups are whole blocks: the codes of rows j, 4 + j, 8 + j,
// 12 + j put in the strip's order with the same 128-bit shuffles (four words of one row a
// 128-bit lane, eight weights a word: eight shuffles for every 16 weight vectors), then each
// 16-bit lane's nibble, plus 16 times its 128-bit lane, looked up by VPERMT2W in the four
// rows' tables of the group (dot_table's 16 weights each). No strip stored and read back.
// Rows past `rows` read zero codes and a zero table. `ahead` steps once a group and row
// set (4 a group).
inline void form_strip_tables(const Layer& L, int64_t first, int rows, const float* s,
                              const float* z, uint16_t* dst, Ahead& ahead) {
  const int64_t per_group = L.group_inputs / kDotBlock;
  const __m512i low = _mm512_set1_epi16(kNibble);
  // 16 t in the 16-bit lanes of 128-bit lane t.
  const __m512i offset = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(16), _mm_setzero_si128())),
      _mm256_set_m128i(_mm_set1_epi16(48), _mm_set1_epi16(32)), 1);
  for (int64_t g = 0; g < L.groups; ++g) {
    for (int j = 0; j < 4; ++j) {
      ahead.step();
      __m256i half[4];
      for (int t = 0; t < 4; ++t) {
        const int row = 4 * t + j;
        half[t] = row < rows ? _mm512_castsi512_si256(dot_table(L, s[row * L.groups + g],
                                                                z[row * L.groups + g]))
                             : _mm256_setzero_si256();
      }
      const __m512i table_a = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
      const __m512i table_b = _mm512_inserti64x4(_mm512_castsi256_si512(half[2]), half[3], 1);
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        __m512i r[4];
        for (int t = 0; t < 4; ++t) {
          const int row = 4 * t + j;
          r[t] = row < rows ? _mm512_loadu_si512(L.codes + (first + row) * L.words + 16 * b)
                            : _mm512_setzero_si512();
        }
        __m512i quarter[4];
        quarters(r, quarter);
        for (int i = 0; i < 4; ++i) {
          // Step 4 b + i: vector i of block b (its inputs 8 w + i, 8 w + i + 4).
          uint16_t* out = dst + 16 * (b * kDotBlock + 32 * i) + 32 * j;
          for (int c = 0; c < 4; ++c) {
            // (nibble & 15) | 16 t: 0xEA is (A & B) | C.
            const __m512i index = _mm512_ternarylogic_epi32(
                _mm512_srli_epi16(quarter[c], 4 * i), low, offset, 0xEA);
            _mm512_storeu_si512(out + 128 * c,
                                _mm512_permutex2var_epi16(table_a, index, table_b));
          }
        }
      }
    }
  }
}

// Elements a thread's panel buffer holds for this layer: the interleaved panel and a strip
// of 16 formed rows.
inline int64_t bf16_panel_elems(const Layer& L) { return (kOuterColumns + 16) * L.padded; }

// The 16 outputs of each of MR activation rows (`x`, `padded` apart, the dot order) through
// an interleaved strip (interleave_strip) into y's rows r0 .. r0 + MR, columns first ..
// first + columns (columns <= 16), plus the bias.
template <int MR>
inline void outer_block(const uint16_t* packed, const uint16_t* x, int64_t padded,
                        int64_t columns, const TileOut& o) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < padded; k += 32) {
    for (int c = 0; c < 4; ++c) {
      const uint16_t* wp = packed + 16 * k + 128 * c;
      __m512i w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512(wp + 32 * j);
      for (int r = 0; r < MR; ++r) {
        // Pairs 4 c .. 4 c + 3 of this step of row r, in every 128-bit lane.
        const __m512bh a = as_bh(_mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r * padded + k + 8 * c))));
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(w[j]), a);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1u);
  __m512 add = _mm512_setzero_ps();
  if (o.bias) {
    const __m256i b = _mm256_maskz_loadu_epi16(mask, o.bias + o.first);
    add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  for (int r = 0; r < MR; ++r) {
    // Lane 4 t + u of acc[r][j]: output 4 t + j's sum over pairs = u (mod 4); the four
    // phases summed, output 4 t + j lands in lane 4 t + j.
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][0], acc[r][1]),
                                    _mm512_unpackhi_ps(acc[r][0], acc[r][1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][2], acc[r][3]),
                                    _mm512_unpackhi_ps(acc[r][2], acc[r][3]));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    _mm256_mask_storeu_epi16(o.y + (o.r0 + r) * o.ldy + o.first, mask,
                             to_bf16_bits(_mm512_add_ps(sums, add)));
  }
}

template <int MR = kOuterRows>
inline void outer_some(int rows, const uint16_t* packed, const uint16_t* x, int64_t padded,
                       int64_t columns, const TileOut& o) {
  if constexpr (MR > 1) {
    if (rows < MR) return outer_some<MR - 1>(rows, packed, x, padded, columns, o);
  }
  outer_block<MR>(packed, x, padded, columns, o);
}

// Panel rows first .. first + count (at most bf16_panel_rows) for activation rows [0, m)
// (in the dot order, xs_all) into y's rows [0, m). Batches of up to kDotFusedRows rows take
// the weights straight from the codes into dot-product tiles; larger ones form the panel
// interleaved into `buffer` (bf16_panel_elems) and pass every row block of at most
// kOuterRows rows through it (the panel stays in L2 meanwhile: bf16_panel_rows). `s` and
// `z` hold count rows of groups; `ahead` steps once a weight row or tile.
void bf16_panel(const Layer& L, int64_t first, int64_t count, const uint16_t* xs_all, int64_t m,
                uint16_t* y, int64_t ldy, const uint16_t* bias, const int32_t* word_group,
                float* s, float* z, uint16_t* buffer, Ahead& ahead) {
  const int64_t padded = L.padded;  // a whole number of kDotBlock: kBlock is 128 here
  for (int64_t t = 0; t < count; ++t) row_groups(L, first + t, s + t * L.groups, z + t * L.groups);
  if (m <= kDotFusedRows) {
    const int rows = static_cast<int>(m);
    for (int64_t t0 = 0; t0 < count; t0 += kDotOutputs) {
      ahead.step();
      const int outputs = static_cast<int>(std::min<int64_t>(kDotOutputs, count - t0));
      const float* st = s + t0 * L.groups;
      const float* zt = z + t0 * L.groups;
      if (outputs == kDotOutputs) {
        fused_bf16_some<kDotOutputs>(rows, L, first + t0, xs_all, st, zt, word_group,
                                     TileOut{y, ldy, bias, first + t0, 0});
      } else {
        for (int t = 0; t < outputs; ++t) {
          fused_bf16_some<1>(rows, L, first + t0 + t, xs_all, st + t * L.groups,
                             zt + t * L.groups, word_group,
                             TileOut{y, ldy, bias, first + t0 + t, 0});
        }
      }
    }
    return;
  }
  uint16_t* packed = buffer;
  uint16_t* strip = buffer + kOuterColumns * padded;
  for (int v = 0; v < kOuterColumns / 16; ++v) {
    const int rows = static_cast<int>(std::min<int64_t>(16, count - 16 * v));
    if (rows <= 0) break;
    if (L.group_inputs % kDotBlock == 0) {
      for (int t = 0; t < rows; ++t) ahead.step();
      // The next strip's codes, into L2 a share at a time while this one forms: 16 rows
      // read side by side are more streams than the hardware prefetcher follows (4 rows
      // from memory, two threads, qkv 2048 x 1024: 0.29-0.34 ms without, 0.19-0.20 with
      // the whole strip prefetched at once; down 1024 x 2816: 0.29, 0.30 at once, 0.24,
      // 0.21 spread, against the dot tiles' 0.26, 0.36).
      const int64_t next = first + 16 * (v + 1);
      Ahead strip_ahead;
      if (next < (ahead.rows_follow ? L.n : first + count)) {
        strip_ahead.next = reinterpret_cast<const char*>(L.codes + next * L.words);
        strip_ahead.end =
            reinterpret_cast<const char*>(L.codes + std::min(L.n, next + 16) * L.words);
        // Spread over the strip's group-and-row-set steps.
        const int64_t steps = 4 * L.groups;
        strip_ahead.lines = ((strip_ahead.end - strip_ahead.next) / 64 + steps - 1) / steps;
      }
      form_strip_tables(L, first + 16 * v, rows, s + 16 * v * L.groups, z + 16 * v * L.groups,
                        packed + 16 * v * padded, strip_ahead);
      continue;
    }
    for (int t = 0; t < rows; ++t) {
      ahead.step();
      const int64_t row = 16 * v + t;
      form_row(L, L.codes + (first + row) * L.words, s + row * L.groups, z + row * L.groups,
               word_group, strip + t * padded);
    }
    interleave_strip(strip, rows, padded, packed + 16 * v * padded);
  }
  // Row blocks of at most kOuterRows, as even as they go (8 rows: 4 + 4, not 6 + 2).
  const int64_t blocks = (m + kOuterRows - 1) / kOuterRows;
  for (int64_t i = 0, r0 = 0; i < blocks; ++i) {
    const int rows = static_cast<int>((m - r0 + blocks - i - 1) / (blocks - i));
    for (int64_t v = 0; 16 * v < count; ++v) {
      outer_some(rows, packed + 16 * v * padded, xs_all + r0 * padded, padded,
                 std::min<int64_t>(16, count - 16 * v), TileOut{y, ldy, bias, first + 16 * v, r0});
    }
    r0 += rows;
  }
}

// Bytes of bfloat16 weights an outer-product panel holds at most: every row block passes
// over the whole panel, which must stay in L2 meanwhile (half the L2 of every CPU with
// AVX512-BF16: 1 MiB on Zen 4 and 5 and Cooper Lake, 2 MiB on Sapphire Rapids).
constexpr int64_t kOuterPanelBytes = 512 << 10;

// Output rows a panel holds for a batch of m rows: one tile where the weights go straight
// from the codes into the dot products, else an outer-product panel of four strips, or of
// two or one where four would leave fewer than four panels a thread (`threads`: those that
// share the panels; a 1024-output layer is 16 panels of 64) or hold more than
// kOuterPanelBytes (64 rows pass it above K = 4096). Panels of 16, 32 and 64 rows were
// level on one thread (above), and an output's sum does not depend on its panel.
inline int64_t bf16_panel_rows(const Layer& L, int64_t m, int threads) {
  if (m <= kDotFusedRows) return kDotOutputs;
  int64_t rows = kOuterColumns;
  while (rows > 16 && (L.n < 4 * threads * rows ||
                       rows * L.padded * static_cast<int64_t>(sizeof(uint16_t)) >
                           kOuterPanelBytes)) {
    rows /= 2;
  }
  return rows;
}

// The whole product for bfloat16 activations (tandem_int4_linear's arguments): threads take
// the panels (bf16_panel).
void linear_bf16_dot(const Layer& L, uint16_t* y, const uint16_t* x, const uint16_t* bias,
                     int64_t m, int64_t ldx, int64_t ldy, int threads) {
  // Kept from call to call: a fresh buffer of this size would be mapped (and faulted in)
  // every call.
  thread_local std::vector<uint16_t> xp;
  if (xp.size() < static_cast<size_t>(m * L.padded)) xp.resize(static_cast<size_t>(m * L.padded));
  permute_rows_bf16(x, m, ldx, L, xp.data(), threads);
  // Read here: inside the parallel region `xp` would name each thread's own buffer.
  const uint16_t* xs_all = xp.data();
  const std::vector<int32_t> word_group = word_groups(L);
  const int64_t panel_rows = bf16_panel_rows(L, m, threads);
  const int64_t panels = (L.n + panel_rows - 1) / panel_rows;
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<uint16_t> wrows;
    if (wrows.size() < static_cast<size_t>(bf16_panel_elems(L))) {
      wrows.resize(static_cast<size_t>(bf16_panel_elems(L)));
    }
    std::vector<float> s(static_cast<size_t>(panel_rows * L.groups));
    std::vector<float> z(s.size());
    Ahead none;
    none.rows_follow = true;
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < panels; ++panel) {
      const int64_t first = panel * panel_rows;
      bf16_panel(L, first, std::min(panel_rows, L.n - first), xs_all, m, y, ldy, bias,
                 word_group.data(), s.data(), z.data(), wrows.data(), none);
    }
  }
}

#endif

// Activation row m in the permuted block order, as float32, zero past K.
void permute_rows(const void* x, int64_t m, int64_t ldx, const Layer& L, float* out,
                  int threads) {
  // A decode step's few rows are not worth waking the other threads for.
#pragma omp parallel for num_threads(threads) schedule(static) if (m * L.padded >= kParallelPermute)
  for (int64_t r = 0; r < m; ++r) {
    float* dst = out + r * L.padded;
    for (int64_t p = 0; p < L.padded; ++p) {
      const int64_t block = p / kBlock, within = p % kBlock;
      const int64_t input = block * kBlock + 8 * (within % kLanes) + within / kLanes;
      dst[p] = input < L.k ? scalar_at(x, r * ldx + input, L.dtype) : 0.0f;
    }
  }
}

int check(const Layer& L) {
  if (L.dtype != kFloat32 && L.dtype != kBFloat16) return 1;
  if (L.k % 8 || L.groups < 1 || L.k % L.groups) return 2;
  // Each word's eight inputs must share a group.
  if (L.group_inputs % 8) return 3;
  return 0;
}

Layer make_layer(const int32_t* codes, const void* scales, const uint8_t* zeros, int64_t n,
                 int64_t k, int64_t groups, int32_t dtype) {
  const int64_t words = k / 8;
  const int64_t blocks = (words + kLanes - 1) / kLanes;
  return Layer{codes, scales, zeros, n, k, groups, groups > 0 ? k / groups : 0, words,
               blocks * kBlock, dtype};
}

// A thread's buffers for f32_tile: a tile's dequantized rows, its scales and zero points.
struct TileScratch {
  std::vector<float> wrows, s, z;
  void fit(const Layer& L) {
    wrows.resize(static_cast<size_t>(kTileOutputs * L.padded));
    s.resize(static_cast<size_t>(kTileOutputs * L.groups));
    z.resize(s.size());
  }
};

// Outputs first .. first + outputs (one tile at most) of activation rows [0, m) (permuted,
// xp) into y's rows [0, m) (row stride ldy), plus bias (may be null), on the float32 FMAs.
void f32_tile(const Layer& L, int64_t first, int outputs, const float* xp, int64_t m, void* y,
              int64_t ldy, const void* bias, const int32_t* word_group, TileScratch& w) {
  float sums[kTileOutputs * kRowsTogether];
  // Outputs of activation rows r0 .. r0 + rows, from sums.
  const auto write = [&](int64_t r0, int rows) {
    for (int t = 0; t < outputs; ++t) {
      const int64_t col = first + t;
      const float add = bias ? scalar_at(bias, col, L.dtype) : 0.0f;
      for (int r = 0; r < rows; ++r) {
        const int64_t at = (r0 + r) * ldy + col;
        const float v = sums[t * rows + r] + add;
        if (L.dtype == kFloat32) {
          static_cast<float*>(y)[at] = v;
        } else {
          static_cast<uint16_t*>(y)[at] = float_to_bf16(v);
        }
      }
    }
  };
  float* s = w.s.data();
  float* z = w.z.data();
  if (fused(L, m)) {
    for (int t = 0; t < outputs; ++t) row_groups(L, first + t, s + t * L.groups, z + t * L.groups);
    // The tile's codes stay in L1 from one batch chunk to the next.
    for (int64_t r0 = 0; r0 < m; r0 += kRowsTogether) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsTogether, m - r0));
      const float* xs = xp + r0 * L.padded;
      if (outputs == kTileOutputs) {
        fused_some<kTileOutputs>(rows, L, first, xs, s, z, word_group, sums);
      } else {
        for (int t = 0; t < outputs; ++t) {
          fused_some<1>(rows, L, first + t, xs, s + t * L.groups, z + t * L.groups, word_group,
                        sums + t * rows);
        }
      }
      write(r0, rows);
    }
    return;
  }
  const int64_t blocks = L.padded / kBlock;
  for (int t = 0; t < outputs; ++t) {
    row_groups(L, first + t, s, z);
    const int32_t* packed = L.codes + (first + t) * L.words;
    float* dst = w.wrows.data() + t * L.padded;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_block(L, packed, s, z, word_group, b, dst + b * kBlock);
    }
  }
  for (int64_t r0 = 0; r0 < m; r0 += kRowsTogether) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowsTogether, m - r0));
    const float* xs = xp + r0 * L.padded;
    if (outputs == kTileOutputs) {
      dot_some<kTileOutputs>(rows, w.wrows.data(), xs, L.padded, sums);
    } else {
      for (int t = 0; t < outputs; ++t) {
        dot_some<1>(rows, w.wrows.data() + t * L.padded, xs, L.padded, sums + t * rows);
      }
    }
    write(r0, rows);
  }
}

}  // namespace
}  // namespace tandem

#include "int4_grouped.h"

extern "C" {

using tandem::Layer;

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) times the dequantized weight
// transposed, plus bias [n] (may be null); x, y, scales and bias in `dtype`. 0 on success.
int tandem_int4_linear(void* y, const void* x, const int32_t* codes, const void* scales,
                       const uint8_t* zeros, const void* bias, int64_t m, int64_t n, int64_t k,
                       int64_t groups, int64_t ldx, int64_t ldy, int32_t dtype,
                       int32_t threads) {
  const Layer L = tandem::make_layer(codes, scales, zeros, n, k, groups, dtype);
  if (const int code = tandem::check(L)) return code;
  if (m == 0 || n == 0) return 0;
  threads = std::max(1, threads);
#ifdef TANDEM_INT4_BF16_DOT
  if (dtype == tandem::kBFloat16) {
    tandem::linear_bf16_dot(L, static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x),
                            static_cast<const uint16_t*>(bias), m, ldx, ldy, threads);
    return 0;
  }
#endif
  std::vector<float> xp(static_cast<size_t>(m * L.padded));
  tandem::permute_rows(x, m, ldx, L, xp.data(), threads);
  const std::vector<int32_t> word_group = tandem::word_groups(L);
  const int64_t tiles = (n + tandem::kTileOutputs - 1) / tandem::kTileOutputs;
#pragma omp parallel num_threads(threads)
  {
    tandem::TileScratch scratch;
    scratch.fit(L);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t first = tile * tandem::kTileOutputs;
      const int outputs = static_cast<int>(std::min<int64_t>(tandem::kTileOutputs, n - first));
      tandem::f32_tile(L, first, outputs, xp.data(), m, y, ldy, bias, word_group.data(), scratch);
    }
  }
  return 0;
}

// Whether bfloat16 activations take the AVX512-BF16 dot products (for every batch size the
// caller hands over) rather than the float32 FMAs.
int tandem_int4_bf16_dot() {
#ifdef TANDEM_INT4_BF16_DOT
  return 1;
#else
  return 0;
#endif
}

// The whole dequantized weight w [n, k] in `dtype`, each value the reference's, for a GEMM
// library to take at batch sizes where one float weight pass is cheap beside the product.
int tandem_int4_dequantize(void* w, const int32_t* codes, const void* scales,
                           const uint8_t* zeros, int64_t n, int64_t k, int64_t groups,
                           int32_t dtype, int32_t threads) {
  const Layer L = tandem::make_layer(codes, scales, zeros, n, k, groups, dtype);
  if (const int code = tandem::check(L)) return code;
#pragma omp parallel num_threads(std::max(1, threads))
  {
    std::vector<float> s(static_cast<size_t>(L.groups)), z(static_cast<size_t>(L.groups));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < n; ++row) {
      tandem::row_groups(L, row, s.data(), z.data());
      tandem::dequantize_row(L, codes + row * L.words, s.data(), z.data(), w, row * k);
    }
  }
  return 0;
}

}  // extern "C"
