// The Retriever applying policies on the CPU backend: confidence budgets widening and
// narrowing the selection, pinned pages surviving eviction, per-head eviction with
// compaction in drop mode (against attention over exactly the resident tokens),
// observation queries, host-tier drops, and configuration errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/host_calls.h"
#include "offload/retriever.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier {
namespace {

using namespace retriever_test;  // NOLINT: the harness is this test's vocabulary
using testing::TypedBuffer;

SequenceOptions WithPolicy(SequenceOptions o, std::string budget, std::string residency,
                           std::map<std::string, std::string> params = {}) {
  o.policy.budget = std::move(budget);
  o.policy.residency = std::move(residency);
  o.policy.params = std::move(params);
  return o;
}

// Peaked (confident) or flat next-token logits over 64 tokens.
std::vector<float> Logits(bool confident) {
  std::vector<float> l(64, 0.0f);
  if (confident) l[3] = 20.0f;
  return l;
}

void Report(Harness& h, bool confident) {
  const std::vector<float> logits = Logits(confident);
  StepSignals s;
  s.first_position = h.seq.tokens() - 1;
  s.logits = logits;
  ASSERT_TRUE(h.retriever->ReportSignals(s).ok());
}

// Resident pages of KV head kh in a snapshot of layer l's table.
std::vector<int32_t> HeadPages(const Harness& h, int32_t l, int32_t num_slots, int32_t kh) {
  std::vector<int32_t> pages;
  for (int32_t s = 0; s < num_slots; ++s) {
    const int32_t page = h.snapshot_tables[l][static_cast<size_t>(kh) * num_slots + s];
    if (page >= 0) pages.push_back(page);
  }
  std::sort(pages.begin(), pages.end());
  return pages;
}

class ConfidenceBudgetTest : public ::testing::TestWithParam<RetrievalMode> {};

// A confident stretch narrows the next step's selection to the tight budget; one flat
// distribution widens it again at once. The selected region always equals the host model's
// top-k_h with the step's query (speculative mode re-selects when the budget changes).
TEST_P(ConfidenceBudgetTest, DropInConfidenceWidensAndConfidentStretchNarrows) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = SmallOptions(GetParam());
  o.selected_pages = 4;
  o = WithPolicy(o, "confidence", "none",
                 {{"confidence.confident_steps", "3"}, {"confidence.tight_fraction", "0.5"}});
  Harness h(g, o);
  h.Append(120);  // 15 pages: 12 candidates
  // confident ×3 → tight (2) from the 4th step; flat at step 5 → loose (4) from step 6.
  const std::vector<bool> confident = {true, true, true, true, false, true, true};
  const std::vector<int32_t> want = {4, 4, 4, 2, 2, 4, 4};
  for (size_t step = 0; step < confident.size(); ++step) {
    const TypedBuffer q = h.seq.Query(100 + step);
    auto r = h.Step(q, /*end=*/true, /*check=*/true);
    ASSERT_EQ(r.views.size(), static_cast<size_t>(g.num_layers));
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const StepStats st = h.retriever->LastStep(l);
      ASSERT_EQ(st.budget, std::vector<int32_t>(g.num_kv_heads, want[step])) << "step " << step;
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        WorkingSetView v = r.views[l];
        v.slot_table = h.snapshot_tables[l].data();
        SequenceOptions ok = o;
        ok.selected_pages = want[step];
        const bool fresh =
            GetParam() == RetrievalMode::kSync || step == 0 || want[step] != want[step - 1];
        if (fresh) {
          EXPECT_EQ(SelectedRegion(v, o, kh), h.seq.Select(l, q, kh, h.seq.tokens(), ok))
              << "step " << step << " layer " << l << " head " << kh;
        } else {
          EXPECT_EQ(SelectedRegion(v, o, kh).size(), static_cast<size_t>(want[step]));
        }
      }
    }
    Report(h, confident[step]);
    h.Append(1);
  }
  ASSERT_TRUE(h.retriever->Wait().ok());
  EXPECT_EQ(h.retriever->Stats().budget_changes, 2 * g.num_layers);
}

INSTANTIATE_TEST_SUITE_P(Modes, ConfidenceBudgetTest,
                         ::testing::Values(RetrievalMode::kSpeculative, RetrievalMode::kSync),
                         [](const auto& param_info) {
                           return std::string(RetrievalModeName(param_info.param));
                         });

