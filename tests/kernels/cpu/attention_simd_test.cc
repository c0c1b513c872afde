// The vectorised CPU attention (every instruction set this CPU has: AVX2, AVX-512) against
// the scalar reference (cpu::Isa::kScalar) on the same inputs: dense and sparse, fp16, bf16
// and fp32, group sizes that do and do not fill the kernel's four-head passes, head
// dimensions with odd tails of its column strips, blocks cut short (partial pages, causal
// limits, sequence lengths off the block size), token_prob, batches, and
// with and without a thread pool. Outputs agree to the dtype's rounding, lse and
// token_prob to float rounding; unattended tokens are exactly 0 in both.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "tests/kernels/cpu/cpu_op_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AttentionCase;
using testing::OutputTolerance;
using testing::TypedBuffer;

// The instruction sets above the reference that can run here.
std::vector<cpu::Isa> VectorIsas() {
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (cpu::IsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Both outputs are fp32 accumulations rounded to the dtype: they may differ by a rounding
// step of the dtype plus fp32 accumulation-order noise.
void ExpectSameOutput(const TypedBuffer& got, const TypedBuffer& want, const std::string& what) {
  const double tol = 2 * OutputTolerance(got.dtype());
  for (int64_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got.Get(i), want.Get(i), tol * (1 + std::fabs(want.Get(i)))) << what << " out " << i;
  }
}

void ExpectSameLse(const std::vector<float>& got, const std::vector<float>& want,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i])) {
      EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << what << " lse " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << what << " lse " << i;
    }
  }
}

// dtype, page size, head_dim, group size, batch.
using SparseParam = std::tuple<DType, int32_t, int32_t, int32_t, int32_t>;
class SparseSimdTest : public ::testing::TestWithParam<SparseParam> {};

