// Top-k page selection on the CPU: deterministic (ties to the lower page, NaN last).
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

// A strict weak order: higher score first, NaN after every number, then lower page first.
struct Better {
  const float* score;
  bool operator()(int32_t x, int32_t y) const {
    const float sx = score[x], sy = score[y];
    const bool nx = std::isnan(sx), ny = std::isnan(sy);
    if (nx != ny) return ny;
    if (!nx && sx != sy) return sx > sy;
    return x < y;
  }
};

void SelectHead(const TopKArgs& a, int32_t b, int32_t h, std::vector<int32_t>& cand) {
  const int32_t n = a.num_pages[b];
  const int32_t begin = std::min(a.sink_pages, n);
  const int32_t end = std::max(begin, n - a.recent_pages);
  cand.resize(static_cast<size_t>(end - begin));
  for (int32_t p = begin; p < end; ++p) cand[static_cast<size_t>(p - begin)] = p;
  const float* score = a.pooled + (int64_t{b} * a.num_kv_heads + h) * a.max_pages;
  const auto take = static_cast<ptrdiff_t>(std::min<size_t>(static_cast<size_t>(a.k), cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), Better{score});
  int32_t* out = a.selected + (int64_t{b} * a.num_kv_heads + h) * a.k;
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
  ParallelFor(pool, int64_t{a.batch} * a.num_kv_heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> cand;
    for (int64_t i = begin; i < end; ++i) {
      if (a.head_mask != nullptr && a.head_mask[i] == 0) continue;
      SelectHead(a, static_cast<int32_t>(i / a.num_kv_heads),
                 static_cast<int32_t>(i % a.num_kv_heads), cand);
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
