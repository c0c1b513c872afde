// Retriever on the CPU backend: working-set contents against a host model of selection,
// speculation, correction, the modes against each other, appends, ordering under a backend
// that delays work, deadlines, cancellation, and long runs (for ASan/TSan builds).
#include "offload/retriever.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/layout.h"
#include "offload/page_pool.h"
#include "offload/recall_strategy.h"
#include "tests/offload/retriever_harness.h"
#include "tests/testutil/chaos_backend.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using namespace retriever_test;  // NOLINT: the harness is this test's vocabulary
using testing::TypedBuffer;

TEST(RetrieverTest, SyncWorkingSetEqualsSelection) {
  for (const SummaryMode summary :
       {SummaryMode::kCenterMad, SummaryMode::kMinMax, SummaryMode::kKeyCodes})
  for (RecallStrategy strategy : kRecallStrategies) {
    SCOPED_TRACE(std::string(SummaryModeName(summary)) + " summaries");
    const Geometry g = SmallGeometry();
    SequenceOptions o = SmallOptions(RetrievalMode::kSync);
    o.recall = strategy;
    o.summary = summary;
    Harness h(g, o);
    h.Append(150);  // 18 full pages + a partial one
    for (int step = 0; step < 6; ++step) {
      const TypedBuffer q = h.seq.Query(100 + step);
      auto r = h.Step(q, /*end=*/false);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        ExpectWorkingSetConsistent(g, o, h.seq, r.views[l]);
        for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
          EXPECT_EQ(SelectedRegion(r.views[l], o, kh), h.seq.Select(l, q, kh, h.seq.tokens(), o))
              << "layer " << l << " head " << kh << " step " << step;
        }
      }
      for (int32_t l = 0; l < g.num_layers; ++l)
        ASSERT_TRUE(h.retriever->EndStep(l, q.data()).ok());
      h.Append(1 + step * 3);
    }
    ASSERT_TRUE(h.retriever->Wait().ok());
    const SequenceStats st = h.retriever->Stats();
    EXPECT_GT(st.recalled_pages, 0);
    // Churn, not budget: over 6 steps far fewer than 6 · layers · heads · k head-pages.
    EXPECT_LT(st.recalled_pages, 6 * g.num_layers * g.num_kv_heads * o.selected_pages);
    EXPECT_EQ(st.recalled_bytes, st.recalled_pages * g.slab_elements() * 4);
    // Summaries of every page the sequence can hold, and with key codes their codes.
    const int64_t pages = (o.max_tokens + g.page_size - 1) / g.page_size;
    EXPECT_EQ(st.selection_bytes,
              g.num_layers * pages *
                  static_cast<int64_t>(g.summary_bytes() +
                                       (summary == SummaryMode::kKeyCodes ? g.key_code_bytes() : 0)));
  }
}

// A 128K-token context (the long contexts the benchmarks' defaults cover): page indices
// past 8K, positions past 2^16 and a host tier of 16K pages per layer; the working set is
// still exactly the host model's selection, step after step.
TEST(RetrieverTest, LongContextOf128KTokensSelectsLikeTheHostModel) {
  Geometry g = SmallGeometry(DType::kF16);
  g.page_size = 16;
  g.head_dim = 8;
  SequenceOptions o = SmallOptions(RetrievalMode::kSync);
  o.selected_pages = 8;
  o.max_tokens = 131072 + 64;
  Harness h(g, o);
  h.Append(131072 + 5);
  for (int step = 0; step < 3; ++step) {
    const TypedBuffer q = h.seq.Query(500 + step);
    auto r = h.Step(q, /*end=*/false);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ExpectWorkingSetConsistent(g, o, h.seq, r.views[l]);
      EXPECT_EQ(r.views[l].num_tokens, h.seq.tokens());
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        EXPECT_EQ(SelectedRegion(r.views[l], o, kh), h.seq.Select(l, q, kh, h.seq.tokens(), o))
            << "layer " << l << " head " << kh << " step " << step;
      }
    }
    for (int32_t l = 0; l < g.num_layers; ++l) ASSERT_TRUE(h.retriever->EndStep(l, q.data()).ok());
    h.Append(1);
  }
  ASSERT_TRUE(h.retriever->Wait().ok());
  EXPECT_GE(h.retriever->num_tokens(0), 131072);
}

TEST(RetrieverTest, UncorrectedHeadsAttendOverPreviousSelection) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = -2.0f;  // never corrects
  Harness h(g, o);
  h.Append(160);
  TypedBuffer prev = h.seq.Query(1);
  h.Step(prev);  // step 0 selects with its own query
  int differing = 0;
  for (int step = 1; step < 6; ++step) {
    const TypedBuffer q = h.seq.Query(10 + step);
    auto r = h.Step(q);
    const SequenceStats st = h.retriever->Stats();
    EXPECT_EQ(st.corrected_heads, 0);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        std::vector<int32_t> attended;
        for (int32_t s = o.sink_pages; s < o.sink_pages + o.selected_pages; ++s) {
          const int32_t page = h.snapshot_tables[l][kh * r.views[l].num_slots + s];
          if (page >= 0) attended.push_back(page);
        }
        std::sort(attended.begin(), attended.end());
        EXPECT_EQ(attended, h.seq.Select(l, prev, kh, h.seq.tokens(), o));
        differing += attended != h.seq.Select(l, q, kh, h.seq.tokens(), o);
      }
    }
    prev = q;
  }
  EXPECT_GT(differing, 0) << "queries too similar: the test cannot tell the selections apart";
}

