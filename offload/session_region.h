// SessionRegion: the part of a tenant's shared-memory arena that holds one session's host
// tier, and the commit protocol that makes its pages visible (docs/architecture.md#processes,
// docs/architecture.md#errors-and-integrity; docs/service.md). The daemon carves the region out of
// the arena and formats it at OpenSession; whoever writes the session's pages (the engine's
// libkvtier for SHM sessions, the daemon's own Retriever for GRPC sessions) runs a PagePool over
// slots() and, once a page's bytes are in its slot, commits it: the directory entry of (layer,
// page) gets the slot and then, with release ordering, the page's generation stamp. Readers (Fetch,
// Reattach) acquire the stamp first, so a page is visible only when its bytes are complete;
// a writer that dies mid-page leaves that page uncommitted, never half visible.
//
// Layout, all offsets from the region's first byte (kRegionAlignment-aligned in the arena):
//   [0, 2048)          RegionHeader: magic, layout version, geometry, counts, offsets, epoch
//   [2048, 4096)       the retrieval telemetry block (offload/telemetry.h), its writer's counters
//   [dir_offset, ...)  DirEntry   [num_layers][max_pages_per_layer]
//   [slots_offset, …)  host pages [num_slots], slot_stride bytes apart (HND, layout.h)
//
// The memory is shared with a process the daemon does not trust: Open() checks the header
// against what the daemon recorded, and every slot index read from the directory is range
// checked, so a corrupt region yields errors, never out-of-bounds access.
//
// Thread-safe for one writer and any number of readers (in any process) per region.
#ifndef KVTIER_OFFLOAD_SESSION_REGION_H_
#define KVTIER_OFFLOAD_SESSION_REGION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/geometry.h"
#include "offload/telemetry.h"

namespace kvtier {

inline constexpr uint32_t kRegionLayoutVersion = 2;  // 2: the telemetry block
inline constexpr uint64_t kRegionMagic = 0x314e4752'5654564bull;  // "KVTVRGN1"
inline constexpr size_t kRegionAlignment = size_t{64} << 10;      // 64 KiB

// Where everything lies in a region of a given shape. Pure function of its inputs.
struct RegionLayout {
  uint64_t dir_offset = 0;
  uint64_t slots_offset = 0;
  uint64_t slot_stride = 0;  // host_page_bytes rounded up to PagePool::kSlotAlignment
  uint64_t total_bytes = 0;  // rounded up to kRegionAlignment
  int32_t max_pages_per_layer = 0;
  int64_t num_slots = 0;
};
// INVALID_ARGUMENT for an invalid geometry, max_pages_per_layer < 1 or num_slots < 1, or a
// total beyond HostArena::kMaxBytes.
absl::StatusOr<RegionLayout> ComputeRegionLayout(const Geometry& g, int32_t max_pages_per_layer,
                                                 int64_t num_slots);

// A committed page as a reader sees it.
struct CommittedPage {
  int64_t slot = -1;
  uint64_t generation = 0;  // the commit stamp, >= 1
  uint64_t epoch = 0;       // the writer's epoch when it committed
};

class SessionRegion {
 public:
  // Formats [base, base + layout.total_bytes) for a new session: header, an empty
  // directory. Epoch starts at 1. INVALID_ARGUMENT for what ComputeRegionLayout refuses,
  // a null or misaligned base, or bytes < total_bytes. REQUIRES: base is kRegionAlignment-aligned
  // memory of at least layout.total_bytes, not in use by anyone else.
  static absl::StatusOr<SessionRegion> Format(void* base, size_t bytes, const Geometry& g,
                                              int32_t max_pages_per_layer, int64_t num_slots);
  // Opens a formatted region, checking magic, version, geometry (must equal `expected`) and
  // that every offset is the one ComputeRegionLayout gives for the header's counts and fits
  // `bytes`. FAILED_PRECONDITION naming the mismatched field; INVALID_ARGUMENT for a null or
  // misaligned base. The counts (max_pages_per_layer, num_slots) are the header's: a caller
  // with its own record of them compares it with layout().
  // Reads the header once: later changes to it by a peer are never looked at.
  static absl::StatusOr<SessionRegion> Open(void* base, size_t bytes, const Geometry& expected);

  const RegionLayout& layout() const { return layout_; }
  const Geometry& geometry() const { return geometry_; }
  void* slots() const;  // first host page slot (PagePool::Create base)
  int64_t num_slots() const { return layout_.num_slots; }
  size_t slot_stride() const { return layout_.slot_stride; }
  const void* SlotData(int64_t slot) const;  // REQUIRES: 0 <= slot < num_slots()
  // The retrieval telemetry block: the writer publishes into it, the daemon reads it. Its
  // words are only ever counts (offload/telemetry.h says how a reader treats them).
  TelemetryBlock telemetry() const;

  // Writer: makes (layer, page) visible in `slot` with stamp `generation` (>= 1), fenced by
  // `epoch`: FAILED_PRECONDITION when the region's epoch has moved past it (another holder
  // reattached). INVALID_ARGUMENT / OUT_OF_RANGE for indices beyond the layout.
  // REQUIRES: the page's bytes are in the slot (release ordering publishes them).
  absl::Status Commit(int32_t layer, int64_t page, int64_t slot, uint64_t generation,
                      uint64_t epoch);
  // Writer: withdraws every entry of `layer` at or after `page` (a reattached writer drops
  // what it will rewrite). OUT_OF_RANGE for bad indices.
  absl::Status Uncommit(int32_t layer, int64_t page);
  // Writer: withdraws the entry of (layer, page) alone (its page moved to the cold tier and
  // its slot is about to be reused). OUT_OF_RANGE for bad indices.
  absl::Status Withdraw(int32_t layer, int64_t page);
  // Reader: the committed entry of (layer, page); NOT_FOUND when not committed;
  // DATA_LOSS when the entry names a slot outside the region (corrupt or hostile writer);
  // OUT_OF_RANGE for bad indices; ABORTED when a writer kept re-committing the entry
  // while it was read (16 attempts).
  absl::StatusOr<CommittedPage> Lookup(int32_t layer, int64_t page) const;
  // Reader: pages 0..n-1 of `layer` are all committed, page n is not.
  int64_t CommittedPrefix(int32_t layer) const;
  // Reader: committed pages of all layers.
  int64_t CommittedPages() const;

  uint64_t epoch() const;
  // Takes the region over: the epoch becomes max(epoch, at_least) + 1, returned, so it never
  // goes back below a value its owner recorded even when a writer of the shared header
  // lowered it. Commits fenced with older epochs fail. FAILED_PRECONDITION instead of
  // wrapping to 0 when the epoch is at its largest value (only a hostile writer gets there).
  absl::StatusOr<uint64_t> BumpEpoch(uint64_t at_least = 0);

 private:
  SessionRegion(char* base, const RegionLayout& layout, const Geometry& g)
      : base_(base), layout_(layout), geometry_(g) {}
  char* base_ = nullptr;
  RegionLayout layout_;
  Geometry geometry_;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_SESSION_REGION_H_
