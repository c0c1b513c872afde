// The kernel features that cache policies (offload/policy) build on, on the CPU: per-head
// top-k budgets and page flags, causal limits, token probabilities and INT8 slots in sparse
// attention, QuantizeSlots and MoveHeadSlots; each against a naive loop or a hand-computed
// case, plus the enqueue-time validation of the new fields.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "tests/testutil/chaos_backend.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::TypedBuffer;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) {
  return std::string(DTypeName(info.param));
}

// ---------------------------------------------------------------------------------------
// TopK: head_k and page_flags.

// Brute force: candidates [sink, n - recent) minus excluded pages, pinned first, then by
// score (NaN last), ties to the lower page; the best k_h, padded to k with kEmptySlot.
std::vector<int32_t> NaiveTopK(const float* score, const uint8_t* flags, int32_t n, int32_t sink,
                               int32_t recent, int32_t k_h, int32_t k) {
  std::vector<int32_t> cand;
  for (int32_t p = std::min(sink, n); p < n - recent; ++p) {
    if (flags == nullptr || (flags[p] & kPageExcluded) == 0) cand.push_back(p);
  }
  auto key = [&](int32_t p) {
    const bool pinned = flags != nullptr && (flags[p] & kPagePinned) != 0;
    const bool is_nan = std::isnan(score[p]);
    return std::make_tuple(!pinned, is_nan, is_nan ? 0.0f : -score[p], p);
  };
  std::sort(cand.begin(), cand.end(), [&](int32_t x, int32_t y) { return key(x) < key(y); });
  std::vector<int32_t> out(static_cast<size_t>(k), kEmptySlot);
  for (size_t i = 0; i < cand.size() && i < static_cast<size_t>(k_h); ++i) out[i] = cand[i];
  return out;
}

struct TopKCase {
  int32_t B = 2, H = 3, P = 12, k = 5;
  std::vector<float> pooled;
  std::vector<int32_t> num_pages{12, 9}, head_k, selected;
  std::vector<uint8_t> flags;

  explicit TopKCase(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    pooled.resize(static_cast<size_t>(B * H * P));
    for (float& x : pooled) x = normal(rng);
    selected.assign(static_cast<size_t>(B * H * k), 99);
  }
  TopKArgs Args() {
    TopKArgs a;
    a.batch = B;
    a.num_kv_heads = H;
    a.max_pages = P;
    a.k = k;
    a.pooled = pooled.data();
    a.num_pages = num_pages.data();
    a.sink_pages = 1;
    a.recent_pages = 2;
    a.selected = selected.data();
    a.head_k = head_k.empty() ? nullptr : head_k.data();
    a.page_flags = flags.empty() ? nullptr : flags.data();
    return a;
  }
  void ExpectNaive(const TopKArgs& a) const {
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t h = 0; h < H; ++h) {
        const int64_t head = int64_t{b} * H + h;
        const std::vector<int32_t> want =
            NaiveTopK(pooled.data() + head * P, flags.empty() ? nullptr : flags.data() + head * P,
                      num_pages[static_cast<size_t>(b)], a.sink_pages, a.recent_pages,
                      head_k.empty() ? k : head_k[static_cast<size_t>(head)], k);
        const std::vector<int32_t> got(selected.begin() + head * k,
                                       selected.begin() + (head + 1) * k);
        EXPECT_EQ(got, want) << "b=" << b << " h=" << h;
      }
    }
  }
};

TEST(TopKPolicyTest, HeadKLimitsEachHeadAndPadsWithEmptySlots) {
  TopKCase c(1);
  c.head_k = {5, 2, 0, 1, 5, 3};
  ThreadPool pool(3);
  const TopKArgs a = c.Args();
  ASSERT_TRUE(CpuTopK(a, &pool).ok());
  c.ExpectNaive(a);
  // Head (0, 2) has k_h = 0: nothing selected at all.
  for (int32_t i = 0; i < c.k; ++i) {
    EXPECT_EQ(c.selected[static_cast<size_t>(2 * c.k + i)], kEmptySlot);
  }
  // Head (0, 1) keeps exactly its best two and pads the rest.
  EXPECT_NE(c.selected[static_cast<size_t>(c.k + 1)], kEmptySlot);
  EXPECT_EQ(c.selected[static_cast<size_t>(c.k + 2)], kEmptySlot);
}

