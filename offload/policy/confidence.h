// Confidence budget (Conf-KV, docs/architecture.md#background, docs/architecture.md#policies): the
// engine reports the next-token distribution (its logits or a LogitSummary) after every step; a
// confident model gets a tight page budget, an uncertain one a loose budget, with hysteresis so the
// budget does not flap.
//
//   summary     normalized entropy H/ln V, margin log p(top1) − log p(top2) (nats), and the
//               mass of the top-m tokens (SummarizeLogits).
//   confidence  a weighted mean of 1 − H/ln V, 1 − exp(−margin / margin_scale) and the top
//               mass, in [0, 1] (Confidence).
//   hysteresis  loose → tight after `confident_steps` consecutive steps at confidence ≥
//               enter_tight; tight → loose at once when confidence < exit_tight.
//
// Free functions are pure and thread-safe. ConfidenceBudget is thread-compatible (one
// Retriever's thread drives it), as every policy (policy.h).
#ifndef KVTIER_OFFLOAD_POLICY_CONFIDENCE_H_
#define KVTIER_OFFLOAD_POLICY_CONFIDENCE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

// The margin reported when the top token has no finite runner-up (a one-token vocabulary,
// every other logit −inf or NaN), and the most any margin is reported as (nats). At 30 nats
// the margin term 1 − exp(−margin / margin_scale) is 1 to float precision for any
// margin_scale ≤ 2.
inline constexpr float kMaxLogitMargin = 30.0f;

// Summarises a next-token distribution given by its logits (log-softmax computed stably in
// double precision). Logit conventions: NaN counts as −inf; −inf has probability 0; when
// some logits are +inf they share all the mass equally (the limit of the softmax); when
// every logit is −inf (or NaN) the distribution is taken as uniform (no information).
// top_m is clamped to [1, V]. Out of contract, empty logits give the least confident
// summary {1, 0, 0}. V = 1 gives {0, kMaxLogitMargin, 1}. Cost O(V log top_m).
LogitSummary SummarizeLogits(std::span<const float> logits, int32_t top_m);

// As SummarizeLogits, but INVALID_ARGUMENT for empty logits or top_m < 1.
absl::StatusOr<LogitSummary> SummarizeLogitsChecked(std::span<const float> logits, int32_t top_m);

// Conf-KV's shape: confidence from entropy, margin and top mass, then hysteresis between a
// tight and a loose budget. The defaults are the paper's operating point.
struct ConfidenceOptions {
  int32_t top_m = 5;  // tokens whose probabilities make the top mass, ≥ 1
  // Weights of the three terms, each ≥ 0 and finite, summing to > 0 (normalised by the sum).
  float w_entropy = 1.0f / 3;
  float w_margin = 1.0f / 3;
  float w_top_mass = 1.0f / 3;
  float margin_scale = 2.0f;  // nats; margin term = 1 − exp(−margin / margin_scale), > 0
  // Hysteresis thresholds on the confidence, 0 ≤ exit_tight ≤ enter_tight ≤ 1.
  float enter_tight = 0.7f;
  float exit_tight = 0.5f;
  int32_t confident_steps = 4;  // consecutive steps ≥ enter_tight to go tight, ≥ 1
  // Tight budget = round(tight_fraction · loose), at least 1 page when loose ≥ 1; in (0, 1].
  float tight_fraction = 0.5f;

  // OK, or INVALID_ARGUMENT naming the first field out of range and its limit.
  absl::Status Validate() const;
};

// The confidence of `summary` under `options`' weights and margin scale, in [0, 1]
// (non-finite summary fields are clamped: NaN counts as the least confident value).
// REQUIRES: options.Validate().ok().
float Confidence(const LogitSummary& summary, const ConfidenceOptions& options);

// Per-step budget from the model's confidence: the same budget for every layer and KV head.
// Starts loose.
class ConfidenceBudget final : public BudgetPolicy {
 public:
  // REQUIRES: options.Validate().ok(), loose_pages ≥ 0 (pages per KV head).
  ConfidenceBudget(const ConfidenceOptions& options, int32_t loose_pages);
  // As the constructor, but INVALID_ARGUMENT for bad options or loose_pages < 0.
  static absl::StatusOr<std::unique_ptr<ConfidenceBudget>> Create(const ConfidenceOptions& options,
                                                                  int32_t loose_pages);

  std::string_view name() const override { return "confidence"; }
  // Summarises signals.logits when present, else uses signals.logit_summary; with neither
  // the step changes nothing (the hysteresis counter included).
  void OnSignals(const StepSignals& signals) override;
  // Fills every entry of `out` with min(max_pages, current budget), at least 0.
  void Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) override;

  bool tight() const { return tight_; }
  // Confidence of the latest step with a distribution; 0 before the first.
  float last_confidence() const { return last_confidence_; }
  // Times the state changed (loose → tight or tight → loose).
  int64_t switches() const { return switches_; }
  int32_t loose_pages() const { return loose_pages_; }
  int32_t tight_pages() const { return tight_pages_; }
  // Pages per KV head the next step gets (before the max_pages clamp).
  int32_t current_pages() const { return tight_ ? tight_pages_ : loose_pages_; }

 private:
  // Advances the hysteresis by one step at confidence `c`.
  void Step(float c);

  ConfidenceOptions options_;
  int32_t loose_pages_;
  int32_t tight_pages_;
  bool tight_ = false;
  int32_t confident_run_ = 0;  // consecutive loose steps at ≥ enter_tight
  float last_confidence_ = 0;
  int64_t switches_ = 0;
};

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_CONFIDENCE_H_
