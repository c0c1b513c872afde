// The Retriever in speculative mode on the cpu and cuda backends over the same trace (the
// same K/V appends and drifting queries): after every BeginStep of every layer the slot
// tables must be equal up to ties, the attention outputs equal within fp16 tolerance, and
// the recall and correction statistics equal at the end (up to what ties explain); once per
// recall strategy (the cpu backend runs the same strategy). Skips itself when no CUDA device
// is usable (ctest label `gpu`).
//
// Ties: pooled page scores are fp32 sums that the two backends reduce in different orders,
// so two pages whose scores are equal up to that rounding may swap places in a selection's
// ranking. The test recomputes every selection's scores with the cpu backend's own
// ScorePages and TopK (SelectionOracle) and accepts, and nothing else:
//   - other selected pages where every page that differs scores within kTieTolerance of the
//     k-th selected score; that head's query group is then compared with attention over the
//     pages the cuda backend selected;
//   - the same pages in other slots once a ranking of the head had such a tie (Replace fills
//     freed slots in rank order);
//   - recall counts apart by at most two per page that tied with a k-th score in any
//     selection (with no such page they are equal).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "offload/page_pool.h"
#include "offload/recall_strategy.h"
#include "offload/retriever.h"
#include "tests/kernels/cuda/cuda_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AlignedHostBuffer;
using testing::ScopedRegistration;
using testing::TypedBuffer;

constexpr int32_t kPrefill = 400;  // 25 pages of 16 tokens
constexpr int32_t kSteps = 24;
// Pooled scores closer than this, relative to the k-th selected score, are a tie: the two
// backends may rank them either way. Their ScorePages sum the same fp32 terms
// max(q_i·hi_i, q_i·lo_i) in different orders (the cpu eight strided partial sums, the
// cuda a warp tree); the terms are exact for fp16 inputs and here practically all
// non-negative, so each order is within ~10·2^-24 of the exact raw score, relative. Softmax
// pooling turns that into ≲ 2e-5 relative on a pooled score (|scale·raw| ≤ 17 on this
// trace), plus a few ulps for exp and the normaliser; measured, the cpu's pooled scores are
// within 1e-6 of a double-precision evaluation here. 1e-4 is well above that, and below
// the closest k-th/(k+1)-th pair of this trace (8.6e-4 apart on the cpu), so a page chosen
// for any other reason is not excused as a tie.
constexpr double kTieTolerance = 1e-4;

Geometry TestGeometry() {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.page_size = 16;
  g.dtype = DType::kF16;
  return g;
}

SequenceOptions TestOptions(RecallStrategy strategy) {
  SequenceOptions o;
  o.mode = RetrievalMode::kSpeculative;
  o.sink_pages = 2;
  o.selected_pages = 6;  // of ~19 candidate pages: selection is not trivial
  o.recent_pages = 4;
  o.max_tokens = 1024;
  o.correction_threshold = 0.9f;
  o.recall = strategy;
  o.stream_chunk_items = 4;  // several chunks per background recall
  o.deadline = absl::Seconds(60);
  // The oracle recomputes min/max summaries (the default is another; the kernels of every
  // summary are compared with the CPU's in backend_ops_test).
  o.summary = SummaryMode::kMinMax;
  return o;
}

// Tokens appended before step s (after the prefill): mostly one, now and then a burst that
// crosses page boundaries.
int32_t AppendBefore(int32_t step) { return step % 6 == 5 ? 7 : 1; }

// Tokens per layer once step `step`'s tokens are appended (-1: the prefill alone).
int32_t TokensAfter(int32_t step) {
  int32_t n = kPrefill;
  for (int32_t s = 0; s <= step; ++s) n += AppendBefore(s);
  return n;
}

