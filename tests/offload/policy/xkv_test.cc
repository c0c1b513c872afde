// XKV per-layer budgets: pooling and ratios by hand, the greedy allocation against brute
// force, the budget store's file format, and the policy end to end on synthetic attention.
#include "offload/policy/xkv.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::FloatNear;
using ::testing::HasSubstr;
using ::testing::Pointwise;

TEST(PoolImportanceTest, ClipsTheWindowAtTheEdges) {
  const std::vector<float> x = {3, 0, 0, 0, 6};
  // Kernel 3: the edges average over their two in-range neighbours, not three.
  EXPECT_THAT(PoolImportance(x, 3), Pointwise(FloatNear(1e-6), {1.5f, 1.0f, 0.0f, 2.0f, 3.0f}));
  const std::vector<float> ramp = {1, 2, 3, 4, 5, 6, 7};
  EXPECT_THAT(PoolImportance(ramp, 5),
              Pointwise(FloatNear(1e-6), {2.0f, 2.5f, 3.0f, 4.0f, 5.0f, 5.5f, 6.0f}));
}

TEST(PoolImportanceTest, KeepsConstantsAndCopiesWithKernelOne) {
  const std::vector<float> c(6, 2.5f);
  EXPECT_THAT(PoolImportance(c), Pointwise(FloatNear(1e-6), c));
  const std::vector<float> x = {1, 5, 2};
  EXPECT_THAT(PoolImportance(x, 1), ElementsAreArray(x));
  // A window wider than the series averages everything.
  EXPECT_THAT(PoolImportance(x, 7), Pointwise(FloatNear(1e-6), {8.0f / 3, 8.0f / 3, 8.0f / 3}));
  EXPECT_TRUE(PoolImportance({}, 7).empty());
}

TEST(RetentionRatioTest, KeepsTheLargestPagesFirst) {
  const std::vector<float> imp = {1, 4, 2, 3};  // total 10
  EXPECT_DOUBLE_EQ(RetentionRatio(imp, 0), 0.0);
  EXPECT_DOUBLE_EQ(RetentionRatio(imp, 1), 0.4);
  EXPECT_DOUBLE_EQ(RetentionRatio(imp, 2), 0.7);
  EXPECT_DOUBLE_EQ(RetentionRatio(imp, 4), 1.0);
  EXPECT_DOUBLE_EQ(RetentionRatio(imp, 9), 1.0);
  const std::vector<float> zeros = {0, 0};
  EXPECT_DOUBLE_EQ(RetentionRatio(zeros, 0), 1.0);  // nothing to lose
}

double SumRatio(const std::vector<std::vector<float>>& imp, const std::vector<int32_t>& b) {
  double sum = 0;
  for (size_t l = 0; l < imp.size(); ++l) sum += RetentionRatio(imp[l], b[l]);
  return sum;
}

// The best Σ ratio over every allocation with floor ≤ b_l ≤ cap and Σ b_l ≤ total; the
// floors' sum when no allocation fits (the floors always hold).
double BruteForceBest(const std::vector<std::vector<float>>& imp, int64_t total, int32_t min_pages,
                      int32_t max_pages) {
  const size_t n = imp.size();
  std::vector<int32_t> floor(n), cap(n), b(n);
  for (size_t l = 0; l < n; ++l) {
    cap[l] = max_pages < 0 ? static_cast<int32_t>(imp[l].size())
                           : std::min<int32_t>(max_pages, static_cast<int32_t>(imp[l].size()));
    floor[l] = std::min(min_pages, cap[l]);
  }
  double best = SumRatio(imp, floor);
  const std::function<void(size_t, int64_t)> walk = [&](size_t l, int64_t used) {
    if (l == n) {
      if (used <= total) best = std::max(best, SumRatio(imp, b));
      return;
    }
    for (b[l] = floor[l]; b[l] <= cap[l]; ++b[l]) walk(l + 1, used + b[l]);
  };
  walk(0, 0);
  return best;
}

