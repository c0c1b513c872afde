// Helpers of the CUDA backend tests: a fixture that skips itself without a device (the
// tests carry the ctest label `gpu`) and synchronous upload/download; page-aligned host
// memory for RegisterHost and the comparisons come from the op table (op_cases.h). The
// tests use only the Backend interface and the registry, as any caller would.
#ifndef KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_
#define KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_

#include <cstddef>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/registry.h"
#include "tests/kernels/op_cases.h"

// Fails the test (fatally) with the status when `expr` is not OK.
#define KVTIER_ASSERT_OK(expr)                  \
  do {                                          \
    const ::absl::Status kvtier_st_ = (expr);   \
    ASSERT_TRUE(kvtier_st_.ok()) << kvtier_st_; \
  } while (0)

namespace kvtier::testing {

// A CUDA backend and one stream per test; skips the test when no device is usable.
template <typename Base = ::testing::Test>
class CudaTestBase : public Base {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(DeviceKind::kCuda);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    absl::StatusOr<std::unique_ptr<Stream>> stream = backend_->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
  }

  // Backend memory holding a copy of `bytes` bytes of host memory at `src`.
  absl::StatusOr<DeviceBuffer> Upload(const void* src, size_t bytes) {
    absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    absl::Status st = backend_->Copy(*stream_, buffer->data(), src, bytes);
    if (st.ok()) st = stream_->Synchronize();
    if (!st.ok()) return st;
    return buffer;
  }

  // Copies `bytes` bytes of backend memory at `src` to host memory at `dst`.
  absl::Status Download(void* dst, const void* src, size_t bytes) {
    absl::Status st = backend_->Copy(*stream_, dst, src, bytes);
    return st.ok() ? stream_->Synchronize() : st;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_
