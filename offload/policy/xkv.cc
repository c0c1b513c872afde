// XKV per-layer budgets.
//
// Invariants: a greedy allocation is the floors plus a prefix of one global order of the
// remaining pages (normalised importance descending, then layer, then rank in the layer),
// so AllocateGreedy and AllocateForTargetRatio agree for every total. XkvBudget's
// allocation_ is empty or has num_layers_ entries, and never changes once set.
#include "offload/policy/xkv.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::policy {
namespace {

constexpr double kRatioTolerance = 1e-9;

// Values that are not > 0 (negative, NaN) count as 0.
double Clean(float x) { return x > 0 ? static_cast<double>(x) : 0.0; }

// One layer's importances, cleaned and sorted descending, with their total.
struct SortedLayer {
  std::vector<double> desc;
  double total = 0;
  int32_t floor = 0;
  int32_t cap = 0;
};

std::vector<SortedLayer> SortLayers(const std::vector<std::vector<float>>& importance,
                                    int32_t min_pages, int32_t max_pages) {
  std::vector<SortedLayer> layers(importance.size());
  for (size_t l = 0; l < importance.size(); ++l) {
    SortedLayer& s = layers[l];
    s.desc.reserve(importance[l].size());
    for (float x : importance[l]) s.desc.push_back(Clean(x));
    std::sort(s.desc.begin(), s.desc.end(), std::greater<>());
    for (double x : s.desc) s.total += x;
    const int64_t pages = static_cast<int64_t>(s.desc.size());
    s.cap = static_cast<int32_t>(max_pages < 0 ? pages : std::min<int64_t>(max_pages, pages));
    s.floor = std::clamp(min_pages, 0, s.cap);
  }
  return layers;
}

// A page beyond its layer's floor, with its gain in ratio.
struct Candidate {
  double gain;  // importance / layer total (0 for a layer with total 0)
  int32_t layer;
  int32_t rank;  // position in the layer's descending order
};

// The pages beyond the floors in greedy order: gain descending, then layer, then rank.
// Within a layer gains are non-increasing in rank, so every prefix of this order takes a
// prefix of each layer's descending list.
std::vector<Candidate> GreedyOrder(const std::vector<SortedLayer>& layers) {
  std::vector<Candidate> order;
  for (size_t l = 0; l < layers.size(); ++l) {
    const SortedLayer& s = layers[l];
    for (int32_t k = s.floor; k < s.cap; ++k) {
      const double gain = s.total > 0 ? s.desc[k] / s.total : 0.0;
      order.push_back({gain, static_cast<int32_t>(l), k});
    }
  }
  std::sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) {
    if (a.gain != b.gain) return a.gain > b.gain;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.rank < b.rank;
  });
  return order;
}

std::vector<int32_t> Floors(const std::vector<SortedLayer>& layers) {
  std::vector<int32_t> b(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) b[l] = layers[l].floor;
  return b;
}

// r(b) of a sorted layer.
double SortedRatio(const SortedLayer& s, int32_t b) {
  if (s.total <= 0) return 1.0;
  double kept = 0;
  for (int32_t k = 0; k < b && k < static_cast<int32_t>(s.desc.size()); ++k) kept += s.desc[k];
  return kept / s.total;
}

absl::Status CheckTaskName(const std::string& task) {
  if (task.empty()) return absl::InvalidArgumentError("xkv task name is empty");
  if (task.find_first_of("\t\n\r") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("xkv task name has a tab or newline: \"", task, "\""));
  }
  return absl::OkStatus();
}

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrFormat("%s %s: %s", what, path, std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// Parses `b0 b1 ...` (spaces between values) into non-negative int32s.
bool ParseBudgets(std::string_view text, std::vector<int32_t>* out) {
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ') {
      ++i;
      continue;
    }
    int32_t v = 0;
    const auto [end, ec] = std::from_chars(text.data() + i, text.data() + text.size(), v);
    if (ec != std::errc() || v < 0) return false;
    i = static_cast<size_t>(end - text.data());
    if (i < text.size() && text[i] != ' ') return false;
    out->push_back(v);
  }
  return !out->empty();
}

}  // namespace

std::vector<float> PoolImportance(std::span<const float> importance, int32_t kernel) {
  const int64_t n = static_cast<int64_t>(importance.size());
  const int32_t odd = kernel < 1 ? 1 : (kernel % 2 == 0 ? kernel - 1 : kernel);
  const int64_t half = odd / 2;
  // Prefix sums in double: each output is one difference, O(n) in all.
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + importance[i];
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = std::max<int64_t>(0, i - half);
    const int64_t hi = std::min<int64_t>(n, i + half + 1);
    out[i] = static_cast<float>((prefix[hi] - prefix[lo]) / static_cast<double>(hi - lo));
  }
  return out;
}

double RetentionRatio(std::span<const float> page_importance, int32_t b) {
  const std::vector<std::vector<float>> one = {
      std::vector<float>(page_importance.begin(), page_importance.end())};
  return SortedRatio(SortLayers(one, 0, -1)[0], b);
}

