// Helpers of the CUDA backend tests: a fixture that skips itself without a device (the
// tests carry the ctest label `gpu`), synchronous upload/download, page-aligned host
// memory for RegisterHost, and a bit-exact comparison that names the first difference.
// The tests use only the Backend interface and the registry, as any caller would.
#ifndef KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_
#define KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/registry.h"

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

// Page-aligned, zero-filled host memory, so that two registrations never share a page.
class AlignedHostBuffer {
 public:
  static constexpr size_t kPage = 4096;
  explicit AlignedHostBuffer(size_t bytes)
      : bytes_(bytes),
        data_(std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage), &std::free) {
    std::memset(data_.get(), 0, bytes_);
  }
  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  std::unique_ptr<void, decltype(&std::free)> data_;
};

// Registers host memory with a backend for the lifetime of the object.
class ScopedRegistration {
 public:
  ScopedRegistration(Backend& backend, void* data, size_t bytes)
      : backend_(backend), data_(data), status_(backend.RegisterHost(data, bytes)) {}
  ~ScopedRegistration() {
    if (status_.ok()) (void)backend_.UnregisterHost(data_);
  }
  ScopedRegistration(const ScopedRegistration&) = delete;
  ScopedRegistration& operator=(const ScopedRegistration&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  Backend& backend_;
  void* data_;
  absl::Status status_;
};

// Index of the first `elem_bytes`-sized element at which `a` and `b` differ, or -1.
inline int64_t FirstDifference(const void* a, const void* b, size_t bytes, size_t elem_bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < bytes; i += elem_bytes) {
    if (std::memcmp(x + i, y + i, elem_bytes) != 0) return static_cast<int64_t>(i / elem_bytes);
  }
  return -1;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_KERNELS_CUDA_CUDA_TEST_UTIL_H_
