// Stands in for the CUDA backend when kvtier is built without CUDA (no nvcc at configure
// time, or KVTIER_WITH_CUDA=OFF): callers link and run unchanged and are told why.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kvtier/cuda.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const DeviceOptions&) {
  return absl::UnimplementedError(
      "kvtier was built without CUDA (no nvcc found at configure time)");
}

int CudaDeviceCountImpl() { return 0; }

bool CudaBuilt() { return false; }

// ---- kvtier/cuda.h ----

namespace {
constexpr char kNoCuda[] =
    "kvtier was built without CUDA (no nvcc found at configure time): there are no CUDA "
    "streams or devices";
}  // namespace

absl::StatusOr<cudaStream_t> NativeCudaStream(Stream&) {
  return absl::UnimplementedError(absl::StrCat("NativeCudaStream: ", kNoCuda));
}

absl::StatusOr<std::unique_ptr<Stream>> AdoptCudaStream(Device&, cudaStream_t) {
  return absl::UnimplementedError(absl::StrCat("AdoptCudaStream: ", kNoCuda));
}

absl::StatusOr<int> CudaDeviceOrdinal(Device&) {
  return absl::UnimplementedError(absl::StrCat("CudaDeviceOrdinal: ", kNoCuda));
}

}  // namespace kvtier
