#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::TypedBuffer;

class CosineTest : public ::testing::TestWithParam<DType> {};

TEST_P(CosineTest, KnownAnglesGroupMeansAndDriftFlags) {
  // One sequence, 2 KV heads × 2 query heads, d = 8. Head pairs: (same, opposite) for
  // KV head 0 → mean 0; (orthogonal, scaled copy) for KV head 1 → mean 0.5.
  const DType t = GetParam();
  const int32_t d = 8;
  TypedBuffer q(t, 4 * d), qp(t, 4 * d);
  for (int32_t i = 0; i < d; ++i) {
    q.Set(0 * d + i, static_cast<float>(i + 1));
    qp.Set(0 * d + i, static_cast<float>(i + 1));  // cos 1
    q.Set(1 * d + i, static_cast<float>(i + 1));
    qp.Set(1 * d + i, -static_cast<float>(i + 1));  // cos -1
    q.Set(2 * d + i, i == 0 ? 1.0f : 0.0f);
    qp.Set(2 * d + i, i == 1 ? 1.0f : 0.0f);  // cos 0
    q.Set(3 * d + i, static_cast<float>(i % 3));
    qp.Set(3 * d + i, 4.0f * static_cast<float>(i % 3));  // cos 1
  }
  std::vector<float> cosine(4), mean(2);
  std::vector<uint8_t> drifted(2, 7);
  QueryCosineArgs a;
  a.shape = {.dtype = t, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = d};
  a.batch = 1;
  a.q = q.data();
  a.q_prev = qp.data();
  a.threshold = 0.4f;
  a.cosine = cosine.data();
  a.group_mean = mean.data();
  a.drifted = drifted.data();
  ASSERT_TRUE(CpuQueryCosine(a, nullptr).ok());
  EXPECT_NEAR(cosine[0], 1.0f, 1e-6);
  EXPECT_NEAR(cosine[1], -1.0f, 1e-6);
  EXPECT_NEAR(cosine[2], 0.0f, 1e-6);
  EXPECT_NEAR(cosine[3], 1.0f, 1e-6);
  EXPECT_NEAR(mean[0], 0.0f, 1e-6);
  EXPECT_NEAR(mean[1], 0.5f, 1e-6);
  EXPECT_EQ(drifted[0], 1);
  EXPECT_EQ(drifted[1], 0);
}

TEST_P(CosineTest, ZeroPreviousQueryCountsAsDrift) {
  const DType t = GetParam();
  TypedBuffer q(t, 8), qp(t, 8);
  q.FillNormal(1);
  std::vector<float> mean(1);
  std::vector<uint8_t> drifted(1);
  QueryCosineArgs a;
  a.shape = {.dtype = t, .num_q_heads = 1, .num_kv_heads = 1, .head_dim = 8};
  a.batch = 1;
  a.q = q.data();
  a.q_prev = qp.data();
  a.group_mean = mean.data();
  a.drifted = drifted.data();
  ASSERT_TRUE(CpuQueryCosine(a, nullptr).ok());
  EXPECT_EQ(mean[0], 0.0f);
  EXPECT_EQ(drifted[0], 1);
}

TEST_P(CosineTest, RandomBatchMatchesDoublePrecision) {
  const DType t = GetParam();
  const int32_t B = 3, Hq = 32, Hkv = 8, d = 128;
  TypedBuffer q(t, B * Hq * d), qp(t, B * Hq * d);
  q.FillNormal(11);
  qp.FillNormal(12);
  std::vector<float> cosine(B * Hq), mean(B * Hkv);
  QueryCosineArgs a;
  a.shape = {.dtype = t, .num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d};
  a.batch = B;
  a.q = q.data();
  a.q_prev = qp.data();
  a.cosine = cosine.data();
  a.group_mean = mean.data();
  ThreadPool pool(3);
  ASSERT_TRUE(CpuQueryCosine(a, &pool).ok());
  for (int32_t i = 0; i < B * Hkv; ++i) {
    double m = 0;
    for (int32_t g = 0; g < 4; ++g) {
      const int64_t base = (int64_t{i} * 4 + g) * d;
      double xy = 0, xx = 0, yy = 0;
      for (int32_t j = 0; j < d; ++j) {
        xy += double{q.Get(base + j)} * qp.Get(base + j);
        xx += double{q.Get(base + j)} * q.Get(base + j);
        yy += double{qp.Get(base + j)} * qp.Get(base + j);
      }
      const double c = xy / std::sqrt(xx * yy);
      EXPECT_NEAR(cosine[static_cast<size_t>(i * 4 + g)], c, 1e-5);
      m += c / 4;
    }
    EXPECT_NEAR(mean[static_cast<size_t>(i)], m, 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CosineTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const auto& tpi) { return std::string(DTypeName(tpi.param)); });

}  // namespace
}  // namespace kvtier