TEST(RetrieverTest, ForcedDriftCorrectsExactlyTheDriftedHeads) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = 0.9f;
  Harness h(g, o);
  h.Append(160);
  const TypedBuffer q0 = h.seq.Query(3);
  h.Step(q0);
  // q1: KV head 0's group keeps its query; head 1's group gets a fresh one.
  const TypedBuffer fresh = h.seq.Query(4);
  TypedBuffer q1(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
  const int32_t G = g.group_size();
  for (int64_t i = 0; i < q1.size(); ++i) {
    const bool drifted_head = (i / g.head_dim) / G == 1;
    q1.Set(i, drifted_head ? fresh.Get(i) : q0.Get(i));
  }
  auto r = h.Step(q1, /*end=*/false);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    const StepStats st = h.retriever->LastStep(l);
    EXPECT_EQ(st.step, 1);
    ASSERT_EQ(st.drifted.size(), 2u);
    EXPECT_EQ(st.drifted[0], 0);
    EXPECT_EQ(st.drifted[1], 1);
    EXPECT_EQ(st.corrected_heads, 1);
    EXPECT_NEAR(st.group_mean[0], 1.0f, 1e-5f);
    EXPECT_LT(st.group_mean[1], 0.9f);
    EXPECT_EQ(SelectedRegion(r.views[l], o, 0), h.seq.Select(l, q0, 0, h.seq.tokens(), o));
    EXPECT_EQ(SelectedRegion(r.views[l], o, 1), h.seq.Select(l, q1, 1, h.seq.tokens(), o));
    ExpectWorkingSetConsistent(g, o, h.seq, r.views[l]);
  }
  ASSERT_TRUE(h.retriever->Wait().ok());
  const SequenceStats st = h.retriever->Stats();
  EXPECT_EQ(st.checked_heads, g.num_layers * g.num_kv_heads);  // step 0 is not a check
  EXPECT_EQ(st.corrected_heads, g.num_layers);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_EQ(st.corrections[l * g.num_kv_heads + 0], 0);
    EXPECT_EQ(st.corrections[l * g.num_kv_heads + 1], 1);
  }
}

// Queries that drift: mostly the previous query plus noise, with an occasional jump, so
// speculation is right for some heads and corrected for others.
class DriftingQuery {
 public:
  DriftingQuery(const HostModel& seq, uint64_t seed)
      : seq_(seq), seed_(seed), q_(seq.Query(seed)) {}
  const TypedBuffer& Next() {
    const TypedBuffer noise = seq_.Query(seed_ * 7919 + (++n_));
    const bool jump = n_ % 7 == 3;
    for (int64_t i = 0; i < q_.size(); ++i) {
      q_.Set(i, jump ? noise.Get(i) : 0.9f * q_.Get(i) + 0.5f * noise.Get(i));
    }
    return q_;
  }

 private:
  const HostModel& seq_;
  const uint64_t seed_;
  TypedBuffer q_;
  uint64_t n_ = 0;
};

// Runs `steps` decode steps with appends of one token (ten now and then, crossing page
// boundaries), checking the working sets, and returns every output.
std::vector<std::vector<float>> RunSteps(Harness& h, int steps, uint64_t qseed) {
  std::vector<std::vector<float>> outs;
  DriftingQuery q(h.seq, qseed);
  for (int step = 0; step < steps; ++step) {
    auto r = h.Step(q.Next(), /*end=*/true, /*check=*/true);
    for (auto& o : r.out) outs.push_back(std::move(o));
    h.Append(1 + (step % 5 == 4 ? 9 : 0));
  }
  return outs;
}

TEST(RetrieverTest, SyncEqualsSpeculativeWithTauOne) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions so = SmallOptions(RetrievalMode::kSync);
  SequenceOptions po = SmallOptions(RetrievalMode::kSpeculative);
  po.correction_threshold = 1.0f;
  Harness sync(g, so), spec(g, po);
  sync.Append(140);
  spec.Append(140);
  const auto a = RunSteps(sync, 12, 50);
  const auto b = RunSteps(spec, 12, 50);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "output " << i;
  ASSERT_TRUE(spec.retriever->Wait().ok());
  EXPECT_NEAR(spec.retriever->Stats().correction_rate(), 1.0, 1e-9);
}

TEST(RetrieverTest, FullModeEqualsDenseAttention) {
  const Geometry g = SmallGeometry();
  Harness h(g, SmallOptions(RetrievalMode::kFull));
  h.Append(77);
  for (int step = 0; step < 3; ++step) {
    const TypedBuffer q = h.seq.Query(70 + step);
    auto r = h.Step(q);
    // Dense attention on the host, in double: over a table naming every page for every head.
    const int32_t pages = (h.seq.tokens() + g.page_size - 1) / g.page_size;
    std::vector<int32_t> every;
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      for (int32_t p = 0; p < pages; ++p) every.push_back(p);
    }
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const std::vector<float> want =
          AttentionOverTable(g, h.seq, l, q, every, pages, h.seq.tokens());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_NEAR(r.out[l][i], want[i], 1e-4)
            << "layer " << l << " head " << i / g.head_dim;
      }
    }
    h.Append(5);
  }
}

