// The CUDA copy kernels (Recall, GatherSlabs + ScatterSlabs, Offload) against the CPU
// reference (kernels/cpu/cpu_ops.h): bit-exact over dtype × page size × head dim × KV heads,
// reading (Recall, GatherSlabs) or writing (Offload) host pages in device memory or in
// registered host memory (zero-copy); and the sticky, sequence-exact reporting of items out
// of range. Skips itself without a device.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kvtier/layout.h"
#include "tests/kernels/cuda/cuda_test_util.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::AlignedHostBuffer;
using testing::FirstDifference;
using testing::ScopedRegistration;
using testing::TypedBuffer;

struct CopyCase {
  DType dtype;
  int32_t page_size;
  int32_t head_dim;
  int32_t kv_heads;
  bool zero_copy;  // host pages in registered host memory instead of device memory
};

std::string CaseName(const ::testing::TestParamInfo<CopyCase>& info) {
  const CopyCase& c = info.param;
  return absl::StrFormat("%s_p%d_d%d_hkv%d_%s", DTypeName(c.dtype), c.page_size, c.head_dim,
                         c.kv_heads, c.zero_copy ? "zerocopy" : "device");
}

std::vector<CopyCase> AllCases() {
  std::vector<CopyCase> cases;
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (int32_t p : {16, 32}) {
      for (int32_t d : {64, 128}) {
        for (int32_t h : {1, 8}) {
          for (bool zero_copy : {false, true}) cases.push_back({t, p, d, h, zero_copy});
        }
      }
    }
  }
  return cases;
}

class CudaCopyOpsTest : public testing::CudaTestBase<::testing::TestWithParam<CopyCase>> {
 protected:
  // Host pages (or summaries) where the op under test reads or writes them: registered
  // host memory for zero-copy cases, else a device copy. `host` must outlive the result.
  struct Placed {
    std::unique_ptr<ScopedRegistration> registration;
    DeviceBuffer device;
    void* data = nullptr;
  };
  Placed Place(AlignedHostBuffer& host) {
    Placed placed;
    if (GetParam().zero_copy) {
      placed.registration =
          std::make_unique<ScopedRegistration>(*backend_, host.data(), host.bytes());
      EXPECT_TRUE(placed.registration->status().ok()) << placed.registration->status();
      placed.data = host.data();
    } else {
      absl::StatusOr<DeviceBuffer> device = Upload(host.data(), host.bytes());
      EXPECT_TRUE(device.ok()) << device.status();
      if (device.ok()) placed.device = *std::move(device);
      placed.data = placed.device.data();
    }
    return placed;
  }

  static AlignedHostBuffer ToAligned(const TypedBuffer& b) {
    AlignedHostBuffer out(b.bytes());
    std::memcpy(out.data(), b.data(), b.bytes());
    return out;
  }
};