std::vector<std::vector<float>> RandomImportance(std::mt19937& rng, size_t layers) {
  std::uniform_int_distribution<int> pages(0, 5), kind(0, 3);
  std::uniform_real_distribution<float> value(0.0f, 1.0f);
  std::vector<std::vector<float>> imp(layers);
  for (auto& layer : imp) {
    layer.resize(pages(rng));
    // Some zeros and some exact ties, where a sloppy greedy goes wrong.
    for (float& x : layer) x = kind(rng) == 0 ? 0.0f : (kind(rng) == 1 ? 0.5f : value(rng));
  }
  return imp;
}

TEST(AllocateGreedyTest, MatchesBruteForce) {
  for (uint32_t seed = 0; seed < 200; ++seed) {
    std::mt19937 rng(seed);
    const auto imp = RandomImportance(rng, 3);
    for (int32_t min_pages : {0, 1, 2}) {
      for (int32_t max_pages : {-1, 3}) {
        for (int64_t total = 0; total <= 15; ++total) {
          SCOPED_TRACE(absl::StrCat("seed ", seed, " min ", min_pages, " max ", max_pages,
                                    " total ", total));
          const std::vector<int32_t> b = AllocateGreedy(imp, total, min_pages, max_pages);
          ASSERT_EQ(b.size(), imp.size());
          int64_t used = 0, floors = 0, caps = 0;
          for (size_t l = 0; l < imp.size(); ++l) {
            const int32_t pages = static_cast<int32_t>(imp[l].size());
            const int32_t cap = max_pages < 0 ? pages : std::min(max_pages, pages);
            ASSERT_GE(b[l], std::min(min_pages, cap));
            ASSERT_LE(b[l], cap);
            used += b[l];
            floors += std::min(min_pages, cap);
            caps += cap;
          }
          EXPECT_EQ(used, std::max(floors, std::min(total, caps)));
          EXPECT_NEAR(SumRatio(imp, b), BruteForceBest(imp, total, min_pages, max_pages), 1e-6);
        }
      }
    }
  }
}

TEST(AllocateGreedyTest, BreaksTiesTowardTheLowerLayer) {
  // Both layers' pages have normalised importance 0.5: the single page goes to layer 0.
  EXPECT_THAT(AllocateGreedy({{1, 1}, {3, 3}}, 1, 0, -1), ElementsAre(1, 0));
  EXPECT_THAT(AllocateGreedy({{1, 1}, {3, 3}}, 3, 0, -1), ElementsAre(2, 1));
  EXPECT_TRUE(AllocateGreedy({}, 5, 1, -1).empty());
}

TEST(AllocateForTargetRatioTest, HandCase) {
  // Gains in greedy order: 0.9 (layer 0), 0.5, 0.5 (layer 1), 0.1 (layer 0).
  const std::vector<std::vector<float>> imp = {{9, 1}, {5, 5}};
  EXPECT_THAT(AllocateForTargetRatio(imp, 0.4, 0, -1), ElementsAre(1, 0));   // mean 0.45
  EXPECT_THAT(AllocateForTargetRatio(imp, 0.5, 0, -1), ElementsAre(1, 1));   // mean 0.7
  EXPECT_THAT(AllocateForTargetRatio(imp, 0.75, 0, -1), ElementsAre(1, 2));  // 0.95
  EXPECT_THAT(AllocateForTargetRatio(imp, 1.0, 0, -1), ElementsAre(2, 2));
  EXPECT_THAT(AllocateForTargetRatio(imp, 0.0, 1, -1), ElementsAre(1, 1));  // the floors
}