TEST(RetrieverTest, AppendsAcrossPageBoundariesMatchTokenByToken) {
  const Geometry g = SmallGeometry(DType::kBF16);
  const SequenceOptions o = SmallOptions(RetrievalMode::kSync);
  Harness chunked(g, o, nullptr, 11), single(g, o, nullptr, 11);
  // Same rows; chunked appends 5, 13, 1, 40, 8, 3 tokens at a time.
  for (int32_t n : {5, 13, 1, 40, 8, 3}) {
    auto rows = chunked.seq.Grow(n);
    single.seq.Grow(n);
    const int64_t per = int64_t{g.num_kv_heads} * g.head_dim;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(
          chunked.retriever->Append(l, rows[l].first.data(), rows[l].second.data(), n).ok());
      for (int32_t t = 0; t < n; ++t) {
        const size_t off = static_cast<size_t>(t * per) * DTypeSize(g.dtype);
        ASSERT_TRUE(single.retriever
                        ->Append(l, static_cast<uint8_t*>(rows[l].first.data()) + off,
                                 static_cast<uint8_t*>(rows[l].second.data()) + off, 1)
                        .ok());
      }
    }
    ASSERT_TRUE(chunked.retriever->Wait().ok());
    ASSERT_TRUE(single.retriever->Wait().ok());
  }
  EXPECT_EQ(chunked.retriever->num_tokens(0), 70);
  const SequenceStats a = chunked.retriever->Stats(), b = single.retriever->Stats();
  EXPECT_EQ(a.offloaded_pages, g.num_layers * (70 / g.page_size));
  EXPECT_EQ(a.offloaded_pages, b.offloaded_pages);
  // Host tier: every full page of every layer, HND, bit for bit.
  for (Harness* h : {&chunked, &single}) {
    EXPECT_EQ(h->tier->pool->stats().in_use, a.offloaded_pages);
    const TypedBuffer q = h->seq.Query(5);
    auto r = h->Step(q);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ExpectWorkingSetConsistent(g, o, h->seq, r.views[l]);
      EXPECT_EQ(r.views[l].num_tokens, 70);
    }
  }
  auto ra = chunked.Step(chunked.seq.Query(6));
  auto rb = single.Step(single.seq.Query(6));
  EXPECT_EQ(ra.out, rb.out);
}

// Pages that land in consecutive slots are copied into the working set together: one copy
// of K and one of V for the run, so an Append that fills eight pages makes no more backend
// tasks than one that fills one (full mode: page L in slot L, no host tier).
TEST(RetrieverTest, AnAppendCopiesARunOfConsecutiveSlotsOnce) {
  const Geometry g = SmallGeometry(DType::kF16);
  const SequenceOptions o = SmallOptions(RetrievalMode::kFull);
  testing::ChaosOptions co;
  co.max_delay = absl::ZeroDuration();
  const auto tasks_of_append = [&](int32_t pages) {
    auto chaos = testing::NewChaosBackend(co);
    Harness h(g, o, chaos.get());
    EXPECT_TRUE(h.retriever->Wait().ok());
    const int64_t before = testing::GetChaosStats(*chaos).tasks_run;
    h.Append(pages * g.page_size);
    EXPECT_TRUE(h.retriever->Wait().ok());
    EXPECT_EQ(h.retriever->num_tokens(0), pages * g.page_size);
    return testing::GetChaosStats(*chaos).tasks_run - before;
  };
  EXPECT_EQ(tasks_of_append(8), tasks_of_append(1));
}

TEST(RetrieverTest, DropModeKeepsSinksAndSlidingWindow) {
  const Geometry g = SmallGeometry();
  const SequenceOptions o = SmallOptions(RetrievalMode::kDrop);
  Harness h(g, o);
  h.Append(100);  // 13 pages: sink 0, then the last 5 pages 8..12 in the ring
  auto r = h.Step(h.seq.Query(1));
  for (int32_t l = 0; l < g.num_layers; ++l) {
    ExpectWorkingSetConsistent(g, o, h.seq, r.views[l]);
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      std::vector<int32_t> pages(h.snapshot_tables[l].begin() + kh * r.views[l].num_slots,
                                 h.snapshot_tables[l].begin() + (kh + 1) * r.views[l].num_slots);
      std::sort(pages.begin(), pages.end());
      EXPECT_EQ(pages, (std::vector<int32_t>{0, 8, 9, 10, 11, 12}));
    }
  }
  EXPECT_EQ(h.tier->pool->stats().in_use, 0);  // no host tier
}

// The three recall strategies move the same bytes: speculative outputs agree bit for bit.
TEST(RetrieverTest, RecallStrategiesAgree) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions a = SmallOptions(RetrievalMode::kSpeculative);
  a.recall = RecallStrategy::kZeroCopy;
  Harness ha(g, a);
  ha.Append(130);
  const auto expected = RunSteps(ha, 10, 900);
  for (RecallStrategy strategy : {RecallStrategy::kBatchedDma}) {
    SequenceOptions b = a;
    b.recall = strategy;
    Harness hb(g, b);
    hb.Append(130);
    EXPECT_EQ(RunSteps(hb, 10, 900), expected) << RecallStrategyName(strategy);
    EXPECT_EQ(hb.retriever->Stats().recall_strategy, strategy);
    EXPECT_GT(hb.retriever->Stats().recalled_pages, 0);
  }
}

