// The GRPC session (kvtier/client.h): a Session owning a remote Sequence whose host tier,
// selection and attention run in the daemon. Append streams tokens with Offload, Decode
// runs Step, FetchPages reads pages with Fetch; every call has finished its work when it
// returns. Pointers passed in are host memory.
//
// Thread-compatible, as a Sequence.
#ifndef KVTIER_CLIENT_SESSION_GRPC_H_
#define KVTIER_CLIENT_SESSION_GRPC_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "kvtier/client.h"

namespace kvtier {

// Tokens per OffloadRequest for a geometry under the connection's limits: at most
// max_tokens_per_offload (0: no limit), and K + V of that many tokens plus `overhead` bytes
// within max_message_bytes. RESOURCE_EXHAUSTED when not even one token fits.
absl::StatusOr<int32_t> OffloadChunkTokens(const Geometry& g, uint64_t max_message_bytes,
                                           uint32_t max_tokens_per_offload, uint64_t overhead);

// A session over the daemon's record `info` (OpenSession or Reattach), with the tokens the
// daemon reported per layer.
absl::StatusOr<std::unique_ptr<Session>> NewGrpcSession(std::shared_ptr<Connection> conn,
                                                        const SessionInfo& info,
                                                        const SessionOptions& options);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_SESSION_GRPC_H_
