// The evaluation metrics (engine/eval_metrics.h) on small cases computed by hand.
#include "engine/eval_metrics.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier::engine {
namespace {

TEST(AttentionProbs, IsTheSoftmaxOfTheScaledDotsOfOneKvHead) {
  // Two KV heads of dim 2; head 1 holds keys (1,0), (0,1), (1,1); q = (2, 0), scale 0.5.
  const std::vector<float> k = {9, 9, 1, 0, /**/ 9, 9, 0, 1, /**/ 9, 9, 1, 1};
  const float q[2] = {2, 0};
  std::vector<float> p;
  AttentionProbs(q, k.data(), 3, /*kv_heads=*/2, /*head_dim=*/2, /*kv_head=*/1, 0.5f, &p);
  // scores 1, 0, 1 → e/(2e+1), 1/(2e+1), e/(2e+1)
  const double e = std::exp(1.0), z = 2 * e + 1;
  ASSERT_EQ(p.size(), 3u);
  EXPECT_NEAR(p[0], e / z, 1e-6);
  EXPECT_NEAR(p[1], 1 / z, 1e-6);
  EXPECT_NEAR(p[2], e / z, 1e-6);
}

TEST(AttentionMassRecall, TokensCountTheOraclesTopBudgetMassTheWorkingSetHolds) {
  // p over 8 tokens, pages of 2: pages {0.05+0.05, 0.4+0.1, 0.1+0.1, 0.15+0.05}.
  const std::vector<float> p = {0.05f, 0.05f, 0.4f, 0.1f, 0.1f, 0.1f, 0.15f, 0.05f};
  // Held: page 1 (tokens 2, 3) and page 3 (tokens 6, 7).
  const std::vector<uint8_t> held = {0, 0, 1, 1, 0, 0, 1, 1};
  // Budget 4 tokens: top tokens 2 (0.4), 6 (0.15), then the first 0.1s: 3 and 4 (ties go to
  // the lower index) → mass 0.75, held 0.4 + 0.15 + 0.1 = 0.65.
  // Budget 4 → 2 pages: page 1 (0.5) and page 3 (0.2) → both held: 1.
  MassRecall r = AttentionMassRecall(p, held, 4, 2);
  EXPECT_NEAR(r.tokens, 0.65 / 0.75, 1e-6);
  EXPECT_NEAR(r.pages, 1.0, 1e-6);
  // Budget 2 tokens / 1 page: tokens {2, 6} both held; page 1 held.
  r = AttentionMassRecall(p, held, 2, 2);
  EXPECT_NEAR(r.tokens, 1.0, 1e-6);
  EXPECT_NEAR(r.pages, 1.0, 1e-6);
  // Holding the sink page only: budget 4 → tokens {2, 6, 3, 4}: none held; pages 1, 3: none.
  const std::vector<uint8_t> sink = {1, 1, 0, 0, 0, 0, 0, 0};
  r = AttentionMassRecall(p, sink, 4, 2);
  EXPECT_NEAR(r.tokens, 0.0, 1e-6);
  EXPECT_NEAR(r.pages, 0.0, 1e-6);
}

TEST(AttentionMassRecall, PagesCountPartlyHeldPagesByTheirHeldTokens) {
  // 5 tokens, pages of 2 (the last partial): masses {0.3, 0.2, 0.5}. Budget 2 → 1 page: page 2
  // (token 4, 0.5) — not held. Budget 4 → 2 pages: page 2 and page 0; token 0 held: 0.1 / 0.8.
  const std::vector<float> p = {0.1f, 0.2f, 0.1f, 0.1f, 0.5f};
  const std::vector<uint8_t> held = {1, 0, 1, 1, 0};
  EXPECT_NEAR(AttentionMassRecall(p, held, 2, 2).pages, 0.0, 1e-6);
  EXPECT_NEAR(AttentionMassRecall(p, held, 4, 2).pages, 0.1 / 0.8, 1e-6);
  // A budget beyond the context makes every token count: held mass 0.1 + 0.1 + 0.1 of 1.
  const MassRecall all = AttentionMassRecall(p, held, 100, 2);
  EXPECT_NEAR(all.tokens, 0.3, 1e-6);
  EXPECT_NEAR(all.pages, 0.3, 1e-6);
}

TEST(NextTokenMetrics, LogProbKlAndArgMaxByHand) {
  const std::vector<float> a = {0.0f, std::log(3.0f)};  // P = (1/4, 3/4)
  const std::vector<float> b = {0.0f, 0.0f};            // Q = (1/2, 1/2)
  EXPECT_NEAR(LogProbAt(a, 1), std::log(0.75), 1e-6);
  EXPECT_NEAR(LogProbAt(b, 0), std::log(0.5), 1e-6);
  // KL(P‖Q) = 1/4 ln(1/2) + 3/4 ln(3/2)
  EXPECT_NEAR(KlDivergence(a, b), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-6);
  EXPECT_NEAR(KlDivergence(a, a), 0.0, 1e-9);
  // Shifting the logits changes nothing.
  const std::vector<float> shifted = {10.0f, 10.0f + std::log(3.0f)};
  EXPECT_NEAR(KlDivergence(shifted, b), KlDivergence(a, b), 1e-5);
  EXPECT_EQ(ArgMax(a), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{2, 5, 5, 1}), 1);  // the lowest index of a tie
}

}  // namespace
}  // namespace kvtier::engine