// Work on every stream is delayed by random amounts, so the streams interleave differently
// from the plain CPU backend; ordering by events must keep every result identical. With the
// backend's waits dropped, the same run must come out different (the check can fail).
TEST(RetrieverTest, DelayedAndReorderedWorkGivesTheSameResults) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = 0.5f;  // some heads corrected, some not
  Harness plain(g, o);
  plain.Append(150);
  const auto expected = RunSteps(plain, 8, 300);

  testing::ChaosOptions co;
  co.seed = 5;
  co.max_delay = absl::Milliseconds(2);
  auto chaos = testing::NewChaosBackend(co);
  Harness delayed(g, o, chaos.get());
  delayed.Append(150);
  EXPECT_EQ(RunSteps(delayed, 8, 300), expected);
  ASSERT_TRUE(delayed.retriever->Wait().ok());
  const SequenceStats st = delayed.retriever->Stats();
  EXPECT_GT(st.corrected_heads, 0);
  EXPECT_LT(st.corrected_heads, st.checked_heads);  // speculation was used, not bypassed
}

// A prefill appended a page at a time while the compute stream is held up (a slow kernel
// ahead of it): the page offloader's staged batches stay in flight, and once the staging
// ring runs dry the sequence must wait for them and take them back, not refuse the append
// with RESOURCE_EXHAUSTED ("in use by work not yet reaped").
TEST(RetrieverTest, SmallAppendsBehindASlowStreamDoNotExhaustTheStagingRing) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.max_tokens = 4096 * g.page_size;
  testing::ChaosOptions co;
  co.max_delay = absl::ZeroDuration();
  auto chaos = testing::NewChaosBackend(co);
  Harness h(g, o, chaos.get());
  ASSERT_TRUE(
      testing::EnqueueStall(*chaos, h.retriever->compute_stream(), absl::Milliseconds(300)).ok());
  for (int call = 0; call < 4000; ++call) h.Append(g.page_size);
  ASSERT_TRUE(h.retriever->Wait().ok());
  EXPECT_EQ(h.retriever->num_tokens(0), 4000 * g.page_size);
}

TEST(RetrieverTest, DroppedWaitsAreCaught) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a backend that drops waits races by design; ThreadSanitizer reports it";
#endif
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = 0.5f;
  Harness plain(g, o);
  plain.Append(150);
  const auto expected = RunSteps(plain, 4, 300);

  testing::ChaosOptions co;
  co.seed = 9;
  co.max_delay = absl::Milliseconds(3);
  co.drop_waits = true;
  auto chaos = testing::NewChaosBackend(co);
  Harness broken(g, o, chaos.get());
  broken.Append(150);
  // Without its waits, attention and the checks race the background recall.
  DriftingQuery queries(broken.seq, 300);
  bool caught = false;
  for (int step = 0; step < 4 && !caught; ++step) {
    auto r = broken.Step(queries.Next());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      caught |= r.out[l] != expected[step * g.num_layers + l];
    }
    broken.Append(1 + (step % 5 == 4 ? 9 : 0));
  }
  EXPECT_TRUE(caught) << "a backend that ignores waits went unnoticed";
}

// A background recall held up far past the deadline: Wait() returns DEADLINE_EXCEEDED
// instead of blocking, and the layer's next BeginStep refuses to queue behind it.
TEST(RetrieverTest, StuckRecallFailsTheStepWithDeadlineExceeded) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.deadline = absl::Milliseconds(100);
  testing::ChaosOptions co;
  co.seed = 3;
  co.max_delay = absl::Microseconds(20);
  auto chaos = testing::NewChaosBackend(co);
  Harness h(g, o, chaos.get());
  h.Append(100);
  h.Step(h.seq.Query(1));
  h.keep.push_back(h.seq.Query(2));  // read by work queued behind the stall
  const TypedBuffer& q = h.keep.back();
  ASSERT_TRUE(h.retriever->BeginStep(0, q.data()).ok());
  // Attention that never seems to end: the background recall waits for it.
  ASSERT_TRUE(testing::EnqueueStall(*chaos, h.retriever->compute_stream(), absl::Seconds(1)).ok());
  ASSERT_TRUE(h.retriever->EndStep(0, q.data()).ok());
  const absl::Time start = absl::Now();
  absl::Status st = h.retriever->Wait();
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(900));  // did not wait for the stall
  absl::SleepFor(absl::Milliseconds(20));
  auto view = h.retriever->BeginStep(0, q.data());
  EXPECT_TRUE(absl::IsDeadlineExceeded(view.status())) << view.status();
  EXPECT_NE(view.status().message().find("deadline"), std::string::npos);
  // The step failed: the sequence refuses further work rather than reading stale slots.
  EXPECT_TRUE(absl::IsDeadlineExceeded(h.retriever->BeginStep(1, q.data()).status()));
}

