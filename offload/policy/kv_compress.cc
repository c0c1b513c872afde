// KV-Compress per-head budgets.
//
// Invariants: KvCompressState::metrics_ has num_layers · Hkv maps, each holding only pages
// seen in an observation and not forgotten since; unobserved_layers_ counts the false
// entries of layer_observed_. KvCompressBudget's allocation_ matches the state's version
// allocated_version_ whenever it is non-empty.
#include "offload/policy/kv_compress.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kvtier::policy {
namespace {

// Orders NaN as the lowest metric, so broken scores never outrank real ones.
float Rankable(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

}  // namespace

std::vector<double> SlotMetrics(const AttentionObservation& obs, int32_t exclude_nearest) {
  const int64_t hq = obs.num_q_heads, hkv = obs.num_kv_heads, s = obs.num_slots;
  const int64_t p = obs.page_size;
  if (hq < 1 || hkv < 1 || hq % hkv != 0 || s < 1 || p < 1) return {};
  if (static_cast<int64_t>(obs.slot_table.size()) < hkv * s ||
      static_cast<int64_t>(obs.token_prob.size()) < hq * s * p) {
    return {};
  }
  // Tokens at positions ≤ last_counted are at least exclude_nearest before the query.
  const int64_t last_counted = std::min(obs.query_position - exclude_nearest, obs.num_tokens - 1);
  const int64_t group = hq / hkv;
  std::vector<double> out(hkv * s, 0.0);
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t slot = 0; slot < s; ++slot) {
      const int64_t page = obs.slot_table[h * s + slot];
      if (page < 0) continue;
      // The slot's tokens that count: positions page·p + t ≤ last_counted.
      const int64_t counted = std::clamp<int64_t>(last_counted - page * p + 1, 0, p);
      double sum = 0;
      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
        const float* prob = obs.token_prob.data() + (g * s + slot) * p;
        for (int64_t t = 0; t < counted; ++t) sum += double{prob[t]} * prob[t];
      }
      out[h * s + slot] = sum;
    }
  }
  return out;
}

std::vector<int64_t> LowestBlocks(std::span<const float> block_metric,
                                  std::span<const int64_t> block_ids, int32_t keep) {
  const size_t n = std::min(block_metric.size(), block_ids.size());
  const size_t evict = keep <= 0 ? n : n - std::min(n, static_cast<size_t>(keep));
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t{0});
  // Lowest metric first, then the lower id: a strict total order, so the result is exact.
  const auto lower = [&](size_t a, size_t b) {
    const float ma = Rankable(block_metric[a]), mb = Rankable(block_metric[b]);
    if (ma != mb) return ma < mb;
    return block_ids[a] < block_ids[b];
  };
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(evict), idx.end(),
                    lower);
  std::vector<int64_t> out(evict);
  for (size_t i = 0; i < evict; ++i) out[i] = block_ids[idx[i]];
  return out;
}

std::vector<int32_t> AllocateHeadBudgets(const std::vector<std::vector<float>>& block_metrics,
                                         int64_t total_blocks, int32_t min_blocks) {
  struct Block {
    float metric;
    int32_t head;
  };
  // Highest metric first, then the lower head.
  const auto higher = [](const Block& a, const Block& b) {
    if (a.metric != b.metric) return a.metric > b.metric;
    return a.head < b.head;
  };
  std::vector<int32_t> keep(block_metrics.size(), 0);
  std::vector<Block> rest;  // every head's blocks beyond its floor
  int64_t left = total_blocks;
  for (size_t h = 0; h < block_metrics.size(); ++h) {
    std::vector<Block> head;
    for (float m : block_metrics[h]) head.push_back({Rankable(m), static_cast<int32_t>(h)});
    // The floor keeps the head's top blocks; the others compete globally.
    const size_t floor = std::min(head.size(), static_cast<size_t>(std::max(min_blocks, 0)));
    std::nth_element(head.begin(), head.begin() + static_cast<std::ptrdiff_t>(floor), head.end(),
                     higher);
    keep[h] = static_cast<int32_t>(floor);
    left -= static_cast<int64_t>(floor);
    rest.insert(rest.end(), head.begin() + static_cast<std::ptrdiff_t>(floor), head.end());
  }
  // The top `left` of the rest; blocks equal under `higher` are interchangeable for counts.
  const size_t take = static_cast<size_t>(std::clamp<int64_t>(left, 0, rest.size()));
  std::nth_element(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(take), rest.end(),
                   higher);
  for (size_t i = 0; i < take; ++i) ++keep[rest[i].head];
  return keep;
}

