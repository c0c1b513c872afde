// Conf-KV confidence budget: logit summaries against hand-computed values, the confidence
// blend, the hysteresis between loose and tight, budgets and option validation.
#include "offload/policy/confidence.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::policy {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(SummarizeLogitsTest, UniformHasFullEntropyNoMarginAndTopMassMOverV) {
  const std::vector<float> logits(8, 3.0f);
  const LogitSummary s = SummarizeLogits(logits, 2);
  EXPECT_NEAR(s.normalized_entropy, 1.0f, 1e-6f);
  EXPECT_EQ(s.margin, 0.0f);
  EXPECT_NEAR(s.top_mass, 2.0f / 8, 1e-6f);
  // Default weights 1/3 each: (0 + 0 + 0.25) / 1 = 0.0833.
  EXPECT_NEAR(Confidence(s, ConfidenceOptions{}), 0.25f / 3, 1e-6f);
}

TEST(SummarizeLogitsTest, PeakedDistributionMatchesHandComputedValues) {
  // V = 4, logits {10, 0, 0, 0}: with e = exp(−10) ≈ 4.539993e-5 and Z = 1 + 3e,
  //   H = ln Z + 30e/Z ≈ 1.49801e-3 nats, H/ln 4 ≈ 1.08058e-3,
  //   margin = 10, top-2 mass = (1 + e)/Z ≈ 0.9999092.
  const std::vector<float> logits = {10, 0, 0, 0};
  const LogitSummary s = SummarizeLogits(logits, 2);
  const double e = std::exp(-10.0);
  const double z = 1 + 3 * e;
  const double h = std::log(z) + 30 * e / z;
  EXPECT_NEAR(s.normalized_entropy, h / std::log(4.0), 1e-7);
  EXPECT_NEAR(s.normalized_entropy, 1.08058e-3, 1e-7);
  EXPECT_NEAR(s.margin, 10.0f, 1e-6f);
  EXPECT_NEAR(s.top_mass, (1 + e) / z, 1e-7);
  EXPECT_NEAR(s.top_mass, 0.9999092, 1e-7);
  // Confidence = ((1 − Hn) + (1 − exp(−10/2)) + top mass) / 3 ≈ 0.997364.
  const double expected = ((1 - h / std::log(4.0)) + (1 - std::exp(-5.0)) + (1 + e) / z) / 3;
  EXPECT_NEAR(Confidence(s, ConfidenceOptions{}), expected, 1e-6);
  EXPECT_NEAR(Confidence(s, ConfidenceOptions{}), 0.997364, 1e-5);
}

TEST(SummarizeLogitsTest, TwoTokens) {
  // p = (e/(1+e), 1/(1+e)) = (0.7310586, 0.2689414); H = 0.5822031 nats; H/ln 2 = 0.8399415.
  const std::vector<float> logits = {1, 0};
  const LogitSummary s = SummarizeLogits(logits, 1);
  EXPECT_NEAR(s.normalized_entropy, 0.8399415f, 1e-6f);
  EXPECT_NEAR(s.margin, 1.0f, 1e-6f);
  EXPECT_NEAR(s.top_mass, 0.7310586f, 1e-6f);
}

TEST(SummarizeLogitsTest, LargeLogitsAreStable) {
  // Shifting every logit changes nothing (exp(80000) would overflow without the shift).
  const std::vector<float> shifted = {80010, 80000, 80000, 80000};
  const LogitSummary a = SummarizeLogits(shifted, 2);
  const LogitSummary b = SummarizeLogits(std::vector<float>{10, 0, 0, 0}, 2);
  EXPECT_NEAR(a.normalized_entropy, b.normalized_entropy, 1e-7f);
  EXPECT_NEAR(a.margin, b.margin, 1e-6f);
  EXPECT_NEAR(a.top_mass, b.top_mass, 1e-7f);
}