TEST(RetrieverTest, CloseDrainsInFlightWorkAndFreesPages) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  testing::ChaosOptions co;
  co.seed = 8;
  co.max_delay = absl::Microseconds(500);
  auto chaos = testing::NewChaosBackend(co);
  Harness h(g, o, chaos.get());
  h.Append(120);
  EXPECT_EQ(h.tier->pool->stats().in_use, g.num_layers * (120 / g.page_size));
  const TypedBuffer q = h.seq.Query(1);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    ASSERT_TRUE(h.retriever->BeginStep(l, q.data()).ok());
    ASSERT_TRUE(h.retriever->EndStep(l, q.data()).ok());  // background recall in flight
  }
  ASSERT_TRUE(h.retriever->Close().ok());
  EXPECT_EQ(h.tier->pool->stats().in_use, 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(h.retriever->BeginStep(0, q.data()).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(h.retriever->Append(0, q.data(), q.data(), 1)));
  EXPECT_TRUE(h.retriever->Close().ok());  // idempotent
}

TEST(RetrieverTest, BadInputGetsClearErrors) {
  const Geometry g = SmallGeometry();
  Harness h(g, SmallOptions(RetrievalMode::kSpeculative));
  const TypedBuffer q = h.seq.Query(1);
  auto st = h.retriever->BeginStep(0, q.data()).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;  // nothing appended yet
  st = h.retriever->Append(5, q.data(), q.data(), 1);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("[0, 2)"), std::string::npos) << st;
  st = h.retriever->Append(0, nullptr, q.data(), 1);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  st = h.retriever->Append(0, q.data(), q.data(), 513);
  EXPECT_TRUE(absl::IsOutOfRange(st)) << st;
  EXPECT_NE(st.message().find("max_tokens = 512"), std::string::npos) << st;
  st = h.retriever->EndStep(0, q.data());
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;

  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.recent_pages = 0;
  auto r = Retriever::Create(g, o, *h.backend, h.tier->pool.get());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  o = SmallOptions(RetrievalMode::kSync);
  r = Retriever::Create(g, o, *h.backend, nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  // More selected pages than a layer can hold: refused at creation, naming the budget.
  o = SmallOptions(RetrievalMode::kSpeculative);
  o.max_tokens = (o.selected_pages - 1) * g.page_size;
  r = Retriever::Create(g, o, *h.backend, h.tier->pool.get());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("selected_pages"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("budget"), std::string::npos) << r.status();
  EXPECT_TRUE(absl::IsInvalidArgument(o.SetBudgetTokens(100, 32)));
  // An eighth sinks (at least 1 page), an eighth recent (at least 2 pages, at most a quarter),
  // the rest selected; the default options are the default budget split so.
  for (const auto& [tokens, sink, selected, recent] :
       {std::tuple{2048, 8, 48, 8}, std::tuple{512, 2, 12, 2}, std::tuple{256, 1, 5, 2},
        std::tuple{128, 1, 2, 1}, std::tuple{384, 1, 9, 2}, std::tuple{1024, 4, 24, 4}}) {
    ASSERT_TRUE(o.SetBudgetTokens(tokens, 32).ok()) << tokens;
    EXPECT_EQ(o.sink_pages, sink) << tokens;
    EXPECT_EQ(o.selected_pages, selected) << tokens;
    EXPECT_EQ(o.recent_pages, recent) << tokens;
  }
  const SequenceOptions defaults;
  ASSERT_TRUE(o.SetBudgetTokens(kDefaultBudgetTokens, kDefaultPageSize).ok());
  EXPECT_EQ(defaults.sink_pages, o.sink_pages);
  EXPECT_EQ(defaults.selected_pages, o.selected_pages);
  EXPECT_EQ(defaults.recent_pages, o.recent_pages);
}

TEST(RetrieverTest, HostTierFullIsRefusedWithNothingKept) {
  const Geometry g = SmallGeometry();
  const SequenceOptions o = SmallOptions(RetrievalMode::kSync);
  auto backend = NewCpuBackend(1);
  HostMemory tier(g, 4);
  auto r = Retriever::Create(g, o, *backend, tier.pool.get()).value();
  TypedBuffer k(g.dtype, 40 * g.num_kv_heads * g.head_dim);
  auto st = r->Append(0, k.data(), k.data(), 40);  // 5 pages, 4 free
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(r->num_tokens(0), 0);
  EXPECT_TRUE(r->Append(0, k.data(), k.data(), 32).ok());
  EXPECT_TRUE(r->Wait().ok());
  EXPECT_EQ(tier.pool->stats().in_use, 4);
}