// The trace both backends replay, in host memory.
struct Trace {
  explicit Trace(const Geometry& g) {
    const int64_t row = int64_t{g.num_kv_heads} * g.head_dim;
    const int64_t qn = int64_t{g.num_q_heads} * g.head_dim;
    std::mt19937_64 rng(2024);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      prefill_k.emplace_back(g.dtype, kPrefill * row);
      prefill_v.emplace_back(g.dtype, kPrefill * row);
      prefill_k.back().FillNormal(rng());
      prefill_v.back().FillNormal(rng());
    }
    // Queries: per KV head group, a small drift most steps (cos ≈ 0.98, not corrected) and a
    // fresh direction now and then (corrected at τ = 0.9).
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    const int32_t G = g.group_size();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<float> cur(static_cast<size_t>(qn));
      for (float& x : cur) x = normal(rng);
      for (int32_t s = 0; s < kSteps; ++s) {
        if (s > 0) {
          for (int32_t h = 0; h < g.num_kv_heads; ++h) {
            const bool jump = unit(rng) < 0.3f;
            for (int64_t i = int64_t{h} * G * g.head_dim; i < int64_t{h + 1} * G * g.head_dim;
                 ++i) {
              cur[static_cast<size_t>(i)] =
                  jump ? normal(rng) : cur[static_cast<size_t>(i)] + 0.2f * normal(rng);
            }
          }
        }
        TypedBuffer q(g.dtype, qn);
        for (int64_t i = 0; i < qn; ++i) q.Set(i, cur[static_cast<size_t>(i)]);
        queries.push_back(std::move(q));
      }
    }
    for (int32_t s = 0; s < kSteps; ++s) {
      for (int32_t l = 0; l < g.num_layers; ++l) {
        const int32_t n = AppendBefore(s);
        step_k.emplace_back(g.dtype, n * row);
        step_v.emplace_back(g.dtype, n * row);
        step_k.back().FillNormal(rng());
        step_v.back().FillNormal(rng());
      }
    }
    for (int32_t l = 0; l < g.num_layers; ++l) {
      all_k.emplace_back(g.dtype, TokensAfter(kSteps - 1) * row);
      all_v.emplace_back(g.dtype, TokensAfter(kSteps - 1) * row);
      size_t at = 0;
      for (int32_t s = -1; s < kSteps; ++s) {
        const size_t i = static_cast<size_t>(s) * g.num_layers + l;
        const TypedBuffer& k = s < 0 ? prefill_k[l] : step_k[i];
        const TypedBuffer& v = s < 0 ? prefill_v[l] : step_v[i];
        std::memcpy(static_cast<char*>(all_k.back().data()) + at, k.data(), k.bytes());
        std::memcpy(static_cast<char*>(all_v.back().data()) + at, v.data(), v.bytes());
        at += k.bytes();
      }
    }
  }
  std::vector<TypedBuffer> prefill_k, prefill_v;  // [layer]
  std::vector<TypedBuffer> queries;               // [layer][step]
  std::vector<TypedBuffer> step_k, step_v;        // [step][layer]
  std::vector<TypedBuffer> all_k, all_v;          // [layer]: every row, in append order
};

// The selections the Retriever makes, recomputed on the cpu backend with its own ScorePages
// and TopK. Selection `s` of a layer is made with q_s over the pages full after step s's
// appends: the background selection at EndStep(s) and a correction at BeginStep(s) (step 0:
// the first selection) both use exactly that. The table BeginStep(s) returns therefore
// holds, per KV head, selection s (corrected or first) or selection s - 1 (speculative).
// Summaries are the per-dimension max and min of each page's keys, which is what the
// offload op writes (exact in the dtype).
class SelectionOracle {
 public:
  struct Selection {
    int32_t step = 0;  // made with q_step
    int32_t full_pages = 0;
    int32_t first = 0, end = 0;  // candidate pages [first, end)
    std::vector<float> pooled;   // [Hkv][P]
    std::vector<int32_t> top;    // [Hkv][k], TopK's output (best first, -1 padded)
    // The pages outside the top-k whose score ties with the k-th (kTieTolerance), summed
    // over the heads: page swaps a backend may make here.
    int64_t near_ties = 0;
    // [Hkv]: the head's ranking may differ on another backend: two adjacent pages of the
    // top-k tie, or the k-th ties with a page outside. Replace fills the freed slots in rank
    // order, so after such a selection the same pages may sit in other slots.
    std::vector<uint8_t> rank_tie;
  };

  SelectionOracle(const Geometry& g, const SequenceOptions& o, const Trace& trace)
      : g_(g), o_(o), P_(o.max_tokens / g.page_size) {
    auto backend = CreateBackend(DeviceKind::kCpu, DeviceOptions{.cpu_threads = 2});
    status_ = backend.status();
    if (!status_.ok()) return;
    backend_ = *std::move(backend);
    auto stream = backend_->CreateStream();
    status_ = stream.status();
    if (!status_.ok()) return;
    stream_ = *std::move(stream);
    selections_.resize(static_cast<size_t>(g.num_layers));
    for (int32_t l = 0; l < g.num_layers && status_.ok(); ++l) {
      const TypedBuffer summaries = Summaries(trace.all_k[l]);
      for (int32_t s = 0; s < kSteps && status_.ok(); ++s) {
        auto sel =
            Select(summaries, trace.queries[static_cast<size_t>(l) * kSteps + s], TokensAfter(s));
        status_ = sel.status();
        if (!status_.ok()) break;
        sel->step = s;
        selections_[l].push_back(*std::move(sel));
      }
    }
  }

