// GatherSlabs and ScatterSlabs, the two halves of Recall: together, whole or streamed in
// chunks through two staging buffers ordered by events, they equal Recall bit for bit;
// skip items touch nothing; items out of range fail the stream; shapes are refused early.
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::TypedBuffer;

std::string CaseName(const ::testing::TestParamInfo<KvShape>& info) {
  const KvShape& c = info.param;
  return absl::StrFormat("%s_p%d_d%d_hkv%d", DTypeName(c.dtype), c.page_size, c.head_dim,
                         c.num_kv_heads);
}

// The page shapes: dtype, KV heads, head dim, page size (query heads are not read).
std::vector<KvShape> AllCases() {
  std::vector<KvShape> cases;
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    cases.push_back({.dtype = t, .num_kv_heads = 1, .head_dim = 64, .page_size = 16});
    cases.push_back({.dtype = t, .num_kv_heads = 4, .head_dim = 128, .page_size = 32});
    // Odd rows: no wide copy unit fits.
    cases.push_back({.dtype = t, .num_kv_heads = 2, .head_dim = 5, .page_size = 3});
  }
  return cases;
}

class SlabsTest : public ::testing::TestWithParam<KvShape> {
 protected:
  static constexpr int32_t kHostPages = 7;
  static constexpr int32_t kSlots = 5;  // B·S global slots

  SlabsTest()
      : c_(GetParam()),
        hl_{c_.num_kv_heads, c_.page_size, c_.head_dim},
        wl_{kSlots, c_.page_size, c_.num_kv_heads, c_.head_dim},
        pages_(c_.dtype, kHostPages * hl_.page_elements()),
        k_(c_.dtype, kSlots * wl_.slot_elements()),
        v_(c_.dtype, kSlots * wl_.slot_elements()) {
    pages_.FillNormal(1);
    k_.FillNormal(2);  // rows no item writes must survive unchanged
    v_.FillNormal(3);
    items_ = RandomItems(4);
  }

  void SetUp() override {
    backend_ = std::move(CreateBackend(DeviceKind::kCpu, {.cpu_threads = 2})).value();
    copy_ = std::move(backend_->CreateStream()).value();
    compute_ = std::move(backend_->CreateStream()).value();
  }

  // Distinct (slot, head) targets in random order, random pages; about one item in four
  // is a skip item whose other fields are out of range (skips are never checked).
  std::vector<RecallItem> RandomItems(uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::vector<RecallItem> items;
    for (int32_t s = 0; s < kSlots; ++s) {
      for (int32_t h = 0; h < c_.num_kv_heads; ++h) {
        const int64_t page = static_cast<int64_t>(rng() % kHostPages);
        items.push_back(rng() % 4 == 0 ? RecallItem{kSkipItem, 1000, -7} : RecallItem{page, h, s});
      }
    }
    std::shuffle(items.begin(), items.end(), rng);
    items.resize(items.size() * 3 / 4 + 1);  // some targets keep their old rows
    return items;
  }

  int64_t SlabElements() const { return hl_.slab_elements(); }

  GatherSlabsArgs Gather(const RecallItem* items, int32_t n, void* staging) const {
    GatherSlabsArgs a;
    a.shape = c_;
    a.host_pages = pages_.data();
    a.num_host_pages = kHostPages;
    a.items = items;
    a.num_items = n;
    a.staging = staging;
    return a;
  }

  ScatterSlabsArgs Scatter(const RecallItem* items, int32_t n, const void* staging, TypedBuffer& k,
                           TypedBuffer& v) const {
    ScatterSlabsArgs a;
    a.shape = c_;
    a.staging = staging;
    a.items = items;
    a.num_items = n;
    a.kv = {.k_cache = k.data(), .v_cache = v.data(), .num_slots = kSlots};
    return a;
  }