TEST(TopKPolicyTest, HeadKOutsideZeroToKFailsWithOutOfRange) {
  for (int32_t bad : {-1, 6}) {
    TopKCase c(2);
    c.head_k = {5, 5, 5, 5, bad, 5};
    const absl::Status st = CpuTopK(c.Args(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("head_k[4] = " + std::to_string(bad)));
    EXPECT_EQ(c.selected[0], 99) << "nothing is written when the op fails";
  }
  // A head the mask leaves alone is not read.
  TopKCase c(3);
  c.head_k = {5, 5, 5, 5, 77, 5};
  std::vector<uint8_t> mask = {1, 1, 1, 1, 0, 1};
  TopKArgs a = c.Args();
  a.head_mask = mask.data();
  ASSERT_TRUE(CpuTopK(a, nullptr).ok());
  EXPECT_EQ(c.selected[static_cast<size_t>(4 * c.k)], 99);
  EXPECT_NE(c.selected[0], 99);
}

TEST(TopKPolicyTest, OutOfRangeHeadKFailsTheStream) {
  auto backend = std::move(CreateBackend(DeviceKind::kCpu)).value();
  auto stream = std::move(backend->CreateStream()).value();
  TopKCase c(4);
  c.head_k = {5, 5, 5, 5, 5, 9};
  ASSERT_TRUE(backend->TopK(*stream, c.Args()).ok());  // data errors show when it runs
  EXPECT_EQ(stream->Synchronize().code(), absl::StatusCode::kOutOfRange);
}

TEST(TopKPolicyTest, PinnedPagesRankFirstAndExcludedPagesNeverCount) {
  TopKCase c(5);
  c.flags.assign(c.pooled.size(), kPageNormal);
  // Head (0, 0): the two lowest-scoring candidates pinned, the best one excluded.
  float* s = c.pooled.data();
  for (int32_t p = 0; p < c.P; ++p) s[p] = static_cast<float>(p);  // page 9 is the best candidate
  c.flags[3] = kPagePinned;
  c.flags[1] = kPagePinned;
  c.flags[9] = kPageExcluded;
  c.flags[0] = kPagePinned;   // a sink page: not a candidate, the flag changes nothing
  c.flags[11] = kPagePinned;  // a recent page: likewise
  ThreadPool pool(2);
  const TopKArgs a = c.Args();
  ASSERT_TRUE(CpuTopK(a, &pool).ok());
  const std::vector<int32_t> head0(c.selected.begin(), c.selected.begin() + c.k);
  EXPECT_EQ(head0, (std::vector<int32_t>{3, 1, 8, 7, 6}));
  c.ExpectNaive(a);
}

TEST(TopKPolicyTest, MorePinnedPagesThanTheBudgetKeepsTheBestPinned) {
  TopKCase c(6);
  c.flags.assign(c.pooled.size(), kPageNormal);
  c.head_k.assign(static_cast<size_t>(c.B * c.H), 2);
  float* s = c.pooled.data();
  for (int32_t p = 0; p < c.P; ++p) s[p] = static_cast<float>(100 - p);  // low pages best
  for (int32_t p : {4, 6, 7, 9}) c.flags[static_cast<size_t>(p)] = kPagePinned;
  c.flags[2] = kPagePinned | kPageExcluded;        // both bits: excluded wins
  s[9] = std::numeric_limits<float>::quiet_NaN();  // NaN ranks last even among pinned
  const TopKArgs a = c.Args();
  ASSERT_TRUE(CpuTopK(a, nullptr).ok());
  EXPECT_EQ(std::vector<int32_t>(c.selected.begin(), c.selected.begin() + c.k),
            (std::vector<int32_t>{4, 6, kEmptySlot, kEmptySlot, kEmptySlot}));
  c.ExpectNaive(a);
}

TEST(TopKPolicyTest, RandomFlagsAndBudgetsMatchBruteForce) {
  for (uint32_t seed = 10; seed < 30; ++seed) {
    TopKCase c(seed);
    std::mt19937 rng(seed);
    c.flags.resize(c.pooled.size());
    for (uint8_t& f : c.flags) f = static_cast<uint8_t>(rng() % 4 == 0 ? rng() % 4 : 0);
    for (int32_t i = 0; i < c.B * c.H; ++i) c.head_k.push_back(static_cast<int32_t>(rng() % 6));
    // Ties between pinned pages go to the lower page, as between normal ones.
    for (size_t i = 0; i < c.pooled.size(); i += 3) c.pooled[i] = 0.5f;
    const TopKArgs a = c.Args();
    ThreadPool pool(4);
    ASSERT_TRUE(CpuTopK(a, seed % 2 ? &pool : nullptr).ok());
    c.ExpectNaive(a);
  }
}

// ---------------------------------------------------------------------------------------
// SparseAttention: query_position, token_prob, INT8 slots.

double Tolerance(DType t) {
  switch (t) {
    case DType::kF16:
      return 2e-3;
    case DType::kBF16:
      return 1e-2;
    case DType::kF32:
      return 2e-5;
  }
  return 0;
}

struct AttnCase {
  DType dtype;
  int32_t B, Hkv, G, d, p, S;
  std::vector<int32_t> table, partial_page, partial_len;
  std::vector<int64_t> qpos;       // empty: no causal limit
  std::vector<uint8_t> slot_int8;  // empty: no INT8 storage
  std::vector<int8_t> k8, v8;
  std::vector<float> ks, vs;
  TypedBuffer q, k, v;
  float scale;

  AttnCase(DType t, int32_t batch, int32_t kv_heads, int32_t group, int32_t dim, int32_t page,
           int32_t slots)
      : dtype(t),
        B(batch),
        Hkv(kv_heads),
        G(group),
        d(dim),
        p(page),
        S(slots),
        q(t, int64_t{batch} * kv_heads * group * dim),
        k(t, int64_t{batch} * slots * page * kv_heads * dim),
        v(t, int64_t{batch} * slots * page * kv_heads * dim),
        scale(1.0f / std::sqrt(static_cast<float>(dim))) {
    q.FillNormal(31, 2.0f);
    k.FillNormal(32);
    v.FillNormal(33);
    table.assign(static_cast<size_t>(B * Hkv * S), kEmptySlot);
    partial_page.assign(static_cast<size_t>(B), -1);
    partial_len.assign(static_cast<size_t>(B), 0);
  }
  int32_t Hq() const { return Hkv * G; }
  WorkingSetLayout wl() const { return WorkingSetLayout{S, p, Hkv, d}; }
  SlotTableLayout tl() const { return SlotTableLayout{Hkv, S}; }

  // Random pages in ~2/3 of the (b, h, s) entries; page P partial in sequence 0.
  void RandomTable(uint32_t seed, int32_t max_page) {
    std::mt19937 rng(seed);
    for (int32_t& e : table) {
      e = rng() % 3 == 0 ? kEmptySlot
                         : static_cast<int32_t>(rng() % static_cast<uint32_t>(max_page));
    }
    partial_page[0] = table[0] >= 0 ? table[0] : 1;
    partial_len[0] = p / 2 + 1;
  }

  // Turns on INT8 storage for a random third of the (b, h, s) entries: quantises them with
  // CpuQuantizeSlots, then overwrites their fp16/bf16/fp32 K and V with garbage, so reading
  // the wrong copy cannot pass.
  void QuantizeSome(uint32_t seed) {
    std::mt19937 rng(seed);
    slot_int8.assign(table.size(), 0);
    const size_t n = static_cast<size_t>(k.size());
    k8.assign(n, 0);
    v8.assign(n, 0);
    ks.assign(static_cast<size_t>(B * S * Hkv * d), 0.0f);
    vs.assign(ks.size(), 0.0f);
    std::vector<HeadSlot> items;
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t h = 0; h < Hkv; ++h) {
        for (int32_t s = 0; s < S; ++s) {
          if (rng() % 3 != 0) continue;
          slot_int8[static_cast<size_t>(tl().Offset(b, h, s))] = 1;
          items.push_back({h, static_cast<int32_t>(wl().GlobalSlot(b, s))});
        }
      }
    }
    QuantizeSlotsArgs qa;
    qa.dtype = dtype;
    qa.page_size = p;
    qa.num_kv_heads = Hkv;
    qa.head_dim = d;
    qa.items = items.data();
    qa.num_items = static_cast<int32_t>(items.size());
    qa.k_cache = k.data();
    qa.v_cache = v.data();
    qa.k_int8 = k8.data();
    qa.v_int8 = v8.data();
    qa.k_scale = ks.data();
    qa.v_scale = vs.data();
    qa.num_slots = B * S;
    ASSERT_TRUE(CpuQuantizeSlots(qa, nullptr).ok());
    for (const HeadSlot& it : items) {
      for (int32_t t = 0; t < p; ++t) {
        for (int32_t i = 0; i < d; ++i) {
          k.Set(wl().Offset(int64_t{it.slot}, t, it.kv_head, i), 50.0f);
          v.Set(wl().Offset(int64_t{it.slot}, t, it.kv_head, i), -50.0f);
        }
      }
    }
  }

  SparseAttentionArgs Args(void* out, float* lse, float* prob) const {
    SparseAttentionArgs a;
    a.dtype = dtype;
    a.batch = B;
    a.num_q_heads = Hq();
    a.num_kv_heads = Hkv;
    a.head_dim = d;
    a.page_size = p;
    a.num_slots = S;
    a.q = q.data();
    a.k_cache = k.data();
    a.v_cache = v.data();
    a.slot_table = table.data();
    a.partial_page = partial_page.data();
    a.partial_len = partial_len.data();
    a.softmax_scale = scale;
    a.out = out;
    a.lse = lse;
    a.token_prob = prob;
    a.query_position = qpos.empty() ? nullptr : qpos.data();
    if (!slot_int8.empty()) {
      a.slot_int8 = slot_int8.data();
      a.k_int8 = k8.data();
      a.v_int8 = v8.data();
      a.k_scale = ks.data();
      a.v_scale = vs.data();
    }
    return a;
  }

  // K (kind 0) or V (kind 1) element as attention must read it: the dequantised INT8 value
  // (the same fp32 product) where the slot is INT8, else the cache element.
  double Element(int32_t kind, int32_t b, int32_t s, int32_t t, int32_t h, int32_t i) const {
    const int64_t off = wl().Offset(b, s, t, h, i);
    if (!slot_int8.empty() && slot_int8[static_cast<size_t>(tl().Offset(b, h, s))] != 0) {
      const auto so = static_cast<size_t>((wl().GlobalSlot(b, s) * Hkv + h) * d + i);
      const auto e = static_cast<size_t>(off);
      return kind == 0 ? static_cast<double>(static_cast<float>(k8[e]) * ks[so])
                       : static_cast<double>(static_cast<float>(v8[e]) * vs[so]);
    }
    return kind == 0 ? k.Get(off) : v.Get(off);
  }

  // Naive attention in double: out [B][Hq][d], lse [B][Hq], prob [B][Hq][S][p].
  void Reference(std::vector<double>& out, std::vector<double>& lse,
                 std::vector<double>& prob) const {
    out.assign(static_cast<size_t>(B * Hq() * d), 0.0);
    lse.assign(static_cast<size_t>(B * Hq()), -kInf);
    prob.assign(static_cast<size_t>(B * Hq() * S * p), 0.0);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t hq = 0; hq < Hq(); ++hq) {
        const int32_t h = hq / G;
        struct Tok {
          int32_t s, t;
          double score;
        };
        std::vector<Tok> toks;
        for (int32_t s = 0; s < S; ++s) {
          const int32_t page = table[static_cast<size_t>(tl().Offset(b, h, s))];
          if (page < 0) continue;
          const int32_t n = page == partial_page[static_cast<size_t>(b)]
                                ? partial_len[static_cast<size_t>(b)]
                                : p;
          for (int32_t t = 0; t < n; ++t) {
            if (!qpos.empty() && int64_t{page} * p + t > qpos[static_cast<size_t>(b)]) continue;
            double dot = 0;
            for (int32_t i = 0; i < d; ++i) {
              dot += double{q.Get((int64_t{b} * Hq() + hq) * d + i)} * Element(0, b, s, t, h, i);
            }
            toks.push_back({s, t, dot * scale});
          }
        }
        if (toks.empty()) continue;
        double m = -kInf, z = 0;
        for (const Tok& tok : toks) m = std::max(m, tok.score);
        for (const Tok& tok : toks) z += std::exp(tok.score - m);
        const int64_t row = int64_t{b} * Hq() + hq;
        for (const Tok& tok : toks) {
          const double w = std::exp(tok.score - m) / z;
          prob[static_cast<size_t>((row * S + tok.s) * p + tok.t)] = w;
          for (int32_t i = 0; i < d; ++i) {
            out[static_cast<size_t>(row * d + i)] += w * Element(1, b, tok.s, tok.t, h, i);
          }
        }
        lse[static_cast<size_t>(row)] = m + std::log(z);
      }
    }
  }

  // Runs CpuSparseAttention (with and without a pool) and compares everything with the
  // naive loop: out within the dtype's rounding (at least `rel`), lse and token_prob
  // within `rel` relative.
  void RunAndCompare(double rel, bool with_prob) const {
    std::vector<double> want, want_lse, want_prob;
    Reference(want, want_lse, want_prob);
    const double out_tol = std::max(rel, Tolerance(dtype));
    std::unique_ptr<ThreadPool> pool = std::make_unique<ThreadPool>(4);
    for (ThreadPool* pl : {static_cast<ThreadPool*>(nullptr), pool.get()}) {
      TypedBuffer out(dtype, int64_t{B} * Hq() * d);
      std::vector<float> lse(static_cast<size_t>(B * Hq()));
      std::vector<float> prob(with_prob ? want_prob.size() : 0, -1.0f);
      ASSERT_TRUE(
          CpuSparseAttention(Args(out.data(), lse.data(), with_prob ? prob.data() : nullptr), pl)
              .ok());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(out.Get(static_cast<int64_t>(i)), want[i], out_tol * (1 + std::fabs(want[i])))
            << "out " << i;
      }
      for (size_t i = 0; i < want_lse.size(); ++i) {
        if (std::isinf(want_lse[i])) {
          EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
        } else {
          EXPECT_NEAR(lse[i], want_lse[i], rel * (1 + std::fabs(want_lse[i]))) << "lse " << i;
        }
      }
      if (!with_prob) continue;
      for (size_t i = 0; i < want_prob.size(); ++i) {
        ASSERT_NEAR(prob[i], want_prob[i], 1e-6 + rel * want_prob[i]) << "prob " << i;
        if (want_prob[i] == 0) {
          ASSERT_EQ(prob[i], 0.0f) << "unattended token " << i;
        }
      }
    }
  }
};

