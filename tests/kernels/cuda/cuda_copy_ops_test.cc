// What the op table (tests/kernels/op_cases.h, run by backend_ops_test) cannot check of the
// CUDA copy kernels: a streaming recall, GatherSlabs and ScatterSlabs over chunks through
// two staging buffers on two streams ordered by events alone, equals CpuRecall bit for bit;
// and items out of range are reported without host synchronisation on the hot path,
// sticky, charged only to work recorded after the failing op, and forgotten by the next
// stream that reuses the error slot. Skips itself without a device.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
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

struct StreamCase {
  DType dtype;
  bool zero_copy;  // host pages in registered host memory instead of device memory
};

std::string CaseName(const ::testing::TestParamInfo<StreamCase>& info) {
  return absl::StrFormat("%s_%s", DTypeName(info.param.dtype),
                         info.param.zero_copy ? "zerocopy" : "device");
}

class CudaStreamedRecallTest : public testing::CudaTestBase<::testing::TestWithParam<StreamCase>> {
};

// Chunk j is gathered on stream_ into buffer j % 2 while chunk j - 1 is scattered from the
// other on `compute`.
TEST_P(CudaStreamedRecallTest, ChunksThroughTwoStagingBuffersEqualRecall) {
  const StreamCase c = GetParam();
  const KvShape shape{c.dtype, 8, 8, 64, 16};
  const HostPageLayout hl{shape.num_kv_heads, shape.page_size, shape.head_dim};
  const WorkingSetLayout wl{1, shape.page_size, shape.num_kv_heads, shape.head_dim};
  constexpr int32_t kHostPages = 5, kSlots = 6, kChunk = 3;
  TypedBuffer pages(c.dtype, kHostPages * hl.page_elements());
  TypedBuffer k(c.dtype, kSlots * wl.slot_elements()), v(c.dtype, k.size());
  pages.FillNormal(11);
  k.FillNormal(12);
  v.FillNormal(13);
  // Distinct (slot, head) targets, every fourth a skip item with wild fields.
  std::vector<RecallItem> items;
  for (int32_t s = 0; s < kSlots; ++s) {
    for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
      if ((s + h) % 4 == 1) {
        items.push_back({kSkipItem, 1000, -7});
      } else if ((s + h) % 3 != 0) {
        items.push_back({(3 * s + 5 * h + 1) % kHostPages, h, s});
      }
    }
  }
  const auto n = static_cast<int32_t>(items.size());

  TypedBuffer want_k = k, want_v = v;
  RecallArgs cpu;
  cpu.shape = shape;
  cpu.kv = PagedKv{.k_cache = want_k.data(), .v_cache = want_v.data(), .num_slots = kSlots};
  cpu.host_pages = pages.data();
  cpu.num_host_pages = kHostPages;
  cpu.items = items.data();
  cpu.num_items = n;
  KVTIER_ASSERT_OK(CpuRecall(cpu, nullptr));

  AlignedHostBuffer host_pages(pages.bytes());
  std::memcpy(host_pages.data(), pages.data(), pages.bytes());
  std::unique_ptr<ScopedRegistration> registration;
  DeviceBuffer device_pages;
  const void* pages_at = host_pages.data();
  if (c.zero_copy) {
    registration =
        std::make_unique<ScopedRegistration>(*backend_, host_pages.data(), host_pages.bytes());
    KVTIER_ASSERT_OK(registration->status());
  } else {
    absl::StatusOr<DeviceBuffer> uploaded = Upload(pages.data(), pages.bytes());
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    device_pages = *std::move(uploaded);
    pages_at = device_pages.data();
  }
  const size_t elem = DTypeSize(c.dtype);
  auto items_d = Upload(items.data(), items.size() * sizeof(RecallItem));
  auto compute = backend_->CreateStream();
  auto buf0 = backend_->Allocate(kChunk * hl.slab_elements() * elem);
  auto buf1 = backend_->Allocate(kChunk * hl.slab_elements() * elem);
  auto k_d = Upload(k.data(), k.bytes());
  auto v_d = Upload(v.data(), v.bytes());
  ASSERT_TRUE(items_d.ok() && compute.ok() && buf0.ok() && buf1.ok() && k_d.ok() && v_d.ok());
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
    GatherSlabsArgs g;
    g.shape = shape;
    g.host_pages = pages_at;
    g.num_host_pages = kHostPages;
    g.items = items_d->as<RecallItem>() + j * kChunk;
    g.num_items = std::min(kChunk, n - j * kChunk);
    g.staging = bufs[b]->data();
    ScatterSlabsArgs s;
    s.shape = shape;
    s.kv = PagedKv{.k_cache = k_d->data(), .v_cache = v_d->data(), .num_slots = kSlots};
    s.staging = bufs[b]->data();
    s.items = g.items;
    s.num_items = g.num_items;
    if (j >= 2) KVTIER_ASSERT_OK(stream_->Wait(*scattered[b]));
    KVTIER_ASSERT_OK(backend_->GatherSlabs(*stream_, g));
    KVTIER_ASSERT_OK(stream_->Record(*gathered[b]));
    KVTIER_ASSERT_OK((*compute)->Wait(*gathered[b]));
    KVTIER_ASSERT_OK(backend_->ScatterSlabs(**compute, s));
    KVTIER_ASSERT_OK((*compute)->Record(*scattered[b]));
  }
  KVTIER_ASSERT_OK((*compute)->Synchronize());
  TypedBuffer got_k(c.dtype, k.size()), got_v(c.dtype, v.size());
  KVTIER_ASSERT_OK(Download(got_k.data(), k_d->data(), k.bytes()));
  KVTIER_ASSERT_OK(Download(got_v.data(), v_d->data(), v.bytes()));
  EXPECT_EQ(FirstDifference(got_k.data(), want_k.data(), k.bytes(), elem), -1) << "streamed K";
  EXPECT_EQ(FirstDifference(got_v.data(), want_v.data(), v.bytes(), elem), -1) << "streamed V";
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaStreamedRecallTest,
                         ::testing::Values(StreamCase{DType::kF16, false},
                                           StreamCase{DType::kBF16, true},
                                           StreamCase{DType::kF32, false},
                                           StreamCase{DType::kF32, true}),
                         CaseName);

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
    a.shape = KvShape{DType::kF16, kHkv, kHkv, kD, kP};
    a.kv = PagedKv{.k_cache = k_.data(), .v_cache = v_.data(), .num_slots = kSlots};
    a.host_pages = pages_.data();
    a.num_host_pages = kPages;
    a.items = storage.as<RecallItem>();
    a.num_items = static_cast<int32_t>(items.size());
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
