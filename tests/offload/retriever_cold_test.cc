// host_drop = demote on the CPU backend: a host tier far smaller than the sequence demotes
// its lowest-scoring pages to a cold tier, and a step that selects one brings it back
// through the host tier. The same trace run over a host tier that holds everything is the
// reference: every step's attention output must be bit-identical, and every working set
// must hold exactly the tokens its slot table names. Faults of the cold tier are errors of
// the call that met them, never wrong data.
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "offload/cold_pages.h"
#include "offload/retriever.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier {
namespace {

using namespace retriever_test;  // NOLINT: the harness is this test's vocabulary
using testing::TypedBuffer;

SequenceOptions DemoteOptions(RetrievalMode mode, RecallStrategy recall) {
  SequenceOptions o = SmallOptions(mode);
  o.recall = recall;
  o.policy.residency = "h2o";
  o.policy.host_drop = "demote";
  return o;
}

// Two sequences fed the same trace: `ref` over a host tier that holds every page, `cold`
// over `host_pages` with host_drop = demote.
struct Pair {
  Pair(const Geometry& g, const SequenceOptions& o, int64_t host_pages)
      : geometry(g), options(o), backend(NewCpuBackend(2)), big(g, 256), small(g, host_pages),
        seq(g, 11) {
    SequenceOptions ro = o;
    ro.policy.host_drop = "refuse";
    ref = Retriever::Create(g, ro, *backend, big.pool.get()).value();
    auto tier = std::make_unique<ColdHostTier>(*small.pool, store);
    host = tier.get();
    auto r = Retriever::Create(g, o, *backend, std::move(tier));
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) cold = *std::move(r);
  }
  ~Pair() {
    cold.reset();
    ref.reset();
  }

  // Appends a page of tokens to every layer of both; the status of the cold one's appends.
  absl::Status Append() {
    auto rows = seq.Grow(geometry.page_size);
    absl::Status st;
    for (int32_t l = 0; l < geometry.num_layers; ++l) {
      EXPECT_TRUE(ref->Append(l, rows[l].first.data(), rows[l].second.data(), geometry.page_size)
                      .ok());
      if (st.ok()) st = cold->Append(l, rows[l].first.data(), rows[l].second.data(),
                                     geometry.page_size);
    }
    for (auto& x : rows) keep.push_back(std::move(x.first)), keep.push_back(std::move(x.second));
    return st;
  }

  // One step of every layer on both, comparing outputs bit for bit and checking the cold
  // one's working sets against the model.
  void Step(int32_t step) {
    const TypedBuffer q = seq.Query(step);
    const size_t n = static_cast<size_t>(geometry.num_q_heads) * geometry.head_dim;
    TypedBuffer want(geometry.dtype, static_cast<int64_t>(n));
    TypedBuffer got(geometry.dtype, static_cast<int64_t>(n));
    for (int32_t l = 0; l < geometry.num_layers; ++l) {
      ASSERT_TRUE(ref->BeginStep(l, q.data()).ok());
      ASSERT_TRUE(ref->Attend(l, q.data(), want.data(), nullptr).ok());
      ASSERT_TRUE(ref->Wait().ok());
      ASSERT_TRUE(ref->EndStep(l, q.data()).ok());
      auto view = cold->BeginStep(l, q.data());
      ASSERT_TRUE(view.ok()) << "step " << step << " layer " << l << ": " << view.status();
      ASSERT_TRUE(cold->Attend(l, q.data(), got.data(), nullptr).ok());
      ASSERT_TRUE(cold->Wait().ok());
      ExpectWorkingSetConsistent(geometry, options, seq, *view);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), n * DTypeSize(geometry.dtype)), 0)
          << "step " << step << " layer " << l << ": outputs differ";
      ASSERT_TRUE(cold->EndStep(l, q.data()).ok());
    }
  }

  Geometry geometry;
  SequenceOptions options;
  std::unique_ptr<Backend> backend;
  HostMemory big, small;
  HostModel seq;
  MemoryColdPages store;
  ColdHostTier* host = nullptr;
  std::unique_ptr<Retriever> ref, cold;
  std::vector<TypedBuffer> keep;
};