TEST_P(SparseSimdTest, MatchesTheScalarReference) {
  const auto [t, p, d, G, B] = GetParam();
  AttentionCase c(t, B, 2, G, d, p, 7);
  c.RandomTable(static_cast<uint32_t>(p * 131 + d * 7 + G), 40);
  c.qpos.assign(static_cast<size_t>(B), 0);
  std::mt19937 rng(static_cast<uint32_t>(d + G));
  for (int64_t& qp : c.qpos) qp = 20 * p + static_cast<int64_t>(rng() % static_cast<uint32_t>(10 * p));
  const int64_t out_elems = int64_t{B} * c.Hq() * d;
  const size_t probs = static_cast<size_t>(int64_t{B} * c.Hq() * c.S * p);
  std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(3);

  TypedBuffer want(t, out_elems);
  std::vector<float> want_lse(static_cast<size_t>(B * c.Hq())), want_prob(probs, -1.0f);
  ASSERT_TRUE(CpuSparseAttention(c.Args(want.data(), want_lse.data(), want_prob.data()), nullptr,
                                 cpu::Isa::kScalar)
                  .ok());
  for (cpu::Isa isa : VectorIsas()) {
    for (ThreadPool* pl : {static_cast<ThreadPool*>(nullptr), pool.get()}) {
      const std::string what = std::string(cpu::IsaName(isa)) + (pl ? " pool" : " inline");
      for (bool with_prob : {false, true}) {
        TypedBuffer got(t, out_elems);
        std::vector<float> lse(want_lse.size()), prob(probs, -1.0f);
        ASSERT_TRUE(CpuSparseAttention(
                        c.Args(got.data(), lse.data(), with_prob ? prob.data() : nullptr), pl, isa)
                        .ok());
        ExpectSameOutput(got, want, what);
        ExpectSameLse(lse, want_lse, what);
        if (!with_prob) continue;
        for (size_t i = 0; i < probs; ++i) {
          if (want_prob[i] == 0) {
            ASSERT_EQ(prob[i], 0.0f) << what << " unattended token " << i;
          } else {
            ASSERT_NEAR(prob[i], want_prob[i], 1e-7 + 2e-5 * want_prob[i]) << what << " prob " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SparseSimdTest,
    ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                       ::testing::Values(1, 8, 16, 64), ::testing::Values(8, 24, 72, 128, 256),
                       ::testing::Values(1, 2, 3, 4, 5, 8), ::testing::Values(1, 3)),
    [](const auto& tpi) {
      return std::string(DTypeName(std::get<0>(tpi.param))) + "_p" +
             std::to_string(std::get<1>(tpi.param)) + "_d" +
             std::to_string(std::get<2>(tpi.param)) + "_g" +
             std::to_string(std::get<3>(tpi.param)) + "_b" + std::to_string(std::get<4>(tpi.param));
    });

// dtype, head_dim, group size.
using DenseParam = std::tuple<DType, int32_t, int32_t>;
class DenseSimdTest : public ::testing::TestWithParam<DenseParam> {};

TEST_P(DenseSimdTest, MatchesTheScalarReference) {
  const auto [t, d, G] = GetParam();
  // Lengths around the block size and long enough to be split across tasks.
  const std::vector<int32_t> seq_len = {0, 1, 31, 33, 1100};
  const auto B = static_cast<int32_t>(seq_len.size());
  const int32_t Hkv = 3, T = 1101, Hq = Hkv * G;
  TypedBuffer q(t, int64_t{B} * Hq * d), k(t, int64_t{B} * T * Hkv * d),
      v(t, int64_t{B} * T * Hkv * d);
  q.FillNormal(11, 1.5f);
  k.FillNormal(12);
  v.FillNormal(13);
  DenseAttentionArgs a;
  a.shape = {.dtype = t, .num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d};
  a.batch = B;
  a.max_tokens = T;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.seq_len = seq_len.data();
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
  TypedBuffer want(t, int64_t{B} * Hq * d);
  std::vector<float> want_lse(static_cast<size_t>(B * Hq));
  a.out = want.data();
  a.lse = want_lse.data();
  ASSERT_TRUE(CpuDenseAttention(a, nullptr, cpu::Isa::kScalar).ok());
  std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(2);
  for (cpu::Isa isa : VectorIsas()) {
    for (ThreadPool* pl : {static_cast<ThreadPool*>(nullptr), pool.get()}) {
      const std::string what = std::string(cpu::IsaName(isa)) + (pl ? " pool" : " inline");
      TypedBuffer got(t, int64_t{B} * Hq * d);
      std::vector<float> lse(want_lse.size());
      a.out = got.data();
      a.lse = lse.data();
      ASSERT_TRUE(CpuDenseAttention(a, pl, isa).ok());
      ExpectSameOutput(got, want, what);
      ExpectSameLse(lse, want_lse, what);
      // An empty sequence attends nothing: zeros and lse = -inf, as the reference.
      for (int32_t i = 0; i < Hq * d; ++i) ASSERT_EQ(got.Get(i), 0.0f) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseSimdTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16,
                                                              DType::kF32),
                                            ::testing::Values(8, 40, 128, 512),
                                            ::testing::Values(1, 2, 4, 7)),
                         [](const auto& tpi) {
                           return std::string(DTypeName(std::get<0>(tpi.param))) + "_d" +
                                  std::to_string(std::get<1>(tpi.param)) + "_g" +
                                  std::to_string(std::get<2>(tpi.param));
                         });

// The default entry points run the active instruction set: the same bits as naming it.
TEST(AttentionIsaTest, DefaultEntryPointRunsTheActiveIsa) {
  AttentionCase c(DType::kF16, 2, 2, 4, 128, 16, 9);
  c.RandomTable(3, 30);
  TypedBuffer a(DType::kF16, int64_t{2} * c.Hq() * 128), b(DType::kF16, int64_t{2} * c.Hq() * 128);
  std::vector<float> la(static_cast<size_t>(2 * c.Hq())), lb(la.size());
  ThreadPool pool(2);
  ASSERT_TRUE(CpuSparseAttention(c.Args(a.data(), la.data(), nullptr), &pool).ok());
  ASSERT_TRUE(
      CpuSparseAttention(c.Args(b.data(), lb.data(), nullptr), &pool, cpu::ActiveIsa()).ok());
  for (int64_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.Get(i), b.Get(i)) << i;
  EXPECT_EQ(la, lb);
}

// Both kernels refuse the same corrupt input with the same error.
TEST(AttentionIsaTest, EveryIsaRefusesCorruptTables) {
  AttentionCase c(DType::kF32, 1, 2, 2, 64, 16, 4);
  c.RandomTable(4, 10);
  c.table[1] = -7;
  std::vector<float> out(static_cast<size_t>(c.Hq() * 64));
  for (cpu::Isa isa : {cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    const absl::Status st = CpuSparseAttention(c.Args(out.data(), nullptr, nullptr), nullptr, isa);
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << cpu::IsaName(isa);
    EXPECT_NE(st.message().find("slot_table[1] = -7"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace kvtier