  const absl::Status& status() const { return status_; }
  const Selection& at(int32_t layer, int32_t step) const { return selections_[layer][step]; }
  int64_t near_ties() const {
    int64_t n = 0;
    for (const auto& layer : selections_) {
      for (const Selection& sel : layer) n += sel.near_ties;
    }
    return n;
  }
  // Whether a selection of head h of `layer` up to `step` may have ranked its pages
  // otherwise on another backend.
  bool MayHaveParted(int32_t layer, int32_t h, int32_t step) const {
    for (int32_t c = 0; c <= step; ++c) {
      if (at(layer, c).rank_tie[static_cast<size_t>(h)]) return true;
    }
    return false;
  }
  // The k-th selected score of head h; NaN when fewer than k pages were candidates.
  double Kth(const Selection& sel, int32_t h) const {
    const int32_t k = o_.selected_pages;
    const int32_t last = sel.top[static_cast<size_t>(h) * k + k - 1];
    return last < 0 ? std::nan("") : Score(sel, h, last);
  }
  double Score(const Selection& sel, int32_t h, int32_t page) const {
    return sel.pooled[static_cast<size_t>(h) * P_ + page];
  }
  // |score(page) − k-th| relative to the k-th.
  double Gap(const Selection& sel, int32_t h, int32_t page) const {
    const double kth = Kth(sel, h);
    return std::abs(Score(sel, h, page) - kth) / std::max(std::abs(kth), 1e-30);
  }
  bool Selected(const Selection& sel, int32_t h, int32_t page) const {
    const auto row = sel.top.begin() + int64_t{h} * o_.selected_pages;
    return std::find(row, row + o_.selected_pages, page) != row + o_.selected_pages;
  }
  std::vector<int32_t> TopPages(const Selection& sel, int32_t h) const {
    const auto row = sel.top.begin() + int64_t{h} * o_.selected_pages;
    std::vector<int32_t> pages(row, row + o_.selected_pages);
    pages.erase(std::remove(pages.begin(), pages.end(), kEmptySlot), pages.end());
    std::sort(pages.begin(), pages.end());
    return pages;
  }

  // Attention of q_s over exactly the pages `table` ([Hkv][S]) names, from the trace's K/V
  // rows after step s: what a working set holding those pages must give.
  absl::StatusOr<std::vector<float>> Attention(const Trace& trace, int32_t layer, int32_t s,
                                               std::vector<int32_t> table, int32_t S,
                                               int32_t partial_page, int32_t partial_len) {
    const int32_t p = g_.page_size, Hkv = g_.num_kv_heads, d = g_.head_dim;
    const size_t e = g_.element_bytes();
    TypedBuffer k(g_.dtype, int64_t{S} * p * Hkv * d), v(g_.dtype, int64_t{S} * p * Hkv * d);
    for (int32_t slot = 0; slot < S; ++slot) {
      for (int32_t h = 0; h < Hkv; ++h) {
        const int32_t page = table[static_cast<size_t>(h) * S + slot];
        for (int32_t t = 0; page >= 0 && t < p && page * p + t < TokensAfter(s); ++t) {
          const size_t src = ((size_t{1} * (page * p + t) * Hkv) + h) * d * e;
          const size_t dst = ((size_t{1} * (slot * p + t) * Hkv) + h) * d * e;
          std::memcpy(static_cast<char*>(k.data()) + dst,
                      static_cast<const char*>(trace.all_k[layer].data()) + src, d * e);
          std::memcpy(static_cast<char*>(v.data()) + dst,
                      static_cast<const char*>(trace.all_v[layer].data()) + src, d * e);
        }
      }
    }
    TypedBuffer out(g_.dtype, int64_t{g_.num_q_heads} * d);
    SparseAttentionArgs a;
    a.shape = KvShapeOf(g_);
    a.kv.k_cache = k.data();
    a.kv.v_cache = v.data();
    a.kv.num_slots = S;
    a.kv.slot_table = table.data();
    a.kv.partial_page = &partial_page;
    a.kv.partial_len = &partial_len;
    a.batch = 1;
    a.q = trace.queries[static_cast<size_t>(layer) * kSteps + s].data();
    a.softmax_scale = scale();
    a.out = out.data();
    absl::Status st = backend_->SparseAttention(*stream_, a);
    if (st.ok()) st = stream_->Synchronize();
    if (!st.ok()) return st;
    return out.ToFloats();
  }

