// The routing around the grouped expert GEMMs on CPU (kernels/cpu/moe_routing.py): the
// router's softmax and top-k, sorting the (token, choice) pairs by expert, gathering each
// sorted pair's row of x, and summing each token's expert outputs back with its routing
// weights. Each is one pass where torch took a handful of ops (a softmax, topk, a sum and a
// division; argsort, bincount, cumsum and a division; index_select; a multiply, a zero fill
// and an index_add), each with its own dispatch and, on a decode step's few rows, most of
// its time in that dispatch: 4-5 % of a served float32 step of the bench MoE model went to
// the sort and the sum alone. A decode step's rows are too few to share between threads for
// the top-k, the sort and the gather: waking a sleeping OpenMP thread (the server's threads
// take the cores between steps) cost more than the work (~130 us an op with the thread made
// to sleep, OMP_WAIT_POLICY=PASSIVE, against ~15 us on one thread), so only large batches go
// parallel. The sum back rounds every product as torch does (most of its time): inside a
// forward the team's other thread is awake, spinning between kernels, and a decode step's
// sum shares it from 16K elements (the bench MoE's 48 tokens x 2 x 512 on the AMX Xeon:
// 21.5 -> 14.2 us a call).
//
// The top-k is torch.topk's: chosen on the logits, which softmax keeps in order, with
// torch.topk's own algorithm and comparison, so tied experts come out in its order as long
// as both are built on libstdc++'s sorts (torch's x86 wheels are). Where two float32 logits a
// rounding apart get one probability, or a row holds a NaN, the reference may choose
// otherwise. Its weights are the reference's within float32 roundings: exp here is fast_exp
// (vec_math.h, 2 ulp), the normalisation divides where torch multiplies by a reciprocal.
//
// The sort and the sum give what the torch reference (kernels/reference/fused_moe.py:
// sort_rows, combine) gives, bit for bit: the sort is stable, and each token's sum takes its products rounded to
// the dtype (mul_), then adds them in float32 in the pairs' sorted order (expert order) and
// rounds the sum to the dtype once, as torch's index_add_ into zeros does (bfloat16 included:
// it accumulates in float32; checked against it for 1 to 8 choices). Built with
// -ffp-contract=off so no product and sum fuse into one rounding.
//
// tandem_moe_block runs a layer's routed experts in one call: the above around the linear
// library's two grouped GEMMs, called through their C entry points, so that a decode step
// crosses from Python once a layer instead of six times.
//
// Plain C entry points; pointers with row strides (elements).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec_math.h"

extern "C" int tandem_moe_route(const int64_t* ids, int64_t tokens, int64_t k, int64_t experts,
                                int64_t* offsets, int64_t* token, int64_t* slot);

namespace {

// Batches of at least this many elements go parallel (see the top); the sum back's from
// kParallelSumElements.
constexpr int64_t kParallelElements = int64_t{1} << 18;
constexpr int64_t kParallelSumElements = int64_t{1} << 14;

// torch.topk's order for largest: NaN first, then by value; nothing else (see below).
inline bool larger(const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
}

// Softmax over a token's `experts` logits in float32, its k largest in descending order as
// torch.topk gives them, renormalised to sum to one where asked, rounded to T.
template <typename T>
void topk_softmax(const T* logits, int64_t ld, int64_t tokens, int64_t experts, int64_t k,
                  bool normalize, T* weights, int64_t* ids, int threads) {
  const bool parallel = tokens * experts >= kParallelElements;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> p(static_cast<size_t>(experts));
    std::vector<std::pair<float, int64_t>> queue(static_cast<size_t>(experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = logits + t * ld;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < experts; ++e) {
        p[e] = tandem::to_float(row[e]);
        queue[e] = {p[e], e};
        top = std::max(top, p[e]);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t e = 0; e < experts; ++e) {
        p[e] = tandem::fast_exp(p[e] - top);
        sum += p[e];
      }
      // torch.topk's selection on CPU (TopKImpl.h), on the logits, which order the experts
      // as their probabilities do: the same algorithm and comparison over (value, expert)
      // pairs, so that experts whose probabilities tie come out in the order torch gives
      // them (in bfloat16, ties between a model's experts are common).
      if (k * 64 <= experts) {
        std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
      } else {
        std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
        std::sort(queue.begin(), queue.begin() + k - 1, larger);
      }
      // The chosen probabilities, kept in queue's value slots (the logits are done with).
      float chosen = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        queue[j].first = p[queue[j].second] / sum;
        chosen += queue[j].first;
      }
      const float norm = normalize ? chosen : 1.f;
      for (int64_t j = 0; j < k; ++j) {
        tandem::store_as(weights + t * k + j, queue[j].first / norm);
        ids[t * k + j] = queue[j].second;
      }
    }
  }
}