class SparseAttentionPolicyTest : public ::testing::TestWithParam<DType> {};

TEST_P(SparseAttentionPolicyTest, QueryPositionCutsTokensAfterTheQuery) {
  AttnCase c(GetParam(), 3, 2, 4, 64, 16, 9);
  c.RandomTable(7, 12);
  // Sequence 0 stops mid page 5 (tokens 0..6 of it), sequence 1 at the end of page 3,
  // sequence 2 before every token (all heads empty: zeros and lse = -inf).
  c.qpos = {5 * 16 + 6, 4 * 16 - 1, -1};
  c.RunAndCompare(1e-4, /*with_prob=*/false);
}

TEST_P(SparseAttentionPolicyTest, TokenProbMatchesANaiveSoftmaxAndSumsToOne) {
  // 40 slots on one (sequence, head) pair per batch: split into several chunks and merged.
  AttnCase c(GetParam(), 2, 1, 2, 32, 8, 40);
  c.RandomTable(8, 60);
  c.qpos = {8 * 50, 8 * 60};
  c.RunAndCompare(1e-4, /*with_prob=*/true);
  std::vector<float> prob(static_cast<size_t>(c.B * c.Hq() * c.S * c.p));
  TypedBuffer out(c.dtype, int64_t{c.B} * c.Hq() * c.d);
  ThreadPool pool(8);
  ASSERT_TRUE(CpuSparseAttention(c.Args(out.data(), nullptr, prob.data()), &pool).ok());
  for (int32_t row = 0; row < c.B * c.Hq(); ++row) {
    double sum = 0;
    for (int32_t i = 0; i < c.S * c.p; ++i) sum += prob[static_cast<size_t>(row * c.S * c.p + i)];
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
}

TEST_P(SparseAttentionPolicyTest, Int8SlotsReadTheDequantisedValues) {
  AttnCase c(GetParam(), 2, 2, 4, 64, 16, 9);
  c.RandomTable(9, 20);
  c.QuantizeSome(10);
  c.RunAndCompare(1e-4, /*with_prob=*/true);
  c.qpos = {16 * 10 + 3, 16 * 4};
  c.RunAndCompare(1e-4, /*with_prob=*/true);
}

TEST_P(SparseAttentionPolicyTest, HeadWithNoTokensGetsZeroProbabilities) {
  AttnCase c(GetParam(), 1, 2, 2, 32, 8, 5);
  c.table = {0,          1,          kEmptySlot, 2,          3,
             kEmptySlot, kEmptySlot, kEmptySlot, kEmptySlot, kEmptySlot};  // head 1 holds nothing
  std::vector<float> prob(static_cast<size_t>(c.Hq() * c.S * c.p), -1.0f);
  TypedBuffer out(c.dtype, int64_t{c.Hq()} * c.d);
  std::vector<float> lse(static_cast<size_t>(c.Hq()));
  ASSERT_TRUE(CpuSparseAttention(c.Args(out.data(), lse.data(), prob.data()), nullptr).ok());
  for (int32_t hq = 2; hq < 4; ++hq) {
    for (int32_t i = 0; i < c.S * c.p; ++i) {
      EXPECT_EQ(prob[static_cast<size_t>(hq * c.S * c.p + i)], 0.0f);
    }
    EXPECT_TRUE(std::isinf(lse[static_cast<size_t>(hq)]));
  }
  c.RunAndCompare(1e-4, /*with_prob=*/true);
}

INSTANTIATE_TEST_SUITE_P(DTypes, SparseAttentionPolicyTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32), DTypeParamName);