TEST_P(CudaCopyOpsTest, RecallMatchesCpuBitForBit) {
  const CopyCase c = GetParam();
  const HostPageLayout hl{c.kv_heads, c.page_size, c.head_dim};
  const WorkingSetLayout wl{1, c.page_size, c.kv_heads, c.head_dim};
  constexpr int32_t kHostPages = 5;
  constexpr int32_t kSlots = 6;  // B·S global slots
  TypedBuffer pages(c.dtype, kHostPages * hl.page_elements());
  TypedBuffer k(c.dtype, kSlots * wl.slot_elements());
  TypedBuffer v(c.dtype, kSlots * wl.slot_elements());
  pages.FillNormal(1);
  k.FillNormal(2);  // rows no item writes must survive unchanged
  v.FillNormal(3);
  // Distinct (slot, head) targets, some left alone, pages reused across items.
  std::vector<RecallItem> items;
  for (int32_t s = 0; s < kSlots; ++s) {
    for (int32_t h = 0; h < c.kv_heads; ++h) {
      if ((s + h) % 3 != 0) items.push_back({(3 * s + 5 * h + 1) % kHostPages, h, s});
    }
  }
  if (items.empty()) items.push_back({4, 0, 0});

  RecallArgs a;
  a.dtype = c.dtype;
  a.page_size = c.page_size;
  a.num_kv_heads = c.kv_heads;
  a.head_dim = c.head_dim;
  a.num_host_pages = kHostPages;
  a.num_items = static_cast<int32_t>(items.size());
  a.num_slots = kSlots;

  TypedBuffer want_k = k, want_v = v;
  RecallArgs cpu = a;
  cpu.host_pages = pages.data();
  cpu.items = items.data();
  cpu.k_cache = want_k.data();
  cpu.v_cache = want_v.data();
  KVTIER_ASSERT_OK(CpuRecall(cpu, nullptr));

  AlignedHostBuffer host_pages = ToAligned(pages);
  Placed placed = Place(host_pages);
  auto items_d = Upload(items.data(), items.size() * sizeof(RecallItem));
  auto k_d = Upload(k.data(), k.bytes());
  auto v_d = Upload(v.data(), v.bytes());
  ASSERT_TRUE(items_d.ok() && k_d.ok() && v_d.ok() && placed.data != nullptr);
  RecallArgs gpu = a;
  gpu.host_pages = placed.data;
  gpu.items = items_d->as<RecallItem>();
  gpu.k_cache = k_d->data();
  gpu.v_cache = v_d->data();
  KVTIER_ASSERT_OK(backend_->Recall(*stream_, gpu));
  TypedBuffer got_k(c.dtype, k.size()), got_v(c.dtype, v.size());
  KVTIER_ASSERT_OK(Download(got_k.data(), k_d->data(), k.bytes()));
  KVTIER_ASSERT_OK(Download(got_v.data(), v_d->data(), v.bytes()));
  const size_t elem = DTypeSize(c.dtype);
  EXPECT_EQ(FirstDifference(got_k.data(), want_k.data(), k.bytes(), elem), -1) << "K";
  EXPECT_EQ(FirstDifference(got_v.data(), want_v.data(), v.bytes(), elem), -1) << "V";
}

