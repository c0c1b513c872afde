// The SHM session (kvtier/client.h): a Session owning a Retriever (a LocalSequence) that
// runs in the engine's process over the session's region of the mapped tenant arena; its
// host tier commits each page to the region's directory (offload/region_host_tier.h) once
// its offload has run.
//
// Thread-compatible, as a Sequence.
#ifndef KVTIER_CLIENT_SESSION_SHM_H_
#define KVTIER_CLIENT_SESSION_SHM_H_

#include <memory>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "kvtier/client.h"

namespace kvtier {

// A session over the region `info` describes (as OpenSession or Reattach returned it),
// running on `mapping`'s backend. With `restore`, the committed prefix of every layer is
// taken over (later entries uncommitted) and the Retriever rebuilt from it. Errors: the
// region's (FAILED_PRECONDITION for a header that does not match, OUT_OF_RANGE for a region
// outside the arena), the Retriever's, DATA_LOSS for a directory naming a slot twice.
absl::StatusOr<std::unique_ptr<Session>> NewShmSession(std::shared_ptr<Connection> conn,
                                                       std::shared_ptr<ArenaMapping> mapping,
                                                       const SessionInfo& info,
                                                       const SessionOptions& options, bool restore);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SESSION_SHM_H_