// out[r] = x[token[r]] for each of `rows` sorted rows, `h` elements each.
template <typename T>
void gather(T* out, const T* x, const int64_t* token, int64_t rows, int64_t h, int64_t ldx,
            int threads) {
  const bool parallel = rows * h >= kParallelElements;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out + r * h, x + token[r] * ldx, static_cast<size_t>(h) * sizeof(T));
  }
}

// y[t] = sum over the token's pairs, in ascending slot order, of w[t, j] rows[slot[t k + j]].
template <typename T>
void combine(T* y, const T* rows, const T* weights, const int64_t* slot, int64_t tokens,
             int64_t k, int64_t h, int64_t ldr, int64_t ldy, int threads) {
  const bool parallel = tokens * k * h >= kParallelSumElements;
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

// A grouped expert GEMM of a linear library (packed_experts.py's grouped_call): out, x, w,
// offsets, E, M, N, K, ldx, ldo, then the experts' panel width where the library takes one,
// then threads; returns 0 or its refusal code.
using GroupedFn = int (*)(void*, const void*, const void*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int32_t);
using GroupedPanelFn = int (*)(void*, const void*, const void*, const int64_t*, int64_t,
                               int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t);

struct GroupedEntry {
  void* fn;
  int32_t panel;  // < 0: the entry point takes no panel width

  int operator()(void* out, const void* x, const void* w, const int64_t* offsets, int64_t e,
                 int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldo, int threads) const {
    if (panel < 0) {
      return reinterpret_cast<GroupedFn>(fn)(out, x, w, offsets, e, m, n, k, ldx, ldo, threads);
    }
    return reinterpret_cast<GroupedPanelFn>(fn)(out, x, w, offsets, e, m, n, k, ldx, ldo, panel,
                                                threads);
  }
};

// The workspace of moe_block, carved in this order, each part from a multiple of 64 bytes:
// ids, offsets, token and slot (int64), the routing weights and the gathered rows (T, the
// rows then taking the down projection's output), the intermediate activations (T).
constexpr int64_t kAlign = 64;
inline int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

inline int64_t block_workspace(int64_t pairs, int64_t experts, int64_t h, int64_t inter,
                               int64_t elem) {
  return aligned(pairs * 8) * 3 + aligned((experts + 1) * 8) + aligned(pairs * elem) +
         aligned(pairs * h * elem) + aligned(pairs * inter * elem);
}

// A MoE layer's routed experts in one call (see tandem_moe_block): the calls the Python
// glue made one by one (top-k, sort, gather, the two grouped GEMMs, the sum back), in the
// same order on the same buffers, so the result is theirs bit for bit.
template <typename T>
int moe_block(T* y, const T* x, int64_t tokens, int64_t h, int64_t ldx, int64_t ldy,
              const T* logits, int64_t ld_logits, int64_t experts, int64_t k, bool normalize,
              const void* w13, GroupedEntry gate_up, const void* w2, GroupedEntry down,
              int64_t inter, char* workspace, int threads) {
  const int64_t pairs = tokens * k;
  int64_t* ids = reinterpret_cast<int64_t*>(workspace);
  int64_t* offsets = reinterpret_cast<int64_t*>(workspace + aligned(pairs * 8));
  int64_t* token = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(offsets) +
                                              aligned((experts + 1) * 8));
  int64_t* slot = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(token) + aligned(pairs * 8));
  T* weights = reinterpret_cast<T*>(reinterpret_cast<char*>(slot) + aligned(pairs * 8));
  T* rows = reinterpret_cast<T*>(reinterpret_cast<char*>(weights) +
                                 aligned(pairs * int64_t{sizeof(T)}));
  T* hidden = reinterpret_cast<T*>(reinterpret_cast<char*>(rows) +
                                   aligned(pairs * h * int64_t{sizeof(T)}));
  topk_softmax(logits, ld_logits, tokens, experts, k, normalize, weights, ids, threads);
  if (tandem_moe_route(ids, tokens, k, experts, offsets, token, slot) != 0) return 3;
  gather(rows, x, token, pairs, h, ldx, threads);
  int code = gate_up(hidden, rows, w13, offsets, experts, pairs, 2 * inter, h, h, inter, threads);
  if (code != 0) return 100 + code;
  code = down(rows, hidden, w2, offsets, experts, pairs, h, inter, inter, h, threads);
  if (code != 0) return 200 + code;
  combine(y, rows, weights, slot, tokens, k, h, h, ldy, threads);
  return 0;
}

}  // namespace