// GatherSlabs into device staging, then ScatterSlabs into the working set: the staging
// matches CpuGatherSlabs (skipped slabs untouched) and the result matches CpuRecall, whole
// and streamed in chunks through two staging buffers on two streams ordered by events.
TEST_P(CudaCopyOpsTest, GatherScatterSlabsMatchCpuBitForBit) {
  const CopyCase c = GetParam();
  const HostPageLayout hl{c.kv_heads, c.page_size, c.head_dim};
  const WorkingSetLayout wl{1, c.page_size, c.kv_heads, c.head_dim};
  constexpr int32_t kHostPages = 5;
  constexpr int32_t kSlots = 6;  // B·S global slots
  TypedBuffer pages(c.dtype, kHostPages * hl.page_elements());
  TypedBuffer k(c.dtype, kSlots * wl.slot_elements());
  TypedBuffer v(c.dtype, kSlots * wl.slot_elements());
  pages.FillNormal(11);
  k.FillNormal(12);
  v.FillNormal(13);
  // Distinct (slot, head) targets, every fourth a skip item with wild fields.
  std::vector<RecallItem> items;
  for (int32_t s = 0; s < kSlots; ++s) {
    for (int32_t h = 0; h < c.kv_heads; ++h) {
      if ((s + h) % 4 == 1) {
        items.push_back({kSkipItem, 1000, -7});
      } else if ((s + h) % 3 != 0) {
        items.push_back({(3 * s + 5 * h + 1) % kHostPages, h, s});
      }
    }
  }
  const int32_t n = static_cast<int32_t>(items.size());
  const int64_t slab = hl.slab_elements();
  TypedBuffer staging(c.dtype, n * slab);
  staging.FillNormal(14);

  GatherSlabsArgs g;
  g.dtype = c.dtype;
  g.page_size = c.page_size;
  g.num_kv_heads = c.kv_heads;
  g.head_dim = c.head_dim;
  g.num_host_pages = kHostPages;
  ScatterSlabsArgs sc;
  sc.dtype = c.dtype;
  sc.page_size = c.page_size;
  sc.num_kv_heads = c.kv_heads;
  sc.head_dim = c.head_dim;
  sc.num_slots = kSlots;

  TypedBuffer want_staging = staging, want_k = k, want_v = v;
  GatherSlabsArgs cpu_g = g;
  cpu_g.host_pages = pages.data();
  cpu_g.items = items.data();
  cpu_g.num_items = n;
  cpu_g.staging = want_staging.data();
  KVTIER_ASSERT_OK(CpuGatherSlabs(cpu_g, nullptr));
  RecallArgs cpu_r;
  cpu_r.dtype = c.dtype;
  cpu_r.page_size = c.page_size;
  cpu_r.num_kv_heads = c.kv_heads;
  cpu_r.head_dim = c.head_dim;
  cpu_r.host_pages = pages.data();
  cpu_r.num_host_pages = kHostPages;
  cpu_r.items = items.data();
  cpu_r.num_items = n;
  cpu_r.k_cache = want_k.data();
  cpu_r.v_cache = want_v.data();
  cpu_r.num_slots = kSlots;
  KVTIER_ASSERT_OK(CpuRecall(cpu_r, nullptr));

  AlignedHostBuffer host_pages = ToAligned(pages);
  Placed placed = Place(host_pages);
  auto items_d = Upload(items.data(), items.size() * sizeof(RecallItem));
  ASSERT_TRUE(items_d.ok() && placed.data != nullptr);
  g.host_pages = placed.data;
  const size_t elem = DTypeSize(c.dtype);

  // Whole: one gather, one scatter, on one stream.
  {
    auto staging_d = Upload(staging.data(), staging.bytes());
    auto k_d = Upload(k.data(), k.bytes());
    auto v_d = Upload(v.data(), v.bytes());
    ASSERT_TRUE(staging_d.ok() && k_d.ok() && v_d.ok());
    GatherSlabsArgs gpu_g = g;
    gpu_g.items = items_d->as<RecallItem>();
    gpu_g.num_items = n;
    gpu_g.staging = staging_d->data();
    ScatterSlabsArgs gpu_s = sc;
    gpu_s.staging = staging_d->data();
    gpu_s.items = items_d->as<RecallItem>();
    gpu_s.num_items = n;
    gpu_s.k_cache = k_d->data();
    gpu_s.v_cache = v_d->data();
    KVTIER_ASSERT_OK(backend_->GatherSlabs(*stream_, gpu_g));
    KVTIER_ASSERT_OK(backend_->ScatterSlabs(*stream_, gpu_s));
    TypedBuffer got_staging(c.dtype, staging.size()), got_k(c.dtype, k.size()),
        got_v(c.dtype, v.size());
    KVTIER_ASSERT_OK(Download(got_staging.data(), staging_d->data(), staging.bytes()));
    KVTIER_ASSERT_OK(Download(got_k.data(), k_d->data(), k.bytes()));
    KVTIER_ASSERT_OK(Download(got_v.data(), v_d->data(), v.bytes()));
    EXPECT_EQ(FirstDifference(got_staging.data(), want_staging.data(), staging.bytes(), elem), -1)
        << "staging";
    EXPECT_EQ(FirstDifference(got_k.data(), want_k.data(), k.bytes(), elem), -1) << "K";
    EXPECT_EQ(FirstDifference(got_v.data(), want_v.data(), v.bytes(), elem), -1) << "V";
  }

  // Streamed: chunk j gathered on stream_ into buffer j % 2 while chunk j - 1 is scattered
  // from the other on `compute`.
  constexpr int32_t kChunk = 3;
  auto compute = backend_->CreateStream();
  auto buf0 = backend_->Allocate(kChunk * slab * elem);
  auto buf1 = backend_->Allocate(kChunk * slab * elem);
  auto k_d = Upload(k.data(), k.bytes());
  auto v_d = Upload(v.data(), v.bytes());
  ASSERT_TRUE(compute.ok() && buf0.ok() && buf1.ok() && k_d.ok() && v_d.ok());
  DeviceBuffer* bufs[2] = {&*buf0, &*buf1};
  std::unique_ptr<Event> gathered[2], scattered[2];
  for (int b = 0; b < 2; ++b) {
    auto e1 = backend_->CreateEvent();
    auto e2 = backend_->CreateEvent();
    ASSERT_TRUE(e1.ok() && e2.ok());
    gathered[b] = *std::move(e1);
    scattered[b] = *std::move(e2);
  }
  for (int32_t j = 0; j * kChunk < n; ++j) {
    const int b = j % 2;
    GatherSlabsArgs gpu_g = g;
    gpu_g.items = items_d->as<RecallItem>() + j * kChunk;
    gpu_g.num_items = std::min(kChunk, n - j * kChunk);
    gpu_g.staging = bufs[b]->data();
    ScatterSlabsArgs gpu_s = sc;
    gpu_s.staging = bufs[b]->data();
    gpu_s.items = gpu_g.items;
    gpu_s.num_items = gpu_g.num_items;
    gpu_s.k_cache = k_d->data();
    gpu_s.v_cache = v_d->data();
    if (j >= 2) KVTIER_ASSERT_OK(stream_->Wait(*scattered[b]));
    KVTIER_ASSERT_OK(backend_->GatherSlabs(*stream_, gpu_g));
    KVTIER_ASSERT_OK(stream_->Record(*gathered[b]));
    KVTIER_ASSERT_OK((*compute)->Wait(*gathered[b]));
    KVTIER_ASSERT_OK(backend_->ScatterSlabs(**compute, gpu_s));
    KVTIER_ASSERT_OK((*compute)->Record(*scattered[b]));
  }
  KVTIER_ASSERT_OK((*compute)->Synchronize());
  TypedBuffer got_k(c.dtype, k.size()), got_v(c.dtype, v.size());
  KVTIER_ASSERT_OK(Download(got_k.data(), k_d->data(), k.bytes()));
  KVTIER_ASSERT_OK(Download(got_v.data(), v_d->data(), v.bytes()));
  EXPECT_EQ(FirstDifference(got_k.data(), want_k.data(), k.bytes(), elem), -1) << "streamed K";
  EXPECT_EQ(FirstDifference(got_v.data(), want_v.data(), v.bytes(), elem), -1) << "streamed V";
}

