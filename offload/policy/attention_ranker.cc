#include "offload/policy/attention_ranker.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvtier::policy {
namespace {

absl::Status FieldError(const char* field, const std::string& limit, double got) {
  return absl::InvalidArgumentError(
      absl::StrCat("AttentionRankerOptions.", field, " must be ", limit, ", got ", got));
}

// (x − lo) / (hi − lo), or 0 when the range is empty.
float MinMax(double x, double lo, double hi) {
  return hi > lo ? static_cast<float>((x - lo) / (hi - lo)) : 0.0f;
}

}  // namespace

absl::Status AttentionRankerOptions::Validate() const {
  if (!(beta >= 0 && beta <= 1)) return FieldError("beta", "in [0, 1]", beta);
  if (!(recency_weight >= 0 && recency_weight <= 1)) {
    return FieldError("recency_weight", "in [0, 1]", recency_weight);
  }
  if (protected_pages < 0) return FieldError("protected_pages", ">= 0", protected_pages);
  return absl::OkStatus();
}

AttentionRanker::AttentionRanker(const AttentionRankerOptions& options, int32_t num_layers,
                                 int32_t num_kv_heads)
    : options_(options),
      num_layers_(std::max(num_layers, 0)),
      num_kv_heads_(std::max(num_kv_heads, 0)),
      heads_(static_cast<size_t>(num_layers_) * num_kv_heads_) {}

absl::StatusOr<std::unique_ptr<AttentionRanker>> AttentionRanker::Create(
    const AttentionRankerOptions& options, int32_t num_layers, int32_t num_kv_heads) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (num_layers < 1 || num_kv_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttentionRanker: num_layers and num_kv_heads must be >= 1, got ", num_layers,
                     " and ", num_kv_heads));
  }
  return std::make_unique<AttentionRanker>(options, num_layers, num_kv_heads);
}

int64_t AttentionRanker::HeadIndex(int32_t layer, int32_t kv_head) const {
  if (layer < 0 || layer >= num_layers_ || kv_head < 0 || kv_head >= num_kv_heads_) return -1;
  return static_cast<int64_t>(layer) * num_kv_heads_ + kv_head;
}

void AttentionRanker::OnAttention(const AttentionObservation& obs) {
  const int64_t hkv = obs.num_kv_heads;
  const int64_t hq = obs.num_q_heads;
  const int64_t s = obs.num_slots;
  const int64_t p = obs.page_size;
  const bool fits = obs.layer >= 0 && obs.layer < num_layers_ && hkv == num_kv_heads_ &&
                    hq >= hkv && hq % hkv == 0 && s >= 1 && p >= 1 &&
                    static_cast<int64_t>(obs.slot_table.size()) >= hkv * s &&
                    static_cast<int64_t>(obs.token_prob.size()) >= hq * s * p;
  if (!fits) {
    ++rejected_;
    return;
  }
  if (obs.num_tokens >= 1) newest_page_ = std::max(newest_page_, (obs.num_tokens - 1) / p);
  const int64_t group = hq / hkv;
  const float beta = options_.beta;
  for (int64_t h = 0; h < hkv; ++h) {
    HeadState& head = *Head(obs.layer, static_cast<int32_t>(h));
    for (int64_t slot = 0; slot < s; ++slot) {
      const int64_t page = obs.slot_table[h * s + slot];
      if (page < 0) continue;
      // Mass: Σ over the page's tokens, mean over the group's query heads.
      float sum = 0;
      for (int64_t g = 0; g < group; ++g) {
        const float* row = obs.token_prob.data() + ((h * group + g) * s + slot) * p;
        for (int64_t t = 0; t < p; ++t) sum += row[t];
      }
      const float m = sum / static_cast<float>(group);
      auto [it, inserted] = head.mass.try_emplace(page, m);
      if (!inserted) {
        it->second = options_.cumulative ? it->second + m : beta * it->second + (1 - beta) * m;
      }
    }
    head.dirty = true;
  }
}

void AttentionRanker::Refresh(HeadState& head) {
  bool any = false;
  head.e_min = head.e_max = 0;
  head.p_min = head.p_max = 0;
  for (const auto& [page, e] : head.mass) {
    if (IsProtected(page)) continue;
    if (!any) {
      head.e_min = head.e_max = e;
      head.p_min = head.p_max = page;
      any = true;
      continue;
    }
    head.e_min = std::min(head.e_min, e);
    head.e_max = std::max(head.e_max, e);
    head.p_min = std::min(head.p_min, page);
    head.p_max = std::max(head.p_max, page);
  }
  head.dirty = false;
  head.cached_newest = newest_page_;
}

float AttentionRanker::Score(int32_t layer, int32_t kv_head, int64_t page) {
  HeadState* head = Head(layer, kv_head);
  if (head == nullptr || page < 0) return 0;
  if (IsProtected(page)) return 1;
  const auto it = head->mass.find(page);
  if (it == head->mass.end()) return 0;
  if (head->dirty || head->cached_newest != newest_page_) Refresh(*head);
  const float w = options_.recency_weight;
  const float attention = MinMax(it->second, head->e_min, head->e_max);
  const float recency = MinMax(static_cast<double>(page), static_cast<double>(head->p_min),
                               static_cast<double>(head->p_max));
  return std::clamp((1 - w) * attention + w * recency, 0.0f, 1.0f);
}

bool AttentionRanker::Pinned(int32_t layer, int32_t kv_head, int64_t page) {
  return Head(layer, kv_head) != nullptr && page >= 0 && IsProtected(page);
}

void AttentionRanker::OnEvicted(int32_t layer, int32_t kv_head, int64_t page) {
  HeadState* head = Head(layer, kv_head);
  if (head != nullptr && head->mass.erase(page) > 0) head->dirty = true;
}

std::optional<float> AttentionRanker::mass(int32_t layer, int32_t kv_head, int64_t page) const {
  const HeadState* head = Head(layer, kv_head);
  if (head == nullptr) return std::nullopt;
  const auto it = head->mass.find(page);
  if (it == head->mass.end()) return std::nullopt;
  return it->second;
}

size_t AttentionRanker::tracked_pages(int32_t layer, int32_t kv_head) const {
  const HeadState* head = Head(layer, kv_head);
  return head == nullptr ? 0 : head->mass.size();
}

}  // namespace kvtier::policy
