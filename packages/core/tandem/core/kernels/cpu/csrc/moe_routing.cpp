// The routing's bookkeeping around the grouped expert GEMMs on CPU (kernels/cpu/moe_routing.py):
// sorting the (token, choice) pairs by expert, and summing each token's expert outputs back
// with its routing weights. Each is one pass where torch took a handful of ops (argsort,
// bincount, cumsum and a division; a multiply, a zero fill and an index_add), each with its
// own dispatch and, on a decode step's few rows, most of its time in that dispatch: 4-5 % of
// a served float32 step of the bench MoE model went to them.
//
// Both give what the torch reference (kernels/reference/fused_moe.py: sort_rows, combine)
// gives, bit for bit: the sort is stable, and each token's sum takes its products rounded to
// the dtype (mul_), then adds them in float32 in the pairs' sorted order (expert order) and
// rounds the sum to the dtype once, as torch's index_add_ into zeros does (bfloat16 included:
// it accumulates in float32; checked against it for 1 to 8 choices). Built with
// -ffp-contract=off so no product and sum fuse into one rounding.
//
// Plain C entry points; pointers with row strides (elements).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

// y[t] = sum over the token's pairs, in ascending slot order, of w[t, j] rows[slot[t k + j]].
template <typename T>
void combine(T* y, const T* rows, const T* weights, const int64_t* slot, int64_t tokens,
             int64_t k, int64_t h, int64_t ldr, int64_t ldy, int threads) {
  const bool parallel = tokens * k * h >= (int64_t{1} << 15);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<int64_t> order(static_cast<size_t>(k));
    std::vector<float> acc(static_cast<size_t>(h));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) order[j] = j;
      const int64_t* s = slot + t * k;
      std::sort(order.begin(), order.end(), [s](int64_t a, int64_t b) { return s[a] < s[b]; });
      T* out = y + t * ldy;
      for (int64_t j = 0; j < k; ++j) {
        const float w = tandem::to_float(weights[t * k + order[j]]);
        const T* r = rows + s[order[j]] * ldr;
        if (j == 0) {
          // 0 + p is p.
#pragma omp simd
          for (int64_t i = 0; i < h; ++i) acc[i] = tandem::rounded<T>(w * tandem::to_float(r[i]));
        } else {
#pragma omp simd
          for (int64_t i = 0; i < h; ++i) {
            acc[i] += tandem::rounded<T>(w * tandem::to_float(r[i]));
          }
        }
      }
      tandem::store_row(acc.data(), out, h, 1.0f);
    }
  }
}

}  // namespace

extern "C" {

// The pairs (token t, choice j), flattened as i = t k + j, sorted by ids[i] (stably):
// offsets[e] .. offsets[e + 1] are expert e's sorted rows, token[r] the token of sorted row
// r, slot[i] the sorted row of pair i. Returns 0, or 1 (nothing written past the arrays)
// where an id is outside [0, experts).
int tandem_moe_route(const int64_t* ids, int64_t tokens, int64_t k, int64_t experts,
                     int64_t* offsets, int64_t* token, int64_t* slot) {
  const int64_t pairs = tokens * k;
  std::fill(offsets, offsets + experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    if (ids[i] < 0 || ids[i] >= experts) return 1;
    ++offsets[ids[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + experts);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = next[ids[i]]++;
    slot[i] = r;
    token[r] = i / k;
  }
  return 0;
}

// y [tokens, h] (row stride ldy) = for each token, the sum of its k sorted rows of `rows`
// (row stride ldr) at slot[t k + j], times weights[t k + j], in slot order (see above);
// dtype 0 float32, 1 bfloat16. Returns 0, or 2 for another dtype. Slots are the route's,
// inside rows: not checked here.
int tandem_moe_combine(void* y, const void* rows, const void* weights, const int64_t* slot,
                       int64_t tokens, int64_t k, int64_t h, int64_t ldr, int64_t ldy,
                       int32_t dtype, int32_t threads) {
  if (dtype == 0) {
    combine(static_cast<float*>(y), static_cast<const float*>(rows),
            static_cast<const float*>(weights), slot, tokens, k, h, ldr, ldy, threads);
  } else if (dtype == 1) {
    combine(static_cast<uint16_t*>(y), static_cast<const uint16_t*>(rows),
            static_cast<const uint16_t*>(weights), slot, tokens, k, h, ldr, ldy, threads);
  } else {
    return 2;
  }
  return 0;
}

}  // extern "C"