 private:
  // The Retriever's softmax scale.
  float scale() const {
    return o_.softmax_scale > 0 ? o_.softmax_scale : 1.0f / std::sqrt(float(g_.head_dim));
  }

  // [P][Hkv][2][d] min/max summaries of every full page of `keys` (NHD rows).
  TypedBuffer Summaries(const TypedBuffer& keys) const {
    const int32_t p = g_.page_size, Hkv = g_.num_kv_heads, d = g_.head_dim;
    const SummaryLayout sl{Hkv, d};
    TypedBuffer out(g_.dtype, int64_t{P_} * sl.page_elements());
    const int64_t pages = keys.size() / (int64_t{p} * Hkv * d);
    for (int64_t page = 0; page < pages; ++page) {
      for (int32_t h = 0; h < Hkv; ++h) {
        for (int32_t i = 0; i < d; ++i) {
          float hi = -std::numeric_limits<float>::infinity(), lo = -hi;
          for (int32_t t = 0; t < p; ++t) {
            const float x = keys.Get(((page * p + t) * Hkv + h) * d + i);
            hi = std::max(hi, x);
            lo = std::min(lo, x);
          }
          out.Set(sl.Offset(page, h, kHi, i), hi);
          out.Set(sl.Offset(page, h, kLo, i), lo);
        }
      }
    }
    return out;
  }

  absl::StatusOr<Selection> Select(const TypedBuffer& summaries, const TypedBuffer& q,
                                   int32_t tokens) {
    const int32_t p = g_.page_size, Hkv = g_.num_kv_heads, k = o_.selected_pages;
    Selection sel;
    sel.full_pages = tokens / p;
    // The recent window's full pages (RetrieverImpl::RecentFull) are no candidates.
    const int32_t total = (tokens + p - 1) / p;
    const int32_t recent_lo = std::max(o_.sink_pages, total - o_.recent_pages);
    const int32_t recent_full = std::max(0, sel.full_pages - recent_lo);
    sel.first = o_.sink_pages;
    sel.end = sel.full_pages - recent_full;
    sel.pooled.resize(static_cast<size_t>(Hkv) * P_);
    sel.top.resize(static_cast<size_t>(Hkv) * k);
    ScorePagesArgs sa;
    sa.shape = KvShapeOf(g_);
    sa.batch = 1;
    sa.max_pages = P_;
    sa.q = q.data();
    sa.summaries = summaries.data();
    sa.num_pages = &sel.full_pages;
    sa.softmax_scale = scale();
    sa.pooled = sel.pooled.data();
    TopKArgs ta;
    ta.shape = KvShapeOf(g_);
    ta.batch = 1;
    ta.max_pages = P_;
    ta.k = k;
    ta.pooled = sel.pooled.data();
    ta.num_pages = &sel.full_pages;
    ta.sink_pages = o_.sink_pages;
    ta.recent_pages = recent_full;
    ta.selected = sel.top.data();
    absl::Status st = backend_->ScorePages(*stream_, sa);
    if (st.ok()) st = backend_->TopK(*stream_, ta);
    if (st.ok()) st = stream_->Synchronize();
    if (!st.ok()) return st;
    sel.rank_tie.assign(static_cast<size_t>(Hkv), 0);
    for (int32_t h = 0; h < Hkv; ++h) {
      const int32_t* top = &sel.top[static_cast<size_t>(h) * k];
      for (int32_t i = 0; i + 1 < k && top[i + 1] >= 0; ++i) {
        const double a = Score(sel, h, top[i]), b = Score(sel, h, top[i + 1]);
        if (std::abs(a - b) <= kTieTolerance * std::abs(b)) sel.rank_tie[h] = 1;
      }
      if (std::isnan(Kth(sel, h))) continue;
      for (int32_t page = sel.first; page < sel.end; ++page) {
        if (!Selected(sel, h, page) && Gap(sel, h, page) <= kTieTolerance) {
          ++sel.near_ties;
          sel.rank_tie[h] = 1;
        }
      }
    }
    return sel;
  }

