// XKV per-layer budgets (docs/architecture.md#background, docs/architecture.md#policies): every
// layer gets its own page budget, sized by how much of its attention importance the budget retains.
//
// The importance of a prompt token in layer l is the softmax probability it receives from
// the observation queries (the last `window` prompt queries, all query heads), smoothed by
// average pooling along tokens; a page's importance is the sum over its tokens. Layer l
// retains r_l(b) = (sum of its b largest page importances) / (its total) with a budget of b
// pages. Budgets maximise Σ_l r_l(b_l) under a total (or reach a target mean ratio with
// the smallest total), and may be recorded per task type and reused without observing.
//
// The free functions are pure. LayerBudgetStore and XkvBudget are thread-compatible:
// const methods may run concurrently, anything else needs the caller's serialisation (the
// thread that drives the Retriever calls the policy).
#ifndef KVTIER_OFFLOAD_POLICY_XKV_H_
#define KVTIER_OFFLOAD_POLICY_XKV_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

// 1-D average pooling along tokens: out[i] = mean of importance[j] for |j − i| ≤ kernel / 2
// and 0 ≤ j < n. The window is clipped at the edges: the mean is over the in-range
// neighbours only (no zero padding), so a constant series stays constant. Same length as
// the input. A kernel < 1 is treated as 1 (a copy); an even kernel as kernel − 1.
std::vector<float> PoolImportance(std::span<const float> importance, int32_t kernel = 7);

// r(b) = (sum of the b largest page importances) / (sum of all), in [0, 1]. A layer whose
// total is 0 retains everything (1); b ≤ 0 retains 0 of a positive total. Values that are
// not > 0 (negative, NaN) count as 0.
double RetentionRatio(std::span<const float> page_importance, int32_t b);

// Pages per layer maximising Σ_l r_l(b_l) subject to Σ_l b_l ≤ total_pages and
// floor_l ≤ b_l ≤ cap_l, where cap_l = min(max_pages, pages of layer l) (max_pages < 0: no
// cap) and floor_l = min(min_pages, cap_l). page_importance is [L][pages], values ≥ 0.
//
// Every layer first gets its floor; the rest goes one page at a time to the layer whose
// next page has the largest normalised importance (importance / total of its layer), i.e.
// a global top-N over normalised importances. Each r_l is concave in b (its increments are
// the layer's importances in decreasing order), so this greedy choice is optimal for the
// sum of ratios. Ties go to the lower layer. Pages are handed out while any layer is below
// its cap, even when they add nothing (a layer with total 0), so the result sums to
// min(total_pages, Σ cap_l) — or to Σ floor_l when that exceeds total_pages: the floors
// always hold.
std::vector<int32_t> AllocateGreedy(const std::vector<std::vector<float>>& page_importance,
                                    int64_t total_pages, int32_t min_pages, int32_t max_pages);

// The greedy allocation (as AllocateGreedy) for the smallest total whose mean ratio
// (Σ_l r_l(b_l) / L) reaches target_average_ratio (within 1e-9). Greedy allocations for
// growing totals are prefixes of one order, so this walks that order once; since greedy is
// optimal, no allocation with a smaller total reaches the target. An unreachable target
// gives every layer its cap.
std::vector<int32_t> AllocateForTargetRatio(const std::vector<std::vector<float>>& page_importance,
                                            double target_average_ratio, int32_t min_pages,
                                            int32_t max_pages);

// Per-layer allocations recorded per task type ("summarisation", "code", ...) so a task
// profiled once reuses its budgets without observing. Persisted as text, one line per
// task: `task<TAB>b0 b1 b2 ...` (pages per layer, decimal). Copyable value.
class LayerBudgetStore {
 public:
  // Records (replacing) the allocation of `task`. INVALID_ARGUMENT for an empty task name,
  // one with a tab, newline or carriage return, an empty allocation or a negative budget.
  absl::Status Record(const std::string& task, std::vector<int32_t> per_layer);
  // The allocation recorded for `task`, if any.
  std::optional<std::vector<int32_t>> Lookup(const std::string& task) const;
  size_t size() const { return budgets_.size(); }

