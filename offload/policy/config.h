// Per-session policy configuration: which budget, residency and host-drop policy a
// Retriever runs, and their parameters by name (the strings a session's OpenSession or a
// config file carries). Every parameter, its default (the papers') and its range are listed
// in docs/policies.md; Validate names the parameter and the limit it broke.
//
//   budget     fixed | confidence (Conf-KV) | xkv (per layer) | kv_compress (per head)
//   residency  none | attention (Conf-KV EMA + recency) | h2o (accumulated attention) |
//              epiphany (EpiKV) | kv_compress (squared attention; default with that budget)
//   host_drop  refuse | evict | demote (demote needs a host tier with a cold tier behind it)
//
// Parameters are "<policy>.<name>" = value, e.g. "confidence.enter_tight" = "0.75"; the
// Retriever-level one is "xkv.task_type".
//
// Value types; thread-compatible.
#ifndef KVTIER_OFFLOAD_POLICY_CONFIG_H_
#define KVTIER_OFFLOAD_POLICY_CONFIG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/options.h"
#include "offload/policy/host_drop.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

class LayerBudgetStore;  // xkv.h

// The fixed budget: every head gets the configured selected pages.
class FixedBudget final : public BudgetPolicy {
 public:
  explicit FixedBudget(int32_t pages) : pages_(pages) {}
  std::string_view name() const override { return "fixed"; }
  void Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) override;

 private:
  int32_t pages_;
};

// The shape a policy set is built for.
struct PolicyContext {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t page_size = 0;
  int32_t default_pages = 0;  // the fixed budget: selected pages per layer and KV head
  // XKV allocations recorded per task type and reused (may be null: not kept). Must outlive
  // the policies.
  LayerBudgetStore* xkv_store = nullptr;
};

// The policy objects of one sequence. `budget` is never null (fixed when not configured);
// `residency` is null for "none".
struct Policies {
  std::unique_ptr<BudgetPolicy> budget;
  std::unique_ptr<ResidencyPolicy> residency;
  HostDropMode host_drop = HostDropMode::kRefuse;
};

// INVALID_ARGUMENT naming the unknown policy, the unknown or malformed parameter, or the
// parameter out of range (with the range).
absl::Status ValidatePolicyConfig(const PolicyConfig& c);
absl::StatusOr<Policies> MakePolicies(const PolicyConfig& c, const PolicyContext& ctx);

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_CONFIG_H_