 private:
  Geometry g_;
  SequenceOptions o_;
  int32_t P_;  // max_pages
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::vector<Selection>> selections_;  // [layer][step]
  absl::Status status_;
};

// One backend's Retriever over its own registered host tier, with the trace uploaded to
// backend memory.
class Runner {
 public:
  Runner(std::unique_ptr<Backend> backend, const Geometry& g, const SequenceOptions& o)
      : backend_(std::move(backend)),
        g_(g),
        tier_mem_(static_cast<size_t>(g.num_layers) * (o.max_tokens / g.page_size) *
                  g.host_page_bytes()),
        registration_(*backend_, tier_mem_.data(), tier_mem_.bytes()) {
    status_ = registration_.status();
    if (!status_.ok()) return;
    auto pool = PagePool::Create(tier_mem_.data(), g.host_page_bytes(),
                                 int64_t{g.num_layers} * (o.max_tokens / g.page_size));
    if (!pool.ok()) {
      status_ = pool.status();
      return;
    }
    pool_ = *std::move(pool);
    auto retriever = Retriever::Create(g, o, *backend_, pool_.get());
    if (!retriever.ok()) {
      status_ = retriever.status();
      return;
    }
    retriever_ = *std::move(retriever);
  }
  ~Runner() {
    retriever_.reset();  // before the pool and the registration
    pool_.reset();
  }

  const absl::Status& status() const { return status_; }
  Backend& backend() { return *backend_; }
  Retriever& retriever() { return *retriever_; }
  Stream& stream() { return retriever_->compute_stream(); }

  // Backend memory holding a copy of `b`, kept until the runner goes.
  absl::StatusOr<const void*> Upload(const TypedBuffer& b) {
    auto buf = backend_->Allocate(b.bytes());
    if (!buf.ok()) return buf.status();
    absl::Status st = backend_->Copy(stream(), buf->data(), b.data(), b.bytes());
    if (st.ok()) st = stream().Synchronize();
    if (!st.ok()) return st;
    buffers_.push_back(*std::move(buf));
    return static_cast<const void*>(buffers_.back().data());
  }
  absl::StatusOr<void*> Scratch(size_t bytes) {
    auto buf = backend_->Allocate(bytes);
    if (!buf.ok()) return buf.status();
    buffers_.push_back(*std::move(buf));
    return buffers_.back().data();
  }
  // Copies backend memory to the host after the work enqueued on the compute stream.
  absl::Status Download(void* dst, const void* src, size_t bytes) {
    absl::Status st = backend_->Copy(stream(), dst, src, bytes);
    return st.ok() ? stream().Synchronize() : st;
  }

 private:
  std::unique_ptr<Backend> backend_;
  Geometry g_;
  AlignedHostBuffer tier_mem_;
  ScopedRegistration registration_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<Retriever> retriever_;
  std::vector<DeviceBuffer> buffers_;
  absl::Status status_;
};

std::string Pages(const std::vector<int32_t>& pages) {
  std::ostringstream out;
  for (size_t i = 0; i < pages.size(); ++i) out << (i ? " " : "{") << pages[i];
  out << (pages.empty() ? "{}" : "}");
  return out.str();
}

// The sorted pages of `table`'s entries [begin, end), empty slots left out.
std::vector<int32_t> RegionPages(const std::vector<int32_t>& table, int64_t begin, int64_t end) {
  std::vector<int32_t> pages(table.begin() + begin, table.begin() + end);
  pages.erase(std::remove(pages.begin(), pages.end(), kEmptySlot), pages.end());
  std::sort(pages.begin(), pages.end());
  return pages;
}

