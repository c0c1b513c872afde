// Conversions between libkvtier's types (kvtier/client.h, kvtier/sequence.h) and the
// kvtier.v1 protocol messages. Client-side validation of what the daemon would refuse lives
// here too, so an engine learns about a bad option before a round trip.
//
// Thread-safe: pure functions.
#ifndef KVTIER_CLIENT_CONVERT_H_
#define KVTIER_CLIENT_CONVERT_H_

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/client.h"
#include "kvtier/geometry.h"
#include "kvtier/v1/kvtier.pb.h"
#include "proto/convert.h"

namespace kvtier {

// 128 random bits as 32 hex digits: an OpenSession request_id.
std::string RandomRequestId();

// The OpenSessionRequest for `options` on behalf of `tenant` (request_id: options' or a
// random one). INVALID_ARGUMENT (naming the field and limit) for an invalid geometry,
// sequence options ResolveSequenceOptions refuses (with its message; max_tokens 0 is the
// daemon's default, resolved there), a working set the protocol's budget_tokens cannot
// carry (not a positive multiple of 4 pages; its split is sent as sink and recent pages) or
// a negative host_tokens.
absl::StatusOr<v1::OpenSessionRequest> BuildOpenSessionRequest(std::string_view tenant,
                                                               const SessionOptions& options);

// The local sequence's options for a session as the daemon resolved it: mode, budget,
// its split, max_tokens, τ, the trigger, its largest loss and the summary from `info`,
// everything else from `local`. INTERNAL when the resolved budget or split is unusable (a
// daemon bug, reported as such).
absl::StatusOr<SequenceOptions> SequenceOptionsForSession(const SequenceOptions& local,
                                                          const SessionInfo& info);

absl::StatusOr<SessionInfo> SessionInfoFromProto(const v1::SessionInfo& info);
Capabilities CapabilitiesFromHello(const v1::HelloReply& reply);
SequenceStats StatsFromProto(const v1::SessionStats& stats);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_CONVERT_H_
