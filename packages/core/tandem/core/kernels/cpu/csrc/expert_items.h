// The work items of a grouped expert GEMM, shared by the kernels that have one
// (avx2_linear.cpp, avx512_linear.cpp; amx_linear.cpp builds its own items, and shares the
// offsets check and the claiming): expert e's rows of x are [offsets[e], offsets[e + 1]),
// and every (expert, panel) pair with rows is one item the threads share, so a decode
// step's dozen rows per expert still keep every core busy.
// Header-only.

#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem {

// Whether offsets are in order within x's M rows: a bad offsets tensor is refused, never
// read past.
inline bool offsets_in_order(const int64_t* offsets, int64_t experts, int64_t M) {
  if (offsets[0] < 0 || offsets[experts] > M) return false;
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] < offsets[e]) return false;
  }
  return true;
}

// expert * panels + panel for every expert with rows, in order; false (nothing filled) for
// offsets that are not in order within x's M rows.
inline bool expert_items(const int64_t* offsets, int64_t experts, int64_t M, int64_t panels,
                         std::vector<int64_t>& items) {
  if (!offsets_in_order(offsets, experts, M)) return false;
  items.reserve(experts * panels);
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] > offsets[e]) {
      for (int64_t p = 0; p < panels; ++p) items.push_back(e * panels + p);
    }
  }
  return true;
}

// One thread's share of claim_ahead, inside a parallel region the caller opened (a kernel
// that sets up per-thread state first, such as AMX tiles): the team shares `counter`,
// which starts at zero.
template <class Body>
void claim_items(std::atomic<int64_t>& counter, int64_t count, Body& body) {
  int64_t current = counter.fetch_add(1);
  while (current < count) {
    const int64_t following = counter.fetch_add(1);
    body(current, following < count ? following : -1);
    current = following;
  }
}

// Runs body(item, following) for items [0, count) on `threads` threads, each thread claiming
// its next item before it starts the current one (following: that next item, or -1): the
// current item's last chunk can prefetch the next one's weights, where OpenMP's dynamic
// schedule hands a thread its next item only once it asks. A thread that finishes early
// claims more, so the balance is the dynamic schedule's, within an item.
template <class Body>
void claim_ahead(int64_t count, int threads, Body body) {
  std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(threads)
  claim_items(counter, count, body);
}

}  // namespace tandem