std::vector<int32_t> Minus(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// Compares the cpu (a) and cuda (b) slot tables ([Hkv][S]) that BeginStep of step s, layer l
// returned. Per KV head: outside the selected region they must be equal. Inside it the cpu's
// pages must be the top-k of selection s or s - 1 (the oracle's model of the Retriever), and
// the cuda's the same pages in the same slots; in other slots where a tie in an earlier
// ranking may have placed them otherwise; or other pages, as many, where every page that
// differs scores within kTieTolerance of the k-th selected score (adds those to *swapped).
// Returns per KV head whether the pages differ (a tie), or an error naming the layer, step,
// head and scores.
absl::StatusOr<std::vector<bool>> CompareTables(const SelectionOracle& oracle,
                                                const SequenceOptions& o, int32_t num_kv_heads,
                                                int32_t l, int32_t s, int32_t S,
                                                const std::vector<int32_t>& a,
                                                const std::vector<int32_t>& b, int64_t* swapped) {
  std::vector<bool> tied(static_cast<size_t>(num_kv_heads), false);
  const int32_t lo = o.sink_pages, hi = o.sink_pages + o.selected_pages;
  for (int32_t h = 0; h < num_kv_heads; ++h) {
    const std::string where = absl::StrFormat("step %d layer %d head %d", s, l, h);
    const int64_t row = int64_t{h} * S;
    for (int32_t slot = 0; slot < S; ++slot) {
      if ((slot < lo || slot >= hi) && a[row + slot] != b[row + slot]) {
        return absl::InternalError(
            absl::StrFormat("%s: slot %d (sinks or recent ring) holds page %d on cpu, %d on cuda",
                            where, slot, a[row + slot], b[row + slot]));
      }
    }
    const std::vector<int32_t> pa = RegionPages(a, row + lo, row + hi);
    const std::vector<int32_t> pb = RegionPages(b, row + lo, row + hi);
    std::vector<const SelectionOracle::Selection*> explain;  // selections giving the cpu's pages
    for (int32_t c = s; c >= std::max(0, s - 1); --c) {
      if (oracle.TopPages(oracle.at(l, c), h) == pa) explain.push_back(&oracle.at(l, c));
    }
    if (explain.empty()) {
      return absl::InternalError(absl::StrFormat(
          "%s: the cpu's selected pages %s are the top-k of neither selection %d nor %d "
          "recomputed on the cpu: the test's model of the Retriever's selection is out of date",
          where, Pages(pa), s, s - 1));
    }
    if (std::equal(a.begin() + row + lo, a.begin() + row + hi, b.begin() + row + lo)) continue;
    if (pa.size() != pb.size()) {
      return absl::InternalError(absl::StrFormat("%s: %d selected pages on cpu %s, %d on cuda %s",
                                                 where, pa.size(), Pages(pa), pb.size(),
                                                 Pages(pb)));
    }
    if (pa == pb) {
      if (oracle.MayHaveParted(l, h, s)) continue;  // placed in another order after a tie
      return absl::InternalError(absl::StrFormat(
          "%s: the same pages %s in other slots, and no selection of the head so far had two "
          "scores within %.0e of each other",
          where, Pages(pa), kTieTolerance));
    }
    const std::vector<int32_t> only_a = Minus(pa, pb), only_b = Minus(pb, pa);
    std::string why;
    for (const SelectionOracle::Selection* sel : explain) {
      int32_t worst = -1;
      double worst_gap = 0;
      for (const std::vector<int32_t>* side : {&only_a, &only_b}) {
        for (int32_t page : *side) {
          const bool candidate = page >= sel->first && page < sel->end;
          const double gap =
              candidate ? oracle.Gap(*sel, h, page) : std::numeric_limits<double>::infinity();
          if (worst < 0 || !(gap <= worst_gap)) {
            worst = page;
            worst_gap = gap;
          }
        }
      }
      if (worst_gap <= kTieTolerance) {
        tied[static_cast<size_t>(h)] = true;
        *swapped += static_cast<int64_t>(only_a.size());
        break;
      }
      absl::StrAppendFormat(
          &why,
          "; scored with q_%d over %d full pages: page %d scores %.9g, the k-th selected "
          "%.9g (relative gap %.3g > %.0e)",
          sel->step, sel->full_pages, worst, oracle.Score(*sel, h, worst), oracle.Kth(*sel, h),
          worst_gap, kTieTolerance);
    }
    if (!tied[static_cast<size_t>(h)]) {
      return absl::InternalError(
          absl::StrFormat("%s: other pages selected, not a tie: cpu %s, cuda %s%s", where,
                          Pages(pa), Pages(pb), why));
    }
  }
  return tied;
}

class RetrieverBackendsTest : public ::testing::TestWithParam<RecallStrategy> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no usable CUDA device";
  }
};