// Hidden-state changes with a spike at `spike` (in the positive band layer 0), small noise
// elsewhere.
StepSignals Hidden(int64_t first, int32_t n, int32_t layers, int64_t spike,
                   std::vector<float>* buf) {
  buf->assign(static_cast<size_t>(n) * layers, 0.0f);
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t l = 0; l < layers; ++l) {
      const int64_t pos = first + t;
      (*buf)[static_cast<size_t>(t) * layers + l] =
          1.0f + 0.05f * static_cast<float>((pos * 7) % 11) / 11.0f +
          (pos == spike && l == 0 ? 25.0f : 0.0f);
    }
  }
  StepSignals s;
  s.first_position = first;
  s.num_tokens = n;
  s.hidden_delta = *buf;
  s.num_layers = layers;
  return s;
}

class PinnedPageTest : public ::testing::TestWithParam<bool> {};

// EpiKV pins the page holding the epiphany token: it stays resident in every head through
// every eviction, while the pages around it go; without the spike it is evicted like them.
TEST_P(PinnedPageTest, PinnedPageIsNeverEvictedWhilePinned) {
  const bool spike = GetParam();
  const Geometry g = SmallGeometry();
  SequenceOptions o = WithPolicy(SmallOptions(RetrievalMode::kDrop), "fixed", "epiphany",
                                 {{"epiphany.window", "16"}});
  Harness h(g, o);
  std::vector<float> buf;
  constexpr int64_t kSpike = 21;  // page 2
  h.Append(40);
  ASSERT_TRUE(
      h.retriever->ReportSignals(Hidden(0, 40, g.num_layers, spike ? kSpike : -1, &buf)).ok());
  bool evicted_any = false;
  for (int32_t step = 0; step < 60; ++step) {
    auto r = h.Step(h.seq.Query(step), /*end=*/true, /*check=*/true);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        const std::vector<int32_t> pages = HeadPages(h, l, r.views[l].num_slots, kh);
        const bool has2 = std::binary_search(pages.begin(), pages.end(), 2);
        // Sink, kept region (3) and recent window (2) at most, plus the pin.
        EXPECT_LE(pages.size(), 1u + 3u + 2u + (spike ? 1u : 0u));
        if (spike) {
          EXPECT_TRUE(has2) << "step " << step << " layer " << l << " head " << kh;
        }
        evicted_any |= !has2;
      }
    }
    h.Append(1);
    ASSERT_TRUE(
        h.retriever->ReportSignals(Hidden(h.seq.tokens() - 1, 1, g.num_layers, -1, &buf)).ok());
  }
  EXPECT_EQ(evicted_any, !spike);
  EXPECT_GT(h.retriever->Stats().evicted_head_pages, 0);
}

INSTANTIATE_TEST_SUITE_P(Spike, PinnedPageTest, ::testing::Bool(), [](const auto& param_info) {
  return param_info.param ? "Spike" : "NoSpike";
});

// In speculative mode a pinned page is always in the selected region, whatever the query
// scores say.
TEST(RetrieverPolicyTest, PinnedPageIsAlwaysSelected) {
  const Geometry g = SmallGeometry();
  SequenceOptions o = WithPolicy(SmallOptions(RetrievalMode::kSpeculative), "fixed", "epiphany",
                                 {{"epiphany.window", "16"}});
  o.selected_pages = 2;
  Harness h(g, o);
  std::vector<float> buf;
  h.Append(120);
  ASSERT_TRUE(h.retriever->ReportSignals(Hidden(0, 120, g.num_layers, 45, &buf)).ok());
  for (int32_t step = 0; step < 20; ++step) {
    auto r = h.Step(h.seq.Query(step), /*end=*/true, /*check=*/true);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      WorkingSetView v = r.views[l];
      v.slot_table = h.snapshot_tables[l].data();
      for (int32_t kh = 0; kh < g.num_kv_heads; ++kh) {
        const std::vector<int32_t> sel = SelectedRegion(v, o, kh);
        EXPECT_TRUE(std::binary_search(sel.begin(), sel.end(), 5))
            << "step " << step << " layer " << l << " head " << kh;
      }
    }
    h.Append(1);
  }
}

