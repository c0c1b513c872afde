// The one place where CUDA runtime errors become absl::Status (docs/architecture.md#errors-and-integrity),
// and a guard that makes one device current for the duration of a backend call.
//
// Only code in kernels/cuda/ includes this header. Thread-safe: pure functions, and a guard
// that touches only the calling thread's current device.
#ifndef KVTIER_KERNELS_CUDA_CUDA_CHECK_H_
#define KVTIER_KERNELS_CUDA_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/status.h"

namespace kvtier::cuda {

// OK for cudaSuccess. Otherwise a status whose message names `call` and carries
// cudaGetErrorString(err), with the code:
//   cudaErrorMemoryAllocation                      → RESOURCE_EXHAUSTED
//   no usable device or driver (no device, invalid ordinal, driver too old or missing,
//     devices unavailable, initialisation failed)  → UNAVAILABLE
//   cudaErrorInvalidValue                          → INVALID_ARGUMENT
//   cudaErrorHostMemoryAlreadyRegistered           → ALREADY_EXISTS
//   cudaErrorHostMemoryNotRegistered               → NOT_FOUND
//   stream capture errors (a call a capture cannot hold, a capture invalidated by one,
//     capture ended on another thread)             → FAILED_PRECONDITION
//   anything else (faults, launch failures)        → INTERNAL
// Clears the thread's last-error slot for non-sticky errors, so a later launch check does
// not report this error a second time.
absl::Status CudaStatus(cudaError_t err, absl::string_view call);

// For the results of cudaEventQuery / cudaStreamQuery: true when the work is complete,
// false for cudaErrorNotReady (which is not an error and is cleared), else CudaStatus.
absl::StatusOr<bool> CudaReady(cudaError_t err, absl::string_view call);

// Makes `device` current on the calling thread and restores the previous device when it
// goes out of scope, so engine threads keep the device they had. Check status() first.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;  // -1: nothing to restore
  absl::Status status_;
};

}  // namespace kvtier::cuda

// Returns a Status from the enclosing function when the CUDA call `expr` fails.
#define KVTIER_CUDA_RETURN_IF_ERROR(expr) \
  KVTIER_RETURN_IF_ERROR(::kvtier::cuda::CudaStatus((expr), #expr))

// Makes `device` current for the rest of the scope; returns its status on failure.
#define KVTIER_CUDA_SCOPED_DEVICE(device)                                                    \
  ::kvtier::cuda::DeviceGuard KVTIER_STATUS_CONCAT_(kvtier_device_guard_, __LINE__)(device); \
  KVTIER_RETURN_IF_ERROR(KVTIER_STATUS_CONCAT_(kvtier_device_guard_, __LINE__).status())

#endif  // KVTIER_KERNELS_CUDA_CUDA_CHECK_H_
