#include "offload/policy/confidence.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier::policy {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The summary when nothing is known: every token as likely as any other.
constexpr LogitSummary kLeastConfident{1.0f, 0.0f, 0.0f};

// NaN logits count as −inf (probability 0).
float CleanLogit(float x) { return std::isnan(x) ? kNegInf : x; }

// The distribution that is uniform over `n` of `v` tokens (1 ≤ n ≤ v): entropy ln n.
LogitSummary UniformOver(int64_t n, int64_t v, int64_t top_m) {
  LogitSummary s;
  s.normalized_entropy =
      v > 1
          ? static_cast<float>(std::log(static_cast<double>(n)) / std::log(static_cast<double>(v)))
          : 0.0f;
  s.margin = n >= 2 ? 0.0f : kMaxLogitMargin;
  s.top_mass = static_cast<float>(static_cast<double>(std::min(top_m, n)) / n);
  return s;
}

// The `k` largest values pushed, as a min-heap (front = smallest kept). O(log k) a push.
class TopK {
 public:
  explicit TopK(size_t k) : k_(k) { heap_.reserve(k); }
  void Push(float x) {
    if (heap_.size() < k_) {
      heap_.push_back(x);
      std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
    } else if (x > heap_.front()) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<float>());
      heap_.back() = x;
      std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
    }
  }
  // The kept values, largest first. Leaves the heap sorted (no more pushes).
  const std::vector<float>& SortedDescending() {
    std::sort(heap_.begin(), heap_.end(), std::greater<float>());
    return heap_;
  }

 private:
  size_t k_;
  std::vector<float> heap_;
};

// Clamps to [lo, hi]; NaN becomes `nan_value`.
float Clamp(float x, float lo, float hi, float nan_value) {
  if (std::isnan(x)) return nan_value;
  return std::clamp(x, lo, hi);
}

absl::Status FieldError(const char* field, const std::string& limit, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat("ConfidenceOptions.", field, " must be ", limit, ", got ", got));
}

}  // namespace

LogitSummary SummarizeLogits(std::span<const float> logits, int32_t top_m) {
  const int64_t v = static_cast<int64_t>(logits.size());
  if (v == 0) return kLeastConfident;
  const int64_t m = std::clamp<int64_t>(top_m, 1, v);
  // Pass 1: the largest logit, and how many are +inf.
  float max_logit = kNegInf;
  int64_t num_pos_inf = 0;
  for (float raw : logits) {
    const float x = CleanLogit(raw);
    max_logit = std::max(max_logit, x);
    num_pos_inf += std::isinf(x) && x > 0;
  }
  if (num_pos_inf > 0) return UniformOver(num_pos_inf, v, m);
  if (max_logit == kNegInf) return UniformOver(v, v, m);

  // Pass 2, relative to the max (every exponent ≤ 0): Z = Σ e_i with e_i = exp(x_i − max),
  // S = Σ e_i (x_i − max) ≤ 0, and the top logits (at least two, for the margin).
  double z = 0;
  double s = 0;
  TopK top(static_cast<size_t>(std::max<int64_t>(m, 2)));
  for (float raw : logits) {
    const float x = CleanLogit(raw);
    if (x == kNegInf) continue;  // probability 0: adds nothing to Z, S or the top mass
    const double d = static_cast<double>(x) - max_logit;
    const double e = std::exp(d);
    z += e;
    s += e * d;
    top.Push(x);
  }
  const std::vector<float>& best = top.SortedDescending();

  LogitSummary out;
  // H = −Σ p_i log p_i with log p_i = d_i − log Z: H = log Z − S / Z (both terms ≥ 0).
  const double entropy = std::log(z) - s / z;
  out.normalized_entropy =
      v > 1 ? static_cast<float>(std::clamp(entropy / std::log(static_cast<double>(v)), 0.0, 1.0))
            : 0.0f;
  // Margin: log p(top1) − log p(top2) = the logits' difference.
  out.margin = kMaxLogitMargin;
  if (best.size() >= 2) {
    const double gap = static_cast<double>(best[0]) - best[1];
    out.margin = static_cast<float>(std::min<double>(gap, kMaxLogitMargin));
  }
  // Top mass: the m largest probabilities (fewer when fewer logits are finite).
  double mass = 0;
  for (size_t i = 0; i < best.size() && static_cast<int64_t>(i) < m; ++i) {
    mass += std::exp(static_cast<double>(best[i]) - max_logit);
  }
  out.top_mass = static_cast<float>(std::clamp(mass / z, 0.0, 1.0));
  return out;
}

absl::StatusOr<LogitSummary> SummarizeLogitsChecked(std::span<const float> logits, int32_t top_m) {
  if (logits.empty()) {
    return absl::InvalidArgumentError("SummarizeLogits: logits are empty (vocabulary of 0)");
  }
  if (top_m < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("SummarizeLogits: top_m must be >= 1, got ", top_m));
  }
  return SummarizeLogits(logits, top_m);
}

