#include "kernels/registry.h"

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "absl/strings/str_cat.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(DeviceKind kind,
                                                       const DeviceOptions& options) {
  switch (kind) {
    case DeviceKind::kCpu:
      return NewCpuBackend(options.cpu_threads);
    case DeviceKind::kCuda:
      return NewCudaBackend(options);
    case DeviceKind::kAuto:
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

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(DeviceKind kind,
                                                     const DeviceOptions& options) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(kind, options);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Device>(*std::move(backend));
}

absl::StatusOr<Backend*> BackendOf(Device& device, std::string_view what) {
  auto* backend = dynamic_cast<Backend*>(&device);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), ": the device was not created by kvtier (CreateDevice); kvtier runs only on "
              "devices it created"));
  }
  return backend;
}


}  // namespace kvtier