// Every full page of every layer is committed to the host tier once, in offload order,
// with the pool's slot and generation and the HND of the appended tokens in the slot; the
// commits come on their own with Append and EndStep, never waiting, and Flush commits the
// rest.
TEST(RetrieverTest, HostTierGetsEveryFullPageCommittedOnce) {
  const Geometry g = SmallGeometry(DType::kF16);
  const SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  Harness h(g, o);
  h.Append(50);
  h.Append(3);
  DriftingQuery q(h.seq, 11);
  for (int step = 0; step < 5; ++step) {
    h.Step(q.Next());
    h.Append(7);
  }
  ASSERT_TRUE(h.retriever->Flush().ok());
  std::vector<StoredPage> stored = h.commits->Take();
  const int32_t p = g.page_size;
  const int32_t full = h.seq.tokens() / p;  // 88 tokens: 11 full pages
  ASSERT_EQ(stored.size(), static_cast<size_t>(g.num_layers * full));
  std::vector<int64_t> next(g.num_layers, 0);
  const HostPageLayout hl{g.num_kv_heads, p, g.head_dim};
  for (const StoredPage& sp : stored) {
    ASSERT_GE(sp.layer, 0);
    ASSERT_LT(sp.layer, g.num_layers);
    EXPECT_EQ(sp.page, next[sp.layer]++) << "layer " << sp.layer;  // in order, once each
    EXPECT_TRUE(h.tier->pool->IsLive(sp.slot, sp.generation));
    const void* page = h.tier->pool->SlotData(sp.slot);
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      for (int32_t t = 0; t < p; ++t) {
        for (int32_t i = 0; i < g.head_dim; ++i) {
          const int64_t token = sp.page * p + t;
          ASSERT_EQ(testing::LoadElement(page, g.dtype, hl.Offset(kh, kKey, t, i)),
                    h.seq.K(sp.layer, token, kh, i));
          ASSERT_EQ(testing::LoadElement(page, g.dtype, hl.Offset(kh, kValue, t, i)),
                    h.seq.V(sp.layer, token, kh, i));
        }
      }
    }
  }
  ASSERT_TRUE(h.retriever->Flush().ok());
  EXPECT_TRUE(h.commits->Take().empty());
  ASSERT_TRUE(h.retriever->Close().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(h.retriever->Flush()));
}

// With the compute stream held up, Append commits nothing rather than waiting, Flush gives
// up at the deadline, and once the work ran the pages are committed.
TEST(RetrieverTest, CommitsNeverWaitOnTheDecodePath) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(RetrievalMode::kSync);
  o.deadline = absl::Milliseconds(100);
  testing::ChaosOptions co;
  co.max_delay = absl::ZeroDuration();
  auto chaos = testing::NewChaosBackend(co);
  Harness h(g, o, chaos.get());
  ASSERT_TRUE(testing::EnqueueStall(*chaos, h.retriever->compute_stream(), absl::Seconds(2)).ok());
  h.Append(3 * g.page_size);  // offloads queued behind the stall
  EXPECT_TRUE(h.commits->committed.empty());
  const absl::Status late = h.retriever->Flush();
  EXPECT_TRUE(absl::IsDeadlineExceeded(late)) << late;
  ASSERT_TRUE(h.retriever->compute_stream().Synchronize().ok());
  ASSERT_TRUE(h.retriever->Flush().ok());
  EXPECT_EQ(h.commits->Take().size(), static_cast<size_t>(3 * g.num_layers));
}

// A commit the host tier refuses (another holder took the region over) fails the sequence:
// the call that committed and every later one return the refusal.
TEST(RetrieverTest, RefusedCommitFailsTheSequence) {
  const Geometry g = SmallGeometry();
  Harness h(g, SmallOptions(RetrievalMode::kSpeculative));
  h.Append(2 * g.page_size);
  ASSERT_TRUE(h.retriever->Flush().ok());
  h.commits->refuse = true;
  auto rows = h.seq.Grow(g.page_size);
  absl::Status st =
      h.retriever->Append(0, rows[0].first.data(), rows[0].second.data(), g.page_size);
  if (st.ok()) st = h.retriever->Flush();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("commit refused"));
  const absl::Status later =
      h.retriever->Append(1, rows[1].first.data(), rows[1].second.data(), g.page_size);
  EXPECT_EQ(later, st);
  ASSERT_TRUE(h.retriever->compute_stream().Synchronize().ok());
}

// One step of every layer of `r` with q: the outputs, and per layer the slot table and the
// K/V bytes of every token the table names, snapshotted after attention.
struct StepSnapshot {
  std::vector<std::vector<float>> out;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> resident;  // [layer]: K then V of each named token
  friend bool operator==(const StepSnapshot&, const StepSnapshot&) = default;
};

StepSnapshot StepAndSnapshot(Retriever& r, Backend& backend, const TypedBuffer& q) {
  const Geometry& g = r.geometry();
  StepSnapshot snap;
  std::vector<WorkingSetView> views;
  std::vector<TypedBuffer> outs;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    absl::StatusOr<WorkingSetView> view = r.BeginStep(l, q.data());
    EXPECT_TRUE(view.ok()) << view.status();
    if (!view.ok()) return snap;
    views.push_back(*view);
    outs.emplace_back(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
    EXPECT_TRUE(r.Attend(l, q.data(), outs.back().data(), nullptr).ok());
  }
  auto done = backend.CreateEvent().value();
  EXPECT_TRUE(r.compute_stream().Record(*done).ok());
  EXPECT_TRUE(done->Wait(absl::Seconds(20)).ok());
  const int32_t p = g.page_size;
  for (const WorkingSetView& v : views) {
    const WorkingSetLayout wl{v.num_slots, p, g.num_kv_heads, g.head_dim};
    snap.tables.emplace_back(v.slot_table, v.slot_table + g.num_kv_heads * v.num_slots);
    std::vector<float> resident;
    for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
      for (int32_t s = 0; s < v.num_slots; ++s) {
        const int32_t page = v.slot_table[kh * v.num_slots + s];
        if (page < 0) continue;
        const int32_t len = std::min(p, v.num_tokens - page * p);
        for (int32_t t = 0; t < len; ++t) {
          for (int32_t i = 0; i < g.head_dim; ++i) {
            resident.push_back(testing::LoadElement(v.k_cache, g.dtype, wl.Offset(s, t, kh, i)));
            resident.push_back(testing::LoadElement(v.v_cache, g.dtype, wl.Offset(s, t, kh, i)));
          }
        }
      }
    }
    snap.resident.push_back(std::move(resident));
  }
  for (const TypedBuffer& o : outs) snap.out.push_back(o.ToFloats());
  for (int32_t l = 0; l < g.num_layers; ++l) EXPECT_TRUE(r.EndStep(l, q.data()).ok());
  return snap;
}

