#include "offload/page_offloader.h"

#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {

absl::StatusOr<std::vector<OffloadItem>> PlanOffload(std::span<const int64_t> src_slots,
                                                     std::span<const int64_t> host_pages,
                                                     std::span<const int64_t> summary_pages) {
  if (src_slots.size() != host_pages.size() || src_slots.size() != summary_pages.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "PlanOffload: %d source slots, %d host pages and %d summary pages: must be equal",
        src_slots.size(), host_pages.size(), summary_pages.size()));
  }
  std::vector<OffloadItem> items;
  items.reserve(src_slots.size());
  for (size_t i = 0; i < src_slots.size(); ++i) {
    if (src_slots[i] < 0 || host_pages[i] < 0 || summary_pages[i] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "PlanOffload: item %d = {src %d, host %d, summary %d}: indices must be >= 0", i,
          src_slots[i], host_pages[i], summary_pages[i]));
    }
    items.push_back(OffloadItem{src_slots[i], host_pages[i], summary_pages[i]});
  }
  return items;
}

absl::StatusOr<std::unique_ptr<PageOffloader>> PageOffloader::Create(const Geometry& geometry,
                                                                     Backend& backend,
                                                                     PagePool& pool,
                                                                     StagingRing* ring) {
  if (pool.slot_stride() != geometry.host_page_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "page pool stride %d bytes != host page size %d bytes of geometry %s: make the pool "
        "with slot_bytes = host_page_bytes(), which must be a multiple of %d",
        pool.slot_stride(), geometry.host_page_bytes(), geometry.ToString(),
        PagePool::kSlotAlignment));
  }
  return std::unique_ptr<PageOffloader>(new PageOffloader(geometry, backend, pool, ring));
}

PageOffloader::~PageOffloader() { (void)Drain(); }

absl::Status PageOffloader::Validate(const PageTable& table, const OffloadRequest& request) const {
  if (&table.pool() != &pool_) {
    return absl::InvalidArgumentError("offload: the page table belongs to another page pool");
  }
  const size_t n = request.logical_pages.size();
  if (request.src_slots.size() != n || n > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "offload: %d logical pages and %d source slots: must be equal and at most %d", n,
        request.src_slots.size(), INT32_MAX));
  }
  if (n > 0 &&
      (request.k_src == nullptr || request.v_src == nullptr || request.summaries == nullptr)) {
    return absl::InvalidArgumentError("offload: k_src, v_src and summaries must be non-null");
  }
  if (n > 0 && request.summary_mode == SummaryMode::kKeyCodes && request.codes == nullptr) {
    return absl::InvalidArgumentError("offload: summary_mode key-codes needs codes");
  }
  absl::flat_hash_set<int64_t> seen;
  seen.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t logical = request.logical_pages[i];
    const int64_t src = request.src_slots[i];
    if (src < 0 || src >= request.num_src_slots) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "offload: item %d: source slot %d out of range [0, %d)", i, src, request.num_src_slots));
    }
    if (logical < 0 || logical >= request.num_summary_pages) {
      return absl::InvalidArgumentError(
          absl::StrFormat("offload: item %d: logical page %d out of range [0, %d) of the summaries",
                          i, logical, request.num_summary_pages));
    }
    if (!seen.insert(logical).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("offload: logical page %d appears twice in one request", logical));
    }
    if (table.Contains(logical)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("offload: logical page %d is already in the host page table", logical));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PageHandle>> PageOffloader::AllocatePages(size_t count) {
  std::vector<PageHandle> pages;
  pages.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<PageHandle> page = pool_.Allocate();
    if (!page.ok()) {  // `pages` frees the slots taken so far: nothing half-done remains
      return absl::Status(page.status().code(),
                          absl::StrFormat("offloading %d pages: %s (after %d allocated)", count,
                                          page.status().message(), i));
    }
    pages.push_back(*std::move(page));
  }
  return pages;
}

absl::Status PageOffloader::Offload(Stream& stream, PageTable& table,
                                    const OffloadRequest& request) {
  Reap();
  KVTIER_RETURN_IF_ERROR(Validate(table, request));
  const size_t n = request.logical_pages.size();
  if (n == 0) return absl::OkStatus();
  KVTIER_ASSIGN_OR_RETURN(std::vector<PageHandle> pages, AllocatePages(n));
  return OffloadPages(stream, table, request, std::move(pages));
}

absl::Status PageOffloader::OffloadInto(Stream& stream, PageTable& table,
                                        const OffloadRequest& request,
                                        std::vector<PageHandle> pages) {
  Reap();
  KVTIER_RETURN_IF_ERROR(Validate(table, request));
  if (pages.size() != request.logical_pages.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("offload: %d pages given for %d logical pages: must be equal", pages.size(),
                        request.logical_pages.size()));
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    if (!pages[i].valid() || pages[i].pool() != &pool_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "offload: page %d given for logical page %d is empty or of another page pool", i,
          request.logical_pages[i]));
    }
  }
  if (pages.empty()) return absl::OkStatus();
  return OffloadPages(stream, table, request, std::move(pages));
}

