// Sparse and dense decode attention on the CPU against a naive double-precision loop.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "tests/kernels/cpu/cpu_op_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AttentionCase;
using testing::OutputTolerance;
using testing::TypedBuffer;

void ExpectClose(const TypedBuffer& got, const std::vector<float>& lse, const std::vector<double>& want,
                 const std::vector<double>& want_lse, DType t) {
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got.Get(static_cast<int64_t>(i)), want[i],
                OutputTolerance(t) * (1 + std::fabs(want[i])))
        << "element " << i;
  }
  for (size_t i = 0; i < want_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
    } else {
      EXPECT_NEAR(lse[i], want_lse[i], 1e-4 * (1 + std::fabs(want_lse[i]))) << i;
    }
  }
}

using Param = std::tuple<DType, int32_t, int32_t, int32_t>;  // dtype, p, d, G

class AttentionTest : public ::testing::TestWithParam<Param> {};

TEST_P(AttentionTest, EveryPageSelectedEqualsDenseAttention) {
  const auto [t, p, d, G] = GetParam();
  AttentionCase c(t, 2, 2, G, d, p, 9);
  // Each head holds all 9 pages, in a different slot order per head (order must not
  // matter), with logical page 8 the partial page of p/2 tokens.
  std::mt19937 rng(5);
  const WorkingSetLayout wl{c.S, p, c.Hkv, d};
  const SlotTableLayout tl{c.Hkv, c.S};
  const int32_t T = 8 * p + p / 2;
  TypedBuffer dk(t, int64_t{c.B} * T * c.Hkv * d), dv(t, int64_t{c.B} * T * c.Hkv * d);
  const DenseKvLayout dl{T, c.Hkv, d};
  for (int32_t b = 0; b < c.B; ++b) {
    c.partial_page[static_cast<size_t>(b)] = 8;
    c.partial_len[static_cast<size_t>(b)] = p / 2;
    for (int32_t h = 0; h < c.Hkv; ++h) {
      std::vector<int32_t> order(9);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      for (int32_t s = 0; s < c.S; ++s) {
        const int32_t page = order[static_cast<size_t>(s)];
        c.table[static_cast<size_t>(tl.Offset(b, h, s))] = page;
        for (int32_t tok = 0; tok < p && page * p + tok < T; ++tok) {
          for (int32_t i = 0; i < d; ++i) {
            dk.Set(dl.Offset(b, page * p + tok, h, i), c.k.Get(wl.Offset(b, s, tok, h, i)));
            dv.Set(dl.Offset(b, page * p + tok, h, i), c.v.Get(wl.Offset(b, s, tok, h, i)));
          }
        }
      }
    }
  }
  ThreadPool pool(4);
  TypedBuffer sparse(t, int64_t{c.B} * c.Hq() * d), dense(t, int64_t{c.B} * c.Hq() * d);
  std::vector<float> sl(static_cast<size_t>(c.B * c.Hq())), dlse(sl.size());
  ASSERT_TRUE(CpuSparseAttention(c.Args(sparse.data(), sl.data(), nullptr), &pool).ok());
  DenseAttentionArgs a;
  a.shape = c.Shape();
  a.batch = c.B;
  a.max_tokens = T;
  a.q = c.q.data();
  a.k = dk.data();
  a.v = dv.data();
  const std::vector<int32_t> len(static_cast<size_t>(c.B), T);
  a.seq_len = len.data();
  a.softmax_scale = c.scale;
  a.out = dense.data();
  a.lse = dlse.data();
  ASSERT_TRUE(CpuDenseAttention(a, &pool).ok());
  for (int64_t i = 0; i < sparse.size(); ++i) {
    // Both accumulate in fp32 in different orders; only the output rounding may differ.
    ASSERT_NEAR(sparse.Get(i), dense.Get(i), OutputTolerance(t) * (1 + std::fabs(dense.Get(i))))
        << i;
  }
  std::vector<double> want, want_lse, want_prob;
  c.Reference(want, want_lse, want_prob);
  ExpectClose(dense, dlse, want, want_lse, t);
}

