#include "offload/region_host_tier.h"

#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<RegionHostTier>> RegionHostTier::Create(
    SessionRegion region, std::optional<uint64_t> epoch, ColdPages* cold) {
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<PagePool> pool,
      PagePool::Create(region.slots(), region.geometry().host_page_bytes(), region.num_slots()));
  if (pool->slot_stride() != region.slot_stride()) {
    return absl::InternalError(absl::StrFormat("page pool stride %d != region slot stride %d",
                                               pool->slot_stride(), region.slot_stride()));
  }
  std::unique_ptr<RegionHostTier> tier(new RegionHostTier(region, epoch, std::move(pool)));
  tier->cold_ = cold;
  return tier;
}

absl::Status RegionHostTier::Commit(std::span<const StoredPage> pages) {
  uint64_t committed = 0;
  for (const StoredPage& p : pages) {
    const uint64_t epoch = epoch_.has_value() ? *epoch_ : region_.epoch();
    absl::Status st = region_.Commit(p.layer, p.page, p.slot, p.generation, epoch);
    if (!st.ok()) {
      region_.telemetry().AddCommitted(committed);
      refused_ = absl::Status(
          st.code(), absl::StrFormat("commit of layer %d page %d (epoch %d) refused: %s", p.layer,
                                     p.page, epoch, st.message()));
      return refused_;
    }
    ++committed;
  }
  region_.telemetry().AddCommitted(committed);
  return absl::OkStatus();
}

absl::Status RegionHostTier::RestoreInto(Retriever& retriever) {
  for (int32_t layer = 0; layer < region_.geometry().num_layers; ++layer) {
    const int64_t n = region_.CommittedPrefix(layer);
    // Entries past the prefix are stale: the engine appends those tokens again.
    if (n < region_.layout().max_pages_per_layer) {
      KVTIER_RETURN_IF_ERROR(region_.Uncommit(layer, n));
    }
    if (n == 0) continue;
    std::vector<PageHandle> handles;
    handles.reserve(static_cast<size_t>(n));
    for (int64_t page = 0; page < n; ++page) {
      KVTIER_ASSIGN_OR_RETURN(const CommittedPage c, region_.Lookup(layer, page));
      absl::StatusOr<PageHandle> h = pool_->Claim(c.slot, c.generation);
      if (!h.ok()) {
        return absl::DataLossError(
            absl::StrFormat("layer %d page %d: committed slot %d cannot be claimed: %s", layer,
                            page, c.slot, h.status().message()));
      }
      handles.push_back(*std::move(h));
    }
    KVTIER_RETURN_IF_ERROR(retriever.Restore(layer, std::move(handles)));
  }
  return absl::OkStatus();
}

absl::Status RegionHostTier::Withdraw(int32_t layer, int64_t page) {
  if (epoch_.has_value() && region_.epoch() != *epoch_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "withdrawing layer %d page %d: the region is at epoch %d, this writer at %d (another "
        "holder reattached)",
        layer, page, region_.epoch(), *epoch_));
  }
  return region_.Withdraw(layer, page);
}

absl::StatusOr<std::unique_ptr<Retriever>> OpenRegionRetriever(SessionRegion region,
                                                               std::optional<uint64_t> epoch,
                                                               const SequenceOptions& options,
                                                               Backend& backend, bool restore,
                                                               ColdPages* cold) {
  const Geometry geometry = region.geometry();
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<RegionHostTier> tier,
                          RegionHostTier::Create(region, epoch, cold));
  RegionHostTier* host = tier.get();
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Retriever> retriever,
                          Retriever::Create(geometry, options, backend, std::move(tier)));
  if (restore) KVTIER_RETURN_IF_ERROR(host->RestoreInto(*retriever));
  return retriever;
}

}  // namespace kvtier
