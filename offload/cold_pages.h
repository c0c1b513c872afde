// ColdPages: the cold tier behind a sequence's host tier, page by page (host_drop = demote;
// docs/architecture.md#policies, docs/service.md#the-cold-tier). When the host tier is full,
// the Retriever demotes its lowest-scoring pages: their bytes go to Put, their host slots are
// freed, and their key summaries stay on the backend, so selection still sees them. A
// selection that names a demoted page recalls it through the host tier: the Retriever reads
// the recall plan on the host (the DMA strategies), takes a host slot (demoting another page
// when it must), Gets the bytes into it, and then issues the plan's copies.
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
  // Stores the HND bytes of host page `page` (its layer, logical page and generation; the
  // slot is the one it leaves) so that Get returns them. OK means the copy is durable by
  // the implementation's standard: only then is the host slot freed. Errors leave the page
  // in the host tier.
  virtual absl::Status Put(const StoredPage& page, std::span<const uint8_t> bytes) = 0;
  // Reads (layer, page) into `out` (host_page_bytes), which is host slot `slot` of the
  // pool: NOT_FOUND when it was never Put, DATA_LOSS when no intact copy is left,
  // UNAVAILABLE / DEADLINE_EXCEEDED when the tier cannot be reached in time.
  virtual absl::Status Get(int32_t layer, int64_t page, int64_t slot, std::span<uint8_t> out) = 0;

  // Several pages at once, in as few round trips as the tier can (`bytes[i]` is page i's).
  // On error some may be stored, none may be relied on. The default calls Put for each.
  virtual absl::Status PutBatch(std::span<const StoredPage> pages,
                                std::span<const std::span<const uint8_t>> bytes) {
    for (size_t i = 0; i < pages.size(); ++i) {
      if (absl::Status st = Put(pages[i], bytes[i]); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  // A page to read: (layer, page) into `out`, host slot `slot`.
  struct Read {
    int32_t layer = 0;
    int64_t page = 0;
    int64_t slot = -1;
    std::span<uint8_t> out;
  };
  // Several pages at once; the first error (each of Get's). The default calls Get for each.
  virtual absl::Status GetBatch(std::span<const Read> reads) {
    for (const Read& r : reads) {
      if (absl::Status st = Get(r.layer, r.page, r.slot, r.out); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_COLD_PAGES_H_