  // The reference: one Recall of every item into copies of k_ and v_.
  std::pair<TypedBuffer, TypedBuffer> Recalled() const {
    std::pair<TypedBuffer, TypedBuffer> kv(k_, v_);
    RecallArgs a;
    a.shape = c_;
    a.host_pages = pages_.data();
    a.num_host_pages = kHostPages;
    a.items = items_.data();
    a.num_items = static_cast<int32_t>(items_.size());
    a.kv = {.k_cache = kv.first.data(), .v_cache = kv.second.data(), .num_slots = kSlots};
    EXPECT_TRUE(CpuRecall(a, nullptr).ok());
    return kv;
  }

  // Recalls items_ into copies of k_ and v_ in chunks of `m` as a streaming recall does:
  // chunk c is gathered on copy_ into staging[c % 2] while chunk c - 1 is scattered from
  // the other buffer on compute_, ordered by events alone.
  std::pair<TypedBuffer, TypedBuffer> Streamed(int32_t m) {
    std::pair<TypedBuffer, TypedBuffer> kv(k_, v_);
    TypedBuffer staging[2] = {TypedBuffer(c_.dtype, m * SlabElements()),
                              TypedBuffer(c_.dtype, m * SlabElements())};
    std::unique_ptr<Event> gathered[2], scattered[2];
    for (int b = 0; b < 2; ++b) {
      gathered[b] = std::move(backend_->CreateEvent()).value();
      scattered[b] = std::move(backend_->CreateEvent()).value();
    }
    const int32_t total = static_cast<int32_t>(items_.size());
    for (int32_t c = 0; c * m < total; ++c) {
      const int b = c % 2;
      const RecallItem* items = items_.data() + c * m;
      const int32_t n = std::min(m, total - c * m);
      if (c >= 2) {  // staging[b] is free again once chunk c - 2 is scattered
        EXPECT_TRUE(copy_->Wait(*scattered[b]).ok());
      }
      const GatherSlabsArgs g = Gather(items, n, staging[b].data());
      const ScatterSlabsArgs s = Scatter(items, n, staging[b].data(), kv.first, kv.second);
      EXPECT_TRUE(backend_->GatherSlabs(*copy_, g).ok());
      EXPECT_TRUE(copy_->Record(*gathered[b]).ok());
      EXPECT_TRUE(compute_->Wait(*gathered[b]).ok());
      EXPECT_TRUE(backend_->ScatterSlabs(*compute_, s).ok());
      EXPECT_TRUE(compute_->Record(*scattered[b]).ok());
    }
    EXPECT_TRUE(copy_->Synchronize().ok());
    EXPECT_TRUE(compute_->Synchronize().ok());
    return kv;
  }

  static bool SameBits(const TypedBuffer& x, const TypedBuffer& y) {
    return x.bytes() == y.bytes() && std::memcmp(x.data(), y.data(), x.bytes()) == 0;
  }

  const KvShape c_;
  const HostPageLayout hl_;
  const WorkingSetLayout wl_;
  TypedBuffer pages_, k_, v_;
  std::vector<RecallItem> items_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> copy_, compute_;
};

TEST_P(SlabsTest, GatherCopiesWholeSlabsAndLeavesSkippedSlabsAlone) {
  const int32_t n = static_cast<int32_t>(items_.size());
  TypedBuffer staging(c_.dtype, n * SlabElements());
  staging.FillNormal(5);
  const TypedBuffer before = staging;
  ASSERT_TRUE(CpuGatherSlabs(Gather(items_.data(), n, staging.data()), nullptr).ok());
  const size_t slab_bytes = static_cast<size_t>(SlabElements()) * DTypeSize(c_.dtype);
  for (int32_t j = 0; j < n; ++j) {
    const RecallItem& it = items_[static_cast<size_t>(j)];
    const auto* got = static_cast<const unsigned char*>(staging.data()) + j * slab_bytes;
    const auto* want = static_cast<const unsigned char*>(before.data()) + j * slab_bytes;
    if (it.host_page != kSkipItem) {
      const int64_t src = it.host_page * hl_.page_elements() + hl_.SlabOffset(it.kv_head);
      want = static_cast<const unsigned char*>(pages_.data()) + src * DTypeSize(c_.dtype);
    }
    EXPECT_EQ(std::memcmp(got, want, slab_bytes), 0) << "slab " << j;
  }
}