// Drop mode with per-head eviction: the prompt stays resident until the first step, which
// evicts it down to the budget; later page boundaries compact the slots and give memory
// back. At every step the output equals attention over exactly the tokens the per-head
// tables name, and those tables name the right data (ExpectWorkingSetConsistent).
TEST(RetrieverPolicyTest, DropModeEvictsPerHeadCompactsAndMatchesReference) {
  const Geometry g = SmallGeometry();
  const SequenceOptions o =
      WithPolicy(SmallOptions(RetrievalMode::kDrop), "kv_compress", "kv_compress",
                 {{"kv_compress.total_pages", "10"},
                  {"kv_compress.exclude_nearest", "4"},
                  // Metrics from the observation window only, so the allocation is the same
                  // at every step (decode updates re-allocate between layers).
                  {"kv_compress.decode_updates", "false"}});
  Harness h(g, o);
  h.Append(160);  // 20 pages
  // The observation window: the last 4 prompt tokens' queries.
  TypedBuffer obs(g.dtype, 4LL * g.num_q_heads * g.head_dim);
  obs.FillNormal(5);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    ASSERT_TRUE(h.retriever->ObserveQueries(l, obs.data(), 4, 156).ok());
  }
  int32_t first_slots = 0;
  for (int32_t step = 0; step < 30; ++step) {
    const TypedBuffer q = h.seq.Query(300 + step);
    auto r = h.Step(q, /*end=*/true, /*check=*/true);
    int32_t kept = 0;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const std::vector<float> want = AttentionOverTable(g, h.seq, l, q, h.snapshot_tables[l],
                                                         r.views[l].num_slots, h.seq.tokens());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(r.out[l][i], want[i], 1e-4) << "step " << step << " layer " << l;
      }
      const StepStats st = h.retriever->LastStep(l);
      for (int32_t b : st.budget) kept += b;
    }
    // KV-Compress's budgets: per layer and head, summing to the total asked for.
    EXPECT_EQ(kept, 10);
    if (step == 0) first_slots = r.views[0].num_slots;
    h.Append(1);
  }
  EXPECT_GE(first_slots, 20);  // the whole prompt, until the first step evicted it
  auto r = h.Step(h.seq.Query(999));
  EXPECT_LE(r.views[0].num_slots, 1 + 4 + 2 + 1);  // compacted and shrunk to the minimum
  const SequenceStats st = h.retriever->Stats();
  EXPECT_GT(st.evicted_head_pages, 0);
  // Sinks (1) and recent window (2) per head and layer, plus the 10 kept head-pages.
  const int64_t fixed = int64_t{g.num_layers} * g.num_kv_heads * 3;
  EXPECT_LE(st.resident_head_pages, fixed + 10 + int64_t{g.num_layers} * g.num_kv_heads);
}

// host_drop = evict: a full host tier drops the lowest-scoring old pages for good, counted;
// selection never names them again; refuse (the default) refuses and counts.
TEST(RetrieverPolicyTest, FullHostTierDropsPagesWhenAskedAndRefusesOtherwise) {
  const Geometry g = SmallGeometry();
  for (const std::string mode : {"evict", "refuse"}) {
    SequenceOptions o = WithPolicy(SmallOptions(RetrievalMode::kSync), "fixed", "h2o");
    o.policy.host_drop = mode;
    auto backend = NewCpuBackend(1);
    HostMemory tier(g, 16);  // 8 pages per layer
    auto r = Retriever::Create(g, o, *backend, tier.pool.get()).value();
    HostModel seq(g, 3);
    std::vector<TypedBuffer> keep;
    absl::Status last;
    for (int32_t chunk = 0; chunk < 12 && last.ok(); ++chunk) {
      auto rows = seq.Grow(8);
      for (int32_t l = 0; l < g.num_layers && last.ok(); ++l) {
        last = r->Append(l, rows[l].first.data(), rows[l].second.data(), 8);
      }
      for (auto& x : rows) keep.push_back(std::move(x.first)), keep.push_back(std::move(x.second));
      if (!last.ok()) break;
      const TypedBuffer q = seq.Query(chunk);
      TypedBuffer out(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        auto view = r->BeginStep(l, q.data());
        ASSERT_TRUE(view.ok()) << view.status();
        ASSERT_TRUE(r->Attend(l, q.data(), out.data(), nullptr).ok());
        ASSERT_TRUE(r->Wait().ok());
        ExpectWorkingSetConsistent(g, o, seq, *view);
        ASSERT_TRUE(r->EndStep(l, q.data()).ok());
      }
    }
    const SequenceStats st = r->Stats();
    if (mode == "evict") {
      EXPECT_TRUE(last.ok()) << last;
      EXPECT_GT(st.host_dropped_pages, 0);
      EXPECT_EQ(st.host_refusals, 0);
    } else {
      EXPECT_TRUE(absl::IsResourceExhausted(last)) << last;
      EXPECT_NE(last.message().find("host_drop = refuse"), std::string::npos) << last;
      EXPECT_EQ(st.host_refusals, 1);
    }
  }
}

