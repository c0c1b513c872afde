// Daemon: kvtierd's running parts put together (docs/architecture.md#processes) — the
// SessionManager (tenants, arenas, sessions), the gRPC server (kvtier.v1.KvTier, the standard
// health service and reflection) on a Unix socket and optionally TCP, and the shared-memory attach
// socket, and the metrics endpoint (GET /metrics and /healthz; docs/metrics.md). kvtierd's
// main() is Start, wait for SIGTERM, Shutdown; tests run it in-process.
//
// Start-up order: validate and resolve paths (config.h ResolvePaths), make sure neither socket path
// belongs to a live daemon (a stale socket file is replaced), create the tenants' arenas, serve
// the attach socket, serve metrics, start the work queue, serve gRPC (kvtier.v1.KvTier, health,
// reflection v1 and v1alpha; Hello reports the attach socket and the metrics address), every
// call counted by an interceptor. Shutdown order: health NOT_SERVING, stop serving metrics,
// refuse new sessions and attaches (StartDrain), stop the attach socket, stop accepting gRPC
// calls and let
// the calls in flight finish until shutdown_grace (then cancel them); as soon as none is left,
// close every connection (idle clients are not waited for), stop the work queue, close every
// session, release the arenas, unlink the sockets. A Drain call turns health NOT_SERVING too.
//
// Thread-safe: Shutdown and Wait may be called from any thread, any number of times.
#ifndef KVTIER_DAEMON_DAEMON_H_
#define KVTIER_DAEMON_DAEMON_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "daemon/config.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace kvtier::daemon {

class AttachServer;
class HttpServer;
class KvTierService;
class RpcMetrics;
class SessionManager;
class WorkQueue;

class Daemon {
 public:
  // Starts serving `config`. INVALID_ARGUMENT for a bad config (Validate's message);
  // FAILED_PRECONDITION when a socket path is taken by a live daemon or by a file that is not a
  // socket, or a listener cannot be bound (the message says which and what to do); the
  // SessionManager's errors for tenants whose arenas cannot be made. On failure nothing is left
  // behind but the socket directories.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonConfig config);
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;
  // Shutdown(), when nobody called it.
  ~Daemon();

  // Graceful stop (the order above); blocks until done. Later calls wait for the first.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until a Shutdown (from any thread) has completed.
  void Wait() ABSL_LOCKS_EXCLUDED(mu_);

  // The configuration as resolved (socket paths filled in).
  const DaemonConfig& config() const { return config_; }
  const std::string& unix_socket() const { return config_.unix_socket; }
  // Empty when the config has shm = false.
  const std::string& attach_socket() const { return attach_socket_; }
  // The bound TCP port (the chosen one when tcp_address asked for port 0); 0 without TCP.
  int tcp_port() const { return tcp_port_; }
  // Where /metrics is served, as bound ("unix:/path" or "127.0.0.1:9464" with the port
  // chosen for port 0); empty when metrics are off.
  const std::string& metrics_address() const { return metrics_address_; }
  // The /metrics text now (docs/metrics.md), as the endpoint serves it.
  std::string RenderMetrics() const;

 private:
  explicit Daemon(DaemonConfig config);
  absl::Status StartGrpc();
  absl::Status StartAttach();
  absl::Status StartMetrics();
  void LogTenants() const;
  void Stop();
  void StopGrpc();

  const DaemonConfig config_;
  std::string attach_socket_;
  std::string metrics_address_;
  int tcp_port_ = 0;
  bool grpc_bound_ = false;  // the Unix socket file is ours to unlink
  // Destroyed in reverse: the servers go before the services, the work queue and the manager
  // they call.
  std::unique_ptr<SessionManager> manager_;
  // The gRPC server's interceptors count into it: it outlives the server.
  std::unique_ptr<RpcMetrics> rpc_metrics_;
  std::unique_ptr<WorkQueue> work_;
  std::unique_ptr<KvTierService> service_;
  std::unique_ptr<grpc::Service> reflection_v1_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<AttachServer> attach_server_;
  // Renders from the members above: stopped first.
  std::unique_ptr<HttpServer> metrics_server_;

  enum class State { kServing, kStopping, kStopped };
  Mutex mu_;
  CondVar stopped_;  // signalled when state_ becomes kStopped
  State state_ ABSL_GUARDED_BY(mu_) = State::kServing;
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_DAEMON_H_
