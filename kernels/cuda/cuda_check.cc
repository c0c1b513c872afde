#include "kernels/cuda/cuda_check.h"

#include "absl/strings/str_cat.h"

namespace kvtier::cuda {
namespace {

absl::StatusCode CodeOf(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorCudartUnloading:
      return absl::StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorHostMemoryAlreadyRegistered:
      return absl::StatusCode::kAlreadyExists;
    case cudaErrorHostMemoryNotRegistered:
      return absl::StatusCode::kNotFound;
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureWrongThread:
      return absl::StatusCode::kFailedPrecondition;
    default:  // cudaError_t is CUDA's enum, not ours: everything else is a fault.
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status CudaStatus(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Reset the last-error slot (a no-op for sticky errors, which stay in the context).
  (void)cudaGetLastError();
  return absl::Status(CodeOf(err), absl::StrCat(call, ": ", cudaGetErrorName(err), " (",
                                                cudaGetErrorString(err), ")"));
}

absl::StatusOr<bool> CudaReady(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // some runtimes also park NotReady in the last-error slot
    return false;
  }
  return CudaStatus(err, call);
}

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  status_ = CudaStatus(cudaGetDevice(&current), "cudaGetDevice");
  if (!status_.ok() || current == device) return;
  status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  if (status_.ok()) previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

}  // namespace kvtier::cuda