std::vector<int32_t> AllocateGreedy(const std::vector<std::vector<float>>& page_importance,
                                    int64_t total_pages, int32_t min_pages, int32_t max_pages) {
  const std::vector<SortedLayer> layers = SortLayers(page_importance, min_pages, max_pages);
  std::vector<int32_t> b = Floors(layers);
  int64_t left = total_pages;
  for (int32_t x : b) left -= x;
  // The top `left` pages of the greedy order beyond the floors.
  const std::vector<Candidate> order = GreedyOrder(layers);
  for (size_t i = 0; left > 0 && i < order.size(); ++i, --left) ++b[order[i].layer];
  return b;
}

std::vector<int32_t> AllocateForTargetRatio(const std::vector<std::vector<float>>& page_importance,
                                            double target_average_ratio, int32_t min_pages,
                                            int32_t max_pages) {
  const std::vector<SortedLayer> layers = SortLayers(page_importance, min_pages, max_pages);
  std::vector<int32_t> b = Floors(layers);
  if (layers.empty()) return b;
  // Σ_l r_l at the floors, then each page of the greedy order adds its gain.
  double sum = 0;
  for (size_t l = 0; l < layers.size(); ++l) sum += SortedRatio(layers[l], b[l]);
  const double target_sum = target_average_ratio * static_cast<double>(layers.size());
  for (const Candidate& c : GreedyOrder(layers)) {
    if (sum >= target_sum - kRatioTolerance) break;
    ++b[c.layer];
    sum += c.gain;
  }
  return b;
}

absl::Status LayerBudgetStore::Record(const std::string& task, std::vector<int32_t> per_layer) {
  KVTIER_RETURN_IF_ERROR(CheckTaskName(task));
  if (per_layer.empty()) return absl::InvalidArgumentError("xkv allocation has no layers");
  for (int32_t x : per_layer) {
    if (x < 0) return absl::InvalidArgumentError(absl::StrCat("xkv budget is negative: ", x));
  }
  budgets_[task] = std::move(per_layer);
  return absl::OkStatus();
}

std::optional<std::vector<int32_t>> LayerBudgetStore::Lookup(const std::string& task) const {
  const auto it = budgets_.find(task);
  if (it == budgets_.end()) return std::nullopt;
  return it->second;
}

absl::Status LayerBudgetStore::Save(const std::string& path) const {
  std::string text;
  for (const auto& [task, per_layer] : budgets_) {
    absl::StrAppend(&text, task, "\t");
    for (size_t l = 0; l < per_layer.size(); ++l) {
      absl::StrAppend(&text, l == 0 ? "" : " ", per_layer[l]);
    }
    text += '\n';
  }
  // Temporary file beside the target, then an atomic rename over it.
  const std::string tmp = absl::StrFormat("%s.tmp.%d", path, getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return Errno("cannot create", tmp);
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
                       std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  absl::Status st = written ? absl::OkStatus() : Errno("cannot write", tmp);
  if (std::fclose(f) != 0 && st.ok()) st = Errno("cannot close", tmp);
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = Errno("cannot rename to", path);
  }
  if (!st.ok()) std::remove(tmp.c_str());
  return st;
}

absl::StatusOr<LayerBudgetStore> LayerBudgetStore::Load(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Errno("cannot open", path);
  std::string text;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool read_error = std::ferror(f) != 0;
  std::fclose(f);
  if (read_error) return absl::InternalError(absl::StrCat("cannot read ", path));

  LayerBudgetStore store;
  size_t start = 0;
  for (int64_t line_no = 1; start < text.size(); ++line_no) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    const auto bad = [&](const char* why) {
      return absl::DataLossError(absl::StrFormat("%s:%d: %s", path, line_no, why));
    };
    const size_t tab = line.find('\t');
    if (tab == std::string_view::npos) return bad("no tab between task and budgets");
    const std::string task(line.substr(0, tab));
    std::vector<int32_t> per_layer;
    if (!CheckTaskName(task).ok()) return bad("bad task name");
    if (!ParseBudgets(line.substr(tab + 1), &per_layer)) {
      return bad("budgets are not non-negative integers");
    }
    if (store.budgets_.contains(task)) return bad("task recorded twice");
    store.budgets_.emplace(task, std::move(per_layer));
  }
  return store;
}

absl::Status XkvOptions::Validate() const {
  if (window < 1) return absl::InvalidArgumentError("xkv window must be ≥ 1");
  if (pooling < 1 || pooling % 2 == 0) {
    return absl::InvalidArgumentError("xkv pooling must be odd and ≥ 1");
  }
  if (total_pages < 0) return absl::InvalidArgumentError("xkv total_pages must be ≥ 0");
  if (!(target_ratio >= 0 && target_ratio <= 1)) {
    return absl::InvalidArgumentError("xkv target_ratio must be in [0, 1]");
  }
  if (min_pages < 0) return absl::InvalidArgumentError("xkv min_pages must be ≥ 0");
  if (!task_type.empty()) KVTIER_RETURN_IF_ERROR(CheckTaskName(task_type));
  return absl::OkStatus();
}

