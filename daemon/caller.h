// Caller: who makes one call of kvtierd and until when it may still do work. The gRPC service
// fills it in (the tenant from the request metadata, the deadline from the call's, less the
// configured margin, and whether the client cancelled or went away); the SessionManager and
// the sessions check it before every step that does work or commits it (docs/service.md,
// "Deadlines").
//
// Thread-compatible value type; `cancelled` may be called from any thread.
#ifndef KVTIER_DAEMON_CALLER_H_
#define KVTIER_DAEMON_CALLER_H_

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvtier::daemon {

struct Caller {
  Caller() = default;
  explicit Caller(std::string tenant_name) : tenant(std::move(tenant_name)) {}

  std::string tenant;  // authenticated; empty for admin calls (Drain)
  std::string token;   // x-kvtier-token as the call presented it (Drain checks it)
  // Work may start or commit only before this (the call's deadline less the margin).
  absl::Time deadline = absl::InfiniteFuture();
  // True once the client cancelled the call or went away; empty: never.
  std::function<bool()> cancelled;

  // OK while the call may still start or commit work named `what` ("OpenSession", "the
  // commit of message 3"); DEADLINE_EXCEEDED or CANCELLED saying that `what` was not done.
  absl::Status CheckLive(std::string_view what) const;
};

// Trailing metadata an error carries to the client, as status payloads: the gRPC service
// sends each one with the failed call. Keys are lower-case gRPC metadata keys.
void SetTrailer(absl::Status& status, std::string_view key, std::string_view value);
std::optional<std::string> Trailer(const absl::Status& status, std::string_view key);
void ForEachTrailer(const absl::Status& status,
                    absl::FunctionRef<void(std::string_view key, std::string_view value)> fn);

// A RESOURCE_EXHAUSTED status may carry a hint: how long the client should wait before it
// retries, in whole milliseconds (at least 1). The service also sends it as
// grpc-retry-pushback-ms, which gRPC's own client retry honours.
inline constexpr char kRetryAfterTrailer[] = "x-kvtier-retry-after-ms";
void SetRetryAfter(absl::Status& status, absl::Duration after);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_CALLER_H_