// ---------------------------------------------------------------------------------------
// QuantizeSlots.

class QuantizeSlotsTest : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizeSlotsTest, RoundTripIsWithinHalfAScaleAndOnlyItemsAreWritten) {
  const DType t = GetParam();
  const int32_t slots = 6, p = 16, H = 3, d = 40;
  const WorkingSetLayout wl{slots, p, H, d};
  TypedBuffer k(t, slots * wl.slot_elements()), v(t, slots * wl.slot_elements());
  k.FillNormal(41, 3.0f);
  v.FillNormal(42, 0.01f);
  // One channel of one item all zeros: scale 0, q 0.
  for (int32_t tok = 0; tok < p; ++tok) k.Set(wl.Offset(int64_t{4}, tok, 2, 7), 0.0f);
  const std::vector<HeadSlot> items = {{0, 0}, {2, 4}, {1, 4}, {2, 5}};
  std::vector<int8_t> k8(static_cast<size_t>(k.size()), 99), v8(k8);
  std::vector<float> ks(static_cast<size_t>(slots * H * d), -1.0f), vs(ks);
  QuantizeSlotsArgs a;
  a.dtype = t;
  a.page_size = p;
  a.num_kv_heads = H;
  a.head_dim = d;
  a.items = items.data();
  a.num_items = static_cast<int32_t>(items.size());
  a.k_cache = k.data();
  a.v_cache = v.data();
  a.k_int8 = k8.data();
  a.v_int8 = v8.data();
  a.k_scale = ks.data();
  a.v_scale = vs.data();
  a.num_slots = slots;
  ThreadPool pool(3);
  ASSERT_TRUE(CpuQuantizeSlots(a, &pool).ok());
  std::vector<bool> quantised(static_cast<size_t>(slots * H), false);
  for (const HeadSlot& it : items) quantised[static_cast<size_t>(it.slot * H + it.kv_head)] = true;
  for (int32_t kind = 0; kind < 2; ++kind) {
    const TypedBuffer& x = kind == 0 ? k : v;
    const std::vector<int8_t>& q8 = kind == 0 ? k8 : v8;
    const std::vector<float>& sc = kind == 0 ? ks : vs;
    for (int32_t s = 0; s < slots; ++s) {
      for (int32_t h = 0; h < H; ++h) {
        for (int32_t c = 0; c < d; ++c) {
          const auto si = static_cast<size_t>((s * H + h) * d + c);
          if (!quantised[static_cast<size_t>(s * H + h)]) {
            ASSERT_EQ(sc[si], -1.0f);
            for (int32_t tok = 0; tok < p; ++tok) {
              ASSERT_EQ(q8[static_cast<size_t>(wl.Offset(int64_t{s}, tok, h, c))], 99);
            }
            continue;
          }
          float amax = 0;
          for (int32_t tok = 0; tok < p; ++tok) {
            amax = std::max(amax, std::fabs(x.Get(wl.Offset(int64_t{s}, tok, h, c))));
          }
          ASSERT_EQ(sc[si], amax / 127.0f) << "kind " << kind << " slot " << s << " head " << h;
          for (int32_t tok = 0; tok < p; ++tok) {
            const int64_t e = wl.Offset(int64_t{s}, tok, h, c);
            const int8_t qv = q8[static_cast<size_t>(e)];
            ASSERT_GE(qv, -127);
            if (sc[si] == 0) {
              ASSERT_EQ(qv, 0);
              continue;
            }
            const double err = std::fabs(double{x.Get(e)} - static_cast<double>(qv) * sc[si]);
            ASSERT_LE(err, sc[si] * (0.5 + 1e-4)) << "kind " << kind << " element " << e;
          }
        }
      }
    }
  }
  EXPECT_EQ(ks[static_cast<size_t>((4 * H + 2) * d + 7)], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(DTypes, QuantizeSlotsTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32), DTypeParamName);

TEST(QuantizeSlotsExactTest, HandComputedPage) {
  // One slot, one head, p = 3 tokens, d = 3 channels. Rows are tokens.
  const std::vector<float> k = {1.0f,  127.0f, 0.0f,    // token 0
                                -2.0f, 0.5f,   0.0f,    // token 1
                                0.5f,  2.5f,   0.0f};   // token 2
  const std::vector<float> v = {-254.0f, 1.0f,  3.0f,   //
                                1.0f,    -1.0f, -3.0f,  //
                                3.0f,    0.25f, 1.5f};
  std::vector<int8_t> k8(9), v8(9);
  std::vector<float> ks(3), vs(3);
  const HeadSlot item{0, 0};
  QuantizeSlotsArgs a;
  a.dtype = DType::kF32;
  a.page_size = 3;
  a.num_kv_heads = 1;
  a.head_dim = 3;
  a.items = &item;
  a.num_items = 1;
  a.k_cache = k.data();
  a.v_cache = v.data();
  a.k_int8 = k8.data();
  a.v_int8 = v8.data();
  a.k_scale = ks.data();
  a.v_scale = vs.data();
  a.num_slots = 1;
  ASSERT_TRUE(CpuQuantizeSlots(a, nullptr).ok());
  // K channel 0: {1, -2, 0.5}, scale 2/127; 1/scale = 63.5 exactly in fp32 → 64 (ties to
  // even), -2 → -127, 0.5/scale = 31.75 → 32. Channel 1: scale 1, 0.5 → 0 and 2.5 → 2 (ties
  // to even). Channel 2: all zero → scale 0, q 0.
  EXPECT_EQ(ks, (std::vector<float>{2.0f / 127.0f, 1.0f, 0.0f}));
  EXPECT_EQ(k8, (std::vector<int8_t>{64, 127, 0, -127, 0, 0, 32, 2, 0}));
  // V channel 0: scale 2: -254 → -127, 0.5 → 0, 1.5 → 2. Channel 1: scale 1/127: 1 → 127,
  // -1 → -127, 0.25 → 31.75 → 32. Channel 2: scale 3/127: 3 → 127, -3 → -127, 1.5 → 63.5.
  EXPECT_EQ(vs, (std::vector<float>{2.0f, 1.0f / 127.0f, 3.0f / 127.0f}));
  const float tie = 1.5f / (3.0f / 127.0f);
  const auto v2 = static_cast<int8_t>(std::nearbyint(tie));  // 63.5 → 64 if exact
  EXPECT_EQ(v8, (std::vector<int8_t>{-127, 127, 127, 0, -127, -127, 2, 32, v2}));
}

TEST(QuantizeSlotsExactTest, ItemsOutOfRangeFailWithOutOfRange) {
  std::vector<float> buf(64);
  std::vector<int8_t> q8(64);
  const HeadSlot bad_head{2, 0}, bad_slot{0, 4};
  QuantizeSlotsArgs a;
  a.dtype = DType::kF32;
  a.page_size = 2;
  a.num_kv_heads = 2;
  a.head_dim = 4;
  a.num_items = 1;
  a.k_cache = a.v_cache = buf.data();
  a.k_int8 = a.v_int8 = q8.data();
  a.k_scale = a.v_scale = buf.data();
  a.num_slots = 4;
  a.items = &bad_head;
  EXPECT_EQ(CpuQuantizeSlots(a, nullptr).code(), absl::StatusCode::kOutOfRange);
  a.items = &bad_slot;
  const absl::Status st = CpuQuantizeSlots(a, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(st.message()), HasSubstr("items[0].slot = 4 must be in [0, 4)"));
}

// ---------------------------------------------------------------------------------------
// MoveHeadSlots.

class MoveHeadSlotsTest : public ::testing::TestWithParam<DType> {};

TEST_P(MoveHeadSlotsTest, BitExactInOrderAndOtherHeadsUntouched) {
  const DType t = GetParam();
  const int32_t slots = 6, p = 8, H = 3, d = 16;
  const WorkingSetLayout wl{slots, p, H, d};
  const int64_t n = slots * wl.slot_elements();
  TypedBuffer k(t, n), v(t, n);
  k.FillNormal(51);
  v.FillNormal(52);
  std::vector<int8_t> k8(static_cast<size_t>(n)), v8(k8.size());
  std::vector<float> ks(static_cast<size_t>(slots * H * d)), vs(ks.size());
  std::mt19937 rng(53);
  for (auto& x : k8) x = static_cast<int8_t>(rng());
  for (auto& x : v8) x = static_cast<int8_t>(rng());
  for (auto& x : ks) x = static_cast<float>(rng() % 1000) / 7.0f;
  for (auto& x : vs) x = static_cast<float>(rng() % 1000) / 9.0f;
  // Item 2 moves what item 0 just wrote: items run in order.
  const std::vector<HeadSlotMove> items = {{0, 1, 3}, {1, 3, 0}, {0, 3, 5}, {2, 5, 2}};

  // Expected: element-wise moves on copies.
  const size_t es = DTypeSize(t);
  std::vector<unsigned char> ek(k.bytes()), ev(v.bytes());
  std::memcpy(ek.data(), k.data(), ek.size());
  std::memcpy(ev.data(), v.data(), ev.size());
  std::vector<int8_t> ek8(k8), ev8(v8);
  std::vector<float> eks(ks), evs(vs);
  for (const HeadSlotMove& it : items) {
    for (int32_t tok = 0; tok < p; ++tok) {
      for (int32_t c = 0; c < d; ++c) {
        const auto src = static_cast<size_t>(wl.Offset(int64_t{it.src_slot}, tok, it.kv_head, c));
        const auto dst = static_cast<size_t>(wl.Offset(int64_t{it.dst_slot}, tok, it.kv_head, c));
        std::memcpy(ek.data() + dst * es, ek.data() + src * es, es);
        std::memcpy(ev.data() + dst * es, ev.data() + src * es, es);
        ek8[dst] = ek8[src];
        ev8[dst] = ev8[src];
      }
    }
    for (int32_t c = 0; c < d; ++c) {
      eks[static_cast<size_t>((it.dst_slot * H + it.kv_head) * d + c)] =
          eks[static_cast<size_t>((it.src_slot * H + it.kv_head) * d + c)];
      evs[static_cast<size_t>((it.dst_slot * H + it.kv_head) * d + c)] =
          evs[static_cast<size_t>((it.src_slot * H + it.kv_head) * d + c)];
    }
  }

  MoveHeadSlotsArgs a;
  a.dtype = t;
  a.page_size = p;
  a.num_kv_heads = H;
  a.head_dim = d;
  a.items = items.data();
  a.num_items = static_cast<int32_t>(items.size());
  a.k_cache = k.data();
  a.v_cache = v.data();
  a.k_int8 = k8.data();
  a.v_int8 = v8.data();
  a.k_scale = ks.data();
  a.v_scale = vs.data();
  a.num_slots = slots;
  ThreadPool pool(2);
  ASSERT_TRUE(CpuMoveHeadSlots(a, &pool).ok());
  EXPECT_EQ(std::memcmp(k.data(), ek.data(), ek.size()), 0);
  EXPECT_EQ(std::memcmp(v.data(), ev.data(), ev.size()), 0);
  EXPECT_EQ(k8, ek8);
  EXPECT_EQ(v8, ev8);
  EXPECT_EQ(std::memcmp(ks.data(), eks.data(), ks.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(vs.data(), evs.data(), vs.size() * sizeof(float)), 0);

  // Without the INT8 buffers only the caches move (and the INT8 buffers stay as they are).
  const std::vector<int8_t> k8_before(k8);
  a.k_int8 = a.v_int8 = nullptr;
  a.k_scale = a.v_scale = nullptr;
  const HeadSlotMove one{1, 4, 1};
  a.items = &one;
  a.num_items = 1;
  ASSERT_TRUE(CpuMoveHeadSlots(a, nullptr).ok());
  for (int32_t tok = 0; tok < p; ++tok) {
    for (int32_t c = 0; c < d; ++c) {
      EXPECT_EQ(std::memcmp(static_cast<const unsigned char*>(k.data()) +
                                wl.Offset(int64_t{1}, tok, 1, c) * static_cast<int64_t>(es),
                            static_cast<const unsigned char*>(k.data()) +
                                wl.Offset(int64_t{4}, tok, 1, c) * static_cast<int64_t>(es),
                            es),
                0);
    }
  }
  EXPECT_EQ(k8, k8_before);
}

INSTANTIATE_TEST_SUITE_P(DTypes, MoveHeadSlotsTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32), DTypeParamName);

TEST(MoveHeadSlotsErrorsTest, SameSlotOrOutOfRangeFailsAndMovesNothing) {
  const int32_t slots = 3, p = 2, H = 2, d = 4;
  std::vector<float> k(static_cast<size_t>(slots * p * H * d)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  const std::vector<float> k_before(k);
  MoveHeadSlotsArgs a;
  a.dtype = DType::kF32;
  a.page_size = p;
  a.num_kv_heads = H;
  a.head_dim = d;
  a.k_cache = k.data();
  a.v_cache = v.data();
  a.num_slots = slots;
  const std::vector<HeadSlotMove> same = {{0, 0, 1}, {1, 2, 2}};
  a.items = same.data();
  a.num_items = 2;
  absl::Status st = CpuMoveHeadSlots(a, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("items[1] moves slot 2 onto itself"));
  EXPECT_EQ(k, k_before);
  const std::vector<HeadSlotMove> out_of_range = {{0, 0, 1}, {2, 0, 1}, {0, 3, 1}};
  a.items = out_of_range.data();
  a.num_items = 2;
  EXPECT_EQ(CpuMoveHeadSlots(a, nullptr).code(), absl::StatusCode::kOutOfRange);
  a.items = out_of_range.data() + 2;
  a.num_items = 1;
  st = CpuMoveHeadSlots(a, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(st.message()), HasSubstr("items[0].src_slot = 3 must be in [0, 3)"));
  EXPECT_EQ(k, k_before);

  // Through a backend the item check runs with the op and fails the stream.
  auto backend = std::move(CreateBackend(DeviceKind::kCpu)).value();
  auto stream = std::move(backend->CreateStream()).value();
  a.items = same.data();
  a.num_items = 2;
  ASSERT_TRUE(backend->MoveHeadSlots(*stream, a).ok());
  EXPECT_EQ(stream->Synchronize().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(k, k_before);
}

// ---------------------------------------------------------------------------------------
// Enqueue-time validation and backend dispatch.

class PolicyOpsValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::move(CreateBackend(DeviceKind::kCpu)).value();
    stream_ = std::move(backend_->CreateStream()).value();
  }
  void ExpectInvalid(const absl::Status& st, const std::string& text) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(text));
  }
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<float> buf_ = std::vector<float>(4096);
  std::vector<int8_t> bytes_ = std::vector<int8_t>(4096);
  std::vector<int32_t> ints_ = std::vector<int32_t>(64, 0);
};

