// Attention ranker (Conf-KV's ranker, docs/architecture.md#policies; H2O as its cumulative
// baseline): ranks each (layer, KV head)'s pages by the attention mass they received, blended with
// recency, and pins the sequence's newest pages.
//
//   mass(P)  for one observation, the attention page P's tokens got from the KV head's query
//            group: mean over the group's query heads of Σ_t prob.
//   e(P)     EMA e ← β·e + (1−β)·mass (first observation: e = mass), or with `cumulative`
//            (H2O) the running sum e += mass. Pages absent from an observation keep e (their
//            mass that step is unknown, not 0).
//   Score    (1 − w_r)·minmax(e) + w_r·minmax(P), each min-max normalised over the (layer,
//            head)'s tracked pages that are not protected; when max == min the normalised
//            value is 0. So scores lie in [0, 1]: the lowest goes first in drop mode.
//   Pinned   the `protected_pages` newest pages of the sequence: P > newest − protected,
//            newest = (tokens − 1) / page_size over every observation so far.
//
// State is one float per (layer, KV head, tracked page) and bounded by the resident pages:
// OnEvicted forgets a page. Thread-compatible (policy.h).
#ifndef KVTIER_OFFLOAD_POLICY_ATTENTION_RANKER_H_
#define KVTIER_OFFLOAD_POLICY_ATTENTION_RANKER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

struct AttentionRankerOptions {
  float beta = 0.9f;            // EMA decay, in [0, 1] (1: the first mass stays forever)
  bool cumulative = false;      // H2O: sum of the masses instead of the EMA
  float recency_weight = 0.5f;  // w_r in [0, 1]; the attention term weighs 1 − w_r
  int32_t protected_pages = 1;  // newest pages of the sequence, pinned; ≥ 0

  // OK, or INVALID_ARGUMENT naming the first field out of range and its limit.
  absl::Status Validate() const;
};

class AttentionRanker final : public ResidencyPolicy {
 public:
  // REQUIRES: options.Validate().ok(), num_layers ≥ 1, num_kv_heads ≥ 1.
  AttentionRanker(const AttentionRankerOptions& options, int32_t num_layers, int32_t num_kv_heads);
  // As the constructor, but INVALID_ARGUMENT for bad options or counts.
  static absl::StatusOr<std::unique_ptr<AttentionRanker>> Create(
      const AttentionRankerOptions& options, int32_t num_layers, int32_t num_kv_heads);

  std::string_view name() const override { return options_.cumulative ? "h2o" : "attention"; }
  bool needs_attention() const override { return true; }
  // Updates e for every (KV head, slot) holding a page. An observation whose shape does not
  // fit (layer out of range, Hkv ≠ the constructor's, Hq not a multiple of Hkv, S or p < 1,
  // spans shorter than [Hkv][S] and [Hq][S][p]) is ignored and counted (rejected()).
  // REQUIRES: a page appears in at most one slot of a head.
  void OnAttention(const AttentionObservation& obs) override;
  // In [0, 1]; 1 for protected pages, 0 for pages never observed (or forgotten) and for
  // layers and heads out of range. Amortised O(1): min/max are cached per (layer, head) and
  // recomputed (O(tracked pages)) after the head's state or the newest page changed.
  float Score(int32_t layer, int32_t kv_head, int64_t page) override;
  bool Pinned(int32_t layer, int32_t kv_head, int64_t page) override;
  void OnEvicted(int32_t layer, int32_t kv_head, int64_t page) override;

  // e of a tracked page, or nullopt.
  std::optional<float> mass(int32_t layer, int32_t kv_head, int64_t page) const;
  // The newest page seen (−1 before any observation).
  int64_t newest_page() const { return newest_page_; }
  // Tracked pages of one (layer, head).
  size_t tracked_pages(int32_t layer, int32_t kv_head) const;
  int64_t rejected() const { return rejected_; }

 private:
  struct HeadState {
    absl::flat_hash_map<int64_t, float> mass;  // page → e
    // Min-max cache over the non-protected pages, valid while !dirty and newest unchanged.
    bool dirty = true;
    int64_t cached_newest = -1;
    float e_min = 0, e_max = 0;
    int64_t p_min = 0, p_max = 0;
  };

  bool IsProtected(int64_t page) const {
    return newest_page_ >= 0 && page > newest_page_ - options_.protected_pages;
  }
  // Index of (layer, kv_head) in heads_, or −1 when out of range.
  int64_t HeadIndex(int32_t layer, int32_t kv_head) const;
  // nullptr when out of range.
  HeadState* Head(int32_t layer, int32_t kv_head) {
    const int64_t i = HeadIndex(layer, kv_head);
    return i < 0 ? nullptr : &heads_[i];
  }
  const HeadState* Head(int32_t layer, int32_t kv_head) const {
    const int64_t i = HeadIndex(layer, kv_head);
    return i < 0 ? nullptr : &heads_[i];
  }
  // Recomputes the head's min-max cache.
  void Refresh(HeadState& head);

  AttentionRankerOptions options_;
  int32_t num_layers_;
  int32_t num_kv_heads_;
  std::vector<HeadState> heads_;  // [layer][kv_head]
  int64_t newest_page_ = -1;
  int64_t rejected_ = 0;
};

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_ATTENTION_RANKER_H_
