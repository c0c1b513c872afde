// KV-Compress per-head budgets: the squared-attention metric with the nearest queries
// excluded, block eviction order, the global per-head allocation, and the budget and
// ranker fed through their shared state.
#include "offload/policy/kv_compress.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::policy {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::IsEmpty;
using ::testing::Pointwise;

// One observation's buffers: slot_table [Hkv][S], token_prob [Hq][S][p].
struct Observation {
  std::vector<int32_t> slot_table;
  std::vector<float> token_prob;
  AttentionObservation obs;
};

Observation Make(int32_t layer, int64_t step, int64_t query_position, int32_t hq, int32_t hkv,
                 int32_t p, int64_t num_tokens, std::vector<int32_t> slot_table,
                 std::vector<float> token_prob) {
  Observation o{std::move(slot_table), std::move(token_prob), {}};
  const int32_t s = static_cast<int32_t>(o.slot_table.size()) / hkv;
  o.obs = {.layer = layer,
           .step = step,
           .query_position = query_position,
           .num_q_heads = hq,
           .num_kv_heads = hkv,
           .num_slots = s,
           .page_size = p,
           .slot_table = o.slot_table,
           .token_prob = o.token_prob,
           .num_tokens = num_tokens};
  return o;
}

// Hq = 2 query heads on one KV head, p = 2, 6 tokens in pages 0..2, query at position 5.
//   q head 0: 0.1 0.2 | 0.3 0.1 | 0.2 0.1
//   q head 1: 0.0 0.4 | 0.1 0.1 | 0.1 0.3
Observation SixTokens() {
  return Make(0, -1, 5, 2, 1, 2, 6, {0, 1, 2},
              {0.1f, 0.2f, 0.3f, 0.1f, 0.2f, 0.1f, 0.0f, 0.4f, 0.1f, 0.1f, 0.1f, 0.3f});
}

TEST(SlotMetricsTest, SumsSquaresOverTheGroupByHand) {
  // v = 0: every token counts. Page 0: .01 + .04 + 0 + .16; page 1: .09 + .01 + .01 + .01;
  // page 2: .04 + .01 + .01 + .09.
  EXPECT_THAT(SlotMetrics(SixTokens().obs, 0), Pointwise(DoubleNear(1e-7), {0.21, 0.12, 0.15}));
  // v = 2: the query at 5 does not count for keys 4 and 5 (i − j < 2).
  EXPECT_THAT(SlotMetrics(SixTokens().obs, 2), Pointwise(DoubleNear(1e-7), {0.21, 0.12, 0.0}));
  // v = 3: key 3 drops out too; only key 2 of page 1 counts.
  EXPECT_THAT(SlotMetrics(SixTokens().obs, 3), Pointwise(DoubleNear(1e-7), {0.21, 0.10, 0.0}));
}

TEST(SlotMetricsTest, ExclusionChangesWhichBlockGoes) {
  const std::vector<int64_t> ids = {0, 1, 2};
  for (int32_t v : {0, 2}) {
    const std::vector<double> m = SlotMetrics(SixTokens().obs, v);
    const std::vector<float> mf(m.begin(), m.end());
    // Keeping two blocks: without exclusion page 1 is the lowest, with it page 2.
    EXPECT_THAT(LowestBlocks(mf, ids, 2), ElementsAre(v == 0 ? 1 : 2)) << "v = " << v;
  }
}

TEST(SlotMetricsTest, EmptySlotsAndMalformedObservations) {
  Observation o = Make(0, -1, 5, 2, 1, 2, 6, {0, -1, 2}, std::vector<float>(12, 0.5f));
  EXPECT_THAT(SlotMetrics(o.obs, 0), Pointwise(DoubleNear(1e-7), {1.0, 0.0, 1.0}));
  o.obs.num_q_heads = 4;  // token_prob is too short for 4 query heads
  EXPECT_THAT(SlotMetrics(o.obs, 0), IsEmpty());
  // Hq = 3 is not a multiple of Hkv = 2 (the buffers are large enough).
  const Observation odd =
      Make(0, -1, 5, 3, 2, 2, 6, {0, 1, 2, 0, 1, 2}, std::vector<float>(18, 0.5f));
  EXPECT_THAT(SlotMetrics(odd.obs, 0), IsEmpty());
}

TEST(LowestBlocksTest, EvictsTheLowestInOrderOlderFirstOnTies) {
  const std::vector<float> m = {0.5f, 0.1f, 0.3f, 0.1f, 0.9f};
  const std::vector<int64_t> ids = {10, 13, 12, 11, 14};
  EXPECT_THAT(LowestBlocks(m, ids, 2), ElementsAre(11, 13, 12));
  EXPECT_THAT(LowestBlocks(m, ids, 0), ElementsAre(11, 13, 12, 10, 14));
  EXPECT_THAT(LowestBlocks(m, ids, 5), IsEmpty());
  EXPECT_THAT(LowestBlocks(m, ids, 7), IsEmpty());
  const std::vector<float> with_nan = {0.5f, std::nanf(""), 0.0f};
  const std::vector<int64_t> nan_ids = {1, 2, 3};
  EXPECT_THAT(LowestBlocks(with_nan, nan_ids, 1), ElementsAre(2, 3));
}

