#include "offload/policy/epiphany.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvtier/dtype.h"

namespace kvtier::policy {
namespace {

constexpr double kMinStd = 1e-12;     // below it, z = 0
constexpr double kLagEpsilon = 1e-6;  // ε of kLagKv's relative changes
// Tokens that may wait for slower band layers (a prefill's prompt). A report further ahead
// of the oldest unscored token is out of contract and rejected rather than buffered.
constexpr int64_t kMaxPendingTokens = int64_t{1} << 22;

absl::Status FieldError(const std::string& field, const std::string& limit, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat("EpiphanyOptions.", field, " must be ", limit, ", got ", got));
}

// Converts `n` elements of `dtype` starting `offset` elements into `base` to floats.
void LoadFloats(const void* base, DType dtype, int64_t offset, int64_t n, float* out) {
  switch (dtype) {
    case DType::kF16: {
      const Half* in = static_cast<const Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
      return;
    }
    case DType::kBF16: {
      const BFloat16* in = static_cast<const BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(in[i]);
      return;
    }
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(base) + offset, n * sizeof(float));
      return;
  }
}

// Band [f, l] of the reference depth as the same depth fraction of `num_layers` layers.
LayerBand ScaleBand(int32_t first, int32_t last, int32_t num_layers) {
  const int64_t f = int64_t{first} * num_layers / kEpiphanyReferenceLayers;  // ⌊f·L/32⌋
  const int64_t end = ((int64_t{last} + 1) * num_layers + kEpiphanyReferenceLayers - 1) /
                      kEpiphanyReferenceLayers;  // ⌈(l+1)·L/32⌉
  const int64_t l = std::min<int64_t>(std::max(f, end - 1), num_layers - 1);
  return LayerBand{static_cast<int32_t>(f), static_cast<int32_t>(l)};
}

absl::Status CheckBand(const char* name, int32_t first, int32_t last, int32_t limit) {
  if (first < 0) return FieldError(absl::StrCat(name, "_first"), ">= 0", first);
  if (last < first) {
    return FieldError(absl::StrCat(name, "_last"), absl::StrCat(">= ", name, "_first = ", first),
                      last);
  }
  if (last >= limit) {
    return FieldError(absl::StrCat(name, "_last"), absl::StrCat("< ", limit, " (layers)"), last);
  }
  return absl::OkStatus();
}

}  // namespace

// ---- RollingZScore ------------------------------------------------------------------------

RollingZScore::RollingZScore(int32_t window) : ring_(static_cast<size_t>(std::max(window, 1))) {}

double RollingZScore::Push(double x) {
  const bool finite = std::isfinite(x);
  if (!finite) x = mean_;  // 0 while empty
  const int64_t cap = static_cast<int64_t>(ring_.size());
  if (n_ < cap) {
    // Growing: Welford's update.
    ++n_;
    const double delta = x - mean_;
    mean_ += delta / static_cast<double>(n_);
    m2_ += delta * (x - mean_);
  } else {
    // Full: x replaces the oldest value; sliding Welford update of mean and M2.
    const double old = ring_[next_];
    const double new_mean = mean_ + (x - old) / static_cast<double>(n_);
    m2_ += (x - old) * (x - new_mean + old - mean_);
    mean_ = new_mean;
  }
  ring_[next_] = x;
  next_ = (next_ + 1) % ring_.size();
  if (++since_recompute_ >= cap) Recompute();
  m2_ = std::max(m2_, 0.0);
  if (!finite || n_ < 2) return 0;
  const double sd = std::sqrt(m2_ / static_cast<double>(n_));
  return sd < kMinStd ? 0 : (x - mean_) / sd;
}

void RollingZScore::Recompute() {
  // The window holds ring_[0, n_): the ring fills from 0 and is full once it wraps.
  double sum = 0;
  for (int64_t i = 0; i < n_; ++i) sum += ring_[i];
  mean_ = sum / static_cast<double>(n_);
  double m2 = 0;
  for (int64_t i = 0; i < n_; ++i) m2 += (ring_[i] - mean_) * (ring_[i] - mean_);
  m2_ = m2;
  since_recompute_ = 0;
}

// ---- Options and bands --------------------------------------------------------------------