TEST(SummarizeLogitsTest, NanAndNegativeInfinityHaveProbabilityZero) {
  // Uniform over the two finite tokens of V = 3: H = ln 2, H / ln 3 = 0.6309298.
  for (float bad : {kNaN, -kInf}) {
    const LogitSummary s = SummarizeLogits(std::vector<float>{bad, 0, 0}, 1);
    EXPECT_NEAR(s.normalized_entropy, 0.6309298f, 1e-6f) << bad;
    EXPECT_EQ(s.margin, 0.0f) << bad;
    EXPECT_NEAR(s.top_mass, 0.5f, 1e-6f) << bad;
  }
  // One finite token: no runner-up, so the margin is the cap.
  const LogitSummary one = SummarizeLogits(std::vector<float>{-kInf, 2, kNaN}, 1);
  EXPECT_EQ(one.normalized_entropy, 0.0f);
  EXPECT_EQ(one.margin, kMaxLogitMargin);
  EXPECT_EQ(one.top_mass, 1.0f);
}

TEST(SummarizeLogitsTest, PositiveInfinityTakesAllTheMass) {
  const LogitSummary one = SummarizeLogits(std::vector<float>{kInf, 0, 5}, 2);
  EXPECT_EQ(one.normalized_entropy, 0.0f);
  EXPECT_EQ(one.margin, kMaxLogitMargin);
  EXPECT_EQ(one.top_mass, 1.0f);
  // Two +inf share it: H = ln 2 of V = 4, margin 0, top-1 mass 1/2.
  const LogitSummary two = SummarizeLogits(std::vector<float>{kInf, 0, kInf, 1}, 1);
  EXPECT_NEAR(two.normalized_entropy, 0.5f, 1e-6f);
  EXPECT_EQ(two.margin, 0.0f);
  EXPECT_NEAR(two.top_mass, 0.5f, 1e-6f);
}

