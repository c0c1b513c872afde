// The kernel features that cache policies (offload/policy) build on, on the CPU: per-head
// top-k budgets and page flags, causal limits and token probabilities in sparse attention,
// and MoveHeadSlots; each against a naive loop or a hand-computed case, plus the
// enqueue-time validation of the new fields.
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
#include "tests/kernels/cpu/cpu_op_test_util.h"
#include "tests/testutil/chaos_backend.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AttentionCase;
using ::testing::HasSubstr;
using testing::TypedBuffer;

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
    a.shape.num_kv_heads = H;
    a.batch = B;
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
// SparseAttention: query_position, token_prob.

class SparseAttentionPolicyTest : public ::testing::TestWithParam<DType> {};

TEST_P(SparseAttentionPolicyTest, QueryPositionCutsTokensAfterTheQuery) {
  AttentionCase c(GetParam(), 3, 2, 4, 64, 16, 9);
  c.RandomTable(7, 12);
  // Sequence 0 stops mid page 5 (tokens 0..6 of it), sequence 1 at the end of page 3,
  // sequence 2 before every token (all heads empty: zeros and lse = -inf).
  c.qpos = {5 * 16 + 6, 4 * 16 - 1, -1};
  c.RunAndCompare(1e-4, /*with_prob=*/false);
}

TEST_P(SparseAttentionPolicyTest, TokenProbMatchesANaiveSoftmaxAndSumsToOne) {
  // 40 slots on one (sequence, head) pair per batch: split into several chunks and merged.
  AttentionCase c(GetParam(), 2, 1, 2, 32, 8, 40);
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

TEST_P(SparseAttentionPolicyTest, HeadWithNoTokensGetsZeroProbabilities) {
  AttentionCase c(GetParam(), 1, 2, 2, 32, 8, 5);
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
  // Item 2 moves what item 0 just wrote: items run in order.
  const std::vector<HeadSlotMove> items = {{0, 1, 3}, {1, 3, 0}, {0, 3, 5}, {2, 5, 2}};

  // Expected: element-wise moves on copies.
  const size_t es = DTypeSize(t);
  std::vector<unsigned char> ek(k.bytes()), ev(v.bytes());
  std::memcpy(ek.data(), k.data(), ek.size());
  std::memcpy(ev.data(), v.data(), ev.size());
  for (const HeadSlotMove& it : items) {
    for (int32_t tok = 0; tok < p; ++tok) {
      for (int32_t c = 0; c < d; ++c) {
        const auto src = static_cast<size_t>(wl.Offset(int64_t{it.src_slot}, tok, it.kv_head, c));
        const auto dst = static_cast<size_t>(wl.Offset(int64_t{it.dst_slot}, tok, it.kv_head, c));
        std::memcpy(ek.data() + dst * es, ek.data() + src * es, es);
        std::memcpy(ev.data() + dst * es, ev.data() + src * es, es);
      }
    }
  }

  MoveHeadSlotsArgs a;
  a.shape = {.dtype = t, .num_kv_heads = H, .head_dim = d, .page_size = p};
  a.items = items.data();
  a.num_items = static_cast<int32_t>(items.size());
  a.kv = {.k_cache = k.data(), .v_cache = v.data(), .num_slots = slots};
  ThreadPool pool(2);
  ASSERT_TRUE(CpuMoveHeadSlots(a, &pool).ok());
  EXPECT_EQ(std::memcmp(k.data(), ek.data(), ek.size()), 0);
  EXPECT_EQ(std::memcmp(v.data(), ev.data(), ev.size()), 0);

}

INSTANTIATE_TEST_SUITE_P(DTypes, MoveHeadSlotsTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32), DTypeParamName);

TEST(MoveHeadSlotsErrorsTest, SameSlotOrOutOfRangeFailsAndMovesNothing) {
  const int32_t slots = 3, p = 2, H = 2, d = 4;
  std::vector<float> k(static_cast<size_t>(slots * p * H * d)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  const std::vector<float> k_before(k);
  MoveHeadSlotsArgs a;
  a.shape = {.dtype = DType::kF32, .num_kv_heads = H, .head_dim = d, .page_size = p};
  a.kv = {.k_cache = k.data(), .v_cache = v.data(), .num_slots = slots};
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
// Backend dispatch (enqueue-time validation: ops_validation_test.cc).

// MoveHeadSlots runs through every CPU-based backend (the chaos backend forwards it too).
TEST(PolicyOpsBackendTest, MoveRunsOnStreams) {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(std::move(CreateBackend(DeviceKind::kCpu)).value());
  backends.push_back(testing::NewChaosBackend(testing::ChaosOptions{}));
  for (auto& backend : backends) {
    auto stream = std::move(backend->CreateStream()).value();
    const int32_t slots = 2, p = 2, H = 1, d = 2;
    std::vector<float> k = {1, -4, 2, 8, 0, 0, 0, 0}, v = {0.5f, 1, 1, -1, 0, 0, 0, 0};
    const KvShape shape{.dtype = DType::kF32, .num_kv_heads = H, .head_dim = d, .page_size = p};
    const PagedKv kv{.k_cache = k.data(), .v_cache = v.data(), .num_slots = slots};
    const HeadSlotMove move{0, 0, 1};
    const MoveHeadSlotsArgs m{.shape = shape, .kv = kv, .items = &move, .num_items = 1};
    ASSERT_TRUE(backend->MoveHeadSlots(*stream, m).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_EQ(k, (std::vector<float>{1, -4, 2, 8, 1, -4, 2, 8}));
    EXPECT_EQ(v, (std::vector<float>{0.5f, 1, 1, -1, 0.5f, 1, 1, -1}));
  }
}

}  // namespace
}  // namespace kvtier