  // Writes every task (sorted by name) to `path` through a temporary file in the same
  // directory and a rename, so readers never see a partial file. NOT_FOUND / PERMISSION_
  // DENIED / INTERNAL (with the OS error) when it cannot be written.
  absl::Status Save(const std::string& path) const;
  // Reads a file written by Save. NOT_FOUND for a missing file; DATA_LOSS naming the line
  // for a malformed one (no tab, bad name, a value that is not a non-negative int32, no
  // values, a task twice). Blank lines are skipped.
  static absl::StatusOr<LayerBudgetStore> Load(const std::string& path);

 private:
  std::map<std::string, std::vector<int32_t>> budgets_;
};

struct XkvOptions {
  int32_t window = 8;       // observation queries used per layer (the last ones)
  int32_t pooling = 7;      // pooling kernel (tokens, odd)
  int64_t total_pages = 0;  // pages over all layers; 0: num_layers × default_pages
  double target_ratio = 0;  // > 0: smallest total reaching this mean ratio (in (0, 1])
  int32_t min_pages = 1;    // floor per layer (pages)
  std::string task_type;    // non-empty: reuse / record allocations under this name

  // INVALID_ARGUMENT naming the field: window < 1, pooling not odd and ≥ 1, total_pages < 0,
  // target_ratio not in [0, 1], min_pages < 0, task_type with a tab or newline.
  absl::Status Validate() const;
};

// BudgetPolicy with per-layer budgets (every KV head of a layer gets the layer's budget).
// Observes the prompt's observation queries (AttentionObservation with step == −1; decode
// steps are ignored) until every layer has at least one, then allocates on the next
// Budget() call and freezes. Before that, Budget() gives default_pages.
//
// Memory: until the allocation, at most `window` per-token series (floats over the
// observed tokens) per layer; freed once allocated.
class XkvBudget final : public BudgetPolicy {
 public:
  // REQUIRES: options.Validate().ok(), num_layers ≥ 1, num_kv_heads ≥ 1,
  // default_pages ≥ 0. `store` may be null; otherwise it must outlive this object. When
  // the store holds an allocation of num_layers layers for options.task_type (at
  // construction or at the first Budget() call), it is used without observing; a
  // successful allocation is recorded there under task_type (when non-empty).
  XkvBudget(XkvOptions options, int32_t num_layers, int32_t num_kv_heads, int32_t default_pages,
            LayerBudgetStore* store);

  std::string_view name() const override { return "xkv"; }
  // True unless the allocation came from the store at construction (nothing to observe).
  bool needs_attention() const override { return needs_attention_; }
  // Accumulates an observation query (step == −1) of a layer not yet allocated; keeps the
  // last `window` per layer. Malformed observations (spans shorter than the shape says,
  // Hkv other than num_kv_heads, Hq not a multiple of Hkv, layer out of range, a page size
  // other than the first observation's) are ignored.
  void OnAttention(const AttentionObservation& obs) override;
  // out[h] = min(max_pages, b_layer) for every head (default_pages before the allocation);
  // a layer out of range gets the default. Allocates first when every layer is observed.
  void Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) override;

  // Pages per layer; empty until allocated.
  const std::vector<int32_t>& allocation() const { return allocation_; }
  bool allocated() const { return !allocation_.empty(); }
  // Page importances per layer of the observations so far ([L][pages]): what Budget()
  // allocates from.
  std::vector<std::vector<float>> PageImportance() const;

 private:
  bool AdoptFromStore();
  void Allocate();

  const XkvOptions options_;
  const int32_t num_layers_;
  const int32_t num_kv_heads_;
  const int32_t default_pages_;
  LayerBudgetStore* const store_;
  bool needs_attention_ = true;
  int32_t page_size_ = 0;  // tokens per page, from the observations
  // Per layer: the per-position importance of each kept observation (oldest first).
  std::vector<std::deque<std::vector<float>>> observations_;
  std::vector<int32_t> allocation_;
};

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_XKV_H_
