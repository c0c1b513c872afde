// Chooses and creates a Backend at run time. The only place, with the CUDA stub, that
// knows which backends were built.
#ifndef KVTIER_KERNELS_REGISTRY_H_
#define KVTIER_KERNELS_REGISTRY_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvtier {

struct BackendOptions {
  int cpu_threads = 0;  // cpu backend worker threads; 0 = hardware concurrency
  int cuda_device = 0;  // cuda backend device ordinal
};

// kCpu: always available. kCuda: UNIMPLEMENTED when built without CUDA, UNAVAILABLE when
// no usable device. kAuto: cuda if a device is usable, else cpu.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options = {});

// Number of usable CUDA devices: 0 when built without CUDA or when there is no driver or
// device (never an error).
int CudaDeviceCount();

// True when this build contains the CUDA backend.
bool CudaBackendBuilt();

// "auto", "cpu", "cuda".
std::string_view BackendKindName(BackendKind kind);
bool ParseBackendKind(std::string_view name, BackendKind* out);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_REGISTRY_H_
