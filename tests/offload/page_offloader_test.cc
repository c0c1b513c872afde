#include "offload/page_offloader.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/layout.h"
#include "offload/host_arena.h"
#include "tests/testutil/random_fill.h"
#include "tests/testutil/assert_ok.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::TypedBuffer;

TEST(PlanOffloadTest, ZipsTheThreeListsIntoItems) {
  const std::vector<int64_t> src = {5, 1, 2};
  const std::vector<int64_t> host = {0, 7, 3};
  const std::vector<int64_t> summary = {3, 0, 9};
  absl::StatusOr<std::vector<OffloadItem>> items = PlanOffload(src, host, summary);
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*items)[i].src_slot, src[i]);
    EXPECT_EQ((*items)[i].host_page, host[i]);
    EXPECT_EQ((*items)[i].summary_page, summary[i]);
  }
  EXPECT_TRUE(PlanOffload({}, {}, {})->empty());
}

TEST(PlanOffloadTest, RejectsUnequalListsAndNegativeIndices) {
  const std::vector<int64_t> two = {0, 1};
  const std::vector<int64_t> three = {0, 1, 2};
  const std::vector<int64_t> negative = {0, -1};
  EXPECT_EQ(PlanOffload(two, three, two).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanOffload(two, two, three).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanOffload(negative, two, two).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanOffload(two, negative, two).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanOffload(two, two, negative).status().code(), absl::StatusCode::kInvalidArgument);
}

// A CPU backend, a registered arena of `pool_pages` host pages with its pool and offloader,
// and an NHD source of `src_slots` random slots in backend memory.
class OffloadFixture {
 public:
  static constexpr int64_t kSrcSlots = 6;
  static constexpr int64_t kSummaryPages = 16;

  absl::Status Init(const Geometry& geometry, int64_t pool_pages) {
    geometry_ = geometry;
    KVTIER_RETURN_IF_ERROR(geometry.Validate());
    backend_ = NewCpuBackend(2);
    KVTIER_ASSIGN_OR_RETURN(stream_, backend_->CreateStream());
    ArenaOptions options;
    options.bytes = static_cast<size_t>(pool_pages) * geometry.host_page_bytes();
    options.hugepages = HugePages::kOff;
    options.name = "kvtier-offloader-test";
    KVTIER_ASSIGN_OR_RETURN(arena_, HostArena::Create(options));
    KVTIER_RETURN_IF_ERROR(arena_->RegisterWith(*backend_));
    KVTIER_ASSIGN_OR_RETURN(
        pool_, PagePool::Create(arena_->data(), geometry.host_page_bytes(), pool_pages));
    KVTIER_ASSIGN_OR_RETURN(offloader_, PageOffloader::Create(geometry, *backend_, *pool_));
    table_ = std::make_unique<PageTable>(*pool_);
    return MakeSources();
  }

  OffloadRequest Request(const std::vector<int64_t>& logical, const std::vector<int64_t>& src) {
    logical_ = logical;
    src_ = src;
    OffloadRequest r;
    r.k_src = k_dev_.data();
    r.v_src = v_dev_.data();
    r.num_src_slots = kSrcSlots;
    r.summaries = summaries_dev_.data();
    r.num_summary_pages = kSummaryPages;
    r.summary_mode = SummaryMode::kMinMax;
    r.logical_pages = logical_;
    r.src_slots = src_;
    return r;
  }

  // Copies `bytes` of backend memory into `out` and waits.
  absl::Status Download(const DeviceBuffer& buffer, void* out, size_t bytes) {
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*stream_, out, buffer.data(), bytes));
    return stream_->Synchronize();
  }

  absl::StatusOr<DeviceBuffer> Upload(const void* data, size_t bytes) {
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer buffer, backend_->Allocate(bytes));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*stream_, buffer.data(), data, bytes));
    KVTIER_RETURN_IF_ERROR(stream_->Synchronize());
    return buffer;
  }

  int64_t SlotElements() const {
    return int64_t{geometry_.page_size} * geometry_.num_kv_heads * geometry_.head_dim;
  }

  Geometry geometry_;
  // Declaration order is destruction order in reverse: the backend outlives everything.
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<PageOffloader> offloader_;
  std::unique_ptr<PageTable> table_;
  std::unique_ptr<TypedBuffer> k_host_;
  std::unique_ptr<TypedBuffer> v_host_;
  DeviceBuffer k_dev_;
  DeviceBuffer v_dev_;
  DeviceBuffer summaries_dev_;
  std::vector<int64_t> logical_;
  std::vector<int64_t> src_;

 private:
  absl::Status MakeSources() {
    k_host_ = std::make_unique<TypedBuffer>(geometry_.dtype, kSrcSlots * SlotElements());
    v_host_ = std::make_unique<TypedBuffer>(geometry_.dtype, kSrcSlots * SlotElements());
    k_host_->FillNormal(1234);
    v_host_->FillNormal(5678);
    KVTIER_ASSIGN_OR_RETURN(k_dev_, Upload(k_host_->data(), k_host_->bytes()));
    KVTIER_ASSIGN_OR_RETURN(v_dev_, Upload(v_host_->data(), v_host_->bytes()));
    const size_t summary_bytes = kSummaryPages * geometry_.summary_bytes();
    KVTIER_ASSIGN_OR_RETURN(summaries_dev_, backend_->Allocate(summary_bytes));
    KVTIER_RETURN_IF_ERROR(backend_->Memset(*stream_, summaries_dev_.data(), 0, summary_bytes));
    return stream_->Synchronize();
  }
};