// The drop-mode policies of `kvtier-run eval` that read attention, as (budget, residency).
struct AttentionPolicy {
  const char* name;
  const char* budget;
  const char* residency;
};

// (policy, query heads).
class FullContextProbeTest
    : public ::testing::TestWithParam<std::tuple<AttentionPolicy, int32_t>> {};

// A drop-mode layer managed by a policy grows with the context (to every page max_tokens
// allows) until a step evicts it, and so does the attention probe the policy reads: at
// kvtier-tiny's full context of 4096 tokens with a 128-token budget, 131 slots where the
// budget names 4. The engine observes the prompt's last 32 queries after the prefill (each a
// probe of the whole prompt), then decodes (every layer holds its probe until its next step).
// Neither may be refused by the staging ring (RESOURCE_EXHAUSTED) nor miss it (a synchronous
// copy through ordinary memory): the ring takes back the blocks of work that has run and is
// sized for the probes a step can hold. kvtier-tiny's shape (6 layers, Hkv 2, pages of 32
// tokens) with its 8 query heads and with 32, whose probes are four times as large.
TEST_P(FullContextProbeTest, ObservationAndDecodeAtFullContextFitTheStagingRing) {
  const auto& [policy, q_heads] = GetParam();
  Geometry g;
  g.num_layers = 6;
  g.num_q_heads = q_heads;
  g.num_kv_heads = 2;
  g.head_dim = 8;  // the probes' size does not depend on it
  g.page_size = 32;
  g.dtype = DType::kF32;
  SequenceOptions o = SmallOptions(RetrievalMode::kDrop);
  o.sink_pages = 1;  // 128 tokens, split 1/4 : 1/2 : 1/4
  o.selected_pages = 2;
  o.recent_pages = 1;
  o.max_tokens = 4160;  // eval's: the context and two pages, rounded to a page
  o = WithPolicy(o, policy.budget, policy.residency);
  Harness h(g, o);
  constexpr int32_t kPrompt = 4096 - 16;
  constexpr int32_t kWindow = 32;  // DecoderOptions::observe_window
  for (int32_t done = 0; done < kPrompt; done += 256) h.Append(std::min(256, kPrompt - done));
  TypedBuffer obs(g.dtype, int64_t{kWindow} * g.num_q_heads * g.head_dim);
  obs.FillNormal(11);
  HostCalls start = ThreadHostCalls();
  for (int32_t l = 0; l < g.num_layers; ++l) {
    const absl::Status st = h.retriever->ObserveQueries(l, obs.data(), kWindow, kPrompt - kWindow);
    ASSERT_TRUE(st.ok()) << "layer " << l << ": " << st;
  }
  EXPECT_EQ((ThreadHostCalls() - start).sync_copies, 0) << "a probe missed the ring";
  // Decode with the query and output in backend memory, as an engine's are: a synchronous
  // copy would be a block that missed the ring.
  const size_t q_bytes = static_cast<size_t>(g.num_q_heads) * g.head_dim * sizeof(float);
  DeviceBuffer q = h.backend->Allocate(q_bytes).value();
  DeviceBuffer out = h.backend->Allocate(q_bytes).value();
  for (int32_t step = 0; step < 16; ++step) {
    const TypedBuffer query = h.seq.Query(step);
    std::memcpy(q.data(), query.data(), q_bytes);  // the CPU backend's memory is the host's
    start = ThreadHostCalls();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      absl::StatusOr<WorkingSetView> view = h.retriever->BeginStep(l, q.data());
      ASSERT_TRUE(view.ok()) << "step " << step << " layer " << l << ": " << view.status();
      if (step == 0) {
        EXPECT_GT(view->num_slots, 120) << "the prompt, resident until the first eviction";
      }
      absl::Status st = h.retriever->Attend(l, q.data(), out.data(), nullptr);
      if (st.ok()) st = h.retriever->EndStep(l, q.data());
      ASSERT_TRUE(st.ok()) << "step " << step << " layer " << l << ": " << st;
    }
    EXPECT_EQ((ThreadHostCalls() - start).sync_copies, 0) << "step " << step;
    h.Append(1);
  }
  const absl::Status st = h.retriever->Wait();
  EXPECT_TRUE(st.ok()) << st;
}

