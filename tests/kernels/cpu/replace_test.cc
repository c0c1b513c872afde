// Page-cache replacement (Replace), head masks and skip items, alone and as the device-side
// selection pipeline the Retriever runs: ScorePages → TopK → Replace → Recall.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "tests/kernels/cpu/cpu_op_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using ::testing::ElementsAre;
using testing::ScoreArgs;
using testing::SelectArgs;
using testing::TypedBuffer;

// One sequence, Hkv heads, S = 8 slots with the selected region [2, 6).
struct Fixture {
  int32_t Hkv;
  std::vector<int32_t> table, selected, misses;
  std::vector<int64_t> host_page_of;
  std::vector<RecallItem> items;

  explicit Fixture(int32_t heads) : Hkv(heads), table(static_cast<size_t>(heads) * 8, 77),
      selected(static_cast<size_t>(heads) * 4, kEmptySlot), misses(static_cast<size_t>(heads)),
      host_page_of(20), items(static_cast<size_t>(heads) * 4) {
    for (int32_t p = 0; p < 20; ++p) host_page_of[static_cast<size_t>(p)] = 100 + p;
  }
  int32_t* Region(int32_t h) { return table.data() + h * 8 + 2; }
  int32_t* Sel(int32_t h) { return selected.data() + h * 4; }
  ReplaceArgs Args(const uint8_t* mask = nullptr) {
    ReplaceArgs a;
    a.batch = 1;
    a.shape.num_kv_heads = Hkv;
    a.kv = {.num_slots = 8, .slot_table = table.data()};
    a.region_begin = 2;
    a.k = 4;
    a.selected = selected.data();
    a.host_page_of = host_page_of.data();
    a.max_pages = 20;
    a.head_mask = mask;
    a.items = items.data();
    a.num_misses = misses.data();
    return a;
  }
};

bool operator==(const RecallItem& x, const RecallItem& y) {
  return x.host_page == y.host_page && x.kv_head == y.kv_head &&
         (x.host_page == kSkipItem || x.dst_slot == y.dst_slot);
}

TEST(ReplaceTest, HitsKeepTheirSlotsMissesFillFreedSlotsInRankOrder) {
  Fixture f(1);
  std::copy_n(std::vector<int32_t>{5, 7, kEmptySlot, 9}.data(), 4, f.Region(0));
  std::copy_n(std::vector<int32_t>{9, 3, 5, 11}.data(), 4, f.Sel(0));
  ASSERT_TRUE(CpuReplace(f.Args(), nullptr).ok());
  EXPECT_THAT(f.table, ElementsAre(77, 77, 5, 3, 11, 9, 77, 77));  // outside the region: untouched
  EXPECT_EQ(f.misses[0], 2);
  EXPECT_TRUE(f.items[0] == (RecallItem{103, 0, 3}));
  EXPECT_TRUE(f.items[1] == (RecallItem{111, 0, 4}));
  EXPECT_EQ(f.items[2].host_page, kSkipItem);
  EXPECT_EQ(f.items[3].host_page, kSkipItem);
}

TEST(ReplaceTest, ShorterSelectionsEmptyTheRestAndNoMissMeansNoTraffic) {
  Fixture f(1);
  std::copy_n(std::vector<int32_t>{4, 5, 6, 7}.data(), 4, f.Region(0));
  std::copy_n(std::vector<int32_t>{6, kEmptySlot, kEmptySlot, kEmptySlot}.data(), 4, f.Sel(0));
  ASSERT_TRUE(CpuReplace(f.Args(), nullptr).ok());
  EXPECT_THAT(std::vector<int32_t>(f.Region(0), f.Region(0) + 4),
              ElementsAre(kEmptySlot, kEmptySlot, 6, kEmptySlot));
  EXPECT_EQ(f.misses[0], 0);
  for (const RecallItem& it : f.items) EXPECT_EQ(it.host_page, kSkipItem);
}