XkvBudget::XkvBudget(XkvOptions options, int32_t num_layers, int32_t num_kv_heads,
                     int32_t default_pages, LayerBudgetStore* store)
    : options_(std::move(options)),
      num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      default_pages_(default_pages),
      store_(store),
      observations_(std::max(num_layers, 0)) {
  needs_attention_ = !AdoptFromStore();
}

bool XkvBudget::AdoptFromStore() {
  if (store_ == nullptr || options_.task_type.empty()) return false;
  std::optional<std::vector<int32_t>> stored = store_->Lookup(options_.task_type);
  // An allocation for another model shape is not ours to reuse; ours replaces it.
  if (!stored.has_value() || static_cast<int32_t>(stored->size()) != num_layers_) return false;
  allocation_ = std::move(*stored);
  observations_.clear();
  return true;
}

void XkvBudget::OnAttention(const AttentionObservation& obs) {
  if (obs.step != -1 || allocated() || obs.layer < 0 || obs.layer >= num_layers_) return;
  const int64_t hq = obs.num_q_heads, hkv = obs.num_kv_heads, s = obs.num_slots;
  const int64_t p = obs.page_size;
  if (hq < 1 || hkv != num_kv_heads_ || hq % hkv != 0 || s < 0 || p < 1 || obs.num_tokens < 0) {
    return;
  }
  if (static_cast<int64_t>(obs.slot_table.size()) < hkv * s ||
      static_cast<int64_t>(obs.token_prob.size()) < hq * s * p) {
    return;
  }
  if (page_size_ != 0 && page_size_ != p) return;  // one page size per sequence
  page_size_ = static_cast<int32_t>(p);
  // Rebuild the per-position series: token t of page P is position P·p + t; sum over the
  // query heads of every KV head's group.
  const int64_t group = hq / hkv;
  std::vector<float> series(obs.num_tokens, 0.0f);
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t slot = 0; slot < s; ++slot) {
      const int64_t page = obs.slot_table[h * s + slot];
      if (page < 0) continue;
      for (int64_t g = h * group; g < (h + 1) * group; ++g) {
        const float* prob = obs.token_prob.data() + (g * s + slot) * p;
        for (int64_t t = 0; t < p && page * p + t < obs.num_tokens; ++t) {
          series[page * p + t] += prob[t];
        }
      }
    }
  }
  std::deque<std::vector<float>>& kept = observations_[obs.layer];
  kept.push_back(std::move(series));
  while (static_cast<int32_t>(kept.size()) > options_.window) kept.pop_front();
}

std::vector<std::vector<float>> XkvBudget::PageImportance() const {
  std::vector<std::vector<float>> pages(observations_.size());
  for (size_t l = 0; l < observations_.size(); ++l) {
    // Sum the kept observations over the longest one's positions, then pool.
    size_t n = 0;
    for (const std::vector<float>& o : observations_[l]) n = std::max(n, o.size());
    std::vector<float> sum(n, 0.0f);
    for (const std::vector<float>& o : observations_[l]) {
      for (size_t i = 0; i < o.size(); ++i) sum[i] += o[i];
    }
    const std::vector<float> pooled = PoolImportance(sum, options_.pooling);
    const size_t p = std::max(page_size_, 1);
    pages[l].assign((n + p - 1) / p, 0.0f);
    for (size_t i = 0; i < n; ++i) pages[l][i / p] += pooled[i];
  }
  return pages;
}

void XkvBudget::Allocate() {
  const std::vector<std::vector<float>> importance = PageImportance();
  const int32_t no_cap = -1;  // each layer's prompt pages bound it
  if (options_.target_ratio > 0) {
    allocation_ =
        AllocateForTargetRatio(importance, options_.target_ratio, options_.min_pages, no_cap);
  } else {
    const int64_t total = options_.total_pages > 0
                              ? options_.total_pages
                              : static_cast<int64_t>(num_layers_) * default_pages_;
    allocation_ = AllocateGreedy(importance, total, options_.min_pages, no_cap);
  }
  observations_.clear();
  if (store_ != nullptr && !options_.task_type.empty()) {
    // Cannot fail: the task name passed Validate() and the allocation is non-empty and
    // non-negative.
    store_->Record(options_.task_type, allocation_).IgnoreError();
  }
}

void XkvBudget::Budget(int32_t layer, int32_t max_pages, std::span<int32_t> out) {
  if (!allocated() && !AdoptFromStore()) {
    const bool all_observed =
        num_layers_ > 0 && std::all_of(observations_.begin(), observations_.end(),
                                       [](const auto& kept) { return !kept.empty(); });
    if (all_observed) Allocate();
  }
  int32_t pages = default_pages_;
  if (allocated() && layer >= 0 && layer < num_layers_) pages = allocation_[layer];
  std::fill(out.begin(), out.end(), std::clamp(pages, 0, std::max(max_pages, 0)));
}

}  // namespace kvtier::policy