absl::Status EpiphanyOptions::Validate() const {
  const int32_t limit =
      scale_bands ? kEpiphanyReferenceLayers : std::numeric_limits<int32_t>::max();
  if (absl::Status s = CheckBand("positive", positive_first, positive_last, limit); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckBand("negative", negative_first, negative_last, limit); !s.ok()) {
    return s;
  }
  if (window < 2) return FieldError("window", ">= 2 (tokens)", window);
  if (!std::isfinite(pin_threshold)) return FieldError("pin_threshold", "finite", pin_threshold);
  if (max_pinned_pages < 0) return FieldError("max_pinned_pages", ">= 0", max_pinned_pages);
  return absl::OkStatus();
}

absl::StatusOr<EpiphanyBands> ResolveEpiphanyBands(const EpiphanyOptions& options,
                                                   int32_t num_layers) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (num_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Epiphany: num_layers must be >= 1, got ", num_layers));
  }
  if (options.scale_bands) {
    return EpiphanyBands{ScaleBand(options.positive_first, options.positive_last, num_layers),
                         ScaleBand(options.negative_first, options.negative_last, num_layers)};
  }
  if (absl::Status s =
          CheckBand("positive", options.positive_first, options.positive_last, num_layers);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckBand("negative", options.negative_first, options.negative_last, num_layers);
      !s.ok()) {
    return s;
  }
  return EpiphanyBands{{options.positive_first, options.positive_last},
                       {options.negative_first, options.negative_last}};
}

// ---- EpiphanyScorer -----------------------------------------------------------------------

EpiphanyScorer::EpiphanyScorer(const EpiphanyOptions& options, int32_t num_layers,
                               int32_t num_kv_heads, int32_t page_size)
    : options_(options),
      num_layers_(std::max(num_layers, 1)),
      num_kv_heads_(std::max(num_kv_heads, 1)),
      page_size_(std::max(page_size, 1)),
      z_positive_(options.window),
      z_negative_(options.window) {
  // Out of contract, fall back to layer 0 for both bands rather than index out of range.
  bands_ = ResolveEpiphanyBands(options_, num_layers_).value_or(EpiphanyBands{});
  in_positive_.assign(num_layers_, false);
  in_negative_.assign(num_layers_, false);
  for (int32_t l = bands_.positive.first; l <= bands_.positive.last; ++l) in_positive_[l] = true;
  for (int32_t l = bands_.negative.first; l <= bands_.negative.last; ++l) in_negative_[l] = true;
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (in_positive_[l] || in_negative_[l]) band_layers_.push_back(l);
  }
  next_position_.assign(num_layers_, kUnset);
  last_signal_.assign(num_layers_, 0.0);
  kv_.resize(num_layers_);
  const size_t w = static_cast<size_t>(std::max(options_.window, 1));
  recent_scores_.assign(w, 0.0f);
  recent_positions_.assign(w, kUnset);
}

absl::StatusOr<std::unique_ptr<EpiphanyScorer>> EpiphanyScorer::Create(
    const EpiphanyOptions& options, int32_t num_layers, int32_t num_kv_heads, int32_t page_size) {
  if (absl::StatusOr<EpiphanyBands> b = ResolveEpiphanyBands(options, num_layers); !b.ok()) {
    return b.status();
  }
  if (num_kv_heads < 1 || page_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EpiphanyScorer: num_kv_heads and page_size must be >= 1, got ", num_kv_heads,
                     " and ", page_size));
  }
  return std::make_unique<EpiphanyScorer>(options, num_layers, num_kv_heads, page_size);
}

void EpiphanyScorer::OnSignals(const StepSignals& signals) {
  if (options_.signal != EpiphanyOptions::Signal::kHiddenDelta) return;
  if (signals.hidden_delta.empty()) return;
  const int64_t n = signals.num_tokens;
  const int64_t l_count = signals.num_layers;
  if (l_count != num_layers_ || n < 1 || signals.first_position < 0 ||
      static_cast<int64_t>(signals.hidden_delta.size()) != n * l_count) {
    ++rejected_;
    return;
  }
  // Token-major: every band layer reports token t before any reports t + 1.
  for (int64_t t = 0; t < n; ++t) {
    for (int32_t l : band_layers_) {
      Report(l, signals.first_position + t, signals.hidden_delta[t * l_count + l]);
    }
  }
  Drain();
}