TEST(ReplaceTest, MaskedOffHeadsAreLeftAloneAndGetOnlySkipItems) {
  Fixture f(2);
  for (int32_t h = 0; h < 2; ++h) {
    std::copy_n(std::vector<int32_t>{1, 2, 3, 4}.data(), 4, f.Region(h));
    std::copy_n(std::vector<int32_t>{10, 11, 12, 13}.data(), 4, f.Sel(h));
  }
  const std::vector<uint8_t> mask = {0, 1};
  ASSERT_TRUE(CpuReplace(f.Args(mask.data()), nullptr).ok());
  EXPECT_THAT(std::vector<int32_t>(f.Region(0), f.Region(0) + 4), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(std::vector<int32_t>(f.Region(1), f.Region(1) + 4), ElementsAre(10, 11, 12, 13));
  EXPECT_EQ(f.misses[0], 0);
  EXPECT_EQ(f.misses[1], 4);
  for (int32_t i = 0; i < 4; ++i) EXPECT_EQ(f.items[static_cast<size_t>(i)].host_page, kSkipItem);
  EXPECT_TRUE(f.items[4] == (RecallItem{110, 1, 8 * 0 + 2 + 0}));
}

TEST(ReplaceTest, DuplicatePagesInACorruptRegionAreEvicted) {
  Fixture f(1);
  std::copy_n(std::vector<int32_t>{5, 5, 5, 5}.data(), 4, f.Region(0));
  std::copy_n(std::vector<int32_t>{5, 6, 7, 8}.data(), 4, f.Sel(0));
  ASSERT_TRUE(CpuReplace(f.Args(), nullptr).ok());
  std::vector<int32_t> region(f.Region(0), f.Region(0) + 4);
  std::sort(region.begin(), region.end());
  EXPECT_THAT(region, ElementsAre(5, 6, 7, 8));
  EXPECT_EQ(f.misses[0], 3);
}

TEST(ReplaceTest, APageWithoutHostCopyFailsBeforeAnythingChanges) {
  Fixture f(1);
  std::copy_n(std::vector<int32_t>{1, 2, 3, 4}.data(), 4, f.Region(0));
  std::copy_n(std::vector<int32_t>{1, 19, kEmptySlot, kEmptySlot}.data(), 4, f.Sel(0));
  f.host_page_of[19] = -1;
  const absl::Status st = CpuReplace(f.Args(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("page 19 has no host page"));
  EXPECT_THAT(std::vector<int32_t>(f.Region(0), f.Region(0) + 4), ElementsAre(1, 2, 3, 4));
}

TEST(HeadMaskTest, ScoreAndTopKTouchOnlyMaskedHeads) {
  const int32_t Hkv = 2, G = 2, d = 16, P = 6, k = 2;
  TypedBuffer q(DType::kF32, Hkv * G * d), sums(DType::kF32, P * Hkv * 2 * d);
  q.FillNormal(1);
  sums.FillNormal(2);
  const int32_t n = P;
  const std::vector<uint8_t> mask = {0, 1};
  std::vector<float> pooled(Hkv * P, 123.0f);
  ScorePagesArgs s =
      ScoreArgs({.dtype = DType::kF32, .num_q_heads = Hkv * G, .num_kv_heads = Hkv, .head_dim = d},
                1, P, q.data(), sums.data(), &n, pooled.data());
  s.head_mask = mask.data();
  ASSERT_TRUE(CpuScorePages(s, nullptr).ok());
  for (int32_t p = 0; p < P; ++p) {
    EXPECT_EQ(pooled[static_cast<size_t>(p)], 123.0f);
    EXPECT_NE(pooled[static_cast<size_t>(P + p)], 123.0f);
  }
  std::vector<int32_t> sel(Hkv * k, 55);
  TopKArgs t = SelectArgs(Hkv, 1, P, k, pooled.data(), &n, sel.data());
  t.head_mask = mask.data();
  ASSERT_TRUE(CpuTopK(t, nullptr).ok());
  EXPECT_THAT(std::vector<int32_t>(sel.begin(), sel.begin() + k), ElementsAre(55, 55));
  EXPECT_NE(sel[2], 55);
}

// Steps of drifting queries through the whole device-side pipeline on the CPU backend:
// after each step every head's region holds exactly its top-k, every slot's K/V equals its
// host page's slab bit for bit, and the recall traffic equals the selection's churn.
TEST(SelectionPipelineTest, WorkingSetFollowsTheSelectionWithChurnOnlyTraffic) {
  const int32_t Hkv = 2, G = 4, Hq = Hkv * G, d = 64, p = 16, P = 40, k = 6, sink = 2, recent = 3;
  const int32_t S = sink + k + recent, region = sink;
  const KvShape shape{DType::kF16, Hq, Hkv, d, p};
  auto backend = std::move(CreateBackend(DeviceKind::kCpu, {.cpu_threads = 2})).value();
  auto stream = std::move(backend->CreateStream()).value();
  // Host tier: P pages (host page of logical page i = P - 1 - i, to catch mix-ups).
  TypedBuffer host(DType::kF16, int64_t{P} * Hkv * 2 * p * d), sums(DType::kF16, int64_t{P} * Hkv * 2 * d);
  host.FillNormal(3);
  sums.FillNormal(4);
  std::vector<int64_t> host_page_of(P);
  for (int32_t i = 0; i < P; ++i) host_page_of[static_cast<size_t>(i)] = P - 1 - i;
  TypedBuffer wk(DType::kF16, int64_t{S} * p * Hkv * d), wv(DType::kF16, int64_t{S} * p * Hkv * d);
  std::vector<int32_t> table(static_cast<size_t>(Hkv * S), kEmptySlot), sel(Hkv * k), misses(Hkv);
  std::vector<float> pooled(Hkv * P);
  std::vector<RecallItem> items(Hkv * k);
  const int32_t num_pages = P;
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> qf(Hq * d);
  for (auto& x : qf) x = normal(rng);
  TypedBuffer q(DType::kF16, Hq * d);
  std::vector<std::set<int32_t>> prev(Hkv);
  int64_t total_churn = 0, total_items = 0;
  for (int32_t step = 0; step < 30; ++step) {
    for (auto& x : qf) x = 0.8f * x + 0.6f * normal(rng);  // AR(1): the selection drifts
    for (int32_t i = 0; i < Hq * d; ++i) q.Set(i, qf[static_cast<size_t>(i)]);
    ScorePagesArgs s = ScoreArgs(shape, 1, P, q.data(), sums.data(), &num_pages, pooled.data());
    s.softmax_scale = 0.125f;
    ASSERT_TRUE(backend->ScorePages(*stream, s).ok());
    TopKArgs t = SelectArgs(Hkv, 1, P, k, pooled.data(), &num_pages, sel.data());
    t.sink_pages = sink;
    t.recent_pages = recent;
    ASSERT_TRUE(backend->TopK(*stream, t).ok());
    ReplaceArgs r;
    r.shape = shape;
    r.batch = 1;
    r.kv = {.num_slots = S, .slot_table = table.data()};
    r.region_begin = region;
    r.k = k;
    r.selected = sel.data();
    r.host_page_of = host_page_of.data();
    r.max_pages = P;
    r.items = items.data();
    r.num_misses = misses.data();
    ASSERT_TRUE(backend->Replace(*stream, r).ok());
    RecallArgs ra;
    ra.shape = shape;
    ra.host_pages = host.data();
    ra.num_host_pages = P;
    ra.items = items.data();
    ra.num_items = Hkv * k;
    ra.kv = {.k_cache = wk.data(), .v_cache = wv.data(), .num_slots = S};
    ASSERT_TRUE(backend->Recall(*stream, ra).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    for (int32_t h = 0; h < Hkv; ++h) {
      const std::set<int32_t> want(sel.begin() + h * k, sel.begin() + (h + 1) * k);
      const std::set<int32_t> got(table.begin() + h * S + region, table.begin() + h * S + region + k);
      ASSERT_EQ(got, want) << "step " << step << " head " << h;
      int32_t churn = 0;
      for (int32_t page : want) churn += prev[static_cast<size_t>(h)].count(page) ? 0 : 1;
      EXPECT_EQ(misses[static_cast<size_t>(h)], churn) << "step " << step;
      total_churn += churn;
      prev[static_cast<size_t>(h)] = want;
      for (int32_t slot = region; slot < region + k; ++slot) {
        const int32_t page = table[static_cast<size_t>(h * S + slot)];
        const HostPageLayout hl{Hkv, p, d};
        const WorkingSetLayout wl{S, p, Hkv, d};
        const int64_t base = host_page_of[static_cast<size_t>(page)] * hl.page_elements();
        for (int32_t tok = 0; tok < p; ++tok) {
          ASSERT_EQ(std::memcmp(static_cast<const Half*>(wk.data()) + wl.Offset(int64_t{slot}, tok, h, 0),
                                static_cast<const Half*>(host.data()) + base + hl.Offset(h, kKey, tok, 0), d * 2), 0);
          ASSERT_EQ(std::memcmp(static_cast<const Half*>(wv.data()) + wl.Offset(int64_t{slot}, tok, h, 0),
                                static_cast<const Half*>(host.data()) + base + hl.Offset(h, kValue, tok, 0), d * 2), 0);
        }
      }
    }
    for (const RecallItem& it : items) total_items += it.host_page == kSkipItem ? 0 : 1;
  }
  EXPECT_EQ(total_items, total_churn);
  EXPECT_LT(total_churn, int64_t{30} * Hkv * k);  // later steps reuse resident pages
}

}  // namespace
}  // namespace kvtier