extern "C" {

// weights [tokens, k] (dtype) and ids [tokens, k] (int64): the router's choice from logits
// [tokens, experts] (row stride ld), see topk_softmax; dtype 0 float32, 1 bfloat16. Returns
// 0, 1 where k is not within [1, experts], or 2 for another dtype.
int tandem_moe_topk_softmax(const void* logits, int64_t ld, int64_t tokens, int64_t experts,
                            int64_t k, int32_t normalize, void* weights, int64_t* ids,
                            int32_t dtype, int32_t threads) {
  if (k < 1 || k > experts) return 1;
  if (dtype == 0) {
    topk_softmax(static_cast<const float*>(logits), ld, tokens, experts, k, normalize != 0,
                 static_cast<float*>(weights), ids, threads);
  } else if (dtype == 1) {
    topk_softmax(static_cast<const uint16_t*>(logits), ld, tokens, experts, k, normalize != 0,
                 static_cast<uint16_t*>(weights), ids, threads);
  } else {
    return 2;
  }
  return 0;
}

// out [rows, h] (contiguous) = x[token[r]] (row stride ldx, x_rows rows) for r < rows; dtype
// as above. Returns 0, 1 (nothing written) where a token is outside x, or 2 for another dtype.
int tandem_moe_gather(void* out, const void* x, const int64_t* token, int64_t rows, int64_t h,
                      int64_t ldx, int64_t x_rows, int32_t dtype, int32_t threads) {
  for (int64_t r = 0; r < rows; ++r) {
    if (token[r] < 0 || token[r] >= x_rows) return 1;
  }
  if (dtype == 0) {
    gather(static_cast<float*>(out), static_cast<const float*>(x), token, rows, h, ldx, threads);
  } else if (dtype == 1) {
    gather(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), token, rows, h, ldx,
           threads);
  } else {
    return 2;
  }
  return 0;
}

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

// A MoE layer's routed experts: y [tokens, h] (row stride ldy) = for each token of x (row
// stride ldx), the sum over the k experts the router's logits [tokens, experts] (row stride
// ld_logits) choose of its routing weight times the expert's down(silu(gate) * up) of its
// row; what tandem_moe_topk_softmax, _route, _gather, the gate/up grouped GEMM with SiLU
// (w13 [E, 2 inter, h] in that library's layout), the down one (w2 [E, h, inter]) and
// tandem_moe_combine give one after another, bit for bit, in one call where a decode step
// paid each its own trip through Python. gate_up / down: the linear library's grouped entry
// points and the panel width each takes (< 0: none). workspace: workspace_bytes of scratch
// (moe_routing.py's workspace_bytes says how many). Returns 0; 1 where k is not within
// [1, experts]; 2 for another dtype; 4 for a workspace too small; 100 + the gate/up GEMM's
// refusal, 200 + the down one's.
int tandem_moe_block(void* y, const void* x, int64_t tokens, int64_t h, int64_t ldx,
                     int64_t ldy, const void* logits, int64_t ld_logits, int64_t experts,
                     int64_t k, int32_t normalize, const void* w13, void* gate_up,
                     int32_t gate_up_panel, const void* w2, void* down, int32_t down_panel,
                     int64_t inter, void* workspace, int64_t workspace_bytes, int32_t dtype,
                     int32_t threads) {
  if (k < 1 || k > experts) return 1;
  if (dtype != 0 && dtype != 1) return 2;
  const int64_t elem = dtype == 0 ? 4 : 2;
  if (workspace_bytes < block_workspace(tokens * k, experts, h, inter, elem)) return 4;
  const GroupedEntry up{gate_up, gate_up_panel}, dn{down, down_panel};
  char* scratch = static_cast<char*>(workspace);
  if (dtype == 0) {
    return moe_block(static_cast<float*>(y), static_cast<const float*>(x), tokens, h, ldx, ldy,
                     static_cast<const float*>(logits), ld_logits, experts, k, normalize != 0,
                     w13, up, w2, dn, inter, scratch, threads);
  }
  return moe_block(static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x), tokens, h, ldx,
                   ldy, static_cast<const uint16_t*>(logits), ld_logits, experts, k,
                   normalize != 0, w13, up, w2, dn, inter, scratch, threads);
}

}  // extern "C"
