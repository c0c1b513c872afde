// The Retriever in speculative mode on the cpu and cuda backends over the same trace (the
// same K/V appends and drifting queries): after every BeginStep of every layer the slot
// tables must be equal, the attention outputs equal within fp16 tolerance, and the recall
// and correction statistics equal at the end; once per recall strategy (the cpu backend
// runs the same strategy). Skips itself when no CUDA device is usable (ctest label `gpu`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/registry.h"
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
  return o;
}

// Tokens appended before step s (after the prefill): mostly one, now and then a burst that
// crosses page boundaries.
int32_t AppendBefore(int32_t step) { return step % 6 == 5 ? 7 : 1; }

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
  }
  std::vector<TypedBuffer> prefill_k, prefill_v;  // [layer]
  std::vector<TypedBuffer> queries;               // [layer][step]
  std::vector<TypedBuffer> step_k, step_v;        // [step][layer]
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

  double worst_rel = 0;
  for (int32_t s = 0; s < kSteps; ++s) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      std::vector<int32_t> tables[2];
      std::vector<float> outs[2];
      int32_t num_slots[2] = {0, 0}, num_tokens[2] = {0, 0};
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
        KVTIER_ASSERT_OK(ret.Attend(l, q, in[r].out[l], nullptr));
        TypedBuffer out(g.dtype, qn);
        KVTIER_ASSERT_OK(runners[r]->Download(out.data(), in[r].out[l], q_bytes));
        outs[r] = out.ToFloats();
        KVTIER_ASSERT_OK(ret.EndStep(l, q));
      }
      ASSERT_EQ(num_slots[0], num_slots[1]);
      ASSERT_EQ(num_tokens[0], num_tokens[1]);
      if (tables[0] != tables[1]) {
        // Say whether the heads hold the same pages in other slots, or other pages.
        bool same_pages = true;
        for (int32_t h = 0; h < g.num_kv_heads; ++h) {
          std::vector<int32_t> pages[2];
          for (int r = 0; r < 2; ++r) {
            pages[r].assign(tables[r].begin() + int64_t{h} * num_slots[r],
                            tables[r].begin() + int64_t{h + 1} * num_slots[r]);
            std::sort(pages[r].begin(), pages[r].end());
          }
          same_pages = same_pages && pages[0] == pages[1];
        }
        ASSERT_EQ(tables[0], tables[1])
            << "step " << s << " layer " << l << ": slot tables differ ("
            << (same_pages ? "same pages per head, other slots" : "other pages selected") << ")";
      }
      double num = 0, den = 0, max_abs = 0;
      for (int64_t i = 0; i < qn; ++i) {
        const double diff = double(outs[1][i]) - outs[0][i];
        num += diff * diff;
        den += double(outs[0][i]) * outs[0][i];
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
  EXPECT_EQ(a.recalled_pages, b.recalled_pages);
  EXPECT_EQ(a.recalled_bytes, b.recalled_bytes);
  EXPECT_EQ(a.correction_pages, b.correction_pages);
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
            << " head-pages, worst output rel. difference " << worst_rel << "\n";
}

INSTANTIATE_TEST_SUITE_P(Strategies, RetrieverBackendsTest,
                         ::testing::Values(RecallStrategy::kSlabDma, RecallStrategy::kBatchedDma,
                                           RecallStrategy::kZeroCopy, RecallStrategy::kAuto),
                         [](const ::testing::TestParamInfo<RecallStrategy>& param_info) {
                           return std::string(RecallStrategyName(param_info.param));
                         });

}  // namespace
}  // namespace kvtier
