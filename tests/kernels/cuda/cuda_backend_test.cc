// The CUDA backend's device services: description, memory, copies, stream ordering, event
// semantics, host registration, and the errors it answers for what it does not accept.
// Every test skips itself when no CUDA device is usable.
#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/registry.h"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace kvtier {
namespace {

using testing::AlignedHostBuffer;
using testing::ScopedRegistration;

class CudaBackendTest : public testing::CudaTestBase<> {
 protected:
  static constexpr int kLongWorkMemsets = 64;

  // kLongWorkMemsets memsets of a 1 GiB buffer, the i-th writing byte i: tens of
  // milliseconds of device work, so work enqueued right before a check (microseconds)
  // is still running when the check runs. No test sleeps.
  absl::Status EnqueueLongWork(DeviceBuffer& buffer) {
    for (int i = 0; i < kLongWorkMemsets; ++i) {
      absl::Status st = backend_->Memset(*stream_, buffer.data(), i, buffer.size());
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }
};

TEST_F(CudaBackendTest, DescribesTheDevice) {
  EXPECT_TRUE(CudaBackendBuilt());
  EXPECT_EQ(backend_->kind(), DeviceKind::kCuda);
  const std::string description = backend_->Describe();
  EXPECT_TRUE(absl::StartsWith(description, "cuda: ")) << description;
  EXPECT_TRUE(absl::StrContains(description, "(sm_")) << description;
  EXPECT_TRUE(absl::StrContains(description, "GiB, driver ")) << description;
}

TEST_F(CudaBackendTest, AnOrdinalBeyondTheDevicesIsUnavailable) {
  DeviceOptions options;
  options.cuda_device = CudaDeviceCount();
  EXPECT_EQ(CreateBackend(DeviceKind::kCuda, options).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(CudaBackendTest, CopiesRoundTripThroughDeviceMemory) {
  constexpr size_t kCount = 1 << 18;  // ints: 1 MiB
  std::vector<int32_t> host(kCount);
  std::iota(host.begin(), host.end(), -1000);
  absl::StatusOr<DeviceBuffer> a = Upload(host.data(), kCount * sizeof(int32_t));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<DeviceBuffer> b = backend_->Allocate(kCount * sizeof(int32_t));
  ASSERT_TRUE(b.ok()) << b.status();
  KVTIER_ASSERT_OK(backend_->Copy(*stream_, b->data(), a->data(), b->size()));  // D2D
  KVTIER_ASSERT_OK(backend_->Memset(*stream_, b->data(), 0xff, 4 * sizeof(int32_t)));
  std::vector<int32_t> back(kCount, 0);
  KVTIER_ASSERT_OK(Download(back.data(), b->data(), b->size()));
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(back[i], -1) << i;
  for (size_t i = 4; i < kCount; ++i) ASSERT_EQ(back[i], host[i]) << i;
}

TEST_F(CudaBackendTest, AllocationErrors) {
  EXPECT_EQ(backend_->Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status huge = backend_->Allocate(size_t{1} << 50).status();  // 1 PiB
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted) << huge;
  EXPECT_TRUE(absl::StrContains(huge.message(), "1125899906842624 bytes")) << huge;
  // The failure is not sticky: the backend keeps working.
  EXPECT_TRUE(backend_->Allocate(4096).ok());
}

TEST_F(CudaBackendTest, WaitOnAnEventOrdersTheOtherStream) {
  absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(size_t{1} << 30);
  if (!buffer.ok()) GTEST_SKIP() << "needs 1 GiB of device memory: " << buffer.status();
  auto other = backend_->CreateStream();
  auto event = backend_->CreateEvent();
  ASSERT_TRUE(other.ok() && event.ok());
  KVTIER_ASSERT_OK(EnqueueLongWork(*buffer));
  KVTIER_ASSERT_OK(stream_->Record(**event));
  KVTIER_ASSERT_OK((*other)->Wait(**event));
  std::vector<unsigned char> tail(4096, 0);
  const auto* end = static_cast<const unsigned char*>(buffer->data()) + buffer->size();
  KVTIER_ASSERT_OK(backend_->Copy(**other, tail.data(), end - tail.size(), tail.size()));
  KVTIER_ASSERT_OK((*other)->Synchronize());
  for (unsigned char byte : tail) ASSERT_EQ(byte, kLongWorkMemsets - 1);
  EXPECT_TRUE((*event)->Query());
}

TEST_F(CudaBackendTest, EventsReportCompletion) {
  auto event = backend_->CreateEvent();
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_TRUE((*event)->Query());  // never recorded: nothing to wait for
  KVTIER_ASSERT_OK((*event)->Wait());
  KVTIER_ASSERT_OK((*event)->Wait(absl::ZeroDuration()));
  absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(1 << 20);
  ASSERT_TRUE(buffer.ok());
  KVTIER_ASSERT_OK(backend_->Memset(*stream_, buffer->data(), 1, buffer->size()));
  KVTIER_ASSERT_OK(stream_->Record(**event));
  KVTIER_ASSERT_OK((*event)->Wait());
  EXPECT_TRUE((*event)->Query());
  KVTIER_ASSERT_OK(stream_->Synchronize());
}

TEST_F(CudaBackendTest, WaitWithATimeoutExpiresWhileWorkIsPending) {
  absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(size_t{1} << 30);
  if (!buffer.ok()) GTEST_SKIP() << "needs 1 GiB of device memory: " << buffer.status();
  auto event = backend_->CreateEvent();
  ASSERT_TRUE(event.ok());
  KVTIER_ASSERT_OK(EnqueueLongWork(*buffer));
  KVTIER_ASSERT_OK(stream_->Record(**event));
  EXPECT_FALSE((*event)->Query());
  EXPECT_EQ((*event)->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*event)->Wait(absl::Microseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
  KVTIER_ASSERT_OK((*event)->Wait(absl::Seconds(60)));  // polls until done
  EXPECT_TRUE((*event)->Query());
  KVTIER_ASSERT_OK((*event)->Wait(absl::ZeroDuration()));
}

TEST_F(CudaBackendTest, RegisteredHostMemoryCopiesBothWays) {
  AlignedHostBuffer host(1 << 20);
  auto* bytes = static_cast<unsigned char*>(host.data());
  for (size_t i = 0; i < host.bytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 31);
  ScopedRegistration registration(*backend_, host.data(), host.bytes());
  KVTIER_ASSERT_OK(registration.status());
  absl::StatusOr<DeviceBuffer> device = backend_->Allocate(host.bytes());
  ASSERT_TRUE(device.ok());
  KVTIER_ASSERT_OK(backend_->Copy(*stream_, device->data(), host.data(), host.bytes()));
  KVTIER_ASSERT_OK(backend_->Memset(*stream_, host.data(), 0, host.bytes()));  // zero-copy
  KVTIER_ASSERT_OK(backend_->Copy(*stream_, host.data(), device->data(), host.bytes() / 2));
  KVTIER_ASSERT_OK(stream_->Synchronize());
  for (size_t i = 0; i < host.bytes() / 2; ++i) {
    ASSERT_EQ(bytes[i], static_cast<unsigned char>(i * 31)) << i;
  }
  for (size_t i = host.bytes() / 2; i < host.bytes(); ++i) ASSERT_EQ(bytes[i], 0) << i;
}

TEST_F(CudaBackendTest, RegisterHostErrors) {
  AlignedHostBuffer host(1 << 16);
  EXPECT_EQ(backend_->RegisterHost(nullptr, 4096).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->RegisterHost(host.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  // Checked before CUDA is asked, so the range need not exist.
  EXPECT_EQ(backend_->RegisterHost(host.data(), Backend::kMaxRegisterBytes + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->UnregisterHost(host.data()).code(), absl::StatusCode::kNotFound);
  KVTIER_ASSERT_OK(backend_->RegisterHost(host.data(), host.bytes()));
  EXPECT_EQ(backend_->RegisterHost(host.data(), host.bytes()).code(),
            absl::StatusCode::kAlreadyExists);
  KVTIER_ASSERT_OK(backend_->UnregisterHost(host.data()));
}

TEST_F(CudaBackendTest, RejectsStreamsAndEventsOfOtherBackends) {
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend(DeviceKind::kCpu);
  ASSERT_TRUE(cpu.ok());
  auto cpu_stream = (*cpu)->CreateStream();
  auto cpu_event = (*cpu)->CreateEvent();
  ASSERT_TRUE(cpu_stream.ok() && cpu_event.ok());
  int32_t x = 0;
  int32_t y = 0;
  EXPECT_EQ(backend_->Copy(**cpu_stream, &x, &y, sizeof(x)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream_->Record(**cpu_event).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream_->Wait(**cpu_event).code(), absl::StatusCode::kInvalidArgument);
  // Another CUDA backend's stream is foreign too, even on the same device.
  absl::StatusOr<std::unique_ptr<Backend>> cuda = CreateBackend(DeviceKind::kCuda);
  ASSERT_TRUE(cuda.ok());
  auto cuda_stream = (*cuda)->CreateStream();
  ASSERT_TRUE(cuda_stream.ok());
  EXPECT_EQ(backend_->Memset(**cuda_stream, &x, 0, sizeof(x)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
