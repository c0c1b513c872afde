// ColdPages: the cold tier behind a sequence's host tier, batched (host_drop = demote;
// docs/architecture.md#policies, docs/service.md#the-cold-tier). When the host tier is full,
// the Retriever demotes its lowest-scoring pages: their bytes go to PutBatch, their host slots
// are freed, and their key summaries stay on the backend, so selection still sees them. A
// selection that names a demoted page recalls it through the host tier: the Retriever reads
// the recall plan on the host (the DMA strategies), takes a host slot (demoting another page
// when it must), reads the bytes into it (GetBatch, every such page of the plan at once), and
// then issues the plan's copies.
//
// A full page never changes, so a page's cold copy stays valid after it was promoted: a page
// demoted a second time is not written again. The implementation removes what it holds when
// it is destroyed or told to (its owner decides: the daemon's sessions keep the pages of a
// session until it is closed).
//
// Thread-compatible: the thread that drives the sequence calls it.
#ifndef KVTIER_OFFLOAD_COLD_PAGES_H_
#define KVTIER_OFFLOAD_COLD_PAGES_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "offload/host_tier.h"

namespace kvtier {

// The fewest host pages (all layers) a sequence with host_drop = demote may run over: every
// layer's sinks, recent window and page being filled, plus one plan's pages twice over (those
// it keeps and those it promotes), so that a promotion always finds pages that may leave.
inline int64_t DemoteFloorPages(const Geometry& g, const SequenceOptions& o) {
  return int64_t{g.num_layers} * (o.sink_pages + o.recent_pages + 1) +
         int64_t{2} * g.num_kv_heads * o.selected_pages;
}

class ColdPages {
 public:
  virtual ~ColdPages() = default;
  // Pages move between the tiers in batches only (one mover, batched put and get:
  // docs/architecture.md#processes).
  //
  // Stores the HND bytes of each host page (its layer, logical page and generation; the slot
  // is the one it leaves; `bytes[i]` is page i's) so that GetBatch returns them, in as few
  // round trips as the tier can. OK means every copy is durable by the implementation's
  // standard: only then are the host slots freed. Errors leave every page in the host tier:
  // some may be stored, none may be relied on.
  virtual absl::Status PutBatch(std::span<const StoredPage> pages,
                                std::span<const std::span<const uint8_t>> bytes) = 0;
  // A page to read: (layer, page) into `out` (host_page_bytes), which is host slot `slot` of
  // the pool.
  struct Read {
    int32_t layer = 0;
    int64_t page = 0;
    int64_t slot = -1;
    std::span<uint8_t> out;
  };
  // Reads every page of `reads` into its `out`. The first error: NOT_FOUND for a page never
  // put, DATA_LOSS when no intact copy is left, UNAVAILABLE / DEADLINE_EXCEEDED when the tier
  // cannot be reached in time.
  virtual absl::Status GetBatch(std::span<const Read> reads) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_COLD_PAGES_H_
