// kvtier/cuda.h on a cpu device, which every build has: each function refuses it with
// INVALID_ARGUMENT naming itself when the CUDA backend is built, and UNIMPLEMENTED (the stub)
// when it is not. Uses the public headers only, as an engine would. The functions on a CUDA
// device: cuda_gpu_test.cc.
#include "kvtier/cuda.h"

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvtier/device.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

absl::StatusCode ExpectedCode() {
  return CudaBackendBuilt() ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kUnimplemented;
}

class CudaApiOnCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceKind::kCpu);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    absl::StatusOr<std::unique_ptr<Stream>> stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_F(CudaApiOnCpuTest, NativeCudaStreamRefusesACpuStream) {
  const absl::StatusOr<cudaStream_t> native = NativeCudaStream(*stream_);
  ASSERT_FALSE(native.ok());
  EXPECT_EQ(native.status().code(), ExpectedCode()) << native.status();
  EXPECT_THAT(native.status().message(), HasSubstr("NativeCudaStream"));
}

TEST_F(CudaApiOnCpuTest, AdoptCudaStreamRefusesACpuDevice) {
  // The device is checked before the handle, so any handle gets the device's refusal.
  const absl::StatusOr<std::unique_ptr<Stream>> adopted = AdoptCudaStream(*device_, nullptr);
  ASSERT_FALSE(adopted.ok());
  EXPECT_EQ(adopted.status().code(), ExpectedCode()) << adopted.status();
  EXPECT_THAT(adopted.status().message(), HasSubstr("AdoptCudaStream"));
}

TEST_F(CudaApiOnCpuTest, CudaDeviceOrdinalRefusesACpuDevice) {
  const absl::StatusOr<int> ordinal = CudaDeviceOrdinal(*device_);
  ASSERT_FALSE(ordinal.ok());
  EXPECT_EQ(ordinal.status().code(), ExpectedCode()) << ordinal.status();
  EXPECT_THAT(ordinal.status().message(), HasSubstr("CudaDeviceOrdinal"));
}

}  // namespace
}  // namespace kvtier