absl::Status ConfidenceOptions::Validate() const {
  if (top_m < 1) return FieldError("top_m", ">= 1", top_m);
  const float weights[] = {w_entropy, w_margin, w_top_mass};
  const char* names[] = {"w_entropy", "w_margin", "w_top_mass"};
  for (int i = 0; i < 3; ++i) {
    if (!(weights[i] >= 0) || !std::isfinite(weights[i])) {
      return FieldError(names[i], "finite and >= 0", weights[i]);
    }
  }
  const double sum = static_cast<double>(w_entropy) + w_margin + w_top_mass;
  if (!(sum > 0)) {
    return FieldError("w_entropy + w_margin + w_top_mass", "> 0", sum);
  }
  if (!(margin_scale > 0) || !std::isfinite(margin_scale)) {
    return FieldError("margin_scale", "finite and > 0 (nats)", margin_scale);
  }
  if (!(enter_tight >= 0 && enter_tight <= 1)) {
    return FieldError("enter_tight", "in [0, 1]", enter_tight);
  }
  if (!(exit_tight >= 0 && exit_tight <= enter_tight)) {
    return FieldError("exit_tight", absl::StrCat("in [0, enter_tight = ", enter_tight, "]"),
                      exit_tight);
  }
  if (confident_steps < 1) return FieldError("confident_steps", ">= 1", confident_steps);
  if (!(tight_fraction > 0 && tight_fraction <= 1)) {
    return FieldError("tight_fraction", "in (0, 1]", tight_fraction);
  }
  return absl::OkStatus();
}

float Confidence(const LogitSummary& summary, const ConfidenceOptions& options) {
  // NaN fields count as the least confident value of each term.
  const float hn = Clamp(summary.normalized_entropy, 0.0f, 1.0f, 1.0f);
  const float margin = Clamp(summary.margin, 0.0f, std::numeric_limits<float>::infinity(), 0.0f);
  const float top_mass = Clamp(summary.top_mass, 0.0f, 1.0f, 0.0f);
  const double entropy_term = 1.0 - hn;
  const double margin_term = 1.0 - std::exp(-static_cast<double>(margin) / options.margin_scale);
  const double sum_w =
      static_cast<double>(options.w_entropy) + options.w_margin + options.w_top_mass;
  const double c = (options.w_entropy * entropy_term + options.w_margin * margin_term +
                    options.w_top_mass * static_cast<double>(top_mass)) /
                   sum_w;
  return static_cast<float>(std::clamp(c, 0.0, 1.0));
}

ConfidenceBudget::ConfidenceBudget(const ConfidenceOptions& options, int32_t loose_pages)
    : options_(options), loose_pages_(std::max(loose_pages, 0)) {
  // round(fraction · loose), but never 0 pages while the loose budget has any.
  const int64_t tight = std::llround(static_cast<double>(options_.tight_fraction) * loose_pages_);
  tight_pages_ = loose_pages_ == 0 ? 0 : std::max<int32_t>(1, static_cast<int32_t>(tight));
}

absl::StatusOr<std::unique_ptr<ConfidenceBudget>> ConfidenceBudget::Create(
    const ConfidenceOptions& options, int32_t loose_pages) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (loose_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ConfidenceBudget: loose_pages must be >= 0, got ", loose_pages));
  }
  return std::make_unique<ConfidenceBudget>(options, loose_pages);
}

void ConfidenceBudget::OnSignals(const StepSignals& signals) {
  LogitSummary summary;
  if (!signals.logits.empty()) {
    summary = SummarizeLogits(signals.logits, options_.top_m);
  } else if (signals.logit_summary.has_value()) {
    summary = *signals.logit_summary;
  } else {
    return;  // no distribution this step
  }
  Step(Confidence(summary, options_));
}

void ConfidenceBudget::Step(float c) {
  last_confidence_ = c;
  if (tight_) {
    // Tight → loose at the first unconfident step; in between the thresholds: stay.
    if (c < options_.exit_tight) {
      tight_ = false;
      ++switches_;
    }
    return;
  }
  // Loose → tight only after a run of confident steps; any other step breaks the run.
  confident_run_ = c >= options_.enter_tight ? confident_run_ + 1 : 0;
  if (confident_run_ >= options_.confident_steps) {
    tight_ = true;
    confident_run_ = 0;
    ++switches_;
  }
}

void ConfidenceBudget::Budget(int32_t /*layer*/, int32_t max_pages, std::span<int32_t> out) {
  const int32_t pages = std::max(0, std::min(max_pages, current_pages()));
  std::fill(out.begin(), out.end(), pages);
}

}  // namespace kvtier::policy