absl::Status KvCompressOptions::Validate() const {
  if (exclude_nearest < 0) {
    return absl::InvalidArgumentError("kv_compress exclude_nearest must be ≥ 0");
  }
  if (total_pages < 0) return absl::InvalidArgumentError("kv_compress total_pages must be ≥ 0");
  if (min_pages < 0) return absl::InvalidArgumentError("kv_compress min_pages must be ≥ 0");
  return absl::OkStatus();
}

KvCompressState::KvCompressState(const KvCompressOptions& options, int32_t num_layers,
                                 int32_t num_q_heads, int32_t num_kv_heads, int32_t page_size,
                                 int32_t default_pages)
    : options_(options),
      num_layers_(num_layers),
      num_q_heads_(num_q_heads),
      num_kv_heads_(num_kv_heads),
      page_size_(page_size),
      default_pages_(default_pages),
      metrics_(static_cast<size_t>(std::max(num_layers, 0)) * std::max(num_kv_heads, 0)),
      layer_observed_(std::max(num_layers, 0), false),
      unobserved_layers_(std::max(num_layers, 0)) {}

void KvCompressState::Observe(const AttentionObservation& obs) {
  if (obs.step < -1 || (obs.step >= 0 && !options_.decode_updates)) return;
  if (obs.layer < 0 || obs.layer >= num_layers_ || obs.num_q_heads != num_q_heads_ ||
      obs.num_kv_heads != num_kv_heads_ || obs.page_size != page_size_) {
    return;
  }
  const std::vector<double> add = SlotMetrics(obs, options_.exclude_nearest);
  if (add.empty()) return;
  const int32_t s = obs.num_slots;
  for (int32_t h = 0; h < num_kv_heads_; ++h) {
    auto& pages = metrics_[static_cast<size_t>(obs.layer) * num_kv_heads_ + h];
    for (int32_t slot = 0; slot < s; ++slot) {
      const int64_t page = obs.slot_table[static_cast<size_t>(h) * s + slot];
      if (page >= 0) pages[page] += add[static_cast<size_t>(h) * s + slot];
    }
  }
  if (!layer_observed_[obs.layer]) {
    layer_observed_[obs.layer] = true;
    --unobserved_layers_;
  }
  ++version_;
}

float KvCompressState::Metric(int32_t layer, int32_t kv_head, int64_t page) const {
  if (layer < 0 || layer >= num_layers_ || kv_head < 0 || kv_head >= num_kv_heads_) return 0;
  const auto& pages = metrics_[static_cast<size_t>(layer) * num_kv_heads_ + kv_head];
  const auto it = pages.find(page);
  return it == pages.end() ? 0.0f : static_cast<float>(it->second);
}

void KvCompressState::Forget(int32_t layer, int32_t kv_head, int64_t page) {
  if (layer < 0 || layer >= num_layers_ || kv_head < 0 || kv_head >= num_kv_heads_) return;
  if (metrics_[static_cast<size_t>(layer) * num_kv_heads_ + kv_head].erase(page) > 0) {
    ++version_;
  }
}

std::vector<std::vector<float>> KvCompressState::BlockMetrics() const {
  std::vector<std::vector<float>> out(metrics_.size());
  for (size_t i = 0; i < metrics_.size(); ++i) {
    out[i].reserve(metrics_[i].size());
    for (const auto& [page, m] : metrics_[i]) out[i].push_back(static_cast<float>(m));
  }
  return out;
}

void KvCompressBudget::Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) {
  const KvCompressState& st = *state_;
  const int32_t cap = std::max(max_pages, 0);
  std::fill(out.begin(), out.end(), std::min(st.default_pages(), cap));
  if (!st.all_layers_observed() || layer < 0 || layer >= st.num_layers()) return;
  if (allocation_.empty() || allocated_version_ != st.version()) {
    const KvCompressOptions& o = st.options();
    const int64_t total = o.total_pages > 0
                              ? o.total_pages
                              : int64_t{st.num_layers()} * st.num_kv_heads() * st.default_pages();
    allocation_ = AllocateHeadBudgets(st.BlockMetrics(), total, o.min_pages);
    allocated_version_ = st.version();
  }
  const size_t heads = std::min(out.size(), static_cast<size_t>(st.num_kv_heads()));
  for (size_t h = 0; h < heads; ++h) {
    out[h] = std::min(allocation_[static_cast<size_t>(layer) * st.num_kv_heads() + h], cap);
  }
}

KvCompressPolicies MakeKvCompress(const KvCompressOptions& options, int32_t num_layers,
                                  int32_t num_q_heads, int32_t num_kv_heads, int32_t page_size,
                                  int32_t default_pages) {
  auto state = std::make_shared<KvCompressState>(options, num_layers, num_q_heads, num_kv_heads,
                                                 page_size, default_pages);
  return {std::make_unique<KvCompressBudget>(state),
          std::make_unique<KvCompressRanker>(std::move(state))};
}

}  // namespace kvtier::policy
