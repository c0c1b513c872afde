// KV-Compress per-head budgets (docs/architecture.md#background, docs/architecture.md#policies):
// whole pages (blocks) are evicted per KV head, at a variable rate per layer and head, by a metric
// of how much attention they get.
//
// The metric of key token j for KV head h is m(h, j) = Σ_i Σ_{g ∈ group(h)} a(g, i, j)²
// over the queries i with i − j ≥ v: the v = exclude_nearest nearest queries (positions
// j .. j + v − 1) do not count, since every token is attended by its neighbours. A block's
// metric is the sum over its tokens, accumulated over the observation queries (step == −1)
// and, optionally, decode steps. Budgets come from one global ranking of all blocks of all
// layers and heads: the lowest blocks anywhere go first.
//
// Two policy objects share one KvCompressState: KvCompressRanker (a ResidencyPolicy) feeds
// it the attention and ranks eviction by block metric; KvCompressBudget (a BudgetPolicy)
// reads it. Install both (MakeKvCompress): without the ranker the budget stays at its
// default. Thread-compatible: the thread that drives the Retriever calls both.
#ifndef KVTIER_OFFLOAD_POLICY_KV_COMPRESS_H_
#define KVTIER_OFFLOAD_POLICY_KV_COMPRESS_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

// The metric one observation adds to each slot's block, [Hkv][S] (0 for an empty slot):
// Σ over the head's query group and the slot's tokens at positions j < num_tokens with
// query_position − j ≥ exclude_nearest of token_prob². Empty when the observation is
// malformed (spans shorter than its shape, Hq not a multiple of Hkv, non-positive sizes).
std::vector<double> SlotMetrics(const AttentionObservation& obs, int32_t exclude_nearest);

// The blocks to evict so that `keep` of them remain: exactly those with the lowest metric,
// in eviction order (lowest first; equal metrics: the lower, older id first; NaN metrics
// count as lowest). keep ≤ 0 evicts every block; keep ≥ the number of blocks none.
// REQUIRES: block_metric.size() == block_ids.size() (the shorter one bounds otherwise).
std::vector<int64_t> LowestBlocks(std::span<const float> block_metric,
                                  std::span<const int64_t> block_ids, int32_t keep);

// Blocks kept per head, block_metrics being [(layer · Hkv + h)][blocks]: every head first
// keeps min(min_blocks, its blocks); the rest of the total goes to the highest metrics
// over all heads (equal metrics: the lower head index first; NaN counts as lowest). The
// result sums to min(total_blocks, all blocks), or to the floors when they exceed the
// total. O(number of blocks).
std::vector<int32_t> AllocateHeadBudgets(const std::vector<std::vector<float>>& block_metrics,
                                         int64_t total_blocks, int32_t min_blocks);

struct KvCompressOptions {
  int32_t exclude_nearest = 10;  // v: nearest queries that do not count (tokens)
  int64_t total_pages = 0;       // pages over all layers and heads; 0: L · Hkv · default
  int32_t min_pages = 1;         // floor per (layer, head) (pages)
  bool decode_updates = true;    // decode steps (step ≥ 0) update the metrics too

  // INVALID_ARGUMENT naming the field: exclude_nearest < 0, total_pages < 0, min_pages < 0.
  absl::Status Validate() const;
};

// Block metrics per (layer, KV head, page), bounded by the pages seen and not evicted.
class KvCompressState {
 public:
  // REQUIRES: options.Validate().ok(); num_layers, num_q_heads, num_kv_heads, page_size ≥
  // 1; num_q_heads a multiple of num_kv_heads; default_pages ≥ 0.
  KvCompressState(const KvCompressOptions& options, int32_t num_layers, int32_t num_q_heads,
                  int32_t num_kv_heads, int32_t page_size, int32_t default_pages);
  KvCompressState(const KvCompressState&) = delete;
  KvCompressState& operator=(const KvCompressState&) = delete;

  // Adds an observation's metrics to the pages of its slots (a page seen with nothing to
  // add is known with metric 0). Ignores decode steps unless decode_updates, and
  // observations whose shape differs from the state's or whose layer is out of range.
  void Observe(const AttentionObservation& obs);
  // The block metric, or 0 for an unknown page.
  float Metric(int32_t layer, int32_t kv_head, int64_t page) const;
  // Forgets the page of that head (evicted for good).
  void Forget(int32_t layer, int32_t kv_head, int64_t page);

  // Known block metrics, [(layer · Hkv + h)][blocks] (blocks in no particular order).
  std::vector<std::vector<float>> BlockMetrics() const;
  // True once every layer has had an observation.
  bool all_layers_observed() const { return unobserved_layers_ == 0; }
  // Changes whenever a metric is added or forgotten.
  uint64_t version() const { return version_; }

  const KvCompressOptions& options() const { return options_; }
  int32_t num_layers() const { return num_layers_; }
  int32_t num_kv_heads() const { return num_kv_heads_; }
  int32_t default_pages() const { return default_pages_; }

 private:
  const KvCompressOptions options_;
  const int32_t num_layers_, num_q_heads_, num_kv_heads_, page_size_, default_pages_;
  std::vector<absl::flat_hash_map<int64_t, double>> metrics_;  // [(l · Hkv + h)]: page →
  std::vector<bool> layer_observed_;
  int32_t unobserved_layers_;
  uint64_t version_ = 0;
};

// Feeds the state with the attention and ranks eviction by block metric. No pins.
class KvCompressRanker final : public ResidencyPolicy {
 public:
  explicit KvCompressRanker(std::shared_ptr<KvCompressState> state) : state_(std::move(state)) {}

  std::string_view name() const override { return "kv_compress"; }
  bool needs_attention() const override { return true; }
  void OnAttention(const AttentionObservation& obs) override { state_->Observe(obs); }
  float Score(int32_t layer, int32_t kv_head, int64_t page) override {
    return state_->Metric(layer, kv_head, page);
  }
  void OnEvicted(int32_t layer, int32_t kv_head, int64_t page) override {
    state_->Forget(layer, kv_head, page);
  }

 private:
  std::shared_ptr<KvCompressState> state_;
};

// Per-head budgets from AllocateHeadBudgets over every layer's current metrics, under
// total_pages; recomputed (O(known blocks)) only when the metrics changed since the last
// allocation. default_pages per head until every layer has been observed.
class KvCompressBudget final : public BudgetPolicy {
 public:
  explicit KvCompressBudget(std::shared_ptr<KvCompressState> state) : state_(std::move(state)) {}

  std::string_view name() const override { return "kv_compress"; }
  // The ranker feeds the shared state; this object consumes nothing itself.
  bool needs_attention() const override { return false; }
  // out[h] = min(max_pages, budget of (layer, h)). REQUIRES: out.size() == Hkv (entries
  // beyond Hkv, and every entry of a layer out of range, get the default).
  void Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) override;

  // Pages per (layer · Hkv + h) of the last allocation; empty before the first.
  const std::vector<int32_t>& allocation() const { return allocation_; }

 private:
  std::shared_ptr<KvCompressState> state_;
  std::vector<int32_t> allocation_;
  uint64_t allocated_version_ = 0;
};

struct KvCompressPolicies {
  std::unique_ptr<KvCompressBudget> budget;
  std::unique_ptr<KvCompressRanker> ranker;
};

// The budget and ranker over one shared state (see KvCompressState for the REQUIRES).
KvCompressPolicies MakeKvCompress(const KvCompressOptions& options, int32_t num_layers,
                                  int32_t num_q_heads, int32_t num_kv_heads, int32_t page_size,
                                  int32_t default_pages);

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_KV_COMPRESS_H_
