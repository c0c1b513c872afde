// Slab copies on the CPU, bit-exact. Recall in two halves: GatherSlabs copies whole K+V
// head-page slabs from HND host pages into a staging buffer; ScatterSlabs writes staged slabs
// into NHD working-set rows (together they do what recall.cc does in one pass). And
// MoveHeadSlots, which moves one KV head's part of a working-set slot to another slot when
// drop mode compacts its per-head slot tables.
#include <cstring>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "core/status.h"

namespace kvtier {
namespace {

// OUT_OF_RANGE naming `op: items[i].field` when `value` is not in [0, limit).
absl::Status CheckItemField(const char* op, int32_t i, const char* field, int64_t value,
                            int64_t limit) {
  if (value >= 0 && value < limit) return absl::OkStatus();
  return absl::OutOfRangeError(
      absl::StrFormat("%s: items[%d].%s = %d must be in [0, %d)", op, i, field, value, limit));
}

absl::Status CheckItems(const GatherSlabsArgs& a) {
  for (int32_t i = 0; i < a.num_items; ++i) {
    const RecallItem& it = a.items[i];
    if (it.host_page == kSkipItem) continue;
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("GatherSlabs", i, "host_page", it.host_page, a.num_host_pages));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("GatherSlabs", i, "kv_head", it.kv_head, a.shape.num_kv_heads));
  }
  return absl::OkStatus();
}

absl::Status CheckItems(const ScatterSlabsArgs& a) {
  for (int32_t i = 0; i < a.num_items; ++i) {
    const RecallItem& it = a.items[i];
    if (it.host_page == kSkipItem) continue;
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("ScatterSlabs", i, "kv_head", it.kv_head, a.shape.num_kv_heads));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("ScatterSlabs", i, "dst_slot", it.dst_slot, a.kv.num_slots));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuGatherSlabs(const GatherSlabsArgs& a, ThreadPool* pool) {
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckItems(a));
  const size_t elem = DTypeSize(a.shape.dtype);
  const HostPageLayout hl{a.shape.num_kv_heads, a.shape.page_size, a.shape.head_dim};
  const size_t slab_bytes = static_cast<size_t>(hl.slab_elements()) * elem;
  const auto* host = static_cast<const unsigned char*>(a.host_pages);
  auto* staging = static_cast<unsigned char*>(a.staging);
  ParallelFor(pool, a.num_items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RecallItem& it = a.items[i];
      if (it.host_page == kSkipItem) continue;
      const int64_t src = it.host_page * hl.page_elements() + hl.SlabOffset(it.kv_head);
      std::memcpy(staging + static_cast<size_t>(i) * slab_bytes,
                  host + static_cast<size_t>(src) * elem, slab_bytes);
    }
  });
  return absl::OkStatus();
}

absl::Status CpuScatterSlabs(const ScatterSlabsArgs& a, ThreadPool* pool) {
  if (a.num_items == 0) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(CheckItems(a));
  const size_t elem = DTypeSize(a.shape.dtype);
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem;
  const HostPageLayout sl{1, a.shape.page_size, a.shape.head_dim};  // one staged slab
  const WorkingSetLayout wl{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads,
                            a.shape.head_dim};
  const auto* staging = static_cast<const unsigned char*>(a.staging);
  unsigned char* const dst_base[2] = {static_cast<unsigned char*>(a.kv.k_cache),
                                      static_cast<unsigned char*>(a.kv.v_cache)};
  ParallelFor(pool, a.num_items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RecallItem& it = a.items[i];
      if (it.host_page == kSkipItem) continue;
      const unsigned char* slab = staging + static_cast<size_t>(i * sl.page_elements()) * elem;
      for (int32_t kind = 0; kind < 2; ++kind) {
        for (int32_t t = 0; t < a.shape.page_size; ++t) {
          const int64_t dst = wl.Offset(it.dst_slot, t, it.kv_head, 0);
          const int64_t src = sl.Offset(0, kind, t, 0);
          std::memcpy(dst_base[kind] + static_cast<size_t>(dst) * elem,
                      slab + static_cast<size_t>(src) * elem, row_bytes);
        }
      }
    }
  });
  return absl::OkStatus();
}

// Every item is checked before anything moves, so a failing call writes nothing. Items run
// in order on the calling thread: a later item may read what an earlier one wrote.
absl::Status CpuMoveHeadSlots(const MoveHeadSlotsArgs& a, ThreadPool* /*pool*/) {
  if (a.num_items == 0) return absl::OkStatus();
  for (int32_t i = 0; i < a.num_items; ++i) {
    const HeadSlotMove& it = a.items[i];
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "kv_head", it.kv_head, a.shape.num_kv_heads));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "src_slot", it.src_slot, a.kv.num_slots));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "dst_slot", it.dst_slot, a.kv.num_slots));
    if (it.src_slot == it.dst_slot) {
      return absl::InvalidArgumentError(
          absl::StrFormat("MoveHeadSlots: items[%d] moves slot %d onto itself", i, it.src_slot));
    }
  }
  const WorkingSetLayout wl{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads,
                            a.shape.head_dim};
  const size_t elem = DTypeSize(a.shape.dtype);
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem;
  unsigned char* const fp[2] = {static_cast<unsigned char*>(a.kv.k_cache),
                                static_cast<unsigned char*>(a.kv.v_cache)};
  for (int32_t i = 0; i < a.num_items; ++i) {
    const HeadSlotMove& it = a.items[i];
    for (int kind = 0; kind < 2; ++kind) {
      for (int32_t t = 0; t < a.shape.page_size; ++t) {
        const int64_t src = wl.Offset(it.src_slot, t, it.kv_head, 0);
        const int64_t dst = wl.Offset(it.dst_slot, t, it.kv_head, 0);
        std::memcpy(fp[kind] + static_cast<size_t>(dst) * elem,
                    fp[kind] + static_cast<size_t>(src) * elem, row_bytes);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