TEST(AllocateForTargetRatioTest, GivesTheSmallestTotalReachingTheTarget) {
  for (uint32_t seed = 0; seed < 200; ++seed) {
    std::mt19937 rng(seed);
    const auto imp = RandomImportance(rng, 3);
    for (double target : {0.1, 0.3, 0.5, 0.77, 0.9, 1.0}) {
      SCOPED_TRACE(absl::StrCat("seed ", seed, " target ", target));
      // The smallest total whose greedy allocation reaches the target.
      std::vector<int32_t> expected;
      for (int64_t total = 0; total <= 15; ++total) {
        expected = AllocateGreedy(imp, total, 1, -1);
        if (SumRatio(imp, expected) / 3 >= target - 1e-9) break;
      }
      EXPECT_EQ(AllocateForTargetRatio(imp, target, 1, -1), expected);
    }
  }
}

// A fresh file name under the test's temporary directory.
std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "xkv_test_", getpid(), "_", name);
}

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fwrite(text.data(), 1, text.size(), f), text.size());
  ASSERT_EQ(std::fclose(f), 0);
}

TEST(LayerBudgetStoreTest, RecordsAndLooksUp) {
  LayerBudgetStore store;
  EXPECT_FALSE(store.Lookup("qa").has_value());
  ASSERT_TRUE(store.Record("qa", {1, 2, 3}).ok());
  ASSERT_TRUE(store.Record("qa", {4, 5}).ok());  // replaces
  EXPECT_THAT(*store.Lookup("qa"), ElementsAre(4, 5));
  EXPECT_EQ(store.Record("a\tb", {1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Record("a\nb", {1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Record("", {1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Record("code", {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Record("code", {1, -1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.size(), 1u);
}

TEST(LayerBudgetStoreTest, SaveLoadRoundTrip) {
  LayerBudgetStore store;
  ASSERT_TRUE(store.Record("summarise", {7, 0, 12}).ok());
  ASSERT_TRUE(store.Record("code gen", {1}).ok());
  const std::string path = TempPath("round_trip");
  ASSERT_TRUE(store.Save(path).ok());
  absl::StatusOr<LayerBudgetStore> loaded = LayerBudgetStore::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->size(), 2u);
  EXPECT_THAT(*loaded->Lookup("summarise"), ElementsAre(7, 0, 12));
  EXPECT_THAT(*loaded->Lookup("code gen"), ElementsAre(1));
  // The documented format, sorted by task, and no temporary file left behind.
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ASSERT_NE(f, nullptr);
  char buf[128] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  EXPECT_EQ(std::string(buf, n), "code gen\t1\nsummarise\t7 0 12\n");
  EXPECT_NE(access(absl::StrCat(path, ".tmp.", getpid()).c_str(), F_OK), 0);
  std::remove(path.c_str());
}

TEST(LayerBudgetStoreTest, LoadReportsMissingAndGarbageFiles) {
  EXPECT_EQ(LayerBudgetStore::Load(TempPath("missing")).status().code(),
            absl::StatusCode::kNotFound);
  const std::string path = TempPath("garbage");
  const struct {
    const char* text;
    const char* where;
  } cases[] = {
      {"qa\t1 2\ncode 3\n", ":2:"},  // no tab
      {"qa\t1 x\n", ":1:"},          // not a number
      {"qa\t1 -2\n", ":1:"},         // negative
      {"qa\t\n", ":1:"},             // no values
      {"\n\tqa\t1\n", ":2:"},        // empty task (after a skipped blank line)
      {"qa\t1\nqa\t2\n", ":2:"},     // a task twice
      {"qa\t99999999999\n", ":1:"},  // not an int32
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    WriteFile(path, c.text);
    const absl::Status st = LayerBudgetStore::Load(path).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.where));
  }
  std::remove(path.c_str());
}

TEST(LayerBudgetStoreTest, SaveIntoAMissingDirectoryFails) {
  LayerBudgetStore store;
  ASSERT_TRUE(store.Record("qa", {1}).ok());
  EXPECT_EQ(store.Save(TempPath("no_such_dir/budgets")).code(), absl::StatusCode::kNotFound);
}

TEST(XkvOptionsTest, Validate) {
  EXPECT_TRUE(XkvOptions{}.Validate().ok());
  XkvOptions o;
  o.pooling = 6;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.window = 0;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.target_ratio = 1.5;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.task_type = "a\tb";
  EXPECT_FALSE(o.Validate().ok());
}

// An observation query of `layer` over `num_tokens` tokens with page size p: every KV head
// holds the pages `slot_pages` in its slots (in that order), and query head hq gives token
// position j the probability prob(hq, j).
struct Observation {
  std::vector<int32_t> slot_table;
  std::vector<float> token_prob;
  AttentionObservation obs;
};

Observation MakeObservation(int32_t layer, int64_t step, int32_t hq, int32_t hkv, int32_t p,
                            int64_t num_tokens, const std::vector<int32_t>& slot_pages,
                            const std::function<float(int32_t, int64_t)>& prob) {
  Observation o;
  const int32_t s = static_cast<int32_t>(slot_pages.size());
  for (int32_t h = 0; h < hkv; ++h) {
    o.slot_table.insert(o.slot_table.end(), slot_pages.begin(), slot_pages.end());
  }
  o.token_prob.assign(static_cast<size_t>(hq) * s * p, 0.0f);
  for (int32_t g = 0; g < hq; ++g) {
    for (int32_t slot = 0; slot < s; ++slot) {
      for (int32_t t = 0; t < p; ++t) {
        const int64_t pos = int64_t{slot_pages[slot]} * p + t;
        if (slot_pages[slot] >= 0 && pos < num_tokens) {
          o.token_prob[(static_cast<size_t>(g) * s + slot) * p + t] = prob(g, pos);
        }
      }
    }
  }
  o.obs = {.layer = layer,
           .step = step,
           .query_position = num_tokens - 1,
           .num_q_heads = hq,
           .num_kv_heads = hkv,
           .num_slots = s,
           .page_size = p,
           .slot_table = o.slot_table,
           .token_prob = o.token_prob,
           .num_tokens = num_tokens};
  return o;
}

// 2 layers, Hq = 4, Hkv = 2, p = 2, 8 tokens (4 pages), slots in a shuffled order.
constexpr int32_t kHq = 4, kHkv = 2, kPage = 2;
constexpr int64_t kTokens = 8;
const std::vector<int32_t> kSlots = {2, 0, 3, 1};

Observation Concentrated(int32_t layer, int64_t token, int64_t step = -1) {
  return MakeObservation(layer, step, kHq, kHkv, kPage, kTokens, kSlots,
                         [token](int32_t, int64_t j) { return j == token ? 1.0f : 0.0f; });
}
Observation Spread(int32_t layer, int64_t step = -1) {
  return MakeObservation(layer, step, kHq, kHkv, kPage, kTokens, kSlots,
                         [](int32_t, int64_t) { return 1.0f / kTokens; });
}

TEST(XkvBudgetTest, RebuildsTokenOrderPoolsAndSumsPages) {
  XkvOptions o;
  o.pooling = 3;
  XkvBudget xkv(o, 2, kHkv, 2, nullptr);
  xkv.OnAttention(Concentrated(0, 0).obs);
  // Position 0 gets 4 (four query heads); pooled: 4/2 at 0, 4/3 at 1, 0 elsewhere.
  const auto imp = xkv.PageImportance();
  EXPECT_THAT(imp[0], Pointwise(FloatNear(1e-5), {2.0f + 4.0f / 3, 0.0f, 0.0f, 0.0f}));
  EXPECT_TRUE(imp[1].empty());
}

TEST(XkvBudgetTest, UsesOnlyTheLastWindowObservations) {
  XkvOptions o;
  o.window = 2;
  o.pooling = 1;
  XkvBudget xkv(o, 1, kHkv, 2, nullptr);
  xkv.OnAttention(Concentrated(0, 7).obs);  // dropped: three observations, window 2
  xkv.OnAttention(Concentrated(0, 0).obs);
  xkv.OnAttention(Concentrated(0, 2).obs);
  xkv.OnAttention(Spread(0, /*step=*/3).obs);  // a decode step: ignored
  EXPECT_THAT(xkv.PageImportance()[0], Pointwise(FloatNear(1e-6), {4.0f, 4.0f, 0.0f, 0.0f}));
}

TEST(XkvBudgetTest, SpreadLayerGetsTheLargerBudgetAndIsRecorded) {
  LayerBudgetStore store;
  XkvOptions o;
  o.pooling = 1;
  o.total_pages = 4;
  o.task_type = "qa";
  XkvBudget xkv(o, 2, kHkv, /*default_pages=*/2, &store);
  EXPECT_TRUE(xkv.needs_attention());
  std::vector<int32_t> out(kHkv);
  xkv.OnAttention(Concentrated(0, 1).obs);
  xkv.Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 2));  // layer 1 not observed yet: the default
  EXPECT_FALSE(xkv.allocated());
  xkv.OnAttention(Spread(1, /*step=*/0).obs);  // a decode step does not count
  xkv.Budget(0, 10, out);
  EXPECT_FALSE(xkv.allocated());
  xkv.OnAttention(Spread(1).obs);
  // Floors 1 + 1; layer 0's other pages add nothing, layer 1's add a quarter each.
  xkv.Budget(1, 10, out);
  EXPECT_THAT(xkv.allocation(), ElementsAre(1, 3));
  EXPECT_THAT(out, ElementsAre(3, 3));
  xkv.Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(1, 1));
  xkv.Budget(1, 2, out);
  EXPECT_THAT(out, ElementsAre(2, 2));  // capped by max_pages
  // Frozen: later observations change nothing.
  xkv.OnAttention(Spread(0).obs);
  xkv.Budget(0, 10, out);
  EXPECT_THAT(xkv.allocation(), ElementsAre(1, 3));
  ASSERT_TRUE(store.Lookup("qa").has_value());
  EXPECT_THAT(*store.Lookup("qa"), ElementsAre(1, 3));
}

TEST(XkvBudgetTest, TargetRatioSizesTheTotal) {
  XkvOptions o;
  o.pooling = 1;
  o.target_ratio = 1.0;
  XkvBudget xkv(o, 2, kHkv, 2, nullptr);
  xkv.OnAttention(Concentrated(0, 5).obs);
  xkv.OnAttention(Spread(1).obs);
  std::vector<int32_t> out(kHkv);
  xkv.Budget(0, 10, out);
  EXPECT_THAT(xkv.allocation(), ElementsAre(1, 4));  // all of layer 0 lies in one page
}

TEST(XkvBudgetTest, ReusesTheStoreWithoutObserving) {
  LayerBudgetStore store;
  ASSERT_TRUE(store.Record("qa", {5, 1}).ok());
  ASSERT_TRUE(store.Record("other model", {5, 1, 1}).ok());
  XkvOptions o;
  o.task_type = "qa";
  XkvBudget xkv(o, 2, kHkv, 2, &store);
  EXPECT_TRUE(xkv.allocated());
  EXPECT_FALSE(xkv.needs_attention());
  std::vector<int32_t> out(kHkv);
  xkv.Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(5, 5));
  // An allocation of another shape is not reused.
  o.task_type = "other model";
  XkvBudget other(o, 2, kHkv, 2, &store);
  EXPECT_FALSE(other.allocated());
  other.Budget(1, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 2));
  // An allocation recorded after construction is picked up by the first Budget().
  o.task_type = "late";
  XkvBudget late(o, 2, kHkv, 2, &store);
  ASSERT_TRUE(store.Record("late", {3, 4}).ok());
  late.Budget(1, 10, out);
  EXPECT_THAT(out, ElementsAre(4, 4));
}

}  // namespace
}  // namespace kvtier::policy