INSTANTIATE_TEST_SUITE_P(
    EvalVariants, FullContextProbeTest,
    ::testing::Combine(::testing::Values(AttentionPolicy{"h2o", "fixed", "h2o"},
                                         AttentionPolicy{"conf_kv", "confidence", "attention"},
                                         AttentionPolicy{"xkv", "xkv", "attention"},
                                         AttentionPolicy{"kv_compress", "kv_compress",
                                                         "kv_compress"}),
                       ::testing::Values(8, 32)),
    [](const auto& param_info) {
      return absl::StrCat(std::get<0>(param_info.param).name, "_Hq",
                          std::get<1>(param_info.param));
    });

TEST(RetrieverPolicyTest, BadPolicyConfigurationsGetClearErrors) {
  const Geometry g = SmallGeometry();
  auto backend = NewCpuBackend(1);
  HostMemory tier(g, 64);
  struct Case {
    RetrievalMode mode;
    std::string budget, residency, host_drop;
    std::map<std::string, std::string> params;
    std::string want;
  };
  const std::vector<Case> cases = {
      {RetrievalMode::kSync, "greedy", "none", "refuse", {}, "policy.budget = 'greedy'"},
      {RetrievalMode::kSync, "fixed", "lru", "refuse", {}, "policy.residency = 'lru'"},
      {RetrievalMode::kSync, "fixed", "none", "spill", {}, "policy.host_drop = 'spill'"},
      {RetrievalMode::kSync,
       "confidence",
       "none",
       "refuse",
       {{"confidence.enter_tight", "1.5"}},
       "confidence.enter_tight"},
      {RetrievalMode::kSync,
       "fixed",
       "none",
       "refuse",
       {{"confidence.top_m", "3"}},
       "confidence.top_m"},
      {RetrievalMode::kSync,
       "fixed",
       "h2o",
       "refuse",
       {{"int8.window_pages", "2"}},
       "INT8 storage was removed"},
      {RetrievalMode::kDrop, "fixed", "h2o", "evict", {}, "no host tier"},
      {RetrievalMode::kDrop,
       "fixed",
       "epiphany",
       "refuse",
       {{"epiphany.signal", "vibes"}},
       "epiphany.signal"},
  };
  for (const Case& c : cases) {
    SequenceOptions o = WithPolicy(SmallOptions(c.mode), c.budget, c.residency, c.params);
    o.policy.host_drop = c.host_drop;
    auto r = Retriever::Create(g, o, *backend, tier.pool.get());
    ASSERT_FALSE(r.ok()) << c.want;
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    EXPECT_NE(r.status().message().find(c.want), std::string::npos) << r.status();
  }
  // Signals of the wrong shape.
  auto r = Retriever::Create(g, WithPolicy(SmallOptions(RetrievalMode::kDrop), "fixed", "epiphany"),
                             *backend, nullptr)
               .value();
  std::vector<float> three(3, 1.0f);
  StepSignals s;
  s.hidden_delta = three;
  s.num_layers = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(r->ReportSignals(s)));
  s.num_tokens = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(r->ReportSignals(s)));
  TypedBuffer q(g.dtype, int64_t{g.num_q_heads} * g.head_dim);
  EXPECT_TRUE(absl::IsFailedPrecondition(r->ObserveQueries(0, q.data(), 1, 0)));  // no tokens
  EXPECT_TRUE(absl::IsInvalidArgument(r->ObserveQueries(0, nullptr, 1, 0)));
}

}  // namespace
}  // namespace kvtier