TEST_P(SlabsTest, GatherThenScatterEqualsRecall) {
  const std::pair<TypedBuffer, TypedBuffer> want = Recalled();
  const std::pair<TypedBuffer, TypedBuffer> got = Streamed(static_cast<int32_t>(items_.size()));
  EXPECT_TRUE(SameBits(got.first, want.first)) << "K";
  EXPECT_TRUE(SameBits(got.second, want.second)) << "V";
}

TEST_P(SlabsTest, ChunkedThroughTwoStagingBuffersEqualsRecall) {
  const std::pair<TypedBuffer, TypedBuffer> want = Recalled();
  for (int32_t m : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrFormat("chunks of %d items", m));
    const std::pair<TypedBuffer, TypedBuffer> got = Streamed(m);
    EXPECT_TRUE(SameBits(got.first, want.first)) << "K";
    EXPECT_TRUE(SameBits(got.second, want.second)) << "V";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, SlabsTest, ::testing::ValuesIn(AllCases()), CaseName);

// Data errors fail the stream when the op runs and write nothing; shape errors are refused
// when it is enqueued.
class SlabsErrorTest : public ::testing::Test {
 protected:
  static constexpr int32_t kP = 2, kHkv = 2, kD = 8, kPages = 2, kSlots = 3;
  static constexpr KvShape kShape{
      .dtype = DType::kF32, .num_kv_heads = kHkv, .head_dim = kD, .page_size = kP};

  void SetUp() override {
    backend_ = std::move(CreateBackend(DeviceKind::kCpu)).value();
    stream_ = std::move(backend_->CreateStream()).value();
  }

  GatherSlabsArgs Gather(const std::vector<RecallItem>& items) {
    GatherSlabsArgs a;
    a.shape = kShape;
    a.host_pages = pages_.data();
    a.num_host_pages = kPages;
    a.items = items.data();
    a.num_items = static_cast<int32_t>(items.size());
    a.staging = staging_.data();
    return a;
  }

  ScatterSlabsArgs Scatter(const std::vector<RecallItem>& items) {
    ScatterSlabsArgs a;
    a.shape = kShape;
    a.staging = staging_.data();
    a.items = items.data();
    a.num_items = static_cast<int32_t>(items.size());
    a.kv = {.k_cache = k_.data(), .v_cache = v_.data(), .num_slots = kSlots};
    return a;
  }

  // Runs `enqueue` on a fresh stream and returns the status Synchronize reports.
  template <typename Fn>
  absl::Status Run(Fn enqueue) {
    stream_ = std::move(backend_->CreateStream()).value();
    EXPECT_TRUE(enqueue().ok());
    return stream_->Synchronize();
  }

  static void ExpectOutOfRange(const absl::Status& st, const std::string& text) {
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(text));
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<float> pages_ = std::vector<float>(kPages * kHkv * 2 * kP * kD, 1.0f);
  std::vector<float> staging_ = std::vector<float>(4 * 2 * kP * kD, 0.0f);
  std::vector<float> k_ = std::vector<float>(kSlots * kP * kHkv * kD, 0.0f);
  std::vector<float> v_ = std::vector<float>(kSlots * kP * kHkv * kD, 0.0f);
};

