// Offload of full pages from the engine's NHD KV buffers into the host tier
// (docs/architecture.md#the-decode-step step 1): host pages are allocated from a PagePool, the NHD
// → HND transpose and the key summaries run as Backend::Offload, and the pages enter the sequence's
// PageTable.
//
// Planning is a pure function (PlanOffload); PageOffloader executes: it validates the whole
// request first, allocates every page before it touches the table, and inserts the pages
// only once the backend has accepted the work, so a failure leaves the table and the pool
// as they were. Op arguments live in backend memory: the item list is uploaded with
// Backend::Allocate + Copy, and kept alive until an event recorded after the op has fired.
//
// Thread-compatible: one PageOffloader per stream, used by one thread at a time. The stream
// runs its work in order, so item lists are reclaimed in the order they were uploaded.
#ifndef KVTIER_OFFLOAD_PAGE_OFFLOADER_H_
#define KVTIER_OFFLOAD_PAGE_OFFLOADER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kvtier/geometry.h"
#include "offload/page_pool.h"
#include "offload/staging_ring.h"
#include "offload/page_table.h"

namespace kvtier {

// Item i = {src_slots[i], host_pages[i], summary_pages[i]}. INVALID_ARGUMENT when the three
// lengths differ or an index is negative.
absl::StatusOr<std::vector<OffloadItem>> PlanOffload(std::span<const int64_t> src_slots,
                                                     std::span<const int64_t> host_pages,
                                                     std::span<const int64_t> summary_pages);

// One offload: which logical pages of one (sequence, layer), where they are now, and where
// their summaries go. Buffers are backend memory (or host memory registered with it) and
// must stay valid until the work enqueued on the stream has run.
struct OffloadRequest {
  const void* k_src = nullptr;  // NHD [num_src_slots][p][Hkv][d]
  const void* v_src = nullptr;
  int64_t num_src_slots = 0;
  void* summaries = nullptr;  // [num_summary_pages][Hkv][2][d]; page index = logical page
  int64_t num_summary_pages = 0;
  SummaryMode summary_mode = SummaryMode::kMinMax;
  uint8_t* codes = nullptr;  // kKeyCodes: [num_summary_pages] KeyCodeLayout pages
  std::span<const int64_t> logical_pages;  // distinct, each in [0, num_summary_pages)
  std::span<const int64_t> src_slots;      // NHD slot of each, in [0, num_src_slots)
};

class PageOffloader {
 public:
  // INVALID_ARGUMENT unless pool.slot_stride() == geometry.host_page_bytes() (the ops index
  // host page i at base + i · host_page_bytes). REQUIRES: `geometry` is validated; `backend`
  // and `pool` outlive the offloader, and the pool's memory is registered with `backend`.
  // `ring`: where item lists are staged for the op to read in place, so an offload on the
  // decode path allocates nothing (null, or a list too large for it: a device buffer, a
  // counted allocation); it must outlive the offloader.
  static absl::StatusOr<std::unique_ptr<PageOffloader>> Create(const Geometry& geometry,
                                                               Backend& backend, PagePool& pool,
                                                               StagingRing* ring = nullptr);
  PageOffloader(const PageOffloader&) = delete;
  PageOffloader& operator=(const PageOffloader&) = delete;
  // Waits for the uploads still in flight (Drain).
  ~PageOffloader();

  // Allocates a host page per logical page, enqueues their offload on `stream`, and inserts
  // them into `table`. The pages' contents are valid once the work enqueued on `stream` so
  // far has run (a Recall on the same stream, or after an event recorded on it, sees them).
  // All or nothing: on error no page was inserted and no slot stays allocated.
  //   INVALID_ARGUMENT: lengths differ, an index out of range or repeated, a null buffer,
  //     or `table` belongs to another pool;
  //   FAILED_PRECONDITION: a logical page is already in `table`;
  //   RESOURCE_EXHAUSTED: the pool (or backend memory for the item list) ran out;
  //   otherwise the backend's error.
  absl::Status Offload(Stream& stream, PageTable& table, const OffloadRequest& request);

  // As Offload, but into `pages` (pages[i] for request.logical_pages[i]) instead of newly
  // allocated ones: for pages whose bytes are already in their slots, to recompute the
  // summaries (Retriever::Restore); the op rewrites the same bytes. Also INVALID_ARGUMENT
  // when the counts differ or a handle is empty or of another pool. On error the handles
  // are released.
  absl::Status OffloadInto(Stream& stream, PageTable& table, const OffloadRequest& request,
                           std::vector<PageHandle> pages);

  // Blocks until every upload enqueued so far has run; returns the first error they hit.
  absl::Status Drain();
  // Offloads whose item lists are still held (not yet known to have run).
  size_t in_flight() const { return in_flight_.size(); }

 private:
  // An uploaded item list, kept until `done` fires.
  struct Batch {
    std::vector<OffloadItem> items;  // host copy: the upload's source
    DeviceBuffer device_items;       // the op's argument, or
    const OffloadItem* staged = nullptr;  // the list in a block of the ring
    uint64_t ticket = 0;
    std::unique_ptr<Event> done;
  };

  PageOffloader(const Geometry& geometry, Backend& backend, PagePool& pool, StagingRing* ring)
      : geometry_(geometry), backend_(backend), pool_(pool), ring_(ring) {}

  absl::Status Validate(const PageTable& table, const OffloadRequest& request) const;
  absl::StatusOr<std::vector<PageHandle>> AllocatePages(size_t count);
  // Enqueues the offload of a validated request into `pages` and inserts them into `table`.
  absl::Status OffloadPages(Stream& stream, PageTable& table, const OffloadRequest& request,
                            std::vector<PageHandle> pages);
  OffloadArgs MakeArgs(const OffloadRequest& request, const Batch& batch) const;
  // Enqueues the upload and the op; parks `batch` whenever the upload was enqueued.
  absl::Status Enqueue(Stream& stream, const OffloadRequest& request, Batch batch);
  absl::Status Park(Stream& stream, Batch batch);
  absl::StatusOr<std::unique_ptr<Event>> TakeEvent();
  void Reap();

  const Geometry geometry_;
  Backend& backend_;
  PagePool& pool_;
  StagingRing* const ring_;
  std::deque<Batch> in_flight_;  // in upload order
  std::vector<std::unique_ptr<Event>> spare_events_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_PAGE_OFFLOADER_H_