// R1 appends T tokens; a copy of its host tier, re-adopted with PagePool::Claim from what
// R1 committed, restores R2. Driven alike from then on, R1 and R2 agree bit
// for bit: slot tables, resident K/V, attention outputs and recall statistics.
void ExpectRestoreEquivalent(int32_t T, RecallStrategy strategy) {
  const Geometry g = SmallGeometry(DType::kF16);
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.correction_threshold = 0.5f;  // some heads corrected, some not
  o.recall = strategy;
  Harness h1(g, o);
  const int32_t p = g.page_size;
  const int32_t n = T / p;
  h1.Append(n * p);
  ASSERT_TRUE(h1.retriever->Flush().ok());
  const std::vector<StoredPage> committed = h1.commits->Take();
  const std::vector<StoredPage>* stored = &committed;
  ASSERT_EQ(stored->size(), static_cast<size_t>(g.num_layers * n));

  // The "restarted process": the same host-tier bytes in other memory, slots claimed.
  const int64_t num_slots = h1.tier->pool->num_slots();
  auto* mem2 = static_cast<uint8_t*>(std::aligned_alloc(PagePool::kSlotAlignment, h1.tier->bytes));
  std::memcpy(mem2, h1.tier->mem, h1.tier->bytes);
  std::unique_ptr<PagePool> pool2 = PagePool::Create(mem2, g.host_page_bytes(), num_slots).value();
  std::unique_ptr<Backend> backend2 = NewCpuBackend(2);
  auto log2 = std::make_unique<CommitLog>(*pool2);
  CommitLog* commits2 = log2.get();
  std::unique_ptr<Retriever> r2 = Retriever::Create(g, o, *backend2, std::move(log2)).value();
  std::vector<std::vector<PageHandle>> pages(g.num_layers);
  for (auto& layer_pages : pages) layer_pages.resize(n);
  for (const StoredPage& sp : *stored) {
    absl::StatusOr<PageHandle> page = pool2->Claim(sp.slot, sp.generation);
    ASSERT_TRUE(page.ok()) << page.status();
    pages[sp.layer][sp.page] = *std::move(page);
  }
  for (int32_t l = 0; l < g.num_layers; ++l) {
    ASSERT_TRUE(r2->Restore(l, std::move(pages[l])).ok()) << "layer " << l;
    EXPECT_EQ(r2->num_tokens(l), n * p);
  }
  EXPECT_EQ(pool2->stats().in_use, g.num_layers * n);
  // Restore rewrote the host pages (recomputing their summaries) with the same bytes.
  ASSERT_TRUE(r2->Wait().ok());
  for (const StoredPage& sp : *stored) {
    ASSERT_EQ(std::memcmp(pool2->SlotData(sp.slot), h1.tier->pool->SlotData(sp.slot),
                          g.host_page_bytes()),
              0)
        << "layer " << sp.layer << " page " << sp.page;
  }
  // Restored pages are not committed again.
  ASSERT_TRUE(r2->Flush().ok());
  EXPECT_TRUE(commits2->Take().empty());

  // Further tokens (the remainder of T first) go to both.
  std::deque<TypedBuffer> keep;
  const auto append_both = [&](int32_t count) {
    auto rows = h1.seq.Grow(count);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(h1.retriever->Append(l, rows[l].first.data(), rows[l].second.data(), count).ok());
      ASSERT_TRUE(r2->Append(l, rows[l].first.data(), rows[l].second.data(), count).ok());
    }
    for (auto& r : rows) {
      keep.push_back(std::move(r.first));
      keep.push_back(std::move(r.second));
    }
  };
  if (T % p != 0) append_both(T % p);
  DriftingQuery queries(h1.seq, 77);
  for (int step = 0; step < 12; ++step) {
    keep.push_back(queries.Next());
    const StepSnapshot a = StepAndSnapshot(*h1.retriever, *h1.backend, keep.back());
    const StepSnapshot b = StepAndSnapshot(*r2, *backend2, keep.back());
    ASSERT_EQ(a.tables, b.tables) << "step " << step;
    ASSERT_EQ(a.resident, b.resident) << "step " << step;
    ASSERT_EQ(a.out, b.out) << "step " << step;
    append_both(1 + (step % 4 == 3 ? 9 : 0));
  }
  ASSERT_TRUE(h1.retriever->Wait().ok());
  ASSERT_TRUE(r2->Wait().ok());
  const SequenceStats s1 = h1.retriever->Stats(), s2 = r2->Stats();
  EXPECT_GT(s1.corrected_heads, 0);
  EXPECT_LT(s1.corrected_heads, s1.checked_heads);
  EXPECT_EQ(s2.corrected_heads, s1.corrected_heads);
  EXPECT_EQ(s2.corrections, s1.corrections);
  EXPECT_EQ(s2.correction_pages, s1.correction_pages);
  // Not recalled_pages: its background part depends on timing. Under load the two were seen
  // to differ by 1 to 4 background pages while every table, resident K/V and output above
  // agreed (a flake of this test since it was written; noted for the Retriever's owners).
  EXPECT_GT(s2.recalled_pages, s2.correction_pages);
  r2.reset();
  pool2.reset();
  std::free(mem2);
}