TEST_F(SlabsErrorTest, GatherItemsOutOfRangeFailTheStreamAndWriteNothing) {
  const std::vector<RecallItem> bad_page = {{0, 0, 0}, {kPages, 0, 0}};
  ExpectOutOfRange(Run([&] { return backend_->GatherSlabs(*stream_, Gather(bad_page)); }),
                   "GatherSlabs: items[1].host_page = 2 must be in [0, 2)");
  EXPECT_EQ(staging_[0], 0.0f);  // the valid item was not applied either: all or nothing
  const std::vector<RecallItem> bad_head = {{kSkipItem, 9, 9}, {1, -1, 0}};
  ExpectOutOfRange(Run([&] { return backend_->GatherSlabs(*stream_, Gather(bad_head)); }),
                   "GatherSlabs: items[1].kv_head = -1 must be in [0, 2)");
  // dst_slot is Scatter's business: Gather neither checks nor reads it.
  const std::vector<RecallItem> any_slot = {{1, 1, 99}};
  EXPECT_TRUE(Run([&] { return backend_->GatherSlabs(*stream_, Gather(any_slot)); }).ok());
}

TEST_F(SlabsErrorTest, ScatterItemsOutOfRangeFailTheStreamAndWriteNothing) {
  staging_.assign(staging_.size(), 2.0f);
  const std::vector<RecallItem> bad_slot = {{0, 0, 0}, {0, 1, kSlots}};
  ExpectOutOfRange(Run([&] { return backend_->ScatterSlabs(*stream_, Scatter(bad_slot)); }),
                   "ScatterSlabs: items[1].dst_slot = 3 must be in [0, 3)");
  EXPECT_EQ(k_[0], 0.0f);
  const std::vector<RecallItem> bad_head = {{0, kHkv, 0}};
  ExpectOutOfRange(Run([&] { return backend_->ScatterSlabs(*stream_, Scatter(bad_head)); }),
                   "ScatterSlabs: items[0].kv_head = 2 must be in [0, 2)");
  // Skip items do nothing, however wild their other fields.
  const std::vector<RecallItem> skips = {{kSkipItem, -5, 1 << 30}, {kSkipItem, 0, 0}};
  EXPECT_TRUE(Run([&] { return backend_->ScatterSlabs(*stream_, Scatter(skips)); }).ok());
  EXPECT_EQ(std::count(k_.begin(), k_.end(), 0.0f), static_cast<int64_t>(k_.size()));
}

TEST_F(SlabsErrorTest, ShapesAreRefusedWhenEnqueued) {
  const std::vector<RecallItem> items = {{0, 0, 0}};
  GatherSlabsArgs g = Gather(items);
  g.staging = nullptr;
  EXPECT_THAT(std::string(backend_->GatherSlabs(*stream_, g).message()),
              HasSubstr("GatherSlabs: staging must not be null"));
  g = Gather(items);
  g.num_host_pages = 0;
  EXPECT_THAT(std::string(backend_->GatherSlabs(*stream_, g).message()),
              HasSubstr("GatherSlabs: num_host_pages = 0 must be in [1, "));
  g = Gather(items);
  g.shape.page_size = 0;
  EXPECT_EQ(backend_->GatherSlabs(*stream_, g).code(), absl::StatusCode::kInvalidArgument);
  ScatterSlabsArgs s = Scatter(items);
  s.kv.num_slots = 0;
  EXPECT_THAT(std::string(backend_->ScatterSlabs(*stream_, s).message()),
              HasSubstr("ScatterSlabs: kv.num_slots = 0 must be in [1, "));
  s = Scatter(items);
  s.kv.v_cache = nullptr;
  EXPECT_EQ(backend_->ScatterSlabs(*stream_, s).code(), absl::StatusCode::kInvalidArgument);
  // No items: nothing to run, so no pointer is required.
  g = GatherSlabsArgs();
  g.shape.page_size = g.shape.num_kv_heads = g.shape.head_dim = 1;
  EXPECT_TRUE(backend_->GatherSlabs(*stream_, g).ok());
  s = ScatterSlabsArgs();
  s.shape.page_size = s.shape.num_kv_heads = s.shape.head_dim = 1;
  EXPECT_TRUE(backend_->ScatterSlabs(*stream_, s).ok());
  EXPECT_TRUE(stream_->Synchronize().ok());
}

}  // namespace
}  // namespace kvtier
