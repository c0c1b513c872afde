// OpenSessionParams ⇄ v1::OpenSessionRequest: the service reads requests with it, and the cold
// tier keeps a session's parameters in its record (cold_record.proto) the same way.
#ifndef KVTIER_DAEMON_SESSION_PARAMS_H_
#define KVTIER_DAEMON_SESSION_PARAMS_H_

#include "absl/status/statusor.h"
#include "daemon/session_manager.h"
#include "daemon/tenant_session.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier::daemon {

// INVALID_ARGUMENT for an enum or geometry the protocol does not define.
absl::StatusOr<OpenSessionParams> ParamsFromProto(const v1::OpenSessionRequest& r);
// The request that opens a session like `spec` again: `params` with the values the daemon
// resolved from `spec` written in (max_tokens, budget_tokens and its split, τ, trigger, largest loss,
// summary), so a
// changed default cannot change the session's shape.
v1::OpenSessionRequest ResolvedRequest(const OpenSessionParams& params, const SessionSpec& spec);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_SESSION_PARAMS_H_
