// NewCudaMath when the CUDA part of kvtier was not built.
#include "absl/status/status.h"
#include "engine/math.h"

namespace kvtier::engine {

absl::StatusOr<std::unique_ptr<Math>> NewCudaMath(Device&, Stream&) {
  return absl::UnimplementedError(
      "the engine's CUDA math was not built (configure with nvcc available, "
      "KVTIER_WITH_CUDA=AUTO or ON)");
}

}  // namespace kvtier::engine