void EpiphanyScorer::OnTokens(const TokenBlock& block) {
  using Signal = EpiphanyOptions::Signal;
  if (options_.signal == Signal::kHiddenDelta) return;
  if (block.layer < 0 || block.layer >= num_layers_) {
    ++rejected_;
    return;
  }
  if (!in_positive_[block.layer] && !in_negative_[block.layer]) return;  // not needed
  KvHistory& h = kv_[block.layer];
  const bool lag = options_.signal == Signal::kLagKv;
  if (block.num_kv_heads != num_kv_heads_ || block.head_dim < 1 || block.num_tokens < 0 ||
      block.first_position < 0 || block.k == nullptr || (lag && block.v == nullptr) ||
      (h.head_dim != 0 && h.head_dim != block.head_dim)) {
    ++rejected_;
    return;
  }
  const int64_t row = int64_t{num_kv_heads_} * block.head_dim;  // one token's [Hkv][d]
  if (h.head_dim == 0) {
    // First block of the layer: size the history.
    h.head_dim = block.head_dim;
    if (lag) {
      h.prev_k.assign(row, 0.0f);
      h.prev_v.assign(row, 0.0f);
    } else {
      h.ring.assign(row * options_.window, 0.0f);
      h.sum.assign(row, 0.0);
    }
  }
  k_row_.resize(row);
  v_row_.resize(row);
  const int64_t next = next_position_[block.layer];
  for (int64_t i = 0; i < block.num_tokens; ++i) {
    const int64_t position = block.first_position + i;
    if (next != kUnset && position < next) continue;  // reported before
    LoadFloats(block.k, block.dtype, i * row, row, k_row_.data());
    double x;
    if (lag) {
      LoadFloats(block.v, block.dtype, i * row, row, v_row_.data());
      x = LagKvSignal(h, k_row_.data(), v_row_.data());
    } else {
      x = KeyVarianceSignal(h, k_row_.data());
    }
    Report(block.layer, position, x);
  }
  Drain();
}

double EpiphanyScorer::KeyVarianceSignal(KvHistory& h, const float* k) {
  const int32_t d = h.head_dim;
  const int64_t row = int64_t{num_kv_heads_} * d;
  // x = mean over heads of (1/d)·‖k − mean of the previous keys‖²; 0 with no previous key.
  double x = 0;
  if (h.ring_size > 0) {
    const double inv = 1.0 / h.ring_size;
    for (int64_t i = 0; i < row; ++i) {
      const double diff = k[i] - h.sum[i] * inv;
      x += diff * diff;
    }
    x /= static_cast<double>(row);  // = mean over heads of (1/d)·Σ over the head's dims
  }
  // Push k: it replaces the oldest key once the ring is full.
  float* slot = h.ring.data() + int64_t{h.ring_next} * row;
  if (h.ring_size == options_.window) {
    for (int64_t i = 0; i < row; ++i) h.sum[i] -= slot[i];
  } else {
    ++h.ring_size;
  }
  std::memcpy(slot, k, row * sizeof(float));
  for (int64_t i = 0; i < row; ++i) h.sum[i] += k[i];
  h.ring_next = (h.ring_next + 1) % options_.window;
  if (++h.since_recompute >= options_.window) {
    // Exact sums again, against the drift of adding and subtracting.
    std::fill(h.sum.begin(), h.sum.end(), 0.0);
    for (int32_t r = 0; r < h.ring_size; ++r) {
      const float* key = h.ring.data() + int64_t{r} * row;
      for (int64_t i = 0; i < row; ++i) h.sum[i] += key[i];
    }
    h.since_recompute = 0;
  }
  return x;
}

double EpiphanyScorer::LagKvSignal(KvHistory& h, const float* k, const float* v) {
  const int32_t d = h.head_dim;
  double x = 0;
  if (h.has_prev) {
    // Per head: relative change of K plus relative change of V; mean over heads.
    for (int32_t head = 0; head < num_kv_heads_; ++head) {
      const int64_t base = int64_t{head} * d;
      double dk = 0, nk = 0, dv = 0, nv = 0;
      for (int32_t j = 0; j < d; ++j) {
        const double pk = h.prev_k[base + j], pv = h.prev_v[base + j];
        dk += (k[base + j] - pk) * (k[base + j] - pk);
        dv += (v[base + j] - pv) * (v[base + j] - pv);
        nk += pk * pk;
        nv += pv * pv;
      }
      x += std::sqrt(dk) / std::max(std::sqrt(nk), kLagEpsilon) +
           std::sqrt(dv) / std::max(std::sqrt(nv), kLagEpsilon);
    }
    x /= num_kv_heads_;
  }
  std::copy(k, k + h.prev_k.size(), h.prev_k.begin());
  std::copy(v, v + h.prev_v.size(), h.prev_v.begin());
  h.has_prev = true;
  return x;
}

