// What a full host tier does (docs/architecture.md#policies): refuse the new page, evict an
// existing page permanently, or demote it to the cold tier behind the host tier (where a
// later selection of it promotes it back), chosen by the residency scores. Every refusal,
// drop and demotion is counted: losing KV data is never silent.
//
// Thread-safe: the mode is fixed at construction and the counters are atomic, so tenants
// sharing an arena may call PickVictim concurrently and a stats reader may read the
// counters at any time. Not copyable.
#ifndef KVTIER_OFFLOAD_POLICY_HOST_DROP_H_
#define KVTIER_OFFLOAD_POLICY_HOST_DROP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

enum class HostDropMode : uint8_t {
  kRefuse = 0,  // the write that needs a page fails (RESOURCE_EXHAUSTED)
  kEvict = 1,   // the lowest-scoring unpinned host page is dropped for good
  kDemote = 2,  // the lowest-scoring unpinned host page moves to the cold tier (offload/cold_pages.h)
};

// "refuse" / "evict" / "demote".
std::string_view HostDropModeName(HostDropMode mode);
// Parses a name of HostDropModeName into *out; false (out untouched) for anything else.
bool ParseHostDropMode(std::string_view name, HostDropMode* out);

// A host page that could make room.
struct HostCandidate {
  int32_t layer = 0;
  int64_t page = 0;     // logical page
  float score = 0;      // importance; the lowest goes first (HostScore)
  bool pinned = false;  // never dropped (HostPinned)
};

class HostDropPolicy {
 public:
  explicit HostDropPolicy(HostDropMode mode) : mode_(mode) {}
  HostDropPolicy(const HostDropPolicy&) = delete;
  HostDropPolicy& operator=(const HostDropPolicy&) = delete;

  // The index in `candidates` of the page to drop (kEvict) or demote (kDemote); the caller
  // must do so (it is counted as dropped or demoted). kEvict and kDemote: the unpinned candidate with the lowest score; NaN scores count as
  // lowest (a page whose importance is unknown is the least justified to keep); equal
  // scores: the lower layer, then the lower page. RESOURCE_EXHAUSTED, counted as a
  // refusal, in kRefuse mode and when no candidate is unpinned.
  absl::StatusOr<size_t> PickVictim(std::span<const HostCandidate> candidates);

  HostDropMode mode() const { return mode_; }
  // Writes refused for want of host space, pages dropped; since construction.
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  uint64_t demoted() const { return demoted_.load(std::memory_order_relaxed); }

 private:
  const HostDropMode mode_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> demoted_{0};
};

// A host page's score for HostCandidate: the maximum over the layer's KV heads of
// r->Score(layer, h, page) (a page stays while any head still wants it). With a null
// ranker, or num_kv_heads < 1: the page index itself, so the oldest (lowest) page scores
// lowest and goes first.
float HostScore(ResidencyPolicy* r, int32_t layer, int64_t page, int32_t num_kv_heads);
// Whether any KV head of the layer pins the page; false with a null ranker.
bool HostPinned(ResidencyPolicy* r, int32_t layer, int64_t page, int32_t num_kv_heads);

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_HOST_DROP_H_
