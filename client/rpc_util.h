// The gRPC edge of libkvtier: target parsing, the one status mapping between gRPC and absl
// (docs/architecture.md#errors-and-integrity: canonical codes map one-to-one), and the per-call
// context every request carries (tenant metadata and a deadline).
//
// Thread-safe: pure functions.
#ifndef KVTIER_CLIENT_RPC_UTIL_H_
#define KVTIER_CLIENT_RPC_UTIL_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "proto/convert.h"  // FromGrpcStatus, ToGrpcStatus

namespace kvtier {

// Metadata keys of proto/kvtier/v1/kvtier.proto.
inline constexpr char kTenantMetadataKey[] = "x-kvtier-tenant";
inline constexpr char kTokenMetadataKey[] = "x-kvtier-token";

// Where a client connects.
struct ParsedTarget {
  std::string grpc_target;  // what grpc::CreateChannel takes: "unix:/p", "unix:p", "h:1"
  std::string unix_path;    // the socket path for unix targets; empty for TCP
};

// "unix:///abs/path" and "unix:/abs/path" → an absolute Unix socket; "unix:rel/path" → a
// relative one; anything else must be "host:port" (host may be a [v6] literal or a name;
// port a decimal number in [1, 65535]). INVALID_ARGUMENT naming the target and the form
// expected.
absl::StatusOr<ParsedTarget> ParseTarget(std::string_view target);

// gRPC ↔ absl: same canonical code, same message. An OK status maps to OK whatever its
// message.

// A context for one call of `tenant`: x-kvtier-tenant, x-kvtier-token (when not empty) and a
// deadline `timeout` from now (none when timeout is infinite).
std::unique_ptr<grpc::ClientContext> NewCallContext(std::string_view tenant, std::string_view token,
                                                    absl::Duration timeout);

// OK while a session is open; FAILED_PRECONDITION "<what>: session <id> is closed" once
// `closed`.
absl::Status CheckSessionOpen(bool closed, std::string_view what, std::string_view id);
// FAILED_PRECONDITION "<what>: session <id> is closed" once `closed`, else "<what>: session
// <id> is suspended; Client::Reattach resumes it" once `suspended` (Session::Suspend).
absl::Status CheckSessionOpen(bool closed, bool suspended, std::string_view what,
                              std::string_view id);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_RPC_UTIL_H_