TEST_P(RetrieverBackendsTest, SpeculativeWorkingSetsAndOutputsMatchTheCpu) {
  const Geometry g = TestGeometry();
  const SequenceOptions o = TestOptions(GetParam());
  auto cpu_backend = CreateBackend(DeviceKind::kCpu, DeviceOptions{.cpu_threads = 2});
  ASSERT_TRUE(cpu_backend.ok()) << cpu_backend.status();
  auto cuda_backend = CreateBackend(DeviceKind::kCuda);
  ASSERT_TRUE(cuda_backend.ok()) << cuda_backend.status();
  Runner cpu(*std::move(cpu_backend), g, o);
  KVTIER_ASSERT_OK(cpu.status());
  Runner cuda(*std::move(cuda_backend), g, o);
  KVTIER_ASSERT_OK(cuda.status());
  Runner* runners[2] = {&cpu, &cuda};
  const char* names[2] = {"cpu", "cuda"};

  const Trace trace(g);
  const size_t q_bytes = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  const int64_t qn = int64_t{g.num_q_heads} * g.head_dim;
  // Backend copies of the trace and the outputs, per runner.
  struct Inputs {
    std::vector<const void*> prefill_k, prefill_v, queries, step_k, step_v;
    std::vector<void*> out;  // [layer]
  } in[2];
  for (int r = 0; r < 2; ++r) {
    auto upload_all = [&](const std::vector<TypedBuffer>& src, std::vector<const void*>* dst) {
      for (const TypedBuffer& b : src) {
        auto p = runners[r]->Upload(b);
        ASSERT_TRUE(p.ok()) << p.status();
        dst->push_back(*p);
      }
    };
    upload_all(trace.prefill_k, &in[r].prefill_k);
    upload_all(trace.prefill_v, &in[r].prefill_v);
    upload_all(trace.queries, &in[r].queries);
    upload_all(trace.step_k, &in[r].step_k);
    upload_all(trace.step_v, &in[r].step_v);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      auto p = runners[r]->Scratch(q_bytes);
      ASSERT_TRUE(p.ok()) << p.status();
      in[r].out.push_back(*p);
    }
    for (int32_t l = 0; l < g.num_layers; ++l) {
      KVTIER_ASSERT_OK(
          runners[r]->retriever().Append(l, in[r].prefill_k[l], in[r].prefill_v[l], kPrefill));
    }
  }
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(o.summary == SummaryMode::kMinMax) << "the oracle recomputes min/max summaries";
  SelectionOracle oracle(g, o, trace);
  KVTIER_ASSERT_OK(oracle.status());
  int64_t swapped = 0;  // pages of accepted ties
  const int32_t G = g.group_size();

  double worst_rel = 0;
  for (int32_t s = 0; s < kSteps; ++s) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<int32_t> tables[2];
      std::vector<float> outs[2];
      int32_t num_slots[2] = {0, 0}, num_tokens[2] = {0, 0};
      int32_t partial[2][2] = {{0, 0}, {0, 0}};  // [runner]: partial page, its tokens
      for (int r = 0; r < 2; ++r) {
        Retriever& ret = runners[r]->retriever();
        const void* q = in[r].queries[static_cast<size_t>(l) * kSteps + s];
        const size_t sl = static_cast<size_t>(s) * g.num_layers + l;
        KVTIER_ASSERT_OK(ret.Append(l, in[r].step_k[sl], in[r].step_v[sl], AppendBefore(s)));
        auto view = ret.BeginStep(l, q);
        ASSERT_TRUE(view.ok()) << names[r] << ": " << view.status();
        num_slots[r] = view->num_slots;
        num_tokens[r] = view->num_tokens;
        tables[r].resize(static_cast<size_t>(g.num_kv_heads) * view->num_slots);
        KVTIER_ASSERT_OK(runners[r]->Download(tables[r].data(), view->slot_table,
                                              tables[r].size() * sizeof(int32_t)));
        KVTIER_ASSERT_OK(runners[r]->Download(&partial[r][0], view->partial_page, sizeof(int32_t)));
        KVTIER_ASSERT_OK(runners[r]->Download(&partial[r][1], view->partial_len, sizeof(int32_t)));
        KVTIER_ASSERT_OK(ret.Attend(l, q, in[r].out[l], nullptr));
        TypedBuffer out(g.dtype, qn);
        KVTIER_ASSERT_OK(runners[r]->Download(out.data(), in[r].out[l], q_bytes));
        outs[r] = out.ToFloats();
        KVTIER_ASSERT_OK(ret.EndStep(l, q));
      }
      ASSERT_EQ(num_slots[0], num_slots[1]);
      ASSERT_EQ(num_tokens[0], num_tokens[1]);
      ASSERT_EQ(partial[0][0], partial[1][0]) << "step " << s << " layer " << l;
      ASSERT_EQ(partial[0][1], partial[1][1]) << "step " << s << " layer " << l;
      auto tied = CompareTables(oracle, o, g.num_kv_heads, l, s, num_slots[0], tables[0], tables[1],
                                &swapped);
      ASSERT_TRUE(tied.ok()) << tied.status().message();
      // The output cuda must give: the cpu's, except for the query groups of heads whose
      // pages differ by a tie, where it is attention over the pages cuda selected.
      std::vector<float> want = outs[0];
      if (std::find(tied->begin(), tied->end(), true) != tied->end()) {
        auto ref =
            oracle.Attention(trace, l, s, tables[1], num_slots[1], partial[1][0], partial[1][1]);
        ASSERT_TRUE(ref.ok()) << ref.status();
        for (int32_t h = 0; h < g.num_kv_heads; ++h) {
          if (!(*tied)[static_cast<size_t>(h)]) continue;
          std::copy(ref->begin() + int64_t{h} * G * g.head_dim,
                    ref->begin() + int64_t{h + 1} * G * g.head_dim,
                    want.begin() + int64_t{h} * G * g.head_dim);
        }
      }
      double num = 0, den = 0, max_abs = 0;
      for (int64_t i = 0; i < qn; ++i) {
        const double diff = double(outs[1][i]) - want[i];
        num += diff * diff;
        den += double(want[i]) * want[i];
        max_abs = std::max(max_abs, std::abs(diff));
      }
      const double rel = std::sqrt(num / std::max(den, 1e-30));
      worst_rel = std::max(worst_rel, rel);
      EXPECT_LE(rel, 1e-2) << "step " << s << " layer " << l;
      EXPECT_LE(max_abs, 2e-2) << "step " << s << " layer " << l;
    }
  }

  KVTIER_ASSERT_OK(cpu.retriever().Wait());
  KVTIER_ASSERT_OK(cuda.retriever().Wait());
  const SequenceStats a = cpu.retriever().Stats(), b = cuda.retriever().Stats();
  EXPECT_EQ(a.steps, b.steps);
  // A tie may swap pages in any selection, seen in a table or not (a correction replaces the
  // background selection; the last one is never attended). A swapped page costs at most one
  // recall more or fewer where the two selections part and one where they meet again; with
  // no near-tie anywhere the counts are equal.
  const int64_t slack = 2 * oracle.near_ties();
  const int64_t slab_bytes = g.slab_elements() * static_cast<int64_t>(g.element_bytes());
  EXPECT_LE(std::abs(a.recalled_pages - b.recalled_pages), slack)
      << "cpu " << a.recalled_pages << ", cuda " << b.recalled_pages;
  EXPECT_EQ(a.recalled_bytes - b.recalled_bytes,
            (a.recalled_pages - b.recalled_pages) * slab_bytes);
  EXPECT_LE(std::abs(a.correction_pages - b.correction_pages), slack)
      << "cpu " << a.correction_pages << ", cuda " << b.correction_pages;
  EXPECT_EQ(a.checked_heads, b.checked_heads);
  EXPECT_EQ(a.corrected_heads, b.corrected_heads);
  EXPECT_EQ(a.corrections, b.corrections);
  // The trace exercises both paths: some heads corrected, some attended speculatively, and
  // the background recall moved pages.
  EXPECT_GT(b.corrected_heads, 0);
  EXPECT_LT(b.corrected_heads, b.checked_heads);
  EXPECT_GT(b.recalled_pages - b.correction_pages, 0);
  if (GetParam() != RecallStrategy::kAuto) {
    EXPECT_EQ(b.recall_strategy, GetParam());
    EXPECT_EQ(a.recall_strategy, GetParam());
  }
  std::cout << "[ " << RecallStrategyName(b.recall_strategy) << " ] correction rate "
            << b.correction_rate() << ", recalled " << b.recalled_pages
            << " head-pages, worst output rel. difference " << worst_rel << ", " << swapped
            << " pages swapped by ties (" << oracle.near_ties() << " near-tied candidates)\n";
}

INSTANTIATE_TEST_SUITE_P(Strategies, RetrieverBackendsTest,
                         ::testing::Values(RecallStrategy::kBatchedDma, RecallStrategy::kZeroCopy,
                                           RecallStrategy::kAuto),
                         [](const ::testing::TestParamInfo<RecallStrategy>& param_info) {
                           return std::string(RecallStrategyName(param_info.param));
                         });

}  // namespace
}  // namespace kvtier