TEST_F(PolicyOpsValidationTest, SparseAttentionInt8BuffersComeTogether) {
  SparseAttentionArgs a;
  a.dtype = DType::kF32;
  a.batch = 1;
  a.num_q_heads = 2;
  a.num_kv_heads = 1;
  a.head_dim = 8;
  a.page_size = 4;
  a.num_slots = 2;
  a.q = a.k_cache = a.v_cache = buf_.data();
  a.slot_table = a.partial_page = a.partial_len = ints_.data();
  a.out = buf_.data() + 2048;
  const std::vector<uint8_t> flags(2, 1);
  a.slot_int8 = flags.data();
  a.k_int8 = a.v_int8 = bytes_.data();
  a.k_scale = buf_.data();
  ExpectInvalid(backend_->SparseAttention(*stream_, a),
                "SparseAttention: slot_int8, k_int8, v_int8, k_scale, v_scale must be given "
                "together or not at all (v_scale is null)");
  a.slot_int8 = nullptr;
  a.k_int8 = a.v_int8 = nullptr;
  a.k_scale = nullptr;
  a.token_prob = buf_.data() + 1024;  // optional outputs and limits need nothing more
  const int64_t qpos = 3;
  a.query_position = &qpos;
  EXPECT_TRUE(backend_->SparseAttention(*stream_, a).ok());
  EXPECT_TRUE(stream_->Synchronize().ok());
}