using OffloadParam = std::tuple<DType, int32_t, int32_t>;  // dtype, page size, head dim

class PageOffloaderTest : public ::testing::TestWithParam<OffloadParam> {
 protected:
  void SetUp() override {
    Geometry g;
    g.num_layers = 1;
    g.num_q_heads = 4;
    g.num_kv_heads = 2;
    g.dtype = std::get<0>(GetParam());
    g.page_size = std::get<1>(GetParam());
    g.head_dim = std::get<2>(GetParam());
    ASSERT_OK(f_.Init(g, /*pool_pages=*/8));
  }

  const Geometry& g() const { return f_.geometry_; }
  size_t elem() const { return g().element_bytes(); }

  // Byte-compares one element of two arrays of the geometry's dtype.
  bool SameElement(const void* a, int64_t ia, const void* b, int64_t ib) const {
    return std::memcmp(static_cast<const char*>(a) + ia * elem(),
                       static_cast<const char*>(b) + ib * elem(), elem()) == 0;
  }

  OffloadFixture f_;
};

// The logical pages offloaded by the tests below, and the NHD slots they come from.
const std::vector<int64_t> kLogical = {3, 0, 7, 4};
const std::vector<int64_t> kSrc = {5, 1, 2, 0};

TEST_P(PageOffloaderTest, HostPagesHoldTheSourceInHndOrder) {
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request(kLogical, kSrc)));
  ASSERT_OK(f_.stream_->Synchronize());
  ASSERT_EQ(f_.table_->size(), kLogical.size());
  const HostPageLayout host{g().num_kv_heads, g().page_size, g().head_dim};
  const WorkingSetLayout nhd{static_cast<int32_t>(OffloadFixture::kSrcSlots), g().page_size,
                             g().num_kv_heads, g().head_dim};
  for (size_t i = 0; i < kLogical.size(); ++i) {
    absl::StatusOr<PageEntry> entry = f_.table_->Lookup(kLogical[i]);
    ASSERT_TRUE(entry.ok()) << entry.status();
    ASSERT_TRUE(f_.table_->IsCurrent(*entry));
    const void* page = f_.pool_->SlotData(entry->slot);
    int mismatches = 0;
    for (int32_t h = 0; h < g().num_kv_heads; ++h) {
      for (int32_t t = 0; t < g().page_size; ++t) {
        for (int32_t d = 0; d < g().head_dim; ++d) {
          const int64_t src = nhd.Offset(kSrc[i], t, h, d);
          mismatches += !SameElement(page, host.Offset(h, kKey, t, d), f_.k_host_->data(), src);
          mismatches += !SameElement(page, host.Offset(h, kValue, t, d), f_.v_host_->data(), src);
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << "logical page " << kLogical[i];
  }
}

TEST_P(PageOffloaderTest, MinMaxSummariesAreTheKeyBounds) {
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request(kLogical, kSrc)));
  TypedBuffer summaries(g().dtype, OffloadFixture::kSummaryPages *
                                       static_cast<int64_t>(g().summary_bytes() / elem()));
  ASSERT_OK(f_.Download(f_.summaries_dev_, summaries.data(), summaries.bytes()));
  const SummaryLayout layout{g().num_kv_heads, g().head_dim};
  const WorkingSetLayout nhd{static_cast<int32_t>(OffloadFixture::kSrcSlots), g().page_size,
                             g().num_kv_heads, g().head_dim};
  for (size_t i = 0; i < kLogical.size(); ++i) {
    for (int32_t h = 0; h < g().num_kv_heads; ++h) {
      for (int32_t d = 0; d < g().head_dim; ++d) {
        const float hi = summaries.Get(layout.Offset(kLogical[i], h, kHi, d));
        const float lo = summaries.Get(layout.Offset(kLogical[i], h, kLo, d));
        float max_key = -1e30f;
        float min_key = 1e30f;
        for (int32_t t = 0; t < g().page_size; ++t) {
          const float key = f_.k_host_->Get(nhd.Offset(kSrc[i], t, h, d));
          ASSERT_LE(key, hi) << "page " << kLogical[i] << " head " << h << " dim " << d;
          ASSERT_GE(key, lo) << "page " << kLogical[i] << " head " << h << " dim " << d;
          max_key = std::max(max_key, key);
          min_key = std::min(min_key, key);
        }
        ASSERT_EQ(hi, max_key) << "page " << kLogical[i] << " head " << h << " dim " << d;
        ASSERT_EQ(lo, min_key) << "page " << kLogical[i] << " head " << h << " dim " << d;
      }
    }
  }
  // Summary pages that were not offloaded stay untouched (zero).
  for (int64_t e = 0; e < layout.page_elements(); ++e) {
    ASSERT_EQ(summaries.Get(layout.Offset(1, 0, kHi, 0) + e), 0.0f);
  }
}