TEST_P(AttentionTest, RandomSelectionsMatchANaiveLoop) {
  const auto [t, p, d, G] = GetParam();
  AttentionCase c(t, 2, 2, G, d, p, 9);
  std::mt19937 rng(9);
  for (auto& e : c.table) e = (rng() % 3 == 0) ? kEmptySlot : static_cast<int32_t>(rng() % 50);
  c.partial_page = {c.table[0] >= 0 ? c.table[0] : 3, -1};
  c.partial_len = {p / 4 + 1, 0};
  // One (sequence, head) with nothing selected: zeros and lse = -inf.
  for (int32_t s = 0; s < c.S; ++s) c.table[static_cast<size_t>(SlotTableLayout{c.Hkv, c.S}.Offset(1, 1, s))] = kEmptySlot;
  TypedBuffer out(t, int64_t{c.B} * c.Hq() * d);
  std::vector<float> lse(static_cast<size_t>(c.B * c.Hq()));
  std::vector<double> want, want_lse, want_prob;
  c.Reference(want, want_lse, want_prob);
  for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), new ThreadPool(3)}) {
    ASSERT_TRUE(CpuSparseAttention(c.Args(out.data(), lse.data(), nullptr), pool).ok());
    ExpectClose(out, lse, want, want_lse, t);
    delete pool;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, AttentionTest,
    ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                       ::testing::Values(16, 32), ::testing::Values(64, 128),
                       ::testing::Values(1, 4, 8)),
    [](const auto& tpi) {
      return std::string(DTypeName(std::get<0>(tpi.param))) + "_p" +
             std::to_string(std::get<1>(tpi.param)) + "_d" + std::to_string(std::get<2>(tpi.param)) +
             "_g" + std::to_string(std::get<3>(tpi.param));
    });

TEST(DenseAttentionTest, LongContextSplitAcrossThreadsMatchesNaive) {
  // Long enough that the work is split into chunks and merged (split-K).
  const int32_t Hkv = 1, G = 2, d = 64, T = 3001;
  TypedBuffer q(DType::kF32, G * d), k(DType::kF32, int64_t{T} * d), v(DType::kF32, int64_t{T} * d);
  q.FillNormal(1, 0.5f);
  k.FillNormal(2);
  v.FillNormal(3);
  std::vector<float> out(static_cast<size_t>(G * d)), lse(G);
  DenseAttentionArgs a;
  a.shape = {.dtype = DType::kF32, .num_q_heads = G, .num_kv_heads = Hkv, .head_dim = d};
  a.batch = 1;
  a.max_tokens = T;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.seq_len = &T;
  a.softmax_scale = 0.125f;
  a.out = out.data();
  a.lse = lse.data();
  ThreadPool pool(8);
  ASSERT_TRUE(CpuDenseAttention(a, &pool).ok());
  for (int32_t g = 0; g < G; ++g) {
    double m = -1e300, z = 0;
    std::vector<double> s(T), o(d, 0.0);
    for (int32_t t = 0; t < T; ++t) {
      double dot = 0;
      for (int32_t i = 0; i < d; ++i) dot += double{q.Get(g * d + i)} * k.Get(int64_t{t} * d + i);
      s[static_cast<size_t>(t)] = dot * 0.125;
      m = std::max(m, s[static_cast<size_t>(t)]);
    }
    for (int32_t t = 0; t < T; ++t) z += std::exp(s[static_cast<size_t>(t)] - m);
    for (int32_t t = 0; t < T; ++t)
      for (int32_t i = 0; i < d; ++i) o[static_cast<size_t>(i)] += std::exp(s[static_cast<size_t>(t)] - m) / z * v.Get(int64_t{t} * d + i);
    for (int32_t i = 0; i < d; ++i) EXPECT_NEAR(out[static_cast<size_t>(g * d + i)], o[static_cast<size_t>(i)], 1e-5);
    EXPECT_NEAR(lse[static_cast<size_t>(g)], m + std::log(z), 1e-4);
  }
}

TEST(SparseAttentionTest, RejectsCorruptTablesAndLengths) {
  AttentionCase c(DType::kF32, 2, 2, 1, 64, 16, 9);
  TypedBuffer out(DType::kF32, int64_t{c.B} * c.Hq() * 64);
  c.table[3] = -2;
  EXPECT_EQ(CpuSparseAttention(c.Args(out.data(), nullptr, nullptr), nullptr).code(),
            absl::StatusCode::kOutOfRange);
  c.table[3] = 0;
  c.partial_len[1] = 17;
  const absl::Status st = CpuSparseAttention(c.Args(out.data(), nullptr, nullptr), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("partial_len[1] = 17"), std::string::npos) << st;
}

}  // namespace
}  // namespace kvtier
