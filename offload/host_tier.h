// HostTier: where a sequence's full pages live (a PagePool of pinned host memory) and how
// they become visible to others. The Retriever allocates host pages from pool() and, once a
// page's offload has run (its bytes are in the slot), hands it to Commit. One commit path
// for every host tier:
//   PoolHostTier      a bare pool; Commit publishes nothing (tests, benchmarks).
//   OwnedHostTier     a private arena and pool (NewLocalSequence).
//   RegionHostTier    a session's region of a tenant arena: Commit writes the region's
//                     directory, fenced by the writer's epoch (offload/region_host_tier.h);
//                     the client library (SHM sessions) and the daemon (GRPC sessions) both
//                     use it.
//
// Thread-compatible: the thread that drives the sequence calls it.
#ifndef KVTIER_OFFLOAD_HOST_TIER_H_
#define KVTIER_OFFLOAD_HOST_TIER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "offload/telemetry.h"

namespace kvtier {

class ColdPages;
class PagePool;

// A host page whose offload has completed: its bytes are in `slot` of the pool.
struct StoredPage {
  int32_t layer = 0;
  int64_t page = 0;         // logical page
  int64_t slot = -1;        // pool slot
  uint64_t generation = 0;  // the slot's generation (PageHandle::generation)
};

class HostTier {
 public:
  virtual ~HostTier() = default;
  virtual PagePool& pool() = 0;
  // Publishes pages whose bytes are in their slots, in offload order (per layer, ascending
  // logical pages). An error fails the sequence: nothing later is committed.
  virtual absl::Status Commit(std::span<const StoredPage> pages) = 0;
  // Where the sequence publishes its retrieval telemetry (offload/telemetry.h); nullopt:
  // nobody reads it (the default).
  virtual std::optional<TelemetryBlock> telemetry() { return std::nullopt; }
  // The cold tier behind this host tier (offload/cold_pages.h), which host_drop = demote
  // needs; null (the default): none.
  virtual ColdPages* cold() { return nullptr; }
  // Takes back the publication of a committed page whose bytes now live in the cold tier,
  // before its slot is freed and reused (host_drop = demote). A promoted page is committed
  // again, in its new slot, through Commit. An error fails the sequence.
  virtual absl::Status Withdraw(int32_t /*layer*/, int64_t /*page*/) { return absl::OkStatus(); }
};

// A host tier that is only a pool (not owned): nothing to publish.
class PoolHostTier final : public HostTier {
 public:
  explicit PoolHostTier(PagePool& pool) : pool_(pool) {}
  PagePool& pool() override { return pool_; }
  absl::Status Commit(std::span<const StoredPage>) override { return absl::OkStatus(); }

 private:
  PagePool& pool_;
};

// One host page (HND [Hkv][2][p][d], as the host tier holds it) turned back into the token
// rows it came from: K and V, NHD [p][Hkv][d] each, exact copies. What Retriever::Restore
// and the rebuilds of sessions that demote pages append again.
void HostPageToRows(const Geometry& geometry, const void* page, void* k, void* v);

// A private host tier for one sequence of `geometry`: an anonymous arena (hugepages when
// the host has them, locked, registered with `backend`) with a slot for every page of
// max_tokens per layer. RESOURCE_EXHAUSTED when host memory runs out; the arena's errors.
// REQUIRES: `backend` outlives the tier.
absl::StatusOr<std::unique_ptr<HostTier>> NewOwnedHostTier(const Geometry& geometry,
                                                           int32_t max_tokens, Backend& backend);

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_HOST_TIER_H_