TEST(RetrieverColdTest, DemotedPagesComeBackWhenSelectedBitIdentical) {
  const Geometry g = SmallGeometry();
  for (RetrievalMode mode : {RetrievalMode::kSync, RetrievalMode::kSpeculative}) {
    for (RecallStrategy recall : {RecallStrategy::kBatchedDma}) {
      SCOPED_TRACE(std::string(RetrievalModeName(mode)) + " " +
                   std::string(RecallStrategyName(recall)));
      // 12 host pages per layer; the sequence grows to 28 pages per layer.
      Pair p(g, DemoteOptions(mode, recall), 24);
      ASSERT_NE(p.cold, nullptr);
      for (int32_t step = 0; step < 28; ++step) {
        const absl::Status st = p.Append();
        ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
        p.Step(step);
        if (HasFatalFailure()) return;
      }
      ASSERT_TRUE(p.cold->Flush().ok());
      const SequenceStats st = p.cold->Stats();
      EXPECT_GT(st.host_demoted_pages, 0);
      EXPECT_GT(st.host_promoted_pages, 0) << "no step ever selected a demoted page";
      // A page is written once, however often it is demoted.
      EXPECT_EQ(st.cold_written_pages, p.store.puts);
      EXPECT_LE(st.cold_written_pages, st.host_demoted_pages);
      EXPECT_EQ(st.host_promoted_pages, p.store.gets);
      EXPECT_EQ(p.host->withdrawn, st.host_demoted_pages);
      // What the host tier publishes is exactly the pages it holds.
      const PagePoolStats ps = p.small.pool->stats();
      EXPECT_EQ(static_cast<int64_t>(p.host->live.size()), ps.in_use);
      EXPECT_EQ(ps.capacity, 24);
      EXPECT_EQ(p.ref->Stats().host_demoted_pages, 0);
    }
  }
}

TEST(RetrieverColdTest, ColdTierFaultsFailTheCallNotTheData) {
  const Geometry g = SmallGeometry();
  Pair p(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kBatchedDma), 24);
  ASSERT_NE(p.cold, nullptr);
  int32_t step = 0;
  // Fill the host tier: 12 pages per layer.
  for (; step < 12; ++step) {
    ASSERT_TRUE(p.Append().ok());
    p.Step(step);
    ASSERT_FALSE(HasFatalFailure());
  }
  // A cold tier that refuses writes: the append that needs room fails with its status and
  // the sequence stays usable (nothing left the host tier).
  p.store.put_error = absl::UnavailableError("cold tier down");
  ASSERT_EQ(p.small.pool->stats().in_use, 24);
  const absl::Status st = p.Append();
  ASSERT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_NE(st.message().find("to the cold tier"), std::string::npos) << st;
  EXPECT_EQ(p.small.pool->stats().in_use, 24);
  EXPECT_EQ(p.cold->Stats().host_demoted_pages, 0);
  EXPECT_TRUE(p.cold->Flush().ok()) << "a refused demotion must not fail the sequence";

  // A page with no intact cold copy: the step that selects it fails with the tier's
  // DATA_LOSS, and the sequence with it (its working set would lack the page), never
  // attending over wrong bytes.
  Pair q(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kBatchedDma), 24);
  ASSERT_NE(q.cold, nullptr);
  q.store.get_error = absl::DataLossError("checksum mismatch on every replica");
  absl::Status failed;
  for (step = 0; step < 28 && failed.ok(); ++step) {
    ASSERT_TRUE(q.Append().ok());
    const TypedBuffer query = q.seq.Query(step);
    for (int32_t l = 0; l < g.num_layers && failed.ok(); ++l) {
      auto view = q.cold->BeginStep(l, query.data());
      if (!view.ok()) {
        failed = view.status();
        break;
      }
      ASSERT_TRUE(q.cold->Wait().ok());
      ExpectWorkingSetConsistent(g, q.options, q.seq, *view);
      ASSERT_TRUE(q.cold->EndStep(l, query.data()).ok());
    }
  }
  ASSERT_TRUE(absl::IsDataLoss(failed)) << failed;
  EXPECT_NE(failed.message().find("from the cold tier"), std::string::npos) << failed;
  EXPECT_EQ(q.cold->Flush().code(), absl::StatusCode::kDataLoss);
}

TEST(RetrieverColdTest, DemoteNeedsAColdTierAndADmaStrategy) {
  const Geometry g = SmallGeometry();
  auto backend = NewCpuBackend(1);
  HostMemory mem(g, 32);
  MemoryColdPages store;
  {
    // No cold tier behind the host tier.
    auto r = Retriever::Create(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kAuto),
                               *backend, mem.pool.get());
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    EXPECT_NE(r.status().message().find("no cold tier"), std::string::npos) << r.status();
  }
  {
    auto r = Retriever::Create(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kZeroCopy),
                               *backend, std::make_unique<ColdHostTier>(*mem.pool, store));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("zero_copy"), std::string::npos) << r.status();
  }
  {
    auto r = Retriever::Create(g, DemoteOptions(RetrievalMode::kDrop, RecallStrategy::kAuto),
                               *backend, std::make_unique<ColdHostTier>(*mem.pool, store));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("no host tier"), std::string::npos) << r.status();
  }
  {
    HostMemory tiny(g, 19);  // 2 × (1 + 2 + 1) + 2 × 2 × 3 = 20 pages at least
    auto r = Retriever::Create(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kAuto),
                               *backend, std::make_unique<ColdHostTier>(*tiny.pool, store));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("needs at least 20"), std::string::npos) << r.status();
  }
  {
    // auto resolves to a DMA strategy.
    auto r = Retriever::Create(g, DemoteOptions(RetrievalMode::kSync, RecallStrategy::kAuto),
                               *backend, std::make_unique<ColdHostTier>(*mem.pool, store));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE((*r)->Stats().recall_strategy, RecallStrategy::kZeroCopy);
  }
}

}  // namespace
}  // namespace kvtier
