// Recall transform on the CPU: HND head-page slabs → NHD working-set rows, bit-exact.
#include <cstring>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

absl::Status CheckItems(const RecallArgs& a) {
  for (int32_t i = 0; i < a.num_items; ++i) {
    const RecallItem& it = a.items[i];
    if (it.host_page == kSkipItem) continue;
    if (it.host_page < 0 || it.host_page >= a.num_host_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "Recall: items[%d].host_page = %d must be in [0, %d)", i, it.host_page,
          a.num_host_pages));
    }
    if (it.kv_head < 0 || it.kv_head >= a.shape.num_kv_heads) {
      return absl::OutOfRangeError(
          absl::StrFormat("Recall: items[%d].kv_head = %d must be in [0, %d)", i, it.kv_head,
                          a.shape.num_kv_heads));
    }
    if (it.dst_slot < 0 || it.dst_slot >= a.kv.num_slots) {
      return absl::OutOfRangeError(absl::StrFormat(
          "Recall: items[%d].dst_slot = %d must be in [0, %d)", i, it.dst_slot, a.kv.num_slots));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuRecall(const RecallArgs& a, ThreadPool* pool) {
  if (a.num_items == 0) return absl::OkStatus();
  if (absl::Status st = CheckItems(a); !st.ok()) return st;
  const size_t elem = DTypeSize(a.shape.dtype);
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem;
  const HostPageLayout hl{a.shape.num_kv_heads, a.shape.page_size, a.shape.head_dim};
  const WorkingSetLayout wl{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads,
                            a.shape.head_dim};
  const auto* host = static_cast<const unsigned char*>(a.host_pages);
  unsigned char* const dst_base[2] = {static_cast<unsigned char*>(a.kv.k_cache),
                                      static_cast<unsigned char*>(a.kv.v_cache)};
  ParallelFor(pool, a.num_items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RecallItem& it = a.items[i];
      if (it.host_page == kSkipItem) continue;
      const unsigned char* page = host + static_cast<size_t>(it.host_page * hl.page_elements()) * elem;
      for (int32_t kind = 0; kind < 2; ++kind) {
        for (int32_t t = 0; t < a.shape.page_size; ++t) {
          std::memcpy(dst_base[kind] + static_cast<size_t>(wl.Offset(it.dst_slot, t, it.kv_head, 0)) * elem,
                      page + static_cast<size_t>(hl.Offset(it.kv_head, kind, t, 0)) * elem, row_bytes);
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace kvtier
