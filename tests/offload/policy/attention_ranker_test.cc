// Conf-KV ranker and H2O: EMA and cumulative attention mass over observations, min-max
// normalised scores blended with recency, protected newest pages, forgetting evicted pages.
#include "offload/policy/attention_ranker.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::policy {
namespace {

using ::testing::HasSubstr;

// An observation with its own storage.
struct Obs {
  std::vector<int32_t> slots;  // [Hkv][S]
  std::vector<float> probs;    // [Hq][S][p]
  AttentionObservation view;

  Obs(int32_t layer, int32_t hq, int32_t hkv, int32_t page_size, int64_t num_tokens,
      std::vector<int32_t> slot_table, std::vector<float> token_prob)
      : slots(std::move(slot_table)), probs(std::move(token_prob)) {
    view.layer = layer;
    view.num_q_heads = hq;
    view.num_kv_heads = hkv;
    view.num_slots = static_cast<int32_t>(slots.size()) / hkv;
    view.page_size = page_size;
    view.slot_table = slots;
    view.token_prob = probs;
    view.num_tokens = num_tokens;
  }
};

// One layer, one KV head, one query head, p = 1: a page's mass is its slot's probability.
// Pages 0..n−1 in slots 0..n−1; the sequence has `num_tokens` tokens.
Obs Simple(std::vector<float> masses, int64_t num_tokens) {
  std::vector<int32_t> slots(masses.size());
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
  return Obs(0, 1, 1, 1, num_tokens, std::move(slots), std::move(masses));
}

// Two query heads for one KV head (G = 2), three slots holding pages 0, 1, 2, p = 2.
// Masses: mean over the group of Σ_t prob.
//   obs 1: page 0 = (0.2 + 0.4)/2 = 0.3, page 1 = (0.2 + 0)/2 = 0.1, page 2 = 0.6
//   obs 2: page 0 = (0 + 0.2)/2 = 0.1,   page 1 = (0.6 + 0.4)/2 = 0.5, page 2 = 0.2
Obs GroupObservation(int step) {
  std::vector<float> probs =
      step == 1 ? std::vector<float>{0.1f, 0.1f, 0.2f, 0.0f, 0.3f, 0.3f,   // q head 0
                                     0.3f, 0.1f, 0.0f, 0.0f, 0.2f, 0.4f}   // q head 1
                : std::vector<float>{0.0f, 0.0f, 0.5f, 0.1f, 0.1f, 0.1f,   // q head 0
                                     0.1f, 0.1f, 0.3f, 0.1f, 0.1f, 0.1f};  // q head 1
  return Obs(0, 2, 1, 2, 6, {0, 1, 2}, std::move(probs));
}

TEST(AttentionRankerTest, EmaOverTwoObservations) {
  AttentionRanker r(AttentionRankerOptions{}, 1, 1);  // β = 0.9
  EXPECT_TRUE(r.needs_attention());
  r.OnAttention(GroupObservation(1).view);
  EXPECT_NEAR(*r.mass(0, 0, 0), 0.3f, 1e-6f);  // first sight: e = mass
  EXPECT_NEAR(*r.mass(0, 0, 1), 0.1f, 1e-6f);
  EXPECT_NEAR(*r.mass(0, 0, 2), 0.6f, 1e-6f);
  r.OnAttention(GroupObservation(2).view);
  EXPECT_NEAR(*r.mass(0, 0, 0), 0.9f * 0.3f + 0.1f * 0.1f, 1e-6f);  // 0.28
  EXPECT_NEAR(*r.mass(0, 0, 1), 0.9f * 0.1f + 0.1f * 0.5f, 1e-6f);  // 0.14
  EXPECT_NEAR(*r.mass(0, 0, 2), 0.9f * 0.6f + 0.1f * 0.2f, 1e-6f);  // 0.56
  EXPECT_EQ(r.newest_page(), 2);                                    // 6 tokens at p = 2
  EXPECT_EQ(r.name(), "attention");
}

TEST(AttentionRankerTest, CumulativeSumsTheMasses) {
  AttentionRankerOptions o;
  o.cumulative = true;
  AttentionRanker r(o, 1, 1);
  r.OnAttention(GroupObservation(1).view);
  r.OnAttention(GroupObservation(2).view);
  EXPECT_NEAR(*r.mass(0, 0, 0), 0.4f, 1e-6f);
  EXPECT_NEAR(*r.mass(0, 0, 1), 0.6f, 1e-6f);
  EXPECT_NEAR(*r.mass(0, 0, 2), 0.8f, 1e-6f);
  EXPECT_EQ(r.name(), "h2o");
}

TEST(AttentionRankerTest, QueryGroupsMapToTheirKvHead) {
  // Hq = 4, Hkv = 2 (G = 2), one slot each, p = 1: KV head 0 has page 5 and q heads 0, 1;
  // KV head 1 has page 7 and q heads 2, 3.
  AttentionRanker r(AttentionRankerOptions{}, 2, 2);
  const Obs obs(1, 4, 2, 1, 100, {5, 7}, {0.2f, 0.4f, 0.6f, 1.0f});
  r.OnAttention(obs.view);
  EXPECT_NEAR(*r.mass(1, 0, 5), 0.3f, 1e-6f);
  EXPECT_NEAR(*r.mass(1, 1, 7), 0.8f, 1e-6f);
  EXPECT_FALSE(r.mass(1, 0, 7).has_value());
  EXPECT_EQ(r.Score(1, 0, 7), 0.0f);     // never seen by that head
  EXPECT_EQ(r.tracked_pages(0, 0), 0u);  // layer 0 untouched
  EXPECT_EQ(r.tracked_pages(0, 1), 0u);
}

TEST(AttentionRankerTest, MinMaxNormalisationOverUnprotectedPages) {
  AttentionRankerOptions o;
  o.recency_weight = 0;  // attention only
  AttentionRanker r(o, 1, 1);
  // Pages 0..3, 4 tokens at p = 1: page 3 is the newest, protected (its mass 9 is left out
  // of the normalisation). e = {0.3, 0.1, 0.5}: scores (e − 0.1) / 0.4.
  r.OnAttention(Simple({0.3f, 0.1f, 0.5f, 9.0f}, 4).view);
  EXPECT_NEAR(r.Score(0, 0, 0), 0.5f, 1e-6f);
  EXPECT_NEAR(r.Score(0, 0, 1), 0.0f, 1e-6f);
  EXPECT_NEAR(r.Score(0, 0, 2), 1.0f, 1e-6f);
  EXPECT_EQ(r.Score(0, 0, 3), 1.0f);   // protected
  EXPECT_EQ(r.Score(0, 0, 42), 1.0f);  // beyond the newest page: protected too
  EXPECT_EQ(r.Score(0, 0, -1), 0.0f);  // not a page
  EXPECT_EQ(r.Score(5, 0, 0), 0.0f);   // layer out of range
}

TEST(AttentionRankerTest, EqualValuesNormaliseToZero) {
  AttentionRanker r(AttentionRankerOptions{}, 1, 1);  // w_r = 0.5
  // One unprotected page: max == min for both terms.
  r.OnAttention(Simple({0.7f, 0.2f}, 2).view);
  EXPECT_EQ(r.Score(0, 0, 0), 0.0f);
  // Two pages of equal mass: attention term 0, recency decides: 0.5 · {0, 1}.
  AttentionRanker q(AttentionRankerOptions{}, 1, 1);
  q.OnAttention(Simple({0.4f, 0.4f, 0.1f}, 3).view);
  EXPECT_EQ(q.Score(0, 0, 0), 0.0f);
  EXPECT_NEAR(q.Score(0, 0, 1), 0.5f, 1e-6f);
}

// The page a drop would evict: the lowest score among the unpinned candidates.
int64_t Victim(AttentionRanker& r, int64_t num_pages) {
  int64_t best = -1;
  float lowest = 2;
  for (int64_t page = 0; page < num_pages; ++page) {
    if (r.Pinned(0, 0, page)) continue;
    const float s = r.Score(0, 0, page);
    if (s < lowest) {
      lowest = s;
      best = page;
    }
  }
  return best;
}

TEST(AttentionRankerTest, RecencyWeightOrdersPages) {
  // e = {0.5, 0.3, 0.1} for pages 0, 1, 2; page 3 protected.
  const Obs obs = Simple({0.5f, 0.3f, 0.1f, 0.0f}, 4);
  AttentionRankerOptions o;
  o.recency_weight = 0;
  AttentionRanker attention(o, 1, 1);
  attention.OnAttention(obs.view);
  EXPECT_GT(attention.Score(0, 0, 0), attention.Score(0, 0, 1));
  EXPECT_GT(attention.Score(0, 0, 1), attention.Score(0, 0, 2));
  EXPECT_EQ(Victim(attention, 4), 2);  // least attended
  o.recency_weight = 1;
  AttentionRanker recency(o, 1, 1);
  recency.OnAttention(obs.view);
  EXPECT_NEAR(recency.Score(0, 0, 0), 0.0f, 1e-6f);
  EXPECT_NEAR(recency.Score(0, 0, 1), 0.5f, 1e-6f);
  EXPECT_NEAR(recency.Score(0, 0, 2), 1.0f, 1e-6f);
  EXPECT_EQ(Victim(recency, 4), 0);  // oldest
  o.recency_weight = 0.25f;
  AttentionRanker blend(o, 1, 1);
  blend.OnAttention(obs.view);
  // 0.75·{1, 0.5, 0} + 0.25·{0, 0.5, 1} = {0.75, 0.5, 0.25}.
  EXPECT_NEAR(blend.Score(0, 0, 0), 0.75f, 1e-6f);
  EXPECT_NEAR(blend.Score(0, 0, 1), 0.5f, 1e-6f);
  EXPECT_NEAR(blend.Score(0, 0, 2), 0.25f, 1e-6f);
  EXPECT_EQ(Victim(blend, 4), 2);
}

TEST(AttentionRankerTest, NewestPagesAreProtectedAndPinned) {
  AttentionRankerOptions o;
  o.protected_pages = 2;
  AttentionRanker r(o, 1, 1);
  EXPECT_FALSE(r.Pinned(0, 0, 0));  // nothing seen yet
  // 7 tokens at p = 2: pages 0..3, newest 3; protected: 2 and 3.
  const Obs obs(0, 1, 1, 2, 7, {0, 1, 2, 3}, std::vector<float>(8, 0.1f));
  r.OnAttention(obs.view);
  EXPECT_FALSE(r.Pinned(0, 0, 0));
  EXPECT_FALSE(r.Pinned(0, 0, 1));
  EXPECT_TRUE(r.Pinned(0, 0, 2));
  EXPECT_TRUE(r.Pinned(0, 0, 3));
  EXPECT_TRUE(r.Pinned(0, 0, 4));   // beyond the newest: protected too
  EXPECT_FALSE(r.Pinned(1, 0, 3));  // layer out of range
  // The sequence grows to 9 tokens (newest page 4): page 2 is no longer protected, and it
  // joins the normalisation.
  const Obs later(0, 1, 1, 2, 9, {0, 1, 2, 4}, std::vector<float>(8, 0.1f));
  r.OnAttention(later.view);
  EXPECT_FALSE(r.Pinned(0, 0, 2));
  EXPECT_TRUE(r.Pinned(0, 0, 3));
  EXPECT_LT(r.Score(0, 0, 2), 1.0f);
  // protected_pages = 0: nothing pinned.
  o.protected_pages = 0;
  AttentionRanker none(o, 1, 1);
  none.OnAttention(obs.view);
  EXPECT_FALSE(none.Pinned(0, 0, 3));
}

TEST(AttentionRankerTest, OnEvictedForgetsThePage) {
  AttentionRankerOptions o;
  o.recency_weight = 0;
  AttentionRanker r(o, 1, 1);
  r.OnAttention(Simple({0.5f, 0.3f, 0.1f, 0.0f}, 4).view);
  EXPECT_EQ(r.tracked_pages(0, 0), 4u);
  EXPECT_NEAR(r.Score(0, 0, 1), 0.5f, 1e-6f);  // (0.3 − 0.1) / 0.4
  r.OnEvicted(0, 0, 2);
  EXPECT_EQ(r.tracked_pages(0, 0), 3u);
  EXPECT_FALSE(r.mass(0, 0, 2).has_value());
  EXPECT_EQ(r.Score(0, 0, 2), 0.0f);
  // The range is now {0.3, 0.5}: page 1 becomes the lowest, page 0 the highest.
  EXPECT_NEAR(r.Score(0, 0, 1), 0.0f, 1e-6f);
  EXPECT_NEAR(r.Score(0, 0, 0), 1.0f, 1e-6f);
  // Seen again later: a fresh start (first sight).
  r.OnAttention(Obs(0, 1, 1, 1, 4, {2}, {0.9f}).view);
  EXPECT_NEAR(*r.mass(0, 0, 2), 0.9f, 1e-6f);
  r.OnEvicted(0, 0, 77);  // unknown: no effect
  r.OnEvicted(3, 0, 0);   // out of range: no effect
  EXPECT_EQ(r.tracked_pages(0, 0), 4u);
}

TEST(AttentionRankerTest, MisshapenObservationsAreRejected) {
  AttentionRanker r(AttentionRankerOptions{}, 2, 2);
  const Obs wrong_heads(0, 1, 1, 1, 4, {0}, {1.0f});  // Hkv 1 ≠ 2
  r.OnAttention(wrong_heads.view);
  const Obs short_probs(0, 2, 2, 2, 4, {0, 1}, {1.0f, 1.0f});  // needs 2·1·2 = 4 probs
  r.OnAttention(short_probs.view);
  const Obs bad_layer(2, 2, 2, 1, 4, {0, 1}, {1.0f, 1.0f});
  r.OnAttention(bad_layer.view);
  const Obs bad_group(0, 3, 2, 1, 4, {0, 1}, {1.0f, 1.0f, 1.0f});  // 3 % 2 ≠ 0
  r.OnAttention(bad_group.view);
  EXPECT_EQ(r.rejected(), 4);
  EXPECT_EQ(r.tracked_pages(0, 0) + r.tracked_pages(0, 1), 0u);
  EXPECT_EQ(r.newest_page(), -1);
  // Empty slots (−1) are skipped.
  r.OnAttention(Obs(0, 2, 2, 1, 4, {-1, 3}, {1.0f, 0.5f}).view);
  EXPECT_EQ(r.tracked_pages(0, 0), 0u);
  EXPECT_NEAR(*r.mass(0, 1, 3), 0.5f, 1e-6f);
}

TEST(AttentionRankerOptionsTest, ValidateNamesTheField) {
  EXPECT_TRUE(AttentionRankerOptions{}.Validate().ok());
  AttentionRankerOptions o;
  o.beta = 1.5f;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("beta must be in [0, 1]"));
  o = {};
  o.recency_weight = -0.1f;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("recency_weight"));
  o = {};
  o.protected_pages = -1;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("protected_pages must be >= 0"));
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AttentionRanker::Create(o, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AttentionRanker::Create(AttentionRankerOptions{}, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(AttentionRanker::Create(AttentionRankerOptions{}, 2, 8).ok());
}

}  // namespace
}  // namespace kvtier::policy
