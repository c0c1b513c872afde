// Host-tier drop policy: refusals and drops are errors or counted victims, never silent;
// the victim is the lowest-scoring unpinned page; host scores from a residency policy.
#include "offload/policy/host_drop.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::policy {
namespace {

using ::testing::HasSubstr;

TEST(HostDropModeTest, NamesRoundTrip) {
  for (HostDropMode m : {HostDropMode::kRefuse, HostDropMode::kEvict}) {
    HostDropMode parsed = m == HostDropMode::kRefuse ? HostDropMode::kEvict : HostDropMode::kRefuse;
    ASSERT_TRUE(ParseHostDropMode(HostDropModeName(m), &parsed));
    EXPECT_EQ(parsed, m);
  }
  EXPECT_EQ(HostDropModeName(HostDropMode::kRefuse), "refuse");
  EXPECT_EQ(HostDropModeName(HostDropMode::kEvict), "evict");
  HostDropMode out = HostDropMode::kEvict;
  EXPECT_FALSE(ParseHostDropMode("drop", &out));
  EXPECT_FALSE(ParseHostDropMode("Evict", &out));
  EXPECT_EQ(out, HostDropMode::kEvict);  // untouched
}

TEST(HostDropPolicyTest, RefuseFailsAndCountsEveryRefusal) {
  HostDropPolicy policy(HostDropMode::kRefuse);
  const std::vector<HostCandidate> c = {{0, 1, 0.5f, false}};
  for (int i = 0; i < 3; ++i) {
    const absl::StatusOr<size_t> victim = policy.PickVictim(c);
    ASSERT_EQ(victim.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(victim.status().message()), HasSubstr("host_drop = refuse"));
  }
  EXPECT_EQ(policy.refused(), 3u);
  EXPECT_EQ(policy.dropped(), 0u);
}

TEST(HostDropPolicyTest, EvictPicksTheLowestUnpinned) {
  HostDropPolicy policy(HostDropMode::kEvict);
  const std::vector<HostCandidate> c = {
      {0, 4, 0.7f, false},
      {1, 2, 0.1f, true},  // lowest, but pinned
      {0, 9, 0.3f, false},
      {2, 5, 0.9f, false},
  };
  ASSERT_EQ(policy.PickVictim(c).value(), 2u);
  EXPECT_EQ(policy.dropped(), 1u);
  EXPECT_EQ(policy.refused(), 0u);
}

TEST(HostDropPolicyTest, TiesGoToTheLowerLayerThenPageAndNanFirst) {
  HostDropPolicy policy(HostDropMode::kEvict);
  const std::vector<HostCandidate> ties = {
      {1, 3, 0.2f, false}, {0, 8, 0.2f, false}, {0, 6, 0.2f, false}, {0, 7, 0.2f, false}};
  EXPECT_EQ(policy.PickVictim(ties).value(), 2u);  // layer 0, page 6
  const std::vector<HostCandidate> nan = {
      {0, 1, -5.0f, false}, {3, 9, std::nanf(""), false}, {0, 2, -9.0f, false}};
  EXPECT_EQ(policy.PickVictim(nan).value(), 1u);
  EXPECT_EQ(policy.dropped(), 2u);
}

TEST(HostDropPolicyTest, AllPinnedOrNoCandidatesIsAnError) {
  HostDropPolicy policy(HostDropMode::kEvict);
  const std::vector<HostCandidate> pinned = {{0, 1, 0.1f, true}, {1, 1, 0.2f, true}};
  const absl::StatusOr<size_t> victim = policy.PickVictim(pinned);
  EXPECT_EQ(victim.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(victim.status().message()), HasSubstr("all pinned"));
  EXPECT_EQ(policy.PickVictim({}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(policy.refused(), 2u);
  EXPECT_EQ(policy.dropped(), 0u);
}

// Scores page · 10 + head, pins page 3 for head 1 only.
class FakeRanker final : public ResidencyPolicy {
 public:
  std::string_view name() const override { return "fake"; }
  float Score(int32_t layer, int32_t kv_head, int64_t page) override {
    ++calls;
    return static_cast<float>(layer * 100 + page * 10 + kv_head);
  }
  bool Pinned(int32_t, int32_t kv_head, int64_t page) override { return kv_head == 1 && page == 3; }
  int calls = 0;
};

TEST(HostScoreTest, MaxOverHeadsAndAnyPin) {
  FakeRanker r;
  EXPECT_FLOAT_EQ(HostScore(&r, 1, 2, 4), 123.0f);  // head 3 scores highest
  EXPECT_EQ(r.calls, 4);
  EXPECT_TRUE(HostPinned(&r, 0, 3, 2));
  EXPECT_FALSE(HostPinned(&r, 0, 3, 1));  // head 1 is not among the heads
  EXPECT_FALSE(HostPinned(&r, 0, 4, 2));
}

TEST(HostScoreTest, NullRankerEvictsTheOldestFirst) {
  EXPECT_FLOAT_EQ(HostScore(nullptr, 0, 7, 4), 7.0f);
  EXPECT_LT(HostScore(nullptr, 0, 2, 4), HostScore(nullptr, 0, 7, 4));
  EXPECT_FALSE(HostPinned(nullptr, 0, 7, 4));
  // Through the policy: with null-ranker scores the oldest page is the victim.
  HostDropPolicy policy(HostDropMode::kEvict);
  std::vector<HostCandidate> c;
  for (int64_t page : {5, 2, 8}) {
    c.push_back({0, page, HostScore(nullptr, 0, page, 4), HostPinned(nullptr, 0, page, 4)});
  }
  EXPECT_EQ(policy.PickVictim(c).value(), 1u);
}

}  // namespace
}  // namespace kvtier::policy
