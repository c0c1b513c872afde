// Policies that decide the GPU working set (docs/architecture.md#policies). Plain C++ bookkeeping
// with no device types: the Retriever gathers their inputs (what the engine reports, the attention
// of each step, the appended keys and values) and applies their decisions every step.
//
//   BudgetPolicy     pages per (layer, KV head) for the layer's next step: the size of the
//                    selected region in speculative and sync mode, of the kept region (beyond
//                    sinks and the recent window) in drop mode.
//   ResidencyPolicy  per-(layer, KV head, page) importance: pins pages resident (speculative,
//                    sync and drop) and ranks eviction in drop mode (lowest goes first).
//   HostDropPolicy   what happens when the host tier is full (offload/policy/host_drop.h).
//
// Policy state is per sequence (one Retriever) and bounded by its pages. Policies are
// thread-compatible: the thread that drives the Retriever calls them.
#ifndef KVTIER_OFFLOAD_POLICY_POLICY_H_
#define KVTIER_OFFLOAD_POLICY_POLICY_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "kvtier/dtype.h"
#include "kvtier/options.h"

namespace kvtier::policy {

// The attention of one layer at one step (or one observation query of the prompt), as the
// Retriever hands it to policies: for every KV head's slot, which logical page it held, and
// the softmax probability of each of its tokens for every query head.
struct AttentionObservation {
  int32_t layer = 0;
  int64_t step = 0;               // the layer's decode step; −1 for an observation query
  int64_t query_position = 0;     // position of the query token
  int32_t num_q_heads = 0;        // Hq
  int32_t num_kv_heads = 0;       // Hkv; query head hq belongs to KV head hq / (Hq / Hkv)
  int32_t num_slots = 0;          // S
  int32_t page_size = 0;          // p
  std::span<const int32_t> slot_table;  // [Hkv][S]: logical page, or −1
  std::span<const float> token_prob;    // [Hq][S][p]: 0 for tokens not attended
  int64_t num_tokens = 0;               // tokens of the sequence (the partial page included)
};

// Keys and values of tokens just appended to a layer, on the host (NHD [n][Hkv][d]).
struct TokenBlock {
  int32_t layer = 0;
  int64_t first_position = 0;
  int32_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kF16;
  const void* k = nullptr;
  const void* v = nullptr;
};

class BudgetPolicy {
 public:
  virtual ~BudgetPolicy() = default;
  virtual std::string_view name() const = 0;
  // What the policy consumes; the Retriever gathers only that.
  virtual bool needs_attention() const { return false; }
  virtual void OnSignals(const StepSignals&) {}
  virtual void OnAttention(const AttentionObservation&) {}
  // Pages per KV head of `layer` for its next step: out.size() = Hkv, each in [0, max_pages].
  virtual void Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) = 0;
};

class ResidencyPolicy {
 public:
  virtual ~ResidencyPolicy() = default;
  virtual std::string_view name() const = 0;
  virtual bool needs_attention() const { return false; }
  virtual bool needs_tokens() const { return false; }  // OnTokens gets the K/V on the host
  virtual void OnSignals(const StepSignals&) {}
  virtual void OnAttention(const AttentionObservation&) {}
  virtual void OnTokens(const TokenBlock&) {}
  // Importance of `page` for `kv_head` of `layer`; the higher, the longer it stays. Pages
  // the policy knows nothing about score 0 unless the policy says otherwise.
  virtual float Score(int32_t layer, int32_t kv_head, int64_t page) = 0;
  // Pinned pages stay resident: never evicted in drop mode, always selected (ahead of the
  // query scores) in speculative and sync mode.
  virtual bool Pinned(int32_t /*layer*/, int32_t /*kv_head*/, int64_t /*page*/) { return false; }
  // The page left the working set of that head for good (drop mode): forget it.
  virtual void OnEvicted(int32_t /*layer*/, int32_t /*kv_head*/, int64_t /*page*/) {}
};

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_POLICY_H_
