#include "offload/recall_strategy.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {
namespace {

constexpr size_t kHostPage = 4096;

size_t RoundUp(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

absl::Status CheckItem(const RecallItem& it, int32_t i, const Geometry& g, const RecallTarget& t) {
  if (it.host_page < 0 || it.host_page >= t.num_host_pages) {
    return absl::InvalidArgumentError(
        absl::StrFormat("recall plan: items[%d].host_page = %d must be in [0, %d)", i, it.host_page,
                        t.num_host_pages));
  }
  if (it.kv_head < 0 || it.kv_head >= g.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "recall plan: items[%d].kv_head = %d must be in [0, %d)", i, it.kv_head, g.num_kv_heads));
  }
  if (it.dst_slot < 0 || it.dst_slot >= t.num_slots) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "recall plan: items[%d].dst_slot = %d must be in [0, %d)", i, it.dst_slot, t.num_slots));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view RecallStrategyName(RecallStrategy strategy) {
  switch (strategy) {
    case RecallStrategy::kAuto:
      return "auto";
    case RecallStrategy::kBatchedDma:
      return "batched_dma";
    case RecallStrategy::kZeroCopy:
      return "zero_copy";
  }
  return "unknown";
}

bool ParseRecallStrategy(std::string_view name, RecallStrategy* out) {
  for (RecallStrategy s :
       {RecallStrategy::kAuto, RecallStrategy::kBatchedDma, RecallStrategy::kZeroCopy}) {
    if (name == RecallStrategyName(s)) {
      *out = s;
      return true;
    }
  }
  return false;
}

RecallArgs ZeroCopyRecallArgs(const Geometry& g, const RecallTarget& t, const RecallItem* items,
                              int32_t n) {
  RecallArgs a;
  a.shape = KvShapeOf(g);
  a.kv.k_cache = t.k_cache;
  a.kv.v_cache = t.v_cache;
  a.kv.num_slots = t.num_slots;
  a.host_pages = t.host_pages;
  a.num_host_pages = t.num_host_pages;
  a.items = items;
  a.num_items = n;
  return a;
}

// ---- SlabRecaller ----

SlabRecaller::SlabRecaller(Backend& backend, const Geometry& g, RecallStrategy strategy,
                           int32_t max_items, int32_t chunk_items)
    : backend_(backend),
      g_(g),
      strategy_(strategy),
      max_items_(max_items),
      chunk_items_(std::min(chunk_items, max_items)) {}

SlabRecaller::~SlabRecaller() {
  // Work still queued may read the plans or write the staging buffers: callers synchronise
  // their streams before destroying a recaller (the Retriever does in its destructor).
  RecallItem* buffers[2] = {plan_, ordered_};
  for (int i = 0; i < 2; ++i) {
    if (registered_[i]) (void)backend_.UnregisterHost(buffers[i]);
    std::free(buffers[i]);
  }
}

