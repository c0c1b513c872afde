// The mass correction trigger on the CPU: the estimated attention mass a stale selection
// loses against a fresh one (kernels/ops.h, SelectionLossArgs).
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

// OUT_OF_RANGE naming the first entry of `sel` ([B·Hkv·k], flat index as the CUDA kernel
// reports it) that is neither a page in [0, P) nor kEmptySlot.
absl::Status CheckSelection(const char* field, const int32_t* sel, int64_t n, int32_t P) {
  for (int64_t i = 0; i < n; ++i) {
    if (sel[i] != kEmptySlot && (sel[i] < 0 || sel[i] >= P)) {
      return absl::OutOfRangeError(
          absl::StrFormat("SelectionLoss: %s[%d] = %d must be in [0, %d) or %d (empty)", field, i,
                          sel[i], P, kEmptySlot));
    }
  }
  return absl::OkStatus();
}

// The head's page weights: its pooled probabilities, NaN as 0.
struct Weights {
  const float* pooled;
  float operator()(int32_t page) const {
    const float w = pooled[page];
    return std::isnan(w) ? 0.0f : w;
  }
};

float HeadLoss(const SelectionLossArgs& a, int64_t head, std::vector<int32_t>& cur,
               std::vector<int32_t>& fr) {
  const auto pages = [&](const int32_t* sel, std::vector<int32_t>& out) {
    out.clear();
    for (int32_t i = 0; i < a.k; ++i) {
      if (sel[head * a.k + i] != kEmptySlot) out.push_back(sel[head * a.k + i]);
    }
  };
  pages(a.current, cur);
  pages(a.fresh, fr);
  const Weights w{a.pooled + head * a.max_pages};
  // total: the fresh selection's mass; gain − lost: what it holds that the current does not,
  // minus the converse (exactly 0 for the same pages in any order).
  double total = 0, gain = 0, lost = 0;
  for (int32_t page : fr) total += w(page);
  std::sort(cur.begin(), cur.end());
  std::sort(fr.begin(), fr.end());
  for (int32_t page : fr) {
    if (!std::binary_search(cur.begin(), cur.end(), page)) gain += w(page);
  }
  for (int32_t page : cur) {
    if (!std::binary_search(fr.begin(), fr.end(), page)) lost += w(page);
  }
  if (!(total > 0)) return 0.0f;
  const auto loss = static_cast<float>((gain - lost) / total);
  return loss > 1.0f ? 1.0f : loss > 0.0f ? loss : 0.0f;  // NaN → 0
}

}  // namespace

absl::Status CpuSelectionLoss(const SelectionLossArgs& a, ThreadPool* pool) {
  const int64_t heads = int64_t{a.batch} * a.shape.num_kv_heads;
  KVTIER_RETURN_IF_ERROR(CheckSelection("current", a.current, heads * a.k, a.max_pages));
  KVTIER_RETURN_IF_ERROR(CheckSelection("fresh", a.fresh, heads * a.k, a.max_pages));
  ParallelFor(pool, heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> cur, fr;
    for (int64_t i = begin; i < end; ++i) {
      const float loss = HeadLoss(a, i, cur, fr);
      a.loss[i] = loss;
      if (a.drifted != nullptr) a.drifted[i] = loss > a.threshold ? 1 : 0;
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