void EpiphanyScorer::Report(int32_t layer, int64_t position, double x) {
  int64_t& next = next_position_[layer];
  if (next != kUnset && position < next) return;  // a repeat
  if (scored_end_ != kUnset && position - scored_end_ >= kMaxPendingTokens) {
    ++rejected_;  // far beyond anything pending: out of contract
    return;
  }
  next = position + 1;
  last_signal_[layer] = x;
  if (scored_end_ == kUnset) scored_end_ = position;
  if (position < scored_end_) return;  // already scored and frozen
  const size_t i = static_cast<size_t>(position - scored_end_);
  if (i >= pending_.size()) pending_.resize(i + 1);
  Partial& p = pending_[i];
  if (in_positive_[layer]) {
    p.sum_positive += x;
    ++p.n_positive;
  }
  if (in_negative_[layer]) {
    p.sum_negative += x;
    ++p.n_negative;
  }
}

void EpiphanyScorer::Drain() {
  if (scored_end_ == kUnset) return;
  // Every band layer has reported the positions before min_next.
  int64_t min_next = std::numeric_limits<int64_t>::max();
  for (int32_t l : band_layers_) {
    if (next_position_[l] == kUnset) return;
    min_next = std::min(min_next, next_position_[l]);
  }
  while (scored_end_ < min_next) {
    if (pending_.empty()) {  // positions every layer skipped
      scored_end_ = min_next;
      break;
    }
    const Partial p = pending_.front();
    pending_.pop_front();
    // A token some band skipped (out of contract) gets no score and leaves z untouched.
    if (p.n_positive > 0 && p.n_negative > 0) {
      const double za = z_positive_.Push(p.sum_positive / p.n_positive);
      const double zb = z_negative_.Push(p.sum_negative / p.n_negative);
      Fold(scored_end_, static_cast<float>(za - zb));
    }
    ++scored_end_;
  }
}

void EpiphanyScorer::Fold(int64_t position, float score) {
  const int64_t page = position / page_size_;
  PageAggregate& agg = pages_[page];
  agg.max = agg.count == 0 ? score : std::max(agg.max, score);
  agg.sum += score;
  ++agg.count;
  // Keep the set of pages at or above the threshold current; the pinned set follows lazily.
  const float value = Aggregate(agg);
  if (value >= options_.pin_threshold) {
    above_threshold_[page] = value;
    pinned_dirty_ = true;
  } else if (above_threshold_.erase(page) > 0) {
    pinned_dirty_ = true;
  }
  const size_t slot = static_cast<size_t>(position) % recent_scores_.size();
  recent_scores_[slot] = score;
  recent_positions_[slot] = position;
  ++scored_tokens_;
}

float EpiphanyScorer::Aggregate(const PageAggregate& page) const {
  switch (options_.aggregate) {
    case EpiphanyOptions::Aggregate::kMax:
      return page.max;
    case EpiphanyOptions::Aggregate::kMean:
      return static_cast<float>(page.sum / static_cast<double>(page.count));
  }
  return 0;
}

void EpiphanyScorer::RefreshPinned() {
  // The max_pinned_pages highest of the pages at ≥ threshold; ties go to the earlier page.
  std::vector<std::pair<float, int64_t>> candidates;
  candidates.reserve(above_threshold_.size());
  for (const auto& [page, score] : above_threshold_) candidates.emplace_back(score, page);
  const size_t k = std::min(candidates.size(), static_cast<size_t>(options_.max_pinned_pages));
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                    [](const auto& a, const auto& b) {
                      return a.first != b.first ? a.first > b.first : a.second < b.second;
                    });
  pinned_.clear();
  for (size_t i = 0; i < k; ++i) pinned_.push_back(candidates[i].second);
  std::sort(pinned_.begin(), pinned_.end());
  pinned_dirty_ = false;
}

float EpiphanyScorer::Score(int32_t /*layer*/, int32_t /*kv_head*/, int64_t page) {
  return page_score(page);
}

bool EpiphanyScorer::Pinned(int32_t /*layer*/, int32_t /*kv_head*/, int64_t page) {
  if (pinned_dirty_) RefreshPinned();
  return std::binary_search(pinned_.begin(), pinned_.end(), page);
}

std::optional<float> EpiphanyScorer::token_score(int64_t position) const {
  if (position < 0) return std::nullopt;
  const size_t slot = static_cast<size_t>(position) % recent_scores_.size();
  if (recent_positions_[slot] != position) return std::nullopt;
  return recent_scores_[slot];
}

float EpiphanyScorer::page_score(int64_t page) const {
  const auto it = pages_.find(page);
  return it == pages_.end() ? 0.0f : Aggregate(it->second);
}

}  // namespace kvtier::policy
