// Page scoring, pooling and top-k on the CPU against brute force.
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

using testing::ScoreArgs;
using testing::SelectArgs;
using testing::TypedBuffer;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dtype, head_dim, group size
using ScoreParam = std::tuple<DType, int32_t, int32_t>;

class ScorePagesTest : public ::testing::TestWithParam<ScoreParam> {};

TEST_P(ScorePagesTest, MatchesBruteForceForEveryHead) {
  const auto [dtype, d, G] = GetParam();
  const int32_t B = 2, Hkv = 2, Hq = Hkv * G, P = 20;
  const std::vector<int32_t> num_pages = {20, 13};
  TypedBuffer q(dtype, int64_t{B} * Hq * d), sums(dtype, int64_t{B} * P * Hkv * 2 * d);
  q.FillNormal(1);
  sums.FillNormal(2);
  const HeadsLayout ql{Hq, d};
  const SummaryLayout sl{Hkv, d};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ThreadPool pool(3);
  {
    std::vector<float> scores(static_cast<size_t>(B * Hq * P)), pooled(static_cast<size_t>(B * Hkv * P));
    ScorePagesArgs a =
        ScoreArgs({.dtype = dtype, .num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d}, B, P,
                  q.data(), sums.data(), num_pages.data(), pooled.data());
    a.softmax_scale = scale;
    a.scores = scores.data();
    ASSERT_TRUE(CpuScorePages(a, &pool).ok());
    for (int32_t b = 0; b < B; ++b) {
      const int32_t n = num_pages[static_cast<size_t>(b)];
      for (int32_t h = 0; h < Hkv; ++h) {
        std::vector<double> want(static_cast<size_t>(P), 0.0);
        for (int32_t g = 0; g < G; ++g) {
          const int32_t hq = h * G + g;
          std::vector<double> raw(static_cast<size_t>(n));
          for (int32_t p = 0; p < n; ++p) {
            double s = 0;
            for (int32_t i = 0; i < d; ++i) {
              const double qi = q.Get(ql.Offset(b, hq, i));
              const int64_t base = int64_t{b} * P * sl.page_elements();
              s += std::max(qi * sums.Get(base + sl.Offset(p, h, kHi, i)),
                            qi * sums.Get(base + sl.Offset(p, h, kLo, i)));
            }
            raw[static_cast<size_t>(p)] = s;
            EXPECT_NEAR(scores[static_cast<size_t>((b * Hq + hq) * P + p)], s, 1e-3 * (1 + std::fabs(s)));
          }
          for (int32_t p = n; p < P; ++p) EXPECT_EQ(scores[static_cast<size_t>((b * Hq + hq) * P + p)], kNegInf);
          double m = -1e300, z = 0;
          for (double r : raw) m = std::max(m, scale * r);
          for (double r : raw) z += std::exp(scale * r - m);
          for (int32_t p = 0; p < n; ++p)
            want[static_cast<size_t>(p)] += std::exp(scale * raw[static_cast<size_t>(p)] - m) / z / G;
        }
        for (int32_t p = 0; p < P; ++p) {
          const float got = pooled[static_cast<size_t>((b * Hkv + h) * P + p)];
          if (p >= n) {
            EXPECT_EQ(got, kNegInf);
          } else {
            EXPECT_NEAR(got, want[static_cast<size_t>(p)], 1e-4 * (1 + std::fabs(want[static_cast<size_t>(p)])))
                << "b=" << b << " h=" << h << " p=" << p;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, ScorePagesTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                                            ::testing::Values(64, 128), ::testing::Values(1, 4, 8)),
                         [](const auto& tpi) {
                           return std::string(DTypeName(std::get<0>(tpi.param))) + "_d" +
                                  std::to_string(std::get<1>(tpi.param)) + "_g" +
                                  std::to_string(std::get<2>(tpi.param));
                         });

// Offloads pages 0..P−1 of the NHD caches k, v (of k's dtype) and returns their summaries
// (min-max unless `mode` says otherwise; key codes into *codes).
TypedBuffer OffloadEveryPage(const TypedBuffer& k, const TypedBuffer& v, int32_t Hkv, int32_t p,
                             int32_t d, int32_t P, SummaryMode mode = SummaryMode::kMinMax,
                             std::vector<uint8_t>* codes = nullptr) {
  const DType t = k.dtype();
  TypedBuffer host(t, int64_t{P} * Hkv * 2 * p * d), sums(t, int64_t{P} * Hkv * 2 * d);
  std::vector<OffloadItem> items;
  for (int32_t i = 0; i < P; ++i) items.push_back({i, i, i});
  OffloadArgs o;
  o.shape = {.dtype = t, .num_kv_heads = Hkv, .head_dim = d, .page_size = p};
  o.k_src = k.data();
  o.v_src = v.data();
  o.num_src_slots = P;
  o.host_pages = host.data();
  o.num_host_pages = P;
  o.summaries = sums.data();
  o.num_summary_pages = P;
  o.summary = mode;
  if (codes != nullptr) {
    codes->assign(static_cast<size_t>(P * KeyCodeLayout{Hkv, p, d}.page_bytes()), 0xEE);
    o.codes = codes->data();
  }
  o.items = items.data();
  o.num_items = P;
  EXPECT_TRUE(CpuOffload(o, nullptr).ok());
  return sums;
}

// Code (token, dim) of one (page, head) as KeyCodeLayout packs it.
int32_t CodeAt(const std::vector<uint8_t>& codes, const KeyCodeLayout& cl, int32_t page,
               int32_t h, int32_t t, int32_t i) {
  const uint8_t byte = codes[static_cast<size_t>(cl.RowOffset(page, h, t) + i / 2)];
  return i % 2 == 0 ? byte & 15 : byte >> 4;
}

TEST(ScorePagesTest, KeyCodesPlaceEveryKeyWithinHalfAStepAndScoreTheDecodedKeys) {
  // Offload writes the bounds and, per key and dimension, the level whose centre is within
  // half a step of it; ScorePages scores a page by the log-sum-exp of its decoded keys'
  // logits (checked against the decoded keys in double, and against the true keys'
  // log-sum-exp within Σ|q_i|·step_i/2, the most a decoded logit can be off).
  const int32_t p = 24, d = 16, Hkv = 2, G = 2, Hq = Hkv * G, P = 5;
  TypedBuffer k(DType::kF32, int64_t{P} * p * Hkv * d), v(DType::kF32, int64_t{P} * p * Hkv * d);
  k.FillNormal(11);
  v.FillNormal(12);
  std::vector<uint8_t> codes;
  TypedBuffer sums = OffloadEveryPage(k, v, Hkv, p, d, P, SummaryMode::kKeyCodes, &codes);
  const SummaryLayout sl{Hkv, d};
  const KeyCodeLayout cl{Hkv, p, d};
  const WorkingSetLayout wl{P, p, Hkv, d};
  for (int32_t pg = 0; pg < P; ++pg) {
    for (int32_t h = 0; h < Hkv; ++h) {
      for (int32_t i = 0; i < d; ++i) {
        const double hi = sums.Get(sl.Offset(pg, h, kHi, i)), lo = sums.Get(sl.Offset(pg, h, kLo, i));
        double mx = -1e300, mn = 1e300;
        for (int32_t t = 0; t < p; ++t) {
          mx = std::max<double>(mx, k.Get(wl.Offset(pg, t, h, i)));
          mn = std::min<double>(mn, k.Get(wl.Offset(pg, t, h, i)));
        }
        EXPECT_EQ(hi, mx);
        EXPECT_EQ(lo, mn);
        const double step = (hi - lo) / 16;
        for (int32_t t = 0; t < p; ++t) {
          const double x = k.Get(wl.Offset(pg, t, h, i));
          const double decoded = lo + (CodeAt(codes, cl, pg, h, t, i) + 0.5) * step;
          EXPECT_LE(std::fabs(decoded - x), step / 2 + 1e-6) << "page " << pg << " t " << t;
        }
      }
    }
  }
  TypedBuffer q(DType::kF32, int64_t{Hq} * d);
  q.FillNormal(13);
  std::vector<float> scores(static_cast<size_t>(Hq * P)), pooled(static_cast<size_t>(Hkv * P));
  const int32_t n = P;
  ScorePagesArgs a = ScoreArgs(
      {.dtype = DType::kF32, .num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d, .page_size = p},
      1, P, q.data(), sums.data(), &n, pooled.data());
  a.scores = scores.data();
  a.codes = codes.data();
  ASSERT_TRUE(CpuScorePages(a, nullptr).ok());
  for (int32_t hq = 0; hq < Hq; ++hq) {
    const int32_t h = hq / G;
    for (int32_t pg = 0; pg < P; ++pg) {
      std::vector<double> decoded, exact;
      double slack = 0;
      for (int32_t i = 0; i < d; ++i) {
        slack += std::fabs(q.Get(int64_t{hq} * d + i)) *
                 (sums.Get(sl.Offset(pg, h, kHi, i)) - sums.Get(sl.Offset(pg, h, kLo, i))) / 32;
      }
      for (int32_t t = 0; t < p; ++t) {
        double dec = 0, tru = 0;
        for (int32_t i = 0; i < d; ++i) {
          const double lo = sums.Get(sl.Offset(pg, h, kLo, i));
          const double step = (sums.Get(sl.Offset(pg, h, kHi, i)) - lo) / 16;
          dec += q.Get(int64_t{hq} * d + i) * (lo + (CodeAt(codes, cl, pg, h, t, i) + 0.5) * step);
          tru += q.Get(int64_t{hq} * d + i) * k.Get(wl.Offset(pg, t, h, i));
        }
        decoded.push_back(dec);
        exact.push_back(tru);
      }
      const auto lse = [](const std::vector<double>& x) {  // softmax_scale 1
        const double m = *std::max_element(x.begin(), x.end());
        double sum = 0;
        for (double e : x) sum += std::exp(e - m);
        return m + std::log(sum);
      };
      const float got = scores[static_cast<size_t>(hq * P + pg)];
      EXPECT_NEAR(got, lse(decoded), 1e-4 * (1 + std::fabs(lse(decoded)))) << "hq " << hq << " page " << pg;
      EXPECT_LE(std::fabs(got - lse(exact)), slack + 1e-4) << "hq " << hq << " page " << pg;
    }
  }
}

TEST(ScorePagesTest, KeyCodesRankFirstThePageOfTheOneKeyAQueryMatches) {
  // Why the codes exist (docs/eval.md): a copying head's query matches one key of a page,
  // which a summary of the page's typical keys (center-mad) averages away. Twelve pages of
  // random keys, one key of page 7 aligned with the query: the codes rank page 7 first,
  // center-mad does not.
  const int32_t p = 32, d = 32, Hkv = 1, P = 12, kPlanted = 7;
  TypedBuffer k(DType::kF32, int64_t{P} * p * Hkv * d), v(DType::kF32, int64_t{P} * p * Hkv * d);
  k.FillNormal(21);
  v.FillNormal(22);
  TypedBuffer q(DType::kF32, d);
  q.FillNormal(23);
  const WorkingSetLayout wl{P, p, Hkv, d};
  double norm = 0;
  for (int32_t i = 0; i < d; ++i) norm += q.Get(i) * q.Get(i);
  for (int32_t i = 0; i < d; ++i) k.Set(wl.Offset(kPlanted, 13, 0, i), static_cast<float>(5.0 * q.Get(i) / std::sqrt(norm)));
  const int32_t n = P;
  const auto best_page = [&](SummaryMode mode) {
    std::vector<uint8_t> codes;
    TypedBuffer sums = OffloadEveryPage(k, v, Hkv, p, d, P, mode,
                                        mode == SummaryMode::kKeyCodes ? &codes : nullptr);
    std::vector<float> pooled(static_cast<size_t>(P));
    ScorePagesArgs a = ScoreArgs(
        {.dtype = DType::kF32, .num_q_heads = 1, .num_kv_heads = 1, .head_dim = d, .page_size = p}, 1,
        P, q.data(), sums.data(), &n, pooled.data());
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
    if (!codes.empty()) a.codes = codes.data();
    EXPECT_TRUE(CpuScorePages(a, nullptr).ok());
    return static_cast<int32_t>(std::max_element(pooled.begin(), pooled.end()) - pooled.begin());
  };
  EXPECT_EQ(best_page(SummaryMode::kKeyCodes), kPlanted);
  EXPECT_NE(best_page(SummaryMode::kCenterMad), kPlanted);
}

TEST(ScorePagesTest, MinMaxSummariesGiveAnUpperBoundOnEveryKeyScore) {
  // Summaries produced by offload bound q·k of every key of the page (the Quest property).
  const int32_t p = 16, d = 64, Hkv = 2, P = 6;
  TypedBuffer k(DType::kF16, int64_t{P} * p * Hkv * d), v(DType::kF16, int64_t{P} * p * Hkv * d);
  k.FillNormal(3);
  v.FillNormal(4);
  TypedBuffer sums = OffloadEveryPage(k, v, Hkv, p, d, P);
  TypedBuffer q(DType::kF16, int64_t{Hkv} * d);
  q.FillNormal(5);
  std::vector<float> scores(static_cast<size_t>(Hkv * P)), pooled(static_cast<size_t>(Hkv * P));
  const int32_t n = P;
  ScorePagesArgs a =
      ScoreArgs({.dtype = DType::kF16, .num_q_heads = Hkv, .num_kv_heads = Hkv, .head_dim = d}, 1,
                P, q.data(), sums.data(), &n, pooled.data());
  a.scores = scores.data();
  ASSERT_TRUE(CpuScorePages(a, nullptr).ok());
  const WorkingSetLayout wl{P, p, Hkv, d};
  for (int32_t h = 0; h < Hkv; ++h) {
    for (int32_t pg = 0; pg < P; ++pg) {
      for (int32_t t = 0; t < p; ++t) {
        double dot = 0;
        for (int32_t i = 0; i < d; ++i) dot += q.Get(int64_t{h} * d + i) * k.Get(wl.Offset(int64_t{pg}, t, h, i));
        EXPECT_GE(scores[static_cast<size_t>(h * P + pg)] + 1e-3, dot);
      }
    }
  }
}

TopKArgs MakeTopK(const std::vector<float>& pooled, const std::vector<int32_t>& n, int32_t Hkv,
                  int32_t P, int32_t k, std::vector<int32_t>& out) {
  out.assign(n.size() * static_cast<size_t>(Hkv * k), 99);
  return SelectArgs(Hkv, static_cast<int32_t>(n.size()), P, k, pooled.data(), n.data(), out.data());
}

TEST(TopKTest, TiesGoToTheLowerPageAndNaNRanksLast) {
  const int32_t P = 8;
  std::vector<float> pooled = {1, 2, 2, std::nanf(""), 2, 0, 5, 1};
  std::vector<int32_t> n = {8}, out;
  TopKArgs a = MakeTopK(pooled, n, 1, P, 8, out);
  ASSERT_TRUE(CpuTopK(a, nullptr).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{6, 1, 2, 4, 0, 7, 5, 3}));
}

TEST(TopKTest, ExcludesSinkAndRecentPagesAndPadsWithEmpty) {
  const int32_t P = 10;
  std::vector<float> pooled(P);
  std::iota(pooled.begin(), pooled.end(), 0.0f);  // page i scores i: recent ones would win
  std::vector<int32_t> n = {10}, out;
  TopKArgs a = MakeTopK(pooled, n, 1, P, 6, out);
  a.sink_pages = 2;
  a.recent_pages = 3;  // candidates: 2..6
  ASSERT_TRUE(CpuTopK(a, nullptr).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{6, 5, 4, 3, 2, kEmptySlot}));
  n = {4};  // sink 2 + recent 3 > 4 pages: no candidate at all
  a = MakeTopK(pooled, n, 1, P, 2, out);
  a.sink_pages = 2;
  a.recent_pages = 3;
  ASSERT_TRUE(CpuTopK(a, nullptr).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{kEmptySlot, kEmptySlot}));
}

TEST(TopKTest, RandomScoresMatchAFullSortAndRepeatIdentically) {
  std::mt19937 rng(7);
  const int32_t B = 3, Hkv = 4, P = 300, k = 37;
  std::vector<float> pooled(static_cast<size_t>(B * Hkv * P));
  // Few distinct values so ties are common.
  for (auto& x : pooled) x = static_cast<float>(rng() % 20);
  std::vector<int32_t> n = {300, 120, 41}, out, again;
  ThreadPool pool(3);
  TopKArgs a = MakeTopK(pooled, n, Hkv, P, k, out);
  a.sink_pages = 4;
  a.recent_pages = 2;
  ASSERT_TRUE(CpuTopK(a, &pool).ok());
  TopKArgs a2 = MakeTopK(pooled, n, Hkv, P, k, again);
  a2.sink_pages = 4;
  a2.recent_pages = 2;
  ASSERT_TRUE(CpuTopK(a2, &pool).ok());
  EXPECT_EQ(out, again);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < Hkv; ++h) {
      const float* s = pooled.data() + (b * Hkv + h) * P;
      std::vector<int32_t> cand;
      for (int32_t p = 4; p < n[static_cast<size_t>(b)] - 2; ++p) cand.push_back(p);
      std::stable_sort(cand.begin(), cand.end(), [&](int32_t x, int32_t y) { return s[x] > s[y]; });
      cand.resize(static_cast<size_t>(k), kEmptySlot);
      const std::vector<int32_t> got(out.begin() + (b * Hkv + h) * k, out.begin() + (b * Hkv + h + 1) * k);
      EXPECT_EQ(got, cand) << "b=" << b << " h=" << h;
    }
  }
}

TEST(TopKTest, RejectsPageCountsOutsideMaxPages) {
  std::vector<float> pooled(4, 0.0f);
  std::vector<int32_t> n = {5}, out;
  TopKArgs a = MakeTopK(pooled, n, 1, 4, 2, out);
  EXPECT_EQ(CpuTopK(a, nullptr).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace kvtier
