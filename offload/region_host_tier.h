// The host tier of a kvtierd session: its region of the tenant arena (offload/session_region.h)
// with a PagePool over the region's slots. Commit makes each page visible in the region's
// directory, fenced by the writer's epoch, so the daemon (Fetch, Reattach) sees exactly the
// pages whose bytes are complete. One setup and one commit path for both writers: the
// client library's SHM sessions (the engine writes) and the daemon's GRPC sessions.
//
// Thread-compatible: the thread that drives the session's Retriever calls it.
#ifndef KVTIER_OFFLOAD_REGION_HOST_TIER_H_
#define KVTIER_OFFLOAD_REGION_HOST_TIER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "offload/cold_pages.h"
#include "offload/host_tier.h"
#include "offload/page_pool.h"
#include "offload/retriever.h"
#include "offload/session_region.h"

namespace kvtier {

class RegionHostTier final : public HostTier {
 public:
  // A pool over `region`'s slots. `epoch`: the writer's epoch, which fences its commits
  // (FAILED_PRECONDITION once the region moved past it: another holder reattached);
  // nullopt: the owner of the region (the daemon), which commits at the region's current
  // epoch. INTERNAL when the pool's slot stride is not the region's.
  // `cold`: the cold tier behind it (host_drop = demote; null: none; must outlive the tier).
  static absl::StatusOr<std::unique_ptr<RegionHostTier>> Create(SessionRegion region,
                                                                std::optional<uint64_t> epoch,
                                                                ColdPages* cold = nullptr);

  PagePool& pool() override { return *pool_; }
  // Also counts the pages in the region's telemetry block (pages_committed).
  absl::Status Commit(std::span<const StoredPage> pages) override;
  std::optional<TelemetryBlock> telemetry() override { return region_.telemetry(); }
  ColdPages* cold() override { return cold_; }
  // Withdraws the page's directory entry (SessionRegion::Withdraw); FAILED_PRECONDITION,
  // like a commit, once the region moved past the writer's epoch.
  absl::Status Withdraw(int32_t layer, int64_t page) override;
  const SessionRegion& region() const { return region_; }
  // The first refused commit (OK while none was): FAILED_PRECONDITION when another holder
  // reattached.
  const absl::Status& refused() const { return refused_; }

  // Takes over the committed prefix of every layer of the region: entries past it are
  // withdrawn (the engine appends those tokens again) and the prefix's slots claimed and
  // restored into `retriever` (Retriever::Restore). DATA_LOSS for a directory naming a
  // slot that cannot be claimed (twice, or a stale generation).
  absl::Status RestoreInto(Retriever& retriever);

 private:
  RegionHostTier(SessionRegion region, std::optional<uint64_t> epoch,
                 std::unique_ptr<PagePool> pool)
      : region_(region), epoch_(epoch), pool_(std::move(pool)) {}
  SessionRegion region_;
  const std::optional<uint64_t> epoch_;
  std::unique_ptr<PagePool> pool_;
  absl::Status refused_;
  ColdPages* cold_ = nullptr;
};

// The Retriever of a session over `region` on `backend` (its arena registered with the
// backend), with a RegionHostTier fenced by `epoch`; with `restore`, rebuilt from the
// region's committed pages (RegionHostTier::RestoreInto); with `cold`, the cold tier behind
// the host tier (host_drop = demote). The Retriever's and the region's errors.
absl::StatusOr<std::unique_ptr<Retriever>> OpenRegionRetriever(SessionRegion region,
                                                               std::optional<uint64_t> epoch,
                                                               const SequenceOptions& options,
                                                               Backend& backend, bool restore,
                                                               ColdPages* cold = nullptr);

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_REGION_HOST_TIER_H_