TEST(LowestBlocksTest, FreesExactlyTheLowestSums) {
  for (uint32_t seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> n_dist(0, 12), coarse(0, 4);
    const int n = n_dist(rng);
    std::vector<float> m(n);
    std::vector<int64_t> ids(n);
    for (int i = 0; i < n; ++i) {
      m[i] = 0.25f * coarse(rng);  // coarse values: many ties
      ids[i] = 100 - 7 * i;
    }
    const int32_t keep = std::uniform_int_distribution<int>(0, n)(rng);
    const std::vector<int64_t> evicted = LowestBlocks(m, ids, keep);
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    ASSERT_EQ(static_cast<int>(evicted.size()), n - keep);
    // The evicted set has the smallest possible metric sum: compare with a full sort.
    std::vector<float> sorted = m;
    std::sort(sorted.begin(), sorted.end());
    double best = 0, got = 0;
    for (int i = 0; i < n - keep; ++i) best += sorted[i];
    for (int64_t id : evicted) got += m[(100 - id) / 7];
    EXPECT_DOUBLE_EQ(got, best);
  }
}

TEST(AllocateHeadBudgetsTest, HandCase) {
  // Floors keep 0.9, 0.5 and 0.05; the rest compete: 0.4 > 0.3 > 0.1.
  const std::vector<std::vector<float>> m = {{0.9f, 0.1f}, {0.3f, 0.5f, 0.4f}, {0.05f}};
  EXPECT_THAT(AllocateHeadBudgets(m, 4, 1), ElementsAre(1, 2, 1));
  EXPECT_THAT(AllocateHeadBudgets(m, 5, 1), ElementsAre(1, 3, 1));
  EXPECT_THAT(AllocateHeadBudgets(m, 6, 1), ElementsAre(2, 3, 1));
  EXPECT_THAT(AllocateHeadBudgets(m, 100, 1), ElementsAre(2, 3, 1));
  // Without floors the 0.05 head loses its only block.
  EXPECT_THAT(AllocateHeadBudgets(m, 3, 0), ElementsAre(1, 2, 0));
  // Floors win over a total too small for them.
  EXPECT_THAT(AllocateHeadBudgets(m, 1, 1), ElementsAre(1, 1, 1));
  // Equal metrics: the lower head first.
  EXPECT_THAT(AllocateHeadBudgets({{0.5f, 0.5f}, {0.5f, 0.5f}}, 3, 0), ElementsAre(2, 1));
  // NaN ranks lowest.
  EXPECT_THAT(AllocateHeadBudgets({{std::nanf("")}, {0.0f}}, 1, 0), ElementsAre(0, 1));
}

TEST(AllocateHeadBudgetsTest, KeepsTheGloballyHighestBlocks) {
  for (uint32_t seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> blocks(0, 6);
    std::uniform_real_distribution<float> value(0.0f, 1.0f);
    std::vector<std::vector<float>> m(4);
    int64_t all = 0;
    for (auto& head : m) {
      head.resize(blocks(rng));
      for (float& x : head) x = value(rng);
      all += static_cast<int64_t>(head.size());
    }
    const int64_t total = std::uniform_int_distribution<int64_t>(0, all + 2)(rng);
    SCOPED_TRACE(absl::StrCat("seed ", seed, " total ", total));
    const std::vector<int32_t> keep = AllocateHeadBudgets(m, total, 0);
    // Without floors: every kept block is at least every evicted one.
    float min_kept = std::numeric_limits<float>::infinity(), max_evicted = -1;
    int64_t sum = 0;
    for (size_t h = 0; h < m.size(); ++h) {
      std::vector<float> sorted = m[h];
      std::sort(sorted.rbegin(), sorted.rend());
      for (size_t i = 0; i < sorted.size(); ++i) {
        if (static_cast<int32_t>(i) < keep[h]) {
          min_kept = std::min(min_kept, sorted[i]);
        } else {
          max_evicted = std::max(max_evicted, sorted[i]);
        }
      }
      sum += keep[h];
    }
    EXPECT_EQ(sum, std::min(total, all));
    EXPECT_GE(min_kept, max_evicted);
  }
}

TEST(KvCompressOptionsTest, Validate) {
  EXPECT_TRUE(KvCompressOptions{}.Validate().ok());
  KvCompressOptions o;
  o.exclude_nearest = -1;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.total_pages = -1;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.min_pages = -1;
  EXPECT_FALSE(o.Validate().ok());
}

// 2 layers, Hq = Hkv = 2, p = 1 (a page is a token), 4 tokens; query at 3, v = 0.
// prob[h] is head h's attention over positions 0..3.
Observation FourTokens(int32_t layer, int64_t step, std::vector<float> prob0,
                       std::vector<float> prob1) {
  std::vector<float> prob = prob0;
  prob.insert(prob.end(), prob1.begin(), prob1.end());
  return Make(layer, step, 3, 2, 2, 1, 4, {0, 1, 2, 3, 0, 1, 2, 3}, prob);
}

