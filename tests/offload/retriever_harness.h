// The Retriever test harness: a small geometry, a host tier, a host model of the sequence
// (dense K/V per layer, Quest selection), working-set consistency checks, and a Harness that
// drives one Retriever on the CPU backend. Shared by the Retriever's test files.
#ifndef KVTIER_TESTS_OFFLOAD_RETRIEVER_HARNESS_H_
#define KVTIER_TESTS_OFFLOAD_RETRIEVER_HARNESS_H_

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/device.h"
#include "kvtier/layout.h"
#include "offload/cold_pages.h"
#include "offload/host_tier.h"
#include "offload/page_pool.h"
#include "offload/retriever.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::retriever_test {

// The backend of a test built twice (once for cpu, once, labelled gpu, with KVTIER_TEST_CUDA
// for cuda), and a device of it: null when none is usable, and the test skips.
#ifdef KVTIER_TEST_CUDA
inline constexpr DeviceKind kTestKind = DeviceKind::kCuda;
#else
inline constexpr DeviceKind kTestKind = DeviceKind::kCpu;
#endif
inline std::unique_ptr<Device> MakeTestDevice() {
  absl::StatusOr<std::unique_ptr<Device>> d = CreateDevice(kTestKind);
  return d.ok() ? *std::move(d) : nullptr;
}
#define KVTIER_SKIP_WITHOUT_TEST_DEVICE()                                                       \
  if (::kvtier::retriever_test::MakeTestDevice() == nullptr)                                    \
  GTEST_SKIP() << "no usable " << ::kvtier::DeviceKindName(::kvtier::retriever_test::kTestKind) \
               << " device"

using testing::TypedBuffer;

inline Geometry SmallGeometry(DType dtype = DType::kF32) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.page_size = 8;
  g.dtype = dtype;
  return g;
}

inline SequenceOptions SmallOptions(RetrievalMode mode) {
  SequenceOptions o;
  o.mode = mode;
  o.sink_pages = 1;
  o.selected_pages = 3;
  o.recent_pages = 2;
  o.max_tokens = 512;
  o.stream_chunk_items = 2;  // several chunks per recall: exercises the double buffer
  o.deadline = absl::Seconds(20);
  return o;
}

// Host memory for a page pool, freed after the pool.
struct HostMemory {
  HostMemory(const Geometry& g, int64_t pages) {
    bytes = static_cast<size_t>(pages) * g.host_page_bytes();
    mem = static_cast<uint8_t*>(std::aligned_alloc(PagePool::kSlotAlignment, bytes));
    pool = PagePool::Create(mem, g.host_page_bytes(), pages).value();
  }
  ~HostMemory() {
    pool.reset();
    std::free(mem);
  }
  size_t bytes = 0;
  uint8_t* mem = nullptr;
  std::unique_ptr<PagePool> pool;
};

// A host tier over a HostMemory's pool that records what the Retriever commits, and
// refuses commits (FAILED_PRECONDITION, as a fenced region does) once `refuse` is set.
class CommitLog final : public kvtier::HostTier {
 public:
  explicit CommitLog(PagePool& pool) : pool_(pool) {}
  PagePool& pool() override { return pool_; }
  absl::Status Commit(std::span<const StoredPage> pages) override {
    if (refuse) return absl::FailedPreconditionError("commit refused: the region moved on");
    committed.insert(committed.end(), pages.begin(), pages.end());
    return absl::OkStatus();
  }
  std::vector<StoredPage> Take() { return std::exchange(committed, {}); }

  bool refuse = false;
  std::vector<StoredPage> committed;

 private:
  PagePool& pool_;
};

// The sequence as the engine sees it: dense K/V per layer, kept on the host as the model.
class HostModel {
 public:
  HostModel(const Geometry& g, uint64_t seed) : g_(g), rng_(seed) {}