TEST_P(PageOffloaderTest, RecallRestoresTheSourceBitExact) {
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request(kLogical, kSrc)));
  // Recall every (page, head) into a 4-slot working set, heads of one page in different
  // slots, as the per-head slot tables allow.
  constexpr int32_t kSlots = 4;
  std::vector<RecallItem> items;
  for (size_t i = 0; i < kLogical.size(); ++i) {
    const PageEntry entry = *f_.table_->Lookup(kLogical[i]);
    for (int32_t h = 0; h < g().num_kv_heads; ++h) {
      items.push_back(RecallItem{entry.slot, h, static_cast<int32_t>((i + h) % kSlots)});
    }
  }
  absl::StatusOr<DeviceBuffer> items_dev =
      f_.Upload(items.data(), items.size() * sizeof(RecallItem));
  ASSERT_TRUE(items_dev.ok()) << items_dev.status();
  const size_t cache_bytes = kSlots * f_.SlotElements() * elem();
  absl::StatusOr<DeviceBuffer> k_cache = f_.backend_->Allocate(cache_bytes);
  absl::StatusOr<DeviceBuffer> v_cache = f_.backend_->Allocate(cache_bytes);
  ASSERT_TRUE(k_cache.ok() && v_cache.ok());
  RecallArgs a;
  a.shape = KvShapeOf(g());
  a.host_pages = f_.pool_->base();
  a.num_host_pages = f_.pool_->num_slots();
  a.items = items_dev->as<const RecallItem>();
  a.num_items = static_cast<int32_t>(items.size());
  a.kv.k_cache = k_cache->data();
  a.kv.v_cache = v_cache->data();
  a.kv.num_slots = kSlots;
  ASSERT_OK(f_.backend_->Recall(*f_.stream_, a));
  TypedBuffer k_out(g().dtype, kSlots * f_.SlotElements());
  TypedBuffer v_out(g().dtype, kSlots * f_.SlotElements());
  ASSERT_OK(f_.Download(*k_cache, k_out.data(), cache_bytes));
  ASSERT_OK(f_.Download(*v_cache, v_out.data(), cache_bytes));

  const WorkingSetLayout src{static_cast<int32_t>(OffloadFixture::kSrcSlots), g().page_size,
                             g().num_kv_heads, g().head_dim};
  const WorkingSetLayout dst{kSlots, g().page_size, g().num_kv_heads, g().head_dim};
  // The (dst_slot, kv_head) pairs are distinct, so every item's data must be there.
  for (size_t n = 0; n < items.size(); ++n) {
    const RecallItem& item = items[n];
    const int64_t src_slot = kSrc[n / static_cast<size_t>(g().num_kv_heads)];
    int mismatches = 0;
    for (int32_t t = 0; t < g().page_size; ++t) {
      for (int32_t d = 0; d < g().head_dim; ++d) {
        const int64_t from = src.Offset(src_slot, t, item.kv_head, d);
        const int64_t to = dst.Offset(item.dst_slot, t, item.kv_head, d);
        mismatches += !SameElement(k_out.data(), to, f_.k_host_->data(), from);
        mismatches += !SameElement(v_out.data(), to, f_.v_host_->data(), from);
      }
    }
    EXPECT_EQ(mismatches, 0) << "item " << n;
  }
}

