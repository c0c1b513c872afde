// Page-cache replacement of the selected region on the CPU (kernels/ops.h ReplaceArgs).
#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

// Checks every selected page of a masked head has a host page, before anything changes.
absl::Status CheckSelection(const ReplaceArgs& a) {
  for (int32_t b = 0; b < a.batch; ++b) {
    for (int32_t h = 0; h < a.shape.num_kv_heads; ++h) {
      if (a.head_mask != nullptr && a.head_mask[b * a.shape.num_kv_heads + h] == 0) continue;
      const int32_t* sel = a.selected + (int64_t{b} * a.shape.num_kv_heads + h) * a.k;
      for (int32_t i = 0; i < a.k; ++i) {
        if (sel[i] == kEmptySlot) continue;
        if (sel[i] < 0 || sel[i] >= a.max_pages ||
            a.host_page_of[int64_t{b} * a.max_pages + sel[i]] < 0) {
          return absl::OutOfRangeError(absl::StrFormat(
              "Replace: selected[%d][%d][%d] = page %d has no host page (max_pages = %d)", b, h,
              i, sel[i], a.max_pages));
        }
      }
    }
  }
  return absl::OkStatus();
}

// Replaces the region of one (sequence, KV head); returns the number of misses.
int32_t ReplaceHead(const ReplaceArgs& a, int32_t b, int32_t h, std::vector<int32_t>& free_slots) {
  const SlotTableLayout tl{a.shape.num_kv_heads, a.kv.num_slots};
  int32_t* region = a.kv.slot_table + tl.Offset(b, h, a.region_begin);
  const int32_t* sel = a.selected + (int64_t{b} * a.shape.num_kv_heads + h) * a.k;
  RecallItem* items = a.items + (int64_t{b} * a.shape.num_kv_heads + h) * a.k;
  auto selected = [&](int32_t page) { return page >= 0 && std::find(sel, sel + a.k, page) != sel + a.k; };
  free_slots.clear();
  for (int32_t s = 0; s < a.k; ++s) {
    // Evict what is not in the new top-k, and any second copy of a page (a table never
    // holds one, but a corrupt one must not make misses outnumber the free slots).
    if (!selected(region[s]) || std::find(region, region + s, region[s]) != region + s) {
      region[s] = kEmptySlot;
      free_slots.push_back(s);
    }
  }
  int32_t misses = 0;
  for (int32_t i = 0; i < a.k; ++i) {
    const int32_t page = sel[i];
    if (page < 0 || std::find(region, region + a.k, page) != region + a.k) continue;  // hit
    const int32_t s = free_slots[static_cast<size_t>(misses)];
    region[s] = page;
    items[misses++] = RecallItem{a.host_page_of[int64_t{b} * a.max_pages + page], h,
                                 static_cast<int32_t>(b * a.kv.num_slots + a.region_begin + s)};
  }
  for (int32_t i = misses; i < a.k; ++i) items[i] = RecallItem{kSkipItem, h, 0};
  return misses;
}

}  // namespace

absl::Status CpuReplace(const ReplaceArgs& a, ThreadPool* pool) {
  if (absl::Status st = CheckSelection(a); !st.ok()) return st;
  ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> free_slots;
    for (int64_t i = begin; i < end; ++i) {
      const auto b = static_cast<int32_t>(i / a.shape.num_kv_heads);
      const auto h = static_cast<int32_t>(i % a.shape.num_kv_heads);
      int32_t misses = 0;
      if (a.head_mask == nullptr || a.head_mask[i] != 0) {
        misses = ReplaceHead(a, b, h, free_slots);
      } else {
        for (int32_t j = 0; j < a.k; ++j) a.items[i * a.k + j] = RecallItem{kSkipItem, h, 0};
      }
      if (a.num_misses != nullptr) a.num_misses[i] = misses;
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