absl::StatusOr<std::unique_ptr<SlabRecaller>> SlabRecaller::Create(Backend& backend,
                                                                   const Geometry& g,
                                                                   RecallStrategy strategy,
                                                                   int32_t max_items,
                                                                   int32_t chunk_items) {
  if (strategy == RecallStrategy::kAuto) {
    return absl::InvalidArgumentError(
        "SlabRecaller: name a strategy (batched_dma or zero_copy); kAuto is resolved by the step "
        "plan");
  }
  if (max_items < 1 || chunk_items < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SlabRecaller: max_items = %d and chunk_items = %d must be ≥ 1", max_items, chunk_items));
  }
  std::unique_ptr<SlabRecaller> r(new SlabRecaller(backend, g, strategy, max_items, chunk_items));
  KVTIER_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::Status SlabRecaller::Init() {
  plan_bytes_ = RoundUp(static_cast<size_t>(max_items_) * sizeof(RecallItem), kHostPage);
  RecallItem** buffers[2] = {&plan_, &ordered_};
  for (int i = 0; i < 2; ++i) {
    *buffers[i] = static_cast<RecallItem*>(std::aligned_alloc(kHostPage, plan_bytes_));
    if (*buffers[i] == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("SlabRecaller: cannot allocate %d bytes of plan", plan_bytes_));
    }
    std::memset(*buffers[i], 0xFF, plan_bytes_);  // every item a skip item
    KVTIER_RETURN_IF_ERROR(backend_.RegisterHost(*buffers[i], plan_bytes_));
    registered_[i] = true;
  }
  if (strategy_ == RecallStrategy::kZeroCopy) return absl::OkStatus();
  const size_t chunk_bytes =
      static_cast<size_t>(chunk_items_) * g_.slab_elements() * g_.element_bytes();
  for (int b = 0; b < 2; ++b) {
    KVTIER_ASSIGN_OR_RETURN(staging_[b], backend_.Allocate(chunk_bytes));
    KVTIER_ASSIGN_OR_RETURN(staged_[b], backend_.CreateEvent());
    KVTIER_ASSIGN_OR_RETURN(freed_[b], backend_.CreateEvent());
  }
  KVTIER_ASSIGN_OR_RETURN(done_, backend_.CreateEvent());
  ranges_.reserve(chunk_items_);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SlabRecaller::Enqueue(Stream& drive, Stream& xform, int32_t n,
                                              const RecallTarget& t) {
  if (n < 0 || n > max_items_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SlabRecaller: n = %d must be in [0, %d]", n, max_items_));
  }
  if (n == 0) return 0;
  if (strategy_ == RecallStrategy::kZeroCopy) {
    KVTIER_RETURN_IF_ERROR(backend_.Recall(drive, ZeroCopyRecallArgs(g_, t, plan_, n)));
    return 0;
  }

  // The DMA strategy reads the plan here: drop skips, check ranges, and order by host address
  // so that adjacent slabs become one range.
  int32_t m = 0;
  for (int32_t i = 0; i < n; ++i) {
    const RecallItem& it = plan_[i];
    if (it.host_page == kSkipItem) continue;
    KVTIER_RETURN_IF_ERROR(CheckItem(it, i, g_, t));
    ordered_[m++] = it;
  }
  if (m == 0) return 0;
  std::sort(ordered_, ordered_ + m, [](const RecallItem& a, const RecallItem& b) {
    return a.host_page != b.host_page ? a.host_page < b.host_page : a.kv_head < b.kv_head;
  });
  const size_t slab_bytes = static_cast<size_t>(g_.slab_elements()) * g_.element_bytes();
  const size_t page_bytes = g_.host_page_bytes();
  const auto* host = static_cast<const uint8_t*>(t.host_pages);
  int64_t issued = 0;
  // Double-buffered: chunk c is copied into staging[c % 2] on `drive` once the transform of
  // chunk c − 2 has freed it, and transformed on `xform` once staged.
  for (int32_t c = 0, begin = 0; begin < m; ++c, begin += chunk_items_) {
    const int b = c % 2;
    const int32_t count = std::min(chunk_items_, m - begin);
    KVTIER_RETURN_IF_ERROR(drive.Wait(*freed_[b]));
    auto* stage = staging_[b].as<uint8_t>();
    ranges_.clear();
    for (int32_t j = 0; j < count; ++j) {
      const RecallItem& it = ordered_[begin + j];
      const uint8_t* src = host + static_cast<size_t>(it.host_page) * page_bytes +
                           static_cast<size_t>(it.kv_head) * slab_bytes;
      uint8_t* dst = stage + static_cast<size_t>(j) * slab_bytes;
      if (!ranges_.empty()) {
        CopyRange& last = ranges_.back();
        if (static_cast<const uint8_t*>(last.src) + last.bytes == src &&
            static_cast<uint8_t*>(last.dst) + last.bytes == dst) {
          last.bytes += slab_bytes;
          continue;
        }
      }
      ranges_.push_back(CopyRange{dst, src, slab_bytes});
    }
    KVTIER_RETURN_IF_ERROR(backend_.CopyBatch(drive, ranges_.data(), ranges_.size()));
    issued += static_cast<int64_t>(ranges_.size());
    KVTIER_RETURN_IF_ERROR(drive.Record(*staged_[b]));
    KVTIER_RETURN_IF_ERROR(xform.Wait(*staged_[b]));
    ScatterSlabsArgs sa;
    sa.shape = KvShapeOf(g_);
    sa.kv.k_cache = t.k_cache;
    sa.kv.v_cache = t.v_cache;
    sa.kv.num_slots = t.num_slots;
    sa.staging = stage;
    sa.items = ordered_ + begin;
    sa.num_items = count;
    KVTIER_RETURN_IF_ERROR(backend_.ScatterSlabs(xform, sa));
    KVTIER_RETURN_IF_ERROR(xform.Record(*freed_[b]));
  }
  KVTIER_RETURN_IF_ERROR(xform.Record(*done_));
  KVTIER_RETURN_IF_ERROR(drive.Wait(*done_));
  return issued;
}

}  // namespace kvtier
