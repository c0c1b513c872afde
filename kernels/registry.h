// Chooses and creates a Backend at run time. The only place, with the CUDA stub, that
// knows which backends were built. (The public face of this file is CreateDevice and the
// device counts in kvtier/device.h.)
#ifndef KVTIER_KERNELS_REGISTRY_H_
#define KVTIER_KERNELS_REGISTRY_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/device.h"

namespace kvtier {

// As CreateDevice, with the compute ops exposed.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(DeviceKind kind,
                                                       const DeviceOptions& options = {});

// The Backend behind a Device an engine handed in. INVALID_ARGUMENT naming `what` when the
// Device was not created by kvtier (CreateDevice): kvtier runs its ops only on its own.
absl::StatusOr<Backend*> BackendOf(Device& device, std::string_view what);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_REGISTRY_H_
