// Factory of the CUDA backend. Built from cuda/ when the toolkit is found, otherwise from
// cuda_stub.cc, which answers UNIMPLEMENTED. Only the registry includes this header.
#ifndef KVTIER_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVTIER_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/registry.h"

namespace kvtier {

// UNAVAILABLE when the device cannot be used (no driver, no such ordinal).
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const DeviceOptions& options);
// 0 when no driver or device: never an error.
int CudaDeviceCountImpl();
bool CudaBuilt();

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CUDA_CUDA_BACKEND_H_
