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

#include <omp.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace
}  // namespace tandem

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
  std::vector<float> xp(static_cast<size_t>(m * L.padded));
  tandem::permute_rows(x, m, ldx, L, xp.data(), threads);
  // Each word's group, padded with group 0 to whole vectors (the padding's codes are masked).
  const int64_t blocks = L.padded / tandem::kBlock;
  std::vector<int32_t> word_group(static_cast<size_t>(blocks * tandem::kLanes), 0);
  for (int64_t w = 0; w < L.words; ++w) word_group[w] = static_cast<int32_t>(8 * w / L.group_inputs);
  const int64_t tiles = (n + tandem::kTileOutputs - 1) / tandem::kTileOutputs;
  const bool registers_only = tandem::fused(L, m);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wrows(static_cast<size_t>(tandem::kTileOutputs * L.padded));
    std::vector<float> s(static_cast<size_t>(tandem::kTileOutputs * L.groups));
    std::vector<float> z(s.size());
    float sums[tandem::kTileOutputs * tandem::kRowsTogether];
    // Outputs first .. first + outputs of activation rows r0 .. r0 + rows, from sums.
    const auto write = [&](int64_t first, int outputs, int64_t r0, int rows) {
      for (int t = 0; t < outputs; ++t) {
        const int64_t col = first + t;
        const float add = bias ? tandem::scalar_at(bias, col, dtype) : 0.0f;
        for (int r = 0; r < rows; ++r) {
          const int64_t at = (r0 + r) * ldy + col;
          const float v = sums[t * rows + r] + add;
          if (dtype == tandem::kFloat32) {
            static_cast<float*>(y)[at] = v;
          } else {
            static_cast<uint16_t*>(y)[at] = tandem::float_to_bf16(v);
          }
        }
      }
    };
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t first = tile * tandem::kTileOutputs;
      const int outputs = static_cast<int>(std::min<int64_t>(tandem::kTileOutputs, n - first));
      if (registers_only) {
        for (int t = 0; t < outputs; ++t) {
          tandem::row_groups(L, first + t, s.data() + t * L.groups, z.data() + t * L.groups);
        }
        // The tile's codes stay in L1 from one batch chunk to the next.
        for (int64_t r0 = 0; r0 < m; r0 += tandem::kRowsTogether) {
          const int rows = static_cast<int>(std::min<int64_t>(tandem::kRowsTogether, m - r0));
          const float* xs = xp.data() + r0 * L.padded;
          if (outputs == tandem::kTileOutputs) {
            tandem::fused_some<tandem::kTileOutputs>(rows, L, first, xs, s.data(), z.data(),
                                                     word_group.data(), sums);
          } else {
            for (int t = 0; t < outputs; ++t) {
              tandem::fused_some<1>(rows, L, first + t, xs, s.data() + t * L.groups,
                                    z.data() + t * L.groups, word_group.data(), sums + t * rows);
            }
          }
          write(first, outputs, r0, rows);
        }
        continue;
      }
      for (int t = 0; t < outputs; ++t) {
        tandem::row_groups(L, first + t, s.data(), z.data());
        const int32_t* packed = codes + (first + t) * L.words;
        float* dst = wrows.data() + t * L.padded;
        for (int64_t b = 0; b < blocks; ++b) {
          tandem::dequantize_block(L, packed, s.data(), z.data(), word_group.data(), b,
                                   dst + b * tandem::kBlock);
        }
      }
      for (int64_t r0 = 0; r0 < m; r0 += tandem::kRowsTogether) {
        const int rows = static_cast<int>(std::min<int64_t>(tandem::kRowsTogether, m - r0));
        const float* xs = xp.data() + r0 * L.padded;
        if (outputs == tandem::kTileOutputs) {
          tandem::dot_some<tandem::kTileOutputs>(rows, wrows.data(), xs, L.padded, sums);
        } else {
          for (int t = 0; t < outputs; ++t) {
            tandem::dot_some<1>(rows, wrows.data() + t * L.padded, xs, L.padded, sums + t * rows);
          }
        }
        write(first, outputs, r0, rows);
      }
    }
  }
  return 0;
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