TEST(RetrieverTest, RestoredLayersStepLikeTheOriginal) {
  // 17 full pages: past the sinks and the recent ring, so the ring has wrapped.
  ExpectRestoreEquivalent(17 * 8, RecallStrategy::kBatchedDma);
}

TEST(RetrieverTest, RestoredFullPagesPlusAppendedRemainderStepLikeTheOriginal) {
  ExpectRestoreEquivalent(17 * 8 + 5, RecallStrategy::kZeroCopy);
}

TEST(RetrieverTest, RestoreOfFewPagesStepsLikeTheOriginal) {
  ExpectRestoreEquivalent(2 * 8 + 3, RecallStrategy::kBatchedDma);  // within sinks and ring
}

TEST(RetrieverTest, RestoreErrors) {
  const Geometry g = SmallGeometry();
  Harness h(g, SmallOptions(RetrievalMode::kSync));
  PagePool& pool = *h.tier->pool;
  const auto claim = [&](int64_t slot) { return pool.Claim(slot, 1).value(); };
  const auto one = [&](PageHandle page) {
    std::vector<PageHandle> pages;
    pages.push_back(std::move(page));
    return pages;
  };
  absl::Status st = h.retriever->Restore(2, one(claim(0)));
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  st = h.retriever->Restore(0, one(PageHandle()));
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("pages[0]"), std::string::npos) << st;
  HostMemory other(g, 2);
  st = h.retriever->Restore(0, one(other.pool->Allocate().value()));
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  std::vector<PageHandle> too_many;
  for (int64_t slot = 0; slot < 512 / g.page_size + 1; ++slot) too_many.push_back(claim(slot));
  st = h.retriever->Restore(0, std::move(too_many));
  EXPECT_TRUE(absl::IsOutOfRange(st)) << st;
  // Refused handles are released, and the Retriever still works.
  EXPECT_EQ(pool.stats().in_use, 0);
  EXPECT_EQ(other.pool->stats().in_use, 0);
  EXPECT_TRUE(h.retriever->Restore(1, {}).ok());  // nothing to restore
  EXPECT_EQ(h.retriever->num_tokens(1), 0);
  h.Append(10);
  st = h.retriever->Restore(0, one(claim(100)));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find("holds 10 tokens"), std::string::npos) << st;

  for (RetrievalMode mode : {RetrievalMode::kDrop, RetrievalMode::kFull}) {
    Harness no_tier(g, SmallOptions(mode));
    st = no_tier.retriever->Restore(0, one(no_tier.tier->pool->Claim(0, 1).value()));
    EXPECT_TRUE(absl::IsFailedPrecondition(st)) << RetrievalModeName(mode) << ": " << st;
  }

  ASSERT_TRUE(h.retriever->Close().ok());
  st = h.retriever->Restore(0, one(claim(101)));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
}

// A long run for the sanitizer builds: 1000 layer-steps of speculative decoding with
// appends and corrections, checking the working set as it goes.
TEST(RetrieverTest, ThousandStepsStayConsistent) {
  Geometry g = SmallGeometry(DType::kF16);
  g.num_layers = 1;
  SequenceOptions o = SmallOptions(RetrievalMode::kSpeculative);
  o.max_tokens = 2048;
  o.correction_threshold = 0.3f;
  Harness h(g, o);
  h.Append(64);
  std::mt19937_64 rng(1);
  TypedBuffer q = h.seq.Query(0);
  for (int step = 0; step < 1000; ++step) {
    // A drifting query: mostly the previous one, sometimes a jump.
    const TypedBuffer noise = h.seq.Query(10'000 + step);
    const bool jump = rng() % 10 == 0;
    for (int64_t i = 0; i < q.size(); ++i) {
      q.Set(i, jump ? noise.Get(i) : 0.9f * q.Get(i) + 0.45f * noise.Get(i));
    }
    h.Step(q, /*end=*/true, /*check=*/step % 50 == 0);
    h.Append(1);
  }
  ASSERT_TRUE(h.retriever->Wait().ok());
  const SequenceStats st = h.retriever->Stats();
  EXPECT_EQ(st.steps, 1000);
  EXPECT_GT(st.corrected_heads, 0);
  EXPECT_LT(st.corrected_heads, st.checked_heads);
  EXPECT_EQ(h.retriever->num_tokens(0), 1064);
}

}  // namespace
}  // namespace kvtier
