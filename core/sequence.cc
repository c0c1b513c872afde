// The parts of the public sequence contract (kvtier/sequence.h) every local sequence shares.
#include "kvtier/sequence.h"

#include "core/status.h"

namespace kvtier {

absl::Status LocalSequence::Decode(int32_t layer, const void* q, void* out, float* lse) {
  KVTIER_RETURN_IF_ERROR(BeginStep(layer, q).status());
  if (out != nullptr) KVTIER_RETURN_IF_ERROR(Attend(layer, q, out, lse));
  return EndStep(layer, q);
}

}  // namespace kvtier
