// Epiphany scores (EpiKV, docs/architecture.md#background, docs/architecture.md#policies): tokens
// where the model's hidden state moves a lot in the middle layers (the positive band, ≈ layers 7–13
// of 32) but not in the later ones (the negative band, ≈ 18–25) matter later; their pages are
// pinned resident. No attention matrix is needed.
//
//   x_l(t)  a per-layer, per-token signal: the hidden-state change ‖h_l(t) − h_l(t−1)‖ the
//           engine reports (StepSignals::hidden_delta), or one computed here from the
//           appended keys and values (TokenBlock) when the engine has no hidden states.
//   s(t)    z_A(t) − z_B(t): A(t), B(t) = mean of x_l(t) over the positive / negative band's
//           layers, each through its own causal rolling z-score (RollingZScore). Computed once,
//           when every band layer has reported token t, and frozen.
//   page    aggregate (max or mean) of its scored tokens' s(t), the same for every layer and
//           KV head: Score ignores layer and head. Pinned: the top max_pinned_pages pages by
//           score, of those at ≥ pin_threshold.
//
// Memory: per page {sum, count, max}; per band layer the KV history the signal needs (kLagKv:
// the previous token's K and V; kKeyVariance: the last `window` keys); tokens some band
// layers have reported and others not yet (a prefill: up to the prompt); the scores of the
// last `window` scored tokens. Thread-compatible (policy.h); RollingZScore too.
#ifndef KVTIER_OFFLOAD_POLICY_EPIPHANY_H_
#define KVTIER_OFFLOAD_POLICY_EPIPHANY_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/policy/policy.h"

namespace kvtier::policy {

// Causal rolling z-score over the last `window` values, the newest included:
// z(t) = (x(t) − mean) / std with the population std of those values. Returns 0 while fewer
// than 2 values were pushed and when std < 1e-12. A non-finite x is pushed as the window's
// current mean (0 when empty) and returns 0. O(1) a push: a ring buffer with a sliding
// Welford mean and sum of squares, recomputed exactly every `window` pushes against drift.
class RollingZScore {
 public:
  // REQUIRES: window ≥ 1 (a smaller one counts as 1, which always returns 0).
  explicit RollingZScore(int32_t window);

  double Push(double x);

  int32_t window() const { return static_cast<int32_t>(ring_.size()); }
  // Values in the window now, ≤ window().
  int64_t size() const { return n_; }

 private:
  void Recompute();

  std::vector<double> ring_;
  size_t next_ = 0;  // where the next value goes (the oldest once full)
  int64_t n_ = 0;
  double mean_ = 0;
  double m2_ = 0;  // Σ (x − mean)² over the window
  int32_t since_recompute_ = 0;
};

// The band layers are given for this depth and scaled to other depths (scale_bands).
inline constexpr int32_t kEpiphanyReferenceLayers = 32;

// EpiKV's shape: bands, window and aggregation follow the paper's defaults for 32 layers.
struct EpiphanyOptions {
  enum class Aggregate { kMax, kMean };  // page score from its tokens' scores
  enum class Signal {
    // x_l(t) = StepSignals::hidden_delta[t·L + l] (engine-reported).
    kHiddenDelta,
    // Mean over KV heads of (1/d)·‖k_h(t) − mean of the head's previous `window` keys‖²;
    // 0 for the layer's first token.
    kKeyVariance,
    // Mean over KV heads of ‖k(t)−k(t−1)‖/max(‖k(t−1)‖, ε) + ‖v(t)−v(t−1)‖/max(‖v(t−1)‖, ε),
    // ε = 1e-6; 0 for the layer's first token.
    kLagKv,
  };

  // Bands of layers, inclusive, 0 ≤ first ≤ last (< 32 when scale_bands).
  int32_t positive_first = 7;
  int32_t positive_last = 13;
  int32_t negative_first = 18;
  int32_t negative_last = 25;
  // Bands are for a 32-layer model; for L layers band [f, l] (the depth fraction
  // [f/32, (l+1)/32)) becomes [⌊f·L/32⌋, max(that, ⌈(l+1)·L/32⌉ − 1)]. Off: used as given,
  // and must lie below L.
  bool scale_bands = true;
  int32_t window = 64;  // tokens of the rolling z-scores (and of kKeyVariance's mean), ≥ 2
  Aggregate aggregate = Aggregate::kMax;
  Signal signal = Signal::kHiddenDelta;
  float pin_threshold = 2.0f;    // pages scoring ≥ this may be pinned; finite
  int32_t max_pinned_pages = 8;  // per (layer, KV head); the highest-scoring go first; ≥ 0

  // OK, or INVALID_ARGUMENT naming the first field out of range and its limit.
  absl::Status Validate() const;
};

struct LayerBand {
  int32_t first = 0;
  int32_t last = 0;  // inclusive
  friend bool operator==(const LayerBand&, const LayerBand&) = default;
};
struct EpiphanyBands {
  LayerBand positive;
  LayerBand negative;  // may overlap `positive` on very shallow models
};

// The bands for a model of `num_layers` layers (scaled or not, as options say).
// INVALID_ARGUMENT for invalid options, num_layers < 1, or unscaled bands beyond the model.
absl::StatusOr<EpiphanyBands> ResolveEpiphanyBands(const EpiphanyOptions& options,
                                                   int32_t num_layers);

class EpiphanyScorer final : public ResidencyPolicy {
 public:
  // REQUIRES: ResolveEpiphanyBands(options, num_layers).ok(), num_kv_heads ≥ 1,
  // page_size ≥ 1 (tokens).
  EpiphanyScorer(const EpiphanyOptions& options, int32_t num_layers, int32_t num_kv_heads,
                 int32_t page_size);
  // As the constructor, but INVALID_ARGUMENT when the requirements do not hold.
  static absl::StatusOr<std::unique_ptr<EpiphanyScorer>> Create(const EpiphanyOptions& options,
                                                                int32_t num_layers,
                                                                int32_t num_kv_heads,
                                                                int32_t page_size);