TEST_P(CudaCopyOpsTest, OffloadMatchesCpuBitForBit) {
  const CopyCase c = GetParam();
  const HostPageLayout hl{c.kv_heads, c.page_size, c.head_dim};
  const WorkingSetLayout wl{1, c.page_size, c.kv_heads, c.head_dim};
  const SummaryLayout sl{c.kv_heads, c.head_dim};
  constexpr int32_t kSrcSlots = 4, kHostPages = 5, kSummaryPages = 6;
  TypedBuffer k(c.dtype, kSrcSlots * wl.slot_elements());
  TypedBuffer v(c.dtype, kSrcSlots * wl.slot_elements());
  TypedBuffer pages(c.dtype, kHostPages * hl.page_elements());
  TypedBuffer sums(c.dtype, kSummaryPages * sl.page_elements());
  k.FillNormal(4);
  v.FillNormal(5);
  pages.FillNormal(6);  // pages and summaries no item writes must survive unchanged
  sums.FillNormal(7);
  const std::vector<OffloadItem> items = {{2, 4, 1}, {0, 1, 5}, {3, 0, 3}};
  auto k_d = Upload(k.data(), k.bytes());
  auto v_d = Upload(v.data(), v.bytes());
  auto items_d = Upload(items.data(), items.size() * sizeof(OffloadItem));
  ASSERT_TRUE(k_d.ok() && v_d.ok() && items_d.ok());

  for (SummaryMode mode : {SummaryMode::kMinMax, SummaryMode::kCenterMad}) {
    SCOPED_TRACE(mode == SummaryMode::kMinMax ? "kMinMax" : "kCenterMad");
    OffloadArgs a;
    a.dtype = c.dtype;
    a.page_size = c.page_size;
    a.num_kv_heads = c.kv_heads;
    a.head_dim = c.head_dim;
    a.summary = mode;
    a.num_src_slots = kSrcSlots;
    a.num_host_pages = kHostPages;
    a.num_summary_pages = kSummaryPages;
    a.num_items = static_cast<int32_t>(items.size());

    TypedBuffer want_pages = pages, want_sums = sums;
    OffloadArgs cpu = a;
    cpu.k_src = k.data();
    cpu.v_src = v.data();
    cpu.host_pages = want_pages.data();
    cpu.summaries = want_sums.data();
    cpu.items = items.data();
    KVTIER_ASSERT_OK(CpuOffload(cpu, nullptr));

    AlignedHostBuffer host_pages = ToAligned(pages);
    AlignedHostBuffer host_sums = ToAligned(sums);
    Placed placed_pages = Place(host_pages);
    Placed placed_sums = Place(host_sums);
    ASSERT_TRUE(placed_pages.data != nullptr && placed_sums.data != nullptr);
    OffloadArgs gpu = a;
    gpu.k_src = k_d->data();
    gpu.v_src = v_d->data();
    gpu.host_pages = placed_pages.data;
    gpu.summaries = placed_sums.data;
    gpu.items = items_d->as<OffloadItem>();
    KVTIER_ASSERT_OK(backend_->Offload(*stream_, gpu));
    KVTIER_ASSERT_OK(stream_->Synchronize());
    if (!c.zero_copy) {  // zero-copy cases were written in place
      KVTIER_ASSERT_OK(Download(host_pages.data(), placed_pages.data, host_pages.bytes()));
      KVTIER_ASSERT_OK(Download(host_sums.data(), placed_sums.data, host_sums.bytes()));
    }
    const size_t elem = DTypeSize(c.dtype);
    EXPECT_EQ(FirstDifference(host_pages.data(), want_pages.data(), pages.bytes(), elem), -1)
        << "host pages";
    EXPECT_EQ(FirstDifference(host_sums.data(), want_sums.data(), sums.bytes(), elem), -1)
        << "summaries";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaCopyOpsTest, ::testing::ValuesIn(AllCases()), CaseName);

// Items out of range: skipped on the device, reported without host synchronisation on
// the hot path, sticky, and charged only to work recorded after the failing op.
class CudaItemRangeTest : public testing::CudaTestBase<> {
 protected:
  static constexpr int32_t kP = 16, kD = 64, kHkv = 2, kPages = 3, kSlots = 4;

  void SetUp() override {
    testing::CudaTestBase<>::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const HostPageLayout hl{kHkv, kP, kD};
    const WorkingSetLayout wl{kSlots, kP, kHkv, kD};
    auto pages = backend_->Allocate(kPages * hl.page_elements() * 2);
    auto k = backend_->Allocate(kSlots * wl.slot_elements() * 2);
    auto v = backend_->Allocate(kSlots * wl.slot_elements() * 2);
    ASSERT_TRUE(pages.ok() && k.ok() && v.ok());
    pages_ = *std::move(pages);
    k_ = *std::move(k);
    v_ = *std::move(v);
  }

  // A recall of `items` (uploaded to `storage`) from pages_ into k_/v_.
  RecallArgs Args(const std::vector<RecallItem>& items, DeviceBuffer& storage) {
    storage = Upload(items.data(), items.size() * sizeof(RecallItem)).value();  // throws on error
    RecallArgs a;
    a.dtype = DType::kF16;
    a.page_size = kP;
    a.num_kv_heads = kHkv;
    a.head_dim = kD;
    a.host_pages = pages_.data();
    a.num_host_pages = kPages;
    a.items = storage.as<RecallItem>();
    a.num_items = static_cast<int32_t>(items.size());
    a.k_cache = k_.data();
    a.v_cache = v_.data();
    a.num_slots = kSlots;
    return a;
  }

  DeviceBuffer pages_, k_, v_;
};

TEST_F(CudaItemRangeTest, FailureIsStickyAndChargedOnlyToLaterRecords) {
  DeviceBuffer good_items, bad_items;
  const RecallArgs good = Args({{0, 0, 0}, {2, 1, 3}}, good_items);
  const RecallArgs bad = Args({{0, 0, 0}, {1, 1, kSlots}, {2, 0, 1}}, bad_items);
  auto before = backend_->CreateEvent();
  auto after = backend_->CreateEvent();
  auto downstream = backend_->CreateStream();
  ASSERT_TRUE(before.ok() && after.ok() && downstream.ok());

  KVTIER_ASSERT_OK(backend_->Recall(*stream_, good));
  KVTIER_ASSERT_OK(stream_->Record(**before));
  KVTIER_ASSERT_OK(backend_->Recall(*stream_, bad));  // enqueues fine: ranges need the data
  KVTIER_ASSERT_OK(stream_->Record(**after));
  KVTIER_ASSERT_OK((*downstream)->Wait(**after));

  const absl::Status st = stream_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "Recall: items[1].dst_slot = 4")) << st;
  EXPECT_TRUE((*before)->Wait().ok());
  EXPECT_EQ((*after)->Wait().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*after)->Wait(absl::Seconds(10)).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*downstream)->Synchronize().code(), absl::StatusCode::kOutOfRange);
  // Sticky: later good work does not clear it.
  KVTIER_ASSERT_OK(backend_->Recall(*stream_, good));
  EXPECT_EQ(stream_->Synchronize().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(CudaItemRangeTest, OffloadNamesTheBadField) {
  const std::vector<OffloadItem> items = {{0, 0, 0}, {1, 2, 9}};
  auto items_d = Upload(items.data(), items.size() * sizeof(OffloadItem));
  auto sums = backend_->Allocate(4 * kHkv * 2 * kD * 2);
  ASSERT_TRUE(items_d.ok() && sums.ok());
  OffloadArgs a;
  a.dtype = DType::kF16;
  a.page_size = kP;
  a.num_kv_heads = kHkv;
  a.head_dim = kD;
  a.k_src = k_.data();
  a.v_src = v_.data();
  a.num_src_slots = kSlots;
  a.host_pages = pages_.data();
  a.num_host_pages = kPages;
  a.summaries = sums->data();
  a.num_summary_pages = 4;
  a.items = items_d->as<OffloadItem>();
  a.num_items = 2;
  KVTIER_ASSERT_OK(backend_->Offload(*stream_, a));
  const absl::Status st = stream_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "Offload: items[1].summary_page = 9")) << st;
}

