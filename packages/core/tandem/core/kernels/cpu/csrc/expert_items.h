// The work items of a grouped expert GEMM, shared by the kernels that have one
// (avx2_linear.cpp, avx512_linear.cpp): expert e's rows of x are [offsets[e], offsets[e + 1]),
// and every (expert, panel) pair with rows is one item the threads share, so a decode step's
// dozen rows per expert still keep every core busy. Header-only.

#pragma once

#include <cstdint>
#include <vector>

namespace tandem {

// expert * panels + panel for every expert with rows, in order; false (nothing filled) for
// offsets that are not in order within x's M rows: a bad offsets tensor is refused, never
// read past.
inline bool expert_items(const int64_t* offsets, int64_t experts, int64_t M, int64_t panels,
                         std::vector<int64_t>& items) {
  if (offsets[0] < 0 || offsets[experts] > M) return false;
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] < offsets[e]) return false;
  }
  items.reserve(experts * panels);
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] > offsets[e]) {
      for (int64_t p = 0; p < panels; ++p) items.push_back(e * panels + p);
    }
  }
  return true;
}

}  // namespace tandem