  std::string_view name() const override { return "epiphany"; }
  bool needs_tokens() const override {
    return options_.signal != EpiphanyOptions::Signal::kHiddenDelta;
  }
  // kHiddenDelta: takes hidden_delta. Ignored (and counted, rejected()) unless it holds
  // num_tokens · L values with L = the constructor's num_layers; ignored for KV signals.
  void OnSignals(const StepSignals& signals) override;
  // KV signals: takes the keys (and values for kLagKv) of a band layer; other layers and
  // kHiddenDelta ignore the block. Rejected (counted) when Hkv differs from the
  // constructor's, head_dim < 1 or differs from the layer's earlier blocks, or k (v for
  // kLagKv) is null. Positions a layer already reported are skipped.
  // REQUIRES: every band layer reports every position once, in order, from one first
  // position (layers may interleave or come a prefill block at a time).
  void OnTokens(const TokenBlock& block) override;
  // page_score(page), whatever the layer and head.
  float Score(int32_t layer, int32_t kv_head, int64_t page) override;
  // Whether `page` is among the pinned pages (the same for every layer and head).
  bool Pinned(int32_t layer, int32_t kv_head, int64_t page) override;

  // Score of a token among the last `window` scored ones, or nullopt.
  std::optional<float> token_score(int64_t position) const;
  // Aggregate of the page's scored tokens; 0 (neutral: z-scores centre on 0) for a page
  // with none.
  float page_score(int64_t page) const;
  int64_t scored_tokens() const { return scored_tokens_; }
  // x_l of the latest token `layer` reported (0 before any, and for layers outside the
  // bands): what the signal measured, for tests and metrics.
  double last_signal(int32_t layer) const {
    return layer >= 0 && layer < num_layers_ ? last_signal_[layer] : 0.0;
  }
  const EpiphanyBands& bands() const { return bands_; }
  int64_t rejected() const { return rejected_; }

 private:
  // Sums of x_l(t) over the band layers that reported token t so far.
  struct Partial {
    double sum_positive = 0;
    double sum_negative = 0;
    int32_t n_positive = 0;
    int32_t n_negative = 0;
  };
  struct PageAggregate {
    double sum = 0;
    int64_t count = 0;
    float max = 0;
  };
  // What a band layer's KV signal remembers of earlier tokens.
  struct KvHistory {
    int32_t head_dim = 0;  // 0 until the first block
    // kLagKv: the previous token's K and V, [Hkv][d].
    std::vector<float> prev_k, prev_v;
    // kKeyVariance: ring of the previous `window` keys [window][Hkv][d] and their sum.
    std::vector<float> ring;
    std::vector<double> sum;
    int32_t ring_next = 0;
    int32_t ring_size = 0;
    int32_t since_recompute = 0;
    bool has_prev = false;
  };

  static constexpr int64_t kUnset = -1;

  // Records x_l(position) and whether the layer moves on; ignores repeats and non-band
  // layers.
  void Report(int32_t layer, int64_t position, double x);
  // Scores, in order, every pending token that every band layer has reported.
  void Drain();
  // Folds a token's frozen score into its page.
  void Fold(int64_t position, float score);
  float Aggregate(const PageAggregate& page) const;
  // x_l of one token from its K (and V) rows, [Hkv][d] as floats; updates the history.
  double KeyVarianceSignal(KvHistory& h, const float* k);
  double LagKvSignal(KvHistory& h, const float* k, const float* v);
  void RefreshPinned();

  EpiphanyOptions options_;
  EpiphanyBands bands_;
  int32_t num_layers_;
  int32_t num_kv_heads_;
  int32_t page_size_;
  std::vector<bool> in_positive_, in_negative_;  // [layer]
  std::vector<int32_t> band_layers_;             // every layer of either band
  std::vector<int64_t> next_position_;           // [layer]: next position expected, or kUnset
  std::vector<double> last_signal_;              // [layer]
  std::vector<KvHistory> kv_;                    // [layer], used for band layers only

  // Tokens reported by some band layers but not scored: positions scored_end_ ...
  std::deque<Partial> pending_;
  int64_t scored_end_ = kUnset;  // the next position to score
  RollingZScore z_positive_, z_negative_;
  int64_t scored_tokens_ = 0;

  absl::flat_hash_map<int64_t, PageAggregate> pages_;
  std::vector<float> recent_scores_;                     // ring [window], by position % window
  std::vector<int64_t> recent_positions_;                // the position each entry holds, or kUnset
  absl::flat_hash_map<int64_t, float> above_threshold_;  // page → score, ≥ pin_threshold
  std::vector<int64_t> pinned_;                          // sorted, ≤ max_pinned_pages
  bool pinned_dirty_ = false;
  int64_t rejected_ = 0;
  std::vector<float> k_row_, v_row_;  // scratch: one token's [Hkv][d] as floats
};

}  // namespace kvtier::policy

#endif  // KVTIER_OFFLOAD_POLICY_EPIPHANY_H_
