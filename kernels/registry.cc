#include "kernels/registry.h"

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kCpu:
      return NewCpuBackend(options.cpu_threads);
    case BackendKind::kCuda:
      return NewCudaBackend(options);
    case BackendKind::kAuto:
      if (CudaDeviceCountImpl() > 0) {
        auto cuda = NewCudaBackend(options);
        if (cuda.ok()) return cuda;
      }
      return NewCpuBackend(options.cpu_threads);
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

int CudaDeviceCount() { return CudaDeviceCountImpl(); }
bool CudaBackendBuilt() { return CudaBuilt(); }

std::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto:
      return "auto";
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

bool ParseBackendKind(std::string_view name, BackendKind* out) {
  if (name == "auto") {
    *out = BackendKind::kAuto;
  } else if (name == "cpu") {
    *out = BackendKind::kCpu;
  } else if (name == "cuda") {
    *out = BackendKind::kCuda;
  } else {
    return false;
  }
  return true;
}

}  // namespace kvtier
