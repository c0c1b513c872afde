// Host-tier drop policy.
#include "offload/policy/host_drop.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvtier::policy {
namespace {

// True when a goes before b: lower score (NaN lowest of all), then layer, then page.
bool EvictsFirst(const HostCandidate& a, const HostCandidate& b) {
  const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.score != b.score) return a.score < b.score;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.page < b.page;
}

}  // namespace

std::string_view HostDropModeName(HostDropMode mode) {
  switch (mode) {
    case HostDropMode::kRefuse:
      return "refuse";
    case HostDropMode::kEvict:
      return "evict";
    case HostDropMode::kDemote:
      return "demote";
  }
  return "unknown";
}

bool ParseHostDropMode(std::string_view name, HostDropMode* out) {
  for (HostDropMode m : {HostDropMode::kRefuse, HostDropMode::kEvict, HostDropMode::kDemote}) {
    if (name == HostDropModeName(m)) {
      *out = m;
      return true;
    }
  }
  return false;
}

absl::StatusOr<size_t> HostDropPolicy::PickVictim(std::span<const HostCandidate> candidates) {
  if (mode_ == HostDropMode::kRefuse) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        "host tier full; host_drop = refuse (set host_drop = demote to move the lowest-scoring "
        "pages to the cold tier, or evict to drop them, or give the tenant more host memory)");
  }
  size_t best = candidates.size();
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].pinned) continue;
    if (best == candidates.size() || EvictsFirst(candidates[i], candidates[best])) best = i;
  }
  if (best == candidates.size()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        absl::StrCat("host tier full; host_drop = ", std::string(HostDropModeName(mode_)), " but none of the ",
                     candidates.size(), " host pages may leave it (all pinned or in use)"));
  }
  (mode_ == HostDropMode::kDemote ? demoted_ : dropped_).fetch_add(1, std::memory_order_relaxed);
  return best;
}

float HostScore(ResidencyPolicy* r, int32_t layer, int64_t page, int32_t num_kv_heads) {
  if (r == nullptr || num_kv_heads < 1) return static_cast<float>(page);
  float best = r->Score(layer, 0, page);
  for (int32_t h = 1; h < num_kv_heads; ++h) best = std::max(best, r->Score(layer, h, page));
  return best;
}

bool HostPinned(ResidencyPolicy* r, int32_t layer, int64_t page, int32_t num_kv_heads) {
  if (r == nullptr) return false;
  for (int32_t h = 0; h < num_kv_heads; ++h) {
    if (r->Pinned(layer, h, page)) return true;
  }
  return false;
}

}  // namespace kvtier::policy