TEST_F(PolicyOpsValidationTest, QuantizeAndMoveShapes) {
  QuantizeSlotsArgs q;
  q.dtype = DType::kF32;
  q.page_size = 4;
  q.num_kv_heads = 2;
  q.head_dim = 8;
  EXPECT_TRUE(backend_->QuantizeSlots(*stream_, q).ok()) << "no items: nothing to check";
  q.num_items = 1;
  q.num_slots = 1;
  q.items = reinterpret_cast<const HeadSlot*>(ints_.data());
  q.k_cache = q.v_cache = buf_.data();
  q.k_int8 = q.v_int8 = bytes_.data();
  q.k_scale = buf_.data();
  ExpectInvalid(backend_->QuantizeSlots(*stream_, q), "QuantizeSlots: v_scale must not be null");
  q.page_size = 0;
  ExpectInvalid(backend_->QuantizeSlots(*stream_, q), "QuantizeSlots: page_size = 0");

  MoveHeadSlotsArgs m;
  m.dtype = DType::kF32;
  m.page_size = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  m.num_items = 1;
  m.num_slots = 2;
  m.items = reinterpret_cast<const HeadSlotMove*>(ints_.data());
  m.k_cache = buf_.data();
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m), "MoveHeadSlots: v_cache must not be null");
  m.v_cache = buf_.data();
  m.k_int8 = bytes_.data();
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m),
                "MoveHeadSlots: k_int8, v_int8, k_scale, v_scale must be given together or not "
                "at all (v_int8 is null)");
  m.num_items = -1;
  m.k_int8 = nullptr;
  ExpectInvalid(backend_->MoveHeadSlots(*stream_, m), "MoveHeadSlots: num_items = -1");
}