TEST_F(CudaItemRangeTest, GatherAndScatterSlabsNameTheBadField) {
  const std::vector<RecallItem> items = {{0, 0, 0}, {1, kHkv, 9}, {kSkipItem, 99, 99}};
  auto items_d = Upload(items.data(), items.size() * sizeof(RecallItem));
  auto staging = backend_->Allocate(items.size() * 2 * kP * kD * 2);
  ASSERT_TRUE(items_d.ok() && staging.ok());
  GatherSlabsArgs g;
  g.dtype = DType::kF16;
  g.page_size = kP;
  g.num_kv_heads = kHkv;
  g.head_dim = kD;
  g.host_pages = pages_.data();
  g.num_host_pages = kPages;
  g.items = items_d->as<RecallItem>();
  g.num_items = 3;
  g.staging = staging->data();
  KVTIER_ASSERT_OK(backend_->GatherSlabs(*stream_, g));
  absl::Status st = stream_->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "GatherSlabs: items[1].kv_head = 2")) << st;

  ScatterSlabsArgs sc;
  sc.dtype = DType::kF16;
  sc.page_size = kP;
  sc.num_kv_heads = kHkv;
  sc.head_dim = kD;
  sc.staging = staging->data();
  sc.items = items_d->as<RecallItem>();
  sc.num_items = 3;
  sc.k_cache = k_.data();
  sc.v_cache = v_.data();
  sc.num_slots = kSlots;
  auto fresh = backend_->CreateStream();
  ASSERT_TRUE(fresh.ok());
  KVTIER_ASSERT_OK(backend_->ScatterSlabs(**fresh, sc));
  st = (*fresh)->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "ScatterSlabs: items[1].kv_head = 2")) << st;
  sc.num_items = 1;  // the good item alone
  auto clean = backend_->CreateStream();
  ASSERT_TRUE(clean.ok());
  KVTIER_ASSERT_OK(backend_->ScatterSlabs(**clean, sc));
  KVTIER_ASSERT_OK((*clean)->Synchronize());
}

TEST_F(CudaItemRangeTest, NewStreamsStartCleanAfterAFailedOne) {
  DeviceBuffer good_items, bad_items;
  const RecallArgs good = Args({{0, 0, 0}}, good_items);
  const RecallArgs bad = Args({{kPages, 0, 0}}, bad_items);
  for (int round = 0; round < 3; ++round) {  // error slots are recycled between streams
    auto failing = backend_->CreateStream();
    ASSERT_TRUE(failing.ok());
    KVTIER_ASSERT_OK(backend_->Recall(**failing, bad));
    EXPECT_EQ((*failing)->Synchronize().code(), absl::StatusCode::kOutOfRange);
    failing->reset();
    auto fresh = backend_->CreateStream();
    ASSERT_TRUE(fresh.ok());
    KVTIER_ASSERT_OK(backend_->Recall(**fresh, good));
    KVTIER_ASSERT_OK((*fresh)->Synchronize());
  }
}

}  // namespace
}  // namespace kvtier