absl::Status PageOffloader::OffloadPages(Stream& stream, PageTable& table,
                                         const OffloadRequest& request,
                                         std::vector<PageHandle> pages) {
  const size_t n = pages.size();
  std::vector<int64_t> host_pages(n);
  for (size_t i = 0; i < n; ++i) host_pages[i] = pages[i].slot();
  Batch batch;
  KVTIER_ASSIGN_OR_RETURN(batch.items,
                          PlanOffload(request.src_slots, host_pages, request.logical_pages));
  const size_t bytes = n * sizeof(OffloadItem);
  if (ring_ != nullptr && bytes <= ring_->capacity() / 8) {
    const StagingRing::Block b = ring_->TryAcquire(bytes);
    if (b.data != nullptr) {
      std::memcpy(b.data, batch.items.data(), bytes);
      batch.staged = reinterpret_cast<const OffloadItem*>(b.data);
      batch.ticket = b.ticket;
    }
  }
  if (batch.staged == nullptr) {
    KVTIER_ASSIGN_OR_RETURN(batch.device_items, backend_.Allocate(bytes));
  }
  KVTIER_RETURN_IF_ERROR(Enqueue(stream, request, std::move(batch)));
  for (size_t i = 0; i < n; ++i) {
    // Validate() ruled out every reason Insert could fail.
    KVTIER_CHECK(table.Insert(request.logical_pages[i], std::move(pages[i])).ok());
  }
  return absl::OkStatus();
}

OffloadArgs PageOffloader::MakeArgs(const OffloadRequest& request, const Batch& batch) const {
  OffloadArgs a;
  a.shape = KvShapeOf(geometry_);
  a.summary = request.summary_mode;
  a.k_src = request.k_src;
  a.v_src = request.v_src;
  a.num_src_slots = request.num_src_slots;
  a.host_pages = pool_.base();  // host page index == pool slot
  a.num_host_pages = pool_.num_slots();
  a.summaries = request.summaries;
  a.num_summary_pages = request.num_summary_pages;
  a.codes = request.codes;
  a.items = batch.staged != nullptr ? batch.staged : batch.device_items.as<const OffloadItem>();
  a.num_items = static_cast<int32_t>(batch.items.size());
  return a;
}

absl::Status PageOffloader::Enqueue(Stream& stream, const OffloadRequest& request, Batch batch) {
  const OffloadArgs args = MakeArgs(request, batch);
  if (absl::Status st = ValidateArgs(args); !st.ok()) {
    if (ring_ != nullptr) ring_->Release(batch.ticket);
    return st;
  }
  if (batch.staged == nullptr) {
    KVTIER_RETURN_IF_ERROR(backend_.Copy(stream, batch.device_items.data(), batch.items.data(),
                                         batch.items.size() * sizeof(OffloadItem)));
  }
  // The upload is enqueued: whatever happens next, `batch` must outlive it.
  const absl::Status enqueued = backend_.Offload(stream, args);
  const absl::Status parked = Park(stream, std::move(batch));
  return enqueued.ok() ? parked : enqueued;
}

absl::Status PageOffloader::Park(Stream& stream, Batch batch) {
  absl::StatusOr<std::unique_ptr<Event>> event = TakeEvent();
  if (event.ok() && stream.Record(**event).ok()) {
    batch.done = *std::move(event);
    in_flight_.push_back(std::move(batch));
    return absl::OkStatus();
  }
  // No event to track the work: wait for it here, then `batch` may go.
  absl::Status st = stream.Synchronize();
  if (ring_ != nullptr) ring_->Release(batch.ticket);
  return st;
}

absl::StatusOr<std::unique_ptr<Event>> PageOffloader::TakeEvent() {
  if (spare_events_.empty()) return backend_.CreateEvent();
  std::unique_ptr<Event> event = std::move(spare_events_.back());
  spare_events_.pop_back();
  return event;
}

void PageOffloader::Reap() {
  // One stream runs the batches in order: the first one still running ends the done prefix.
  // (Querying every batch made each offload cost O(in flight), and a long prefill quadratic.)
  while (!in_flight_.empty() && in_flight_.front().done->Query()) {
    if (ring_ != nullptr) ring_->Release(in_flight_.front().ticket);
    spare_events_.push_back(std::move(in_flight_.front().done));
    in_flight_.pop_front();
  }
}

absl::Status PageOffloader::Drain() {
  absl::Status first;
  for (Batch& batch : in_flight_) {
    absl::Status s = batch.done->Wait();
    if (first.ok() && !s.ok()) first = s;
    if (ring_ != nullptr) ring_->Release(batch.ticket);
    spare_events_.push_back(std::move(batch.done));
  }
  in_flight_.clear();
  return first;
}

}  // namespace kvtier