  // n tokens of random K/V for every layer; returns the new rows per layer.
  std::vector<std::pair<TypedBuffer, TypedBuffer>> Grow(int32_t n) {
    std::vector<std::pair<TypedBuffer, TypedBuffer>> rows;
    const int64_t per_token = int64_t{g_.num_kv_heads} * g_.head_dim;
    if (k_.empty()) k_.resize(g_.num_layers), v_.resize(g_.num_layers);
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      TypedBuffer k(g_.dtype, n * per_token), v(g_.dtype, n * per_token);
      k.FillNormal(rng_());
      v.FillNormal(rng_());
      for (int64_t i = 0; i < n * per_token; ++i) {
        k_[l].push_back(k.Get(i));
        v_[l].push_back(v.Get(i));
      }
      rows.emplace_back(std::move(k), std::move(v));
    }
    tokens_ += n;
    return rows;
  }
  TypedBuffer Query(uint64_t seed) const {
    TypedBuffer q(g_.dtype, int64_t{g_.num_q_heads} * g_.head_dim);
    q.FillNormal(seed);
    return q;
  }
  float K(int32_t layer, int64_t token, int32_t h, int32_t i) const {
    return k_[layer][(token * g_.num_kv_heads + h) * g_.head_dim + i];
  }
  float V(int32_t layer, int64_t token, int32_t h, int32_t i) const {
    return v_[layer][(token * g_.num_kv_heads + h) * g_.head_dim + i];
  }
  int32_t tokens() const { return tokens_; }

  // SummaryMode::kKeyCodes: query head qh's scaled score of `page` from the bounds and the
  // 4-bit codes of its keys (kernels/ops.h: the log-sum-exp of the decoded keys' scaled
  // logits), in double.
  double KeyCodeScore(int32_t layer, const TypedBuffer& q, int32_t qh, int32_t h,
                      int32_t page, double scale) const {
    const int32_t p = g_.page_size, d = g_.head_dim;
    std::vector<float> hi(static_cast<size_t>(d), -INFINITY), lo(static_cast<size_t>(d), INFINITY);
    for (int32_t t = page * p; t < (page + 1) * p; ++t) {
      for (int32_t i = 0; i < d; ++i) {
        hi[static_cast<size_t>(i)] = std::max(hi[static_cast<size_t>(i)], K(layer, t, h, i));
        lo[static_cast<size_t>(i)] = std::min(lo[static_cast<size_t>(i)], K(layer, t, h, i));
      }
    }
    std::vector<double> logits;
    for (int32_t t = page * p; t < (page + 1) * p; ++t) {
      double s = 0;
      for (int32_t i = 0; i < d; ++i) {
        const float l = lo[static_cast<size_t>(i)];
        const float step = (hi[static_cast<size_t>(i)] - l) / 16.0f;
        const float x = step > 0 ? std::floor((K(layer, t, h, i) - l) / step) : 0.0f;
        const double c = std::clamp(x, 0.0f, 15.0f);
        s += double{q.Get(int64_t{qh} * d + i)} * (l + (c + 0.5) * step);
      }
      logits.push_back(scale * s);
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double x : logits) sum += std::exp(x - m);
    return m + std::log(sum);
  }

  // Quest scores over the page summaries `o.summary` names (per-dimension max/min, or mean ±
  // mean absolute deviation, computed as the CPU kernel does) of every full page, pooled as
  // the Retriever pools them (per query head a softmax over the full pages of the scaled
  // scores, then the mean over the group), then the top k among full pages
  // [sink, full − recent_full): the selection a host model expects.
  std::vector<int32_t> Select(int32_t layer, const TypedBuffer& q, int32_t h, int32_t tokens,
                              const SequenceOptions& o) const {
    const int32_t p = g_.page_size;
    const int32_t full = tokens / p;
    const int32_t total = (tokens + p - 1) / p;
    const int32_t recent_lo = std::max(o.sink_pages, total - o.recent_pages);
    const int32_t recent_full = std::max(0, full - recent_lo);
    const int32_t G = g_.group_size();
    const double scale =
        o.softmax_scale > 0 ? o.softmax_scale : 1.0 / std::sqrt(static_cast<double>(g_.head_dim));
    std::vector<double> pooled(static_cast<size_t>(full), 0.0);
    for (int32_t qh = h * G; qh < (h + 1) * G; ++qh) {
      std::vector<double> raw(static_cast<size_t>(full));
      for (int32_t page = 0; page < full; ++page) {
        if (o.summary == SummaryMode::kKeyCodes) {
          raw[static_cast<size_t>(page)] = KeyCodeScore(layer, q, qh, h, page, scale);
          continue;
        }
        double s = 0;
        for (int32_t i = 0; i < g_.head_dim; ++i) {
          float hi = -INFINITY, lo = INFINITY;
          if (o.summary == SummaryMode::kMinMax) {
            for (int32_t t = page * p; t < (page + 1) * p; ++t) {
              hi = std::max(hi, K(layer, t, h, i));
              lo = std::min(lo, K(layer, t, h, i));
            }
          } else {
            float centre = 0, dev = 0;
            for (int32_t t = page * p; t < (page + 1) * p; ++t) centre += K(layer, t, h, i);
            centre /= static_cast<float>(p);
            for (int32_t t = page * p; t < (page + 1) * p; ++t) {
              dev += std::fabs(K(layer, t, h, i) - centre);
            }
            const float mad = dev / static_cast<float>(p);
            hi = centre + mad;
            lo = centre - mad;
          }
          const float qi = q.Get(int64_t{qh} * g_.head_dim + i);
          s += std::max(qi * hi, qi * lo);
        }
        raw[static_cast<size_t>(page)] = scale * s;
      }
      double m = -INFINITY, sum = 0;
      for (double r : raw) m = std::max(m, r);
      for (double r : raw) sum += std::exp(r - m);
      for (int32_t page = 0; page < full; ++page) {
        pooled[static_cast<size_t>(page)] += std::exp(raw[static_cast<size_t>(page)] - m) / sum / G;
      }
    }
    std::vector<std::pair<double, int32_t>> scored;
    for (int32_t page = o.sink_pages; page < full - recent_full; ++page) {
      scored.push_back({-pooled[static_cast<size_t>(page)], page});
    }
    std::sort(scored.begin(), scored.end());
    std::vector<int32_t> out;
    for (size_t i = 0; i < scored.size() && i < static_cast<size_t>(o.selected_pages); ++i) {
      out.push_back(scored[i].second);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  const Geometry g_;
  std::mt19937_64 rng_;
  std::vector<std::vector<float>> k_, v_;
  int32_t tokens_ = 0;
};

// Attention of query q over exactly the tokens each KV head's slot table names (the host
// model of what the working set holds), fp64.
inline std::vector<float> AttentionOverTable(const Geometry& g, const HostModel& seq, int32_t layer,
                                      const TypedBuffer& q, const std::vector<int32_t>& table,
                                      int32_t num_slots, int32_t tokens) {
  const int32_t p = g.page_size;
  const int32_t G = g.group_size();
  const double scale = 1.0 / std::sqrt(double(g.head_dim));
  std::vector<float> out(static_cast<size_t>(g.num_q_heads) * g.head_dim, 0.0f);
  for (int32_t qh = 0; qh < g.num_q_heads; ++qh) {
    const int32_t h = qh / G;
    std::vector<int32_t> pos;
    for (int32_t s = 0; s < num_slots; ++s) {
      const int32_t page = table[static_cast<size_t>(h) * num_slots + s];
      for (int32_t t = 0; page >= 0 && t < p && page * p + t < tokens; ++t) {
        pos.push_back(page * p + t);
      }
    }
    std::vector<double> w(pos.size());
    double mx = -INFINITY;
    for (size_t j = 0; j < pos.size(); ++j) {
      double dot = 0;
      for (int32_t i = 0; i < g.head_dim; ++i) {
        dot += double(q.Get(int64_t{qh} * g.head_dim + i)) * seq.K(layer, pos[j], h, i);
      }
      w[j] = dot * scale;
      mx = std::max(mx, w[j]);
    }
    double sum = 0;
    for (double& x : w) sum += (x = std::exp(x - mx));
    for (int32_t i = 0; i < g.head_dim; ++i) {
      double acc = 0;
      for (size_t j = 0; j < pos.size(); ++j) acc += w[j] * seq.V(layer, pos[j], h, i);
      out[static_cast<size_t>(qh) * g.head_dim + i] = static_cast<float>(acc / sum);
    }
  }
  return out;
}

// A cold tier in memory, with injectable faults.
class MemoryColdPages final : public ColdPages {
 public:
  absl::Status PutBatch(std::span<const StoredPage> batch,
                        std::span<const std::span<const uint8_t>> bytes) override {
    if (!put_error.ok()) return put_error;
    for (size_t i = 0; i < batch.size(); ++i) {
      pages[{batch[i].layer, batch[i].page}].assign(bytes[i].begin(), bytes[i].end());
      ++puts;
    }
    return absl::OkStatus();
  }
  absl::Status GetBatch(std::span<const Read> reads) override {
    if (!get_error.ok()) return get_error;
    for (const Read& r : reads) {
      auto it = pages.find({r.layer, r.page});
      if (it == pages.end()) return absl::NotFoundError("never demoted");
      if (it->second.size() != r.out.size()) return absl::InternalError("size");
      std::memcpy(r.out.data(), it->second.data(), r.out.size());
      ++gets;
    }
    return absl::OkStatus();
  }
  std::map<std::pair<int32_t, int64_t>, std::vector<uint8_t>> pages;
  absl::Status put_error, get_error;
  int64_t puts = 0, gets = 0;
};

// A host tier over a pool with a cold tier behind it; records withdrawals and commits.
class ColdHostTier final : public HostTier {
 public:
  ColdHostTier(PagePool& pool, MemoryColdPages& cold) : pool_(pool), cold_(cold) {}
  PagePool& pool() override { return pool_; }
  absl::Status Commit(std::span<const StoredPage> pages) override {
    for (const StoredPage& p : pages) live[{p.layer, p.page}] = p.slot;
    return absl::OkStatus();
  }
  ColdPages* cold() override { return &cold_; }
  absl::Status Withdraw(int32_t layer, int64_t page) override {
    if (live.erase({layer, page}) != 1) return absl::InternalError("withdrew an unpublished page");
    ++withdrawn;
    return absl::OkStatus();
  }
  std::map<std::pair<int32_t, int64_t>, int64_t> live;  // published (layer, page) → slot
  int64_t withdrawn = 0;

 private:
  PagePool& pool_;
  MemoryColdPages& cold_;
};

// The pages of head h's selected region, sorted.
inline std::vector<int32_t> SelectedRegion(const WorkingSetView& view, const SequenceOptions& o,
                                           int32_t h) {
  std::vector<int32_t> pages;
  for (int32_t s = o.sink_pages; s < o.sink_pages + o.selected_pages; ++s) {
    const int32_t page = view.slot_table[h * view.num_slots + s];
    if (page >= 0) pages.push_back(page);
  }
  std::sort(pages.begin(), pages.end());
  return pages;
}

// Every slot the table names holds that page's K and V for that head, bit for bit, no page
// appears twice for a head, and every page of the sequence that must be resident (sinks,
// recent window) is.
inline void ExpectWorkingSetConsistent(const Geometry& g, const SequenceOptions& o,
                                       const HostModel& seq, const WorkingSetView& view) {
  const WorkingSetLayout wl{view.num_slots, g.page_size, g.num_kv_heads, g.head_dim};
  const int32_t p = g.page_size;
  const int32_t total = (view.num_tokens + p - 1) / p;
  for (int32_t h = 0; h < g.num_kv_heads; ++h) {
    std::set<int32_t> seen;
    for (int32_t s = 0; s < view.num_slots; ++s) {
      const int32_t page = view.slot_table[h * view.num_slots + s];
      if (page < 0) continue;
      ASSERT_TRUE(seen.insert(page).second) << "head " << h << " page " << page << " twice";
      ASSERT_LT(page, total);
      const int32_t len = std::min(p, view.num_tokens - page * p);
      for (int32_t t = 0; t < len; ++t) {
        for (int32_t i = 0; i < g.head_dim; ++i) {
          const int64_t off = wl.Offset(s, t, h, i);
          ASSERT_EQ(testing::LoadElement(view.k_cache, g.dtype, off),
                    seq.K(view.layer, int64_t{page} * p + t, h, i))
              << "head " << h << " slot " << s << " page " << page << " token " << t;
          ASSERT_EQ(testing::LoadElement(view.v_cache, g.dtype, off),
                    seq.V(view.layer, int64_t{page} * p + t, h, i));
        }
      }
    }
    if (o.mode == RetrievalMode::kDrop) continue;
    for (int32_t page = 0; page < std::min(o.sink_pages, total); ++page) {
      EXPECT_TRUE(seen.contains(page)) << "sink page " << page << " of head " << h;
    }
    const int32_t window = o.mode == RetrievalMode::kFull ? total : o.recent_pages;
    for (int32_t page = std::max(0, total - window); page < total; ++page) {
      EXPECT_TRUE(seen.contains(page)) << "recent page " << page << " of head " << h;
    }
  }
}

struct Harness {
  Harness(const Geometry& g, const SequenceOptions& o, Backend* backend_in = nullptr,
          uint64_t seed = 7)
      : geometry(g), options(o), seq(g, seed) {
    if (backend_in == nullptr) {
      own_backend = NewCpuBackend(2);
      backend = own_backend.get();
    } else {
      backend = backend_in;
    }
    tier = std::make_unique<HostMemory>(g, int64_t{g.num_layers} * (o.max_tokens / g.page_size));
    auto log = std::make_unique<CommitLog>(*tier->pool);
    commits = log.get();
    retriever = Retriever::Create(g, o, *backend, std::move(log)).value();
  }
  ~Harness() { retriever.reset(); }

  // Appends n random tokens to every layer. Nothing waits: the rows are kept alive until
  // the harness is destroyed, as an engine keeps its buffers until its stream ran.
  void Append(int32_t n) {
    auto rows = seq.Grow(n);
    for (int32_t l = 0; l < geometry.num_layers; ++l) {
      ASSERT_TRUE(retriever->Append(l, rows[l].first.data(), rows[l].second.data(), n).ok());
    }
    for (auto& r : rows) {
      keep.push_back(std::move(r.first));
      keep.push_back(std::move(r.second));
    }
  }
  // Waits for the compute stream only (what an engine waits for before reading outputs);
  // background recalls may still be running.
  void WaitCompute() {
    auto e = backend->CreateEvent().value();
    ASSERT_TRUE(retriever->compute_stream().Record(*e).ok());
    ASSERT_TRUE(e->Wait(absl::Seconds(20)).ok());
  }
  // One decode step of every layer with query q; returns the views and the outputs. With
  // `check`, the working sets are checked after attention, before EndStep hands them to the
  // background recall.
  struct StepResult {
    std::vector<WorkingSetView> views;
    std::vector<std::vector<float>> out;
  };
  StepResult Step(const TypedBuffer& q_in, bool end = true, bool check = false) {
    keep.push_back(q_in);
    const TypedBuffer& q = keep.back();
    StepResult r;
    std::vector<TypedBuffer> outs;
    for (int32_t l = 0; l < geometry.num_layers; ++l) {
      auto view = retriever->BeginStep(l, q.data());
      EXPECT_TRUE(view.ok()) << view.status();
      if (!view.ok()) return r;
      r.views.push_back(*view);
      outs.emplace_back(geometry.dtype, int64_t{geometry.num_q_heads} * geometry.head_dim);
      EXPECT_TRUE(retriever->Attend(l, q.data(), outs.back().data(), nullptr).ok());
    }
    WaitCompute();
    for (auto& o : outs) r.out.push_back(o.ToFloats());
    // Snapshot before EndStep: the background recall rewrites the selected region.
    snapshot_tables.clear();
    for (const WorkingSetView& v : r.views) {
      snapshot_tables.emplace_back(v.slot_table,
                                   v.slot_table + geometry.num_kv_heads * v.num_slots);
      if (check) ExpectWorkingSetConsistent(geometry, options, seq, v);
    }
    if (end) {
      for (int32_t l = 0; l < geometry.num_layers; ++l) {
        EXPECT_TRUE(retriever->EndStep(l, q.data()).ok());
      }
    }
    return r;
  }

  std::deque<TypedBuffer> keep;
  Geometry geometry;
  SequenceOptions options;
  HostModel seq;
  std::unique_ptr<Backend> own_backend;
  Backend* backend;
  std::unique_ptr<HostMemory> tier;
  CommitLog* commits = nullptr;  // owned by the Retriever
  std::unique_ptr<Retriever> retriever;
  std::vector<std::vector<int32_t>> snapshot_tables;
};

}  // namespace kvtier::retriever_test

#endif  // KVTIER_TESTS_OFFLOAD_RETRIEVER_HARNESS_H_
