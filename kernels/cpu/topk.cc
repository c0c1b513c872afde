// Top-k page selection on the CPU: deterministic (pinned pages first, then by score, ties to
// the lower page, NaN last), with per-head budgets (head_k) and excluded pages.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

// A page's rank class among candidates: lower ranks first. kPageExcluded wins over
// kPagePinned when a flag byte carries both bits; any other bits are kPageNormal.
inline int RankClass(const uint8_t* flags, int32_t page) {
  return flags != nullptr && (flags[page] & kPagePinned) != 0 ? 0 : 1;
}
inline bool Excluded(const uint8_t* flags, int32_t page) {
  return flags != nullptr && (flags[page] & kPageExcluded) != 0;
}

// A strict weak order: pinned pages first (when flags are given), then higher score first,
// NaN after every number, then lower page first.
struct Better {
  const float* score;
  const uint8_t* flags;  // this head's [P] page flags, or null
  bool operator()(int32_t x, int32_t y) const {
    if (flags != nullptr) {
      const int cx = RankClass(flags, x), cy = RankClass(flags, y);
      if (cx != cy) return cx < cy;
    }
    const float sx = score[x], sy = score[y];
    const bool nx = std::isnan(sx), ny = std::isnan(sy);
    if (nx != ny) return ny;
    if (!nx && sx != sy) return sx > sy;
    return x < y;
  }
};

void SelectHead(const TopKArgs& a, int32_t b, int32_t h, std::vector<int32_t>& cand) {
  const int64_t head = int64_t{b} * a.shape.num_kv_heads + h;
  const int32_t n = a.num_pages[b];
  const int32_t begin = std::min(a.sink_pages, n);
  const int32_t end = std::max(begin, n - a.recent_pages);
  const uint8_t* flags = a.page_flags != nullptr ? a.page_flags + head * a.max_pages : nullptr;
  cand.clear();
  for (int32_t p = begin; p < end; ++p) {
    if (!Excluded(flags, p)) cand.push_back(p);
  }
  const float* score = a.pooled + head * a.max_pages;
  const int32_t k_h = a.head_k != nullptr ? a.head_k[head] : a.k;  // range-checked by CpuTopK
  const auto take = static_cast<ptrdiff_t>(std::min<size_t>(static_cast<size_t>(k_h), cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), Better{score, flags});
  int32_t* out = a.selected + head * a.k;
  for (int32_t i = 0; i < a.k; ++i) out[i] = i < take ? cand[static_cast<size_t>(i)] : kEmptySlot;
}

}  // namespace

absl::Status CpuTopK(const TopKArgs& a, ThreadPool* pool) {
  for (int32_t b = 0; b < a.batch; ++b) {
    if (a.num_pages[b] < 0 || a.num_pages[b] > a.max_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "TopK: num_pages[%d] = %d must be in [0, max_pages = %d]", b, a.num_pages[b],
          a.max_pages));
    }
  }
  // head_k is checked only for the heads this call selects (head_mask), before any output.
  if (a.head_k != nullptr) {
    for (int64_t i = 0; i < int64_t{a.batch} * a.shape.num_kv_heads; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      if (a.head_k[i] < 0 || a.head_k[i] > a.k) {
        return absl::OutOfRangeError(
            absl::StrFormat("TopK: head_k[%d] = %d must be in [0, k = %d]", i, a.head_k[i], a.k));
      }
    }
  }
  ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> cand;
    for (int64_t i = begin; i < end; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      SelectHead(a, static_cast<int32_t>(i / a.shape.num_kv_heads),
                 static_cast<int32_t>(i % a.shape.num_kv_heads), cand);
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