TEST(SummarizeLogitsTest, DegenerateInputs) {
  // Every logit −inf or NaN: no information, taken as uniform.
  const LogitSummary none = SummarizeLogits(std::vector<float>{-kInf, kNaN, -kInf, -kInf}, 1);
  EXPECT_NEAR(none.normalized_entropy, 1.0f, 1e-6f);
  EXPECT_EQ(none.margin, 0.0f);
  EXPECT_NEAR(none.top_mass, 0.25f, 1e-6f);
  // V = 1: certain.
  const LogitSummary single = SummarizeLogits(std::vector<float>{3}, 5);
  EXPECT_EQ(single.normalized_entropy, 0.0f);
  EXPECT_EQ(single.margin, kMaxLogitMargin);
  EXPECT_EQ(single.top_mass, 1.0f);
  // A huge gap is capped; top_m beyond V is the whole mass.
  const LogitSummary gap = SummarizeLogits(std::vector<float>{1e30f, 0}, 9);
  EXPECT_EQ(gap.margin, kMaxLogitMargin);
  EXPECT_NEAR(gap.top_mass, 1.0f, 1e-7f);
  // Empty: the least confident summary; the checked variant refuses.
  const LogitSummary empty = SummarizeLogits({}, 5);
  EXPECT_EQ(empty.normalized_entropy, 1.0f);
  EXPECT_EQ(empty.margin, 0.0f);
  EXPECT_EQ(empty.top_mass, 0.0f);
  EXPECT_EQ(SummarizeLogitsChecked({}, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SummarizeLogitsChecked(std::vector<float>{1, 2}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(SummarizeLogitsChecked(std::vector<float>{1, 0}, 1).ok());
  EXPECT_NEAR(SummarizeLogitsChecked(std::vector<float>{1, 0}, 1)->top_mass, 0.7310586f, 1e-6f);
}

TEST(ConfidenceTest, WeightsAreNormalisedAndTermsClamped) {
  ConfidenceOptions o;
  o.w_entropy = 2;
  o.w_margin = 0;
  o.w_top_mass = 2;
  // (2·(1 − 0.4) + 2·0.5) / 4 = 0.55.
  EXPECT_NEAR(Confidence(LogitSummary{0.4f, 3.0f, 0.5f}, o), 0.55f, 1e-6f);
  // Margin term alone with scale 2: 1 − exp(−1) at margin 2.
  o.w_entropy = 0;
  o.w_top_mass = 0;
  o.w_margin = 1;
  EXPECT_NEAR(Confidence(LogitSummary{0, 2.0f, 0}, o), 1 - std::exp(-1.0f), 1e-6f);
  // NaN counts as the least confident value of each term.
  EXPECT_EQ(Confidence(LogitSummary{kNaN, kNaN, kNaN}, ConfidenceOptions{}), 0.0f);
  EXPECT_EQ(Confidence(LogitSummary{-1, kInf, 2}, ConfidenceOptions{}), 1.0f);
}

// Confidence = 1 − normalized entropy with these weights, so a summary sets it directly.
ConfidenceOptions EntropyOnly() {
  ConfidenceOptions o;
  o.w_entropy = 1;
  o.w_margin = 0;
  o.w_top_mass = 0;
  return o;  // enter 0.7, exit 0.5, 4 steps, fraction 0.5
}

void Feed(ConfidenceBudget& b, float confidence) {
  StepSignals s;
  s.logit_summary = LogitSummary{1 - confidence, 0, 0};
  b.OnSignals(s);
}

TEST(ConfidenceBudgetTest, HysteresisBetweenLooseAndTight) {
  ConfidenceBudget b(EntropyOnly(), 10);
  EXPECT_FALSE(b.tight());  // starts loose
  // A confident stretch shorter than confident_steps (3 < 4) stays loose; 0.6 breaks it.
  for (int i = 0; i < 3; ++i) Feed(b, 0.8f);
  EXPECT_FALSE(b.tight());
  Feed(b, 0.6f);
  EXPECT_FALSE(b.tight());
  for (int i = 0; i < 3; ++i) Feed(b, 0.8f);
  EXPECT_FALSE(b.tight());  // the run restarted: 3 again
  Feed(b, 0.8f);            // the 4th consecutive
  EXPECT_TRUE(b.tight());
  EXPECT_EQ(b.switches(), 1);
  EXPECT_NEAR(b.last_confidence(), 0.8f, 1e-6f);
  // Between exit and enter: the state holds.
  Feed(b, 0.6f);
  Feed(b, 0.5f);  // exactly exit_tight is not below it
  EXPECT_TRUE(b.tight());
  // One step below exit_tight goes loose at once.
  Feed(b, 0.4f);
  EXPECT_FALSE(b.tight());
  EXPECT_EQ(b.switches(), 2);
  // The run counts from zero again after going loose.
  for (int i = 0; i < 3; ++i) Feed(b, 0.9f);
  EXPECT_FALSE(b.tight());
  Feed(b, 0.7f);  // exactly enter_tight counts as confident
  EXPECT_TRUE(b.tight());
  EXPECT_EQ(b.switches(), 3);
}

TEST(ConfidenceBudgetTest, StepsWithoutADistributionChangeNothing) {
  ConfidenceBudget b(EntropyOnly(), 10);
  for (int i = 0; i < 3; ++i) Feed(b, 0.9f);
  b.OnSignals(StepSignals{});  // neither logits nor summary
  EXPECT_NEAR(b.last_confidence(), 0.9f, 1e-6f);
  Feed(b, 0.9f);
  EXPECT_TRUE(b.tight());
}

TEST(ConfidenceBudgetTest, LogitsTakePrecedenceOverTheSummary) {
  ConfidenceOptions o;
  o.confident_steps = 2;
  ConfidenceBudget b(o, 8);
  const std::vector<float> peaked = {10, 0, 0, 0};
  StepSignals s;
  s.logits = peaked;
  s.logit_summary = LogitSummary{1, 0, 0};  // ignored: logits are present
  b.OnSignals(s);
  b.OnSignals(s);
  EXPECT_TRUE(b.tight());
  EXPECT_GT(b.last_confidence(), 0.99f);
  // Uniform logits: confidence (0 + 0 + 5/8)/3 ≈ 0.208 < exit → loose.
  const std::vector<float> flat(8, 0.0f);
  s.logits = flat;
  b.OnSignals(s);
  EXPECT_FALSE(b.tight());
  EXPECT_NEAR(b.last_confidence(), (5.0f / 8) / 3, 1e-6f);
}

TEST(ConfidenceBudgetTest, BudgetFillsEveryHeadClampedToMaxPages) {
  ConfidenceBudget b(EntropyOnly(), 10);
  EXPECT_EQ(b.loose_pages(), 10);
  EXPECT_EQ(b.tight_pages(), 5);
  std::vector<int32_t> out(4, -7);
  b.Budget(0, 100, out);
  EXPECT_THAT(out, ::testing::Each(10));
  b.Budget(3, 8, out);
  EXPECT_THAT(out, ::testing::Each(8));
  b.Budget(3, -1, out);
  EXPECT_THAT(out, ::testing::Each(0));
  for (int i = 0; i < 4; ++i) Feed(b, 1.0f);
  ASSERT_TRUE(b.tight());
  b.Budget(1, 100, out);
  EXPECT_THAT(out, ::testing::Each(5));
  b.Budget(1, 3, out);
  EXPECT_THAT(out, ::testing::Each(3));
}

TEST(ConfidenceBudgetTest, TightBudgetRoundsAndKeepsAPage) {
  ConfidenceOptions o;
  o.tight_fraction = 0.5f;
  EXPECT_EQ(ConfidenceBudget(o, 3).tight_pages(), 2);  // round(1.5) = 2
  o.tight_fraction = 0.3f;
  EXPECT_EQ(ConfidenceBudget(o, 1).tight_pages(), 1);  // round(0.3) = 0 → at least 1
  EXPECT_EQ(ConfidenceBudget(o, 0).tight_pages(), 0);
  EXPECT_EQ(ConfidenceBudget(o, 100).tight_pages(), 30);
}

// The field named in the error of `o`, which must be INVALID_ARGUMENT.
std::string ErrorOf(const ConfidenceOptions& o) {
  const absl::Status s = o.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  return std::string(s.message());
}

TEST(ConfidenceOptionsTest, ValidateNamesTheFieldAndLimit) {
  EXPECT_TRUE(ConfidenceOptions{}.Validate().ok());
  ConfidenceOptions o;
  o.top_m = 0;
  EXPECT_THAT(ErrorOf(o), HasSubstr("top_m must be >= 1"));
  o = {};
  o.w_margin = -1;
  EXPECT_THAT(ErrorOf(o), HasSubstr("w_margin"));
  o = {};
  o.w_entropy = o.w_margin = o.w_top_mass = 0;
  EXPECT_THAT(ErrorOf(o), HasSubstr("w_entropy + w_margin + w_top_mass must be > 0"));
  o = {};
  o.margin_scale = 0;
  EXPECT_THAT(ErrorOf(o), HasSubstr("margin_scale"));
  o = {};
  o.enter_tight = 1.5f;
  EXPECT_THAT(ErrorOf(o), HasSubstr("enter_tight must be in [0, 1]"));
  o = {};
  o.exit_tight = 0.8f;
  EXPECT_THAT(ErrorOf(o), HasSubstr("exit_tight must be in [0, enter_tight = 0.7]"));
  o = {};
  o.confident_steps = 0;
  EXPECT_THAT(ErrorOf(o), HasSubstr("confident_steps"));
  o = {};
  o.tight_fraction = 0;
  EXPECT_THAT(ErrorOf(o), HasSubstr("tight_fraction must be in (0, 1]"));
  EXPECT_EQ(ConfidenceBudget::Create(o, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConfidenceBudget::Create(ConfidenceOptions{}, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(ConfidenceBudget::Create(ConfidenceOptions{}, 4).ok());
}

}  // namespace
}  // namespace kvtier::policy