KvCompressOptions Options() {
  KvCompressOptions o;
  o.exclude_nearest = 0;
  o.total_pages = 6;
  o.min_pages = 1;
  return o;
}

TEST(KvCompressTest, BudgetAndRankerShareTheMetrics) {
  KvCompressPolicies p = MakeKvCompress(Options(), 2, 2, 2, 1, /*default_pages=*/2);
  EXPECT_TRUE(p.ranker->needs_attention());
  EXPECT_FALSE(p.budget->needs_attention());
  std::vector<int32_t> out(2);
  p.budget->Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 2));  // nothing observed: the default
  // Layer 0: head 0 metrics {1, 0, 0, 0}, head 1 {.25, .25, 0, 0}.
  p.ranker->OnAttention(FourTokens(0, -1, {1, 0, 0, 0}, {0.5f, 0.5f, 0, 0}).obs);
  p.budget->Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 2));  // layer 1 not observed yet
  // Layer 1: head 0 {.0625 × 4}, head 1 {0, 0, 0, 1}.
  p.ranker->OnAttention(FourTokens(1, -1, {0.25f, 0.25f, 0.25f, 0.25f}, {0, 0, 0, 1}).obs);
  EXPECT_FLOAT_EQ(p.ranker->Score(0, 0, 0), 1.0f);
  EXPECT_FLOAT_EQ(p.ranker->Score(0, 1, 1), 0.25f);
  EXPECT_FLOAT_EQ(p.ranker->Score(1, 0, 2), 0.0625f);
  EXPECT_FLOAT_EQ(p.ranker->Score(1, 1, 9), 0.0f);  // unknown page
  EXPECT_FALSE(p.ranker->Pinned(0, 0, 0));
  // Floors take 4 of the 6 pages; the other two go to .25 (layer 0 head 1) and .0625
  // (layer 1 head 0, ahead of the zeros).
  p.budget->Budget(0, 10, out);
  EXPECT_THAT(out, ElementsAre(1, 2));
  p.budget->Budget(1, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 1));
  p.budget->Budget(1, 1, out);
  EXPECT_THAT(out, ElementsAre(1, 1));  // capped by max_pages
  EXPECT_THAT(p.budget->allocation(), ElementsAre(1, 2, 2, 1));
  // Evicting layer 0 head 1's .25 page forgets it and reallocates.
  p.ranker->OnEvicted(0, 1, 1);
  EXPECT_FLOAT_EQ(p.ranker->Score(0, 1, 1), 0.0f);
  p.budget->Budget(1, 10, out);
  EXPECT_THAT(out, ElementsAre(3, 1));
  EXPECT_THAT(p.budget->allocation(), ElementsAre(1, 1, 3, 1));
}

TEST(KvCompressTest, DecodeStepsUpdateOnlyWhenAsked) {
  for (bool decode_updates : {false, true}) {
    KvCompressOptions o = Options();
    o.decode_updates = decode_updates;
    KvCompressPolicies p = MakeKvCompress(o, 2, 2, 2, 1, 2);
    p.ranker->OnAttention(FourTokens(0, -1, {1, 0, 0, 0}, {0, 0, 0, 1}).obs);
    p.ranker->OnAttention(FourTokens(0, /*step=*/0, {0.5f, 0, 0, 0}, {0, 0, 0, 0}).obs);
    EXPECT_FLOAT_EQ(p.ranker->Score(0, 0, 0), decode_updates ? 1.25f : 1.0f);
  }
}

TEST(KvCompressTest, ExclusionAppliesThroughTheRanker) {
  KvCompressOptions o = Options();
  o.exclude_nearest = 2;  // the query at 3 does not count for keys 2 and 3
  KvCompressPolicies p = MakeKvCompress(o, 2, 2, 2, 1, 2);
  p.ranker->OnAttention(FourTokens(0, -1, {0.1f, 0.2f, 0.3f, 0.4f}, {0, 0, 0, 1}).obs);
  EXPECT_THAT((std::vector<float>{p.ranker->Score(0, 0, 0), p.ranker->Score(0, 0, 1),
                                  p.ranker->Score(0, 0, 2), p.ranker->Score(0, 0, 3)}),
              Pointwise(FloatNear(1e-7), {0.01f, 0.04f, 0.0f, 0.0f}));
}

TEST(KvCompressTest, IgnoresObservationsOfAnotherShape) {
  KvCompressPolicies p = MakeKvCompress(Options(), 2, 2, 2, 1, 2);
  Observation o = FourTokens(0, -1, {1, 0, 0, 0}, {0, 0, 0, 1});
  o.obs.page_size = 2;  // not the state's page size
  p.ranker->OnAttention(o.obs);
  EXPECT_FLOAT_EQ(p.ranker->Score(0, 0, 0), 0.0f);
  o = FourTokens(5, -1, {1, 0, 0, 0}, {0, 0, 0, 1});  // layer out of range
  p.ranker->OnAttention(o.obs);
  std::vector<int32_t> out(2);
  p.budget->Budget(5, 10, out);
  EXPECT_THAT(out, ElementsAre(2, 2));
}

}  // namespace
}  // namespace kvtier::policy