std::string ParamName(const ::testing::TestParamInfo<OffloadParam>& info) {
  return absl::StrCat(std::string(DTypeName(std::get<0>(info.param))), "_p",
                      std::get<1>(info.param), "_d", std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Shapes, PageOffloaderTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16,
                                                              DType::kF32),
                                            ::testing::Values(16, 32), ::testing::Values(64, 128)),
                         ParamName);

// Failures that must leave the page table and the pool as they were.
class PageOffloaderRollbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Geometry g;
    g.num_layers = 1;
    g.num_q_heads = 2;
    g.num_kv_heads = 1;
    g.head_dim = 64;
    g.page_size = 16;
    ASSERT_OK(f_.Init(g, /*pool_pages=*/4));
  }

  void ExpectUnchanged(size_t table_size) {
    EXPECT_EQ(f_.table_->size(), table_size);
    EXPECT_EQ(f_.pool_->stats().in_use, static_cast<int64_t>(table_size));
  }

  OffloadFixture f_;
};

TEST_F(PageOffloaderRollbackTest, PoolExhaustionInsertsNothing) {
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request({9}, {0})));
  const absl::Status s =
      f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request({0, 1, 2, 3}, {0, 1, 2, 3}));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("page pool exhausted: all 4 slots"));
  EXPECT_THAT(s.message(), HasSubstr("after 3 allocated"));
  ExpectUnchanged(1);
  for (int64_t logical : {0, 1, 2, 3}) EXPECT_FALSE(f_.table_->Contains(logical));
  // The slots came back: the three pages fit now.
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request({0, 1, 2}, {0, 1, 2})));
  ExpectUnchanged(4);
  ASSERT_OK(f_.offloader_->Drain());
  EXPECT_EQ(f_.offloader_->in_flight(), 0u);
  ASSERT_OK(f_.stream_->Synchronize());
}

TEST_F(PageOffloaderRollbackTest, BadRequestsInsertNothing) {
  ASSERT_OK(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request({9}, {0})));
  struct Case {
    std::vector<int64_t> logical;
    std::vector<int64_t> src;
    absl::StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {{1, 9}, {0, 1}, absl::StatusCode::kFailedPrecondition, "already in the host page table"},
      {{1, 1}, {0, 1}, absl::StatusCode::kInvalidArgument, "appears twice"},
      {{1, 2},
       {0, OffloadFixture::kSrcSlots},
       absl::StatusCode::kInvalidArgument,
       "source slot 6 out of range"},
      {{1, OffloadFixture::kSummaryPages},
       {0, 1},
       absl::StatusCode::kInvalidArgument,
       "logical page 16 out of range"},
      {{-1}, {0}, absl::StatusCode::kInvalidArgument, "logical page -1 out of range"},
      {{1, 2}, {0}, absl::StatusCode::kInvalidArgument, "must be equal"},
  };
  for (const Case& c : cases) {
    const absl::Status s =
        f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request(c.logical, c.src));
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
    ExpectUnchanged(1);
  }
  OffloadRequest no_buffers = f_.Request({1}, {0});
  no_buffers.summaries = nullptr;
  EXPECT_EQ(f_.offloader_->Offload(*f_.stream_, *f_.table_, no_buffers).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUnchanged(1);
  EXPECT_TRUE(f_.offloader_->Offload(*f_.stream_, *f_.table_, f_.Request({}, {})).ok());
  ExpectUnchanged(1);
  ASSERT_OK(f_.stream_->Synchronize());
}

TEST_F(PageOffloaderRollbackTest, TableOfAnotherPoolIsRejected) {
  absl::StatusOr<std::unique_ptr<PagePool>> other =
      PagePool::Create(f_.arena_->data(), f_.geometry_.host_page_bytes(), 1);
  ASSERT_TRUE(other.ok());
  PageTable foreign(**other);
  const absl::Status s = f_.offloader_->Offload(*f_.stream_, foreign, f_.Request({0}, {0}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("another page pool"));
  EXPECT_EQ(foreign.size(), 0u);
  ExpectUnchanged(0);
}

TEST_F(PageOffloaderRollbackTest, PoolStrideMustEqualTheHostPageSize) {
  absl::StatusOr<std::unique_ptr<PagePool>> wide =
      PagePool::Create(f_.arena_->data(), f_.geometry_.host_page_bytes() + 1, 1);
  ASSERT_TRUE(wide.ok());
  absl::StatusOr<std::unique_ptr<PageOffloader>> offloader =
      PageOffloader::Create(f_.geometry_, *f_.backend_, **wide);
  EXPECT_EQ(offloader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(offloader.status().message(), HasSubstr("stride"));
}

}  // namespace
}  // namespace kvtier