// Both ops run through every CPU-based backend (the chaos backend forwards them too).
TEST_F(PolicyOpsValidationTest, QuantizeThenMoveRunOnStreams) {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(std::move(CreateBackend(DeviceKind::kCpu)).value());
  backends.push_back(testing::NewChaosBackend(testing::ChaosOptions{}));
  for (auto& backend : backends) {
    auto stream = std::move(backend->CreateStream()).value();
    const int32_t slots = 2, p = 2, H = 1, d = 2;
    std::vector<float> k = {1, -4, 2, 8, 0, 0, 0, 0}, v = {0.5f, 1, 1, -1, 0, 0, 0, 0};
    std::vector<int8_t> k8(8), v8(8);
    std::vector<float> ks(4), vs(4);
    const HeadSlot item{0, 0};
    QuantizeSlotsArgs q;
    q.dtype = DType::kF32;
    q.page_size = p;
    q.num_kv_heads = H;
    q.head_dim = d;
    q.items = &item;
    q.num_items = 1;
    q.k_cache = k.data();
    q.v_cache = v.data();
    q.k_int8 = k8.data();
    q.v_int8 = v8.data();
    q.k_scale = ks.data();
    q.v_scale = vs.data();
    q.num_slots = slots;
    ASSERT_TRUE(backend->QuantizeSlots(*stream, q).ok());
    const HeadSlotMove move{0, 0, 1};
    MoveHeadSlotsArgs m;
    m.dtype = DType::kF32;
    m.page_size = p;
    m.num_kv_heads = H;
    m.head_dim = d;
    m.items = &move;
    m.num_items = 1;
    m.k_cache = k.data();
    m.v_cache = v.data();
    m.k_int8 = k8.data();
    m.v_int8 = v8.data();
    m.k_scale = ks.data();
    m.v_scale = vs.data();
    m.num_slots = slots;
    ASSERT_TRUE(backend->MoveHeadSlots(*stream, m).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_EQ(k, (std::vector<float>{1, -4, 2, 8, 1, -4, 2, 8}));
    EXPECT_EQ(ks, (std::vector<float>{2.0f / 127.0f, 8.0f / 127.0f, 2.0f / 127.0f, 8.0f / 127.0f}));
    EXPECT_EQ(k8, (std::vector<int8_t>{64, -64, 127, 127, 64, -64, 127, 127}));
  }
}

}  // namespace
}  // namespace kvtier
