// kvtierctl's commands against one kvtierd: gRPC (health, stats, list, drain) and its /metrics
// over HTTP (metrics, tenants, sessions). Each command writes its result to `out`, a one-line
// error naming the daemon's address (and the gRPC code) to `err`, and returns the process's
// exit code.
//
// Thread-compatible: one Ctl per command.
#ifndef KVTIER_TOOLS_KVTIERCTL_COMMANDS_H_
#define KVTIER_TOOLS_KVTIERCTL_COMMANDS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/http.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace kvtier::ctl {

// Exit codes: 0 success (health: SERVING; drain: drained), 1 a refusal or failure the daemon
// reported (health: not serving), 2 a usage error or a daemon that cannot be reached.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUnreachable = 2;
inline constexpr int kExitUsage = 2;

struct CtlOptions {
  std::string socket;              // PATH, unix:PATH or host:port
  std::string tenant = "default";  // x-kvtier-tenant
  std::string token;               // x-kvtier-token (empty: not sent)
  std::string metrics;             // HTTP address of /metrics; empty: HelloReply.metrics_address
  int64_t timeout_ms = 5000;       // deadline of every RPC and GET, > 0
  bool json = false;               // tenants, sessions, list, stats: JSON instead of a table
};

// kvtierd's control socket as given to --socket: the gRPC target and the name errors use.
struct DaemonAddress {
  std::string target;                      // "unix:/path" or "host:port", as gRPC takes it
  std::string display;                     // "unix:/path" or "host:port"
  std::optional<daemon::HttpAddress> tcp;  // set for host:port
};

// "unix:PATH" and anything with a '/' or without a ":port" is a Unix socket path; "host:port"
// (ParseHttpAddress's forms) is TCP. INVALID_ARGUMENT for an empty address or a bad host:port.
absl::StatusOr<DaemonAddress> ParseDaemonAddress(std::string_view socket);

// Where to GET /metrics given what the daemon advertises: an unspecified host (0.0.0.0, [::])
// is the daemon's own host when it is reached over TCP, else loopback. INVALID_ARGUMENT when
// `advertised` does not parse.
absl::StatusOr<std::string> MetricsAddress(std::string_view advertised,
                                           const DaemonAddress& daemon);

class Ctl {
 public:
  // REQUIRES: ParseDaemonAddress(options.socket) is OK.
  Ctl(CtlOptions options, std::ostream& out, std::ostream& err);
  ~Ctl();
  Ctl(const Ctl&) = delete;
  Ctl& operator=(const Ctl&) = delete;

  // grpc.health.v1.Health/Check of `service` ("" = the whole server): prints the serving
  // status; 0 when SERVING, 1 otherwise, 2 when unreachable.
  int Health(const std::string& service);
  // The /metrics body, verbatim.
  int Metrics();
  // Tables from /metrics (report.h).
  int Tenants();
  int Sessions(const std::string& tenant_filter);
  // GetStats of one session of the tenant, field by field.
  int Stats(const std::string& session_id);
  // ListSessions of the tenant, one row per session.
  int List();
  // Drain with the admin token, waiting up to drain_timeout_ms for calls in flight: 0 when
  // drained, 1 when not (or refused).
  int Drain(uint32_t drain_timeout_ms, const std::string& admin_token);

 private:
  // Prints the error (one line) and returns its exit code: 2 for UNAVAILABLE, else 1.
  int Fail(const absl::Status& status);
  // A gRPC failure as a Status naming the address and the method; UNAVAILABLE when the
  // daemon could not be reached at all.
  absl::Status RpcError(std::string_view method, int code, const std::string& message);
  void Prepare(grpc::ClientContext& ctx, bool as_tenant, int64_t extra_ms = 0) const;
  absl::StatusOr<std::string> FetchMetrics();

  const CtlOptions options_;
  DaemonAddress daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::ostream& out_;
  std::ostream& err_;
};

}  // namespace kvtier::ctl

#endif  // KVTIER_TOOLS_KVTIERCTL_COMMANDS_H_
