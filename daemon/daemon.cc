// Daemon: start-up and graceful shutdown. Invariants: a socket path is unlinked only when it was
// found stale (connecting was refused) or when this daemon bound it; every member is torn down in
// Stop(), in the order the header gives, whether Start finished or not.
#include "daemon/daemon.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "daemon/attach_server.h"
#include "daemon/http.h"
#include "daemon/kvtier_service.h"
#include "daemon/logging.h"
#include "daemon/metrics.h"
#include "daemon/reflection_v1.h"
#include "daemon/session_manager.h"
#include "daemon/unix_socket.h"
#include "daemon/work_queue.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {
namespace {

// Makes `path` free to bind (daemon/unix_socket.h), logging a stale socket it replaced.
absl::Status ClaimSocketPath(std::string_view key, const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(
      const bool replaced,
      ClaimUnixSocketPath(key, path,
                          "stop it or choose another path (--unix-socket / --attach-socket)"));
  if (replaced) spdlog::info("replaced stale socket {}={}", key, path);
  return absl::OkStatus();
}

// gRPC's own log lines, through the daemon's logger (so JSON logs stay JSON), rate-limited:
// a client sending garbage can make gRPC log a line per connection.
void LogFromGrpc(gpr_log_func_args* args) {
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
      : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                : spdlog::level::debug;
  LogLimited(level, "grpc", "grpc {}:{} {}", args->file, args->line, args->message);
}

int WorkThreads(const DaemonConfig& c) {
  if (c.work_threads > 0) return c.work_threads;
  return std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
}

// The `method` label of a call: the name of the registered method gRPC routed it to, or
// kUnknownMethod. A path that no registered service serves goes to gRPC's catch-all generic
// handler (which answers UNIMPLEMENTED): those are the only calls whose context is a
// GenericCallbackServerContext, since the daemon registers no generic service of its own. So
// the label's values are the methods the server serves (kvtier.v1.KvTier, health, reflection
// v1 and v1alpha) and "unknown", whatever paths callers send: a caller, authenticated or not,
// can neither add series nor put its bytes into the exposition.
const char* MethodLabel(grpc::experimental::ServerRpcInfo* info) {
  if (info->method() == nullptr ||
      dynamic_cast<grpc::GenericCallbackServerContext*>(info->server_context()) != nullptr) {
    return kUnknownMethod;
  }
  return info->method();
}

// Counts every gRPC call (any service) by method and status, with its wall time: from the
// interceptor's creation, when the call arrives, to its status, counted just before the status
// is sent, so a client that has its status finds its call in /metrics. A call that ends
// without a status sent (cancelled) counts as CANCELLED when the interceptor goes.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(grpc::experimental::ServerRpcInfo* info, RpcMetrics& metrics)
      : metrics_(metrics), method_(MethodLabel(info)) {
    metrics_.Begin();
  }
  ~RpcMetricsInterceptor() override { End(grpc::StatusCode::CANCELLED); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      End(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void End(grpc::StatusCode code) {
    if (ended_) return;
    ended_ = true;
    metrics_.End(method_, absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                 absl::ToDoubleSeconds(absl::Now() - start_));
  }

  RpcMetrics& metrics_;
  const std::string method_;
  const absl::Time start_ = absl::Now();
  bool ended_ = false;  // counted
};

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsFactory(RpcMetrics& metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcMetricsInterceptor(info, metrics_);
  }

 private:
  RpcMetrics& metrics_;
};

void UnlinkIfPresent(const std::string& path) {
  if (::unlink(path.c_str()) == 0) spdlog::info("shutdown: removed socket {}", path);
}

}  // namespace

Daemon::Daemon(DaemonConfig config) : config_(std::move(config)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonConfig config) {
  KVTIER_RETURN_IF_ERROR(config.Validate());
  KVTIER_ASSIGN_OR_RETURN(config, ResolvePaths(std::move(config)));
  // Refuse a taken path before the arenas (the slow part) are made.
  KVTIER_RETURN_IF_ERROR(ClaimSocketPath("server.unix_socket", config.unix_socket));
  if (config.shm) {
    KVTIER_RETURN_IF_ERROR(ClaimSocketPath("server.attach_socket", config.attach_socket));
  }
  std::unique_ptr<Daemon> daemon(new Daemon(std::move(config)));
  const DaemonConfig& c = daemon->config_;
  spdlog::info(
      "starting kvtierd unix_socket={} tcp_address={} shm={} attach_socket={} tenants={} "
      "max_message_bytes={} cpu_threads={} rpc_threads={} shutdown_grace_ms={}",
      c.unix_socket, c.tcp_address.empty() ? "none" : c.tcp_address, c.shm,
      c.shm ? c.attach_socket : "none", c.tenants.size(), c.max_message_bytes, c.cpu_threads,
      c.rpc_threads, absl::ToInt64Milliseconds(c.shutdown_grace));
  spdlog::info(
      "limits max_sessions_per_tenant={} max_tokens_per_session={} default_max_tokens={} "
      "max_layers={} max_tokens_per_offload={} admin_token={}",
      c.max_sessions_per_tenant, c.max_tokens_per_session, c.default_max_tokens, c.max_layers,
      c.max_tokens_per_offload, c.admin_token.empty() ? "unset (Drain refused)" : "set");
  KVTIER_ASSIGN_OR_RETURN(daemon->manager_, SessionManager::Create(c));
  daemon->LogTenants();
  // With one tenant there is no other to keep a worker for: it may use them all.
  const int work_threads = WorkThreads(c);
  KVTIER_ASSIGN_OR_RETURN(
      daemon->work_,
      WorkQueue::Create({.threads = work_threads,
                         .max_queued = c.max_queued_calls,
                         .max_running_per_tenant = c.tenants.size() > 1 ? 0 : work_threads}));
  daemon->rpc_metrics_ = std::make_unique<RpcMetrics>();
  // The attach socket and metrics first: Hello reports them from the first call on.
  if (c.shm) KVTIER_RETURN_IF_ERROR(daemon->StartAttach());
  if (!c.metrics_address.empty()) KVTIER_RETURN_IF_ERROR(daemon->StartMetrics());
  KVTIER_RETURN_IF_ERROR(daemon->StartGrpc());
  spdlog::info("kvtierd serving unix:{}{}{} metrics {}", c.unix_socket,
               daemon->tcp_port_ != 0 ? absl::StrCat(" tcp port ", daemon->tcp_port_) : "",
               c.shm ? absl::StrCat(" attach ", daemon->attach_socket_) : " (shm off)",
               daemon->metrics_address_.empty() ? "off" : daemon->metrics_address_);
  return daemon;
}

void Daemon::LogTenants() const {
  for (const TenantConfig& t : config_.tenants) {
    const Tenant& tenant = manager_->tenant(t.name);
    // The SessionManager has logged each arena's report.
    spdlog::info("tenant name={} quota_bytes={} token={} uids={}", t.name, tenant.quota_bytes(),
                 t.token.empty() ? "none" : "set",
                 t.uids.empty() ? "daemon's own" : absl::StrJoin(t.uids, ","));
  }
}

absl::Status Daemon::StartGrpc() {
  gpr_set_log_function(LogFromGrpc);
  RouteProtobufLogs();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  service_ = std::make_unique<KvTierService>(*manager_, *work_, config_);
  service_->set_shm_endpoint({.available = attach_server_ != nullptr, .path = attach_socket_});
  service_->set_metrics_address(metrics_address_);
  reflection_v1_ = NewReflectionV1Service(
      {kvtier::v1::KvTier::service_full_name(), "grpc.health.v1.Health",
       "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"});
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + config_.unix_socket, grpc::InsecureServerCredentials());
  if (!config_.tcp_address.empty()) {
    builder.AddListeningPort(config_.tcp_address, grpc::InsecureServerCredentials(), &tcp_port_);
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
  if (config_.rpc_threads > 0) {
    grpc::ResourceQuota quota("kvtierd");
    quota.SetMaxThreads(config_.rpc_threads);
    builder.SetResourceQuota(quota);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<RpcMetricsFactory>(*rpc_metrics_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(service_.get());
  builder.RegisterService(reflection_v1_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "gRPC could not listen on unix:%s%s; check that the socket directory is writable%s",
        config_.unix_socket,
        config_.tcp_address.empty() ? "" : absl::StrCat(" and ", config_.tcp_address),
        config_.tcp_address.empty() ? "" : " and the TCP port is free (server.tcp_address)"));
  }
  grpc_bound_ = true;
  // Like the attach socket: the daemon's user and group may connect (engines of other uids
  // need the group; the tenant token authenticates each call).
  if (::chmod(config_.unix_socket.c_str(), 0660) != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("chmod 0660 %s: %s", config_.unix_socket, std::strerror(errno)));
  }
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus(kvtier::v1::KvTier::service_full_name(), true);
    // A drained daemon takes no new sessions: load balancers and probes must see it.
    manager_->set_drain_listener([health] {
      health->SetServingStatus(false);
      spdlog::info("health: NOT_SERVING (draining)");
    });
    // A Drain that came before the listener was set (the server was already serving).
    if (manager_->draining()) health->SetServingStatus(false);
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartAttach() {
  SessionManager* manager = manager_.get();
  AttachServerOptions options;
  options.handshake_timeout = config_.attach_handshake_timeout;
  options.max_connections = config_.attach_max_connections;
  options.max_connections_per_peer = config_.attach_max_connections_per_peer;
  options.min_protocol_version = kMinProtocolVersion;
  options.max_protocol_version = kServerProtocolVersion;
  KVTIER_ASSIGN_OR_RETURN(
      attach_server_,
      AttachServer::Start(
          config_.attach_socket,
          [manager](const PeerCredentials& peer, std::string_view tenant, std::string_view token) {
            return manager->AuthorizeAttach(peer, tenant, token);
          },
          options));
  attach_socket_ = attach_server_->path();
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics() {
  HttpServerOptions options;
  options.address = config_.metrics_address;
  options.max_connections = kMetricsMaxConnections;
  options.max_connections_per_peer = config_.metrics_max_connections_per_peer;
  KVTIER_ASSIGN_OR_RETURN(
      metrics_server_,
      HttpServer::Start(options, [this](const HttpRequest& request) -> HttpResponse {
        const std::string_view path =
            std::string_view(request.target).substr(0, request.target.find('?'));
        if (path == "/metrics") {
          return {.status = 200,
                  .content_type = "text/plain; version=0.0.4; charset=utf-8",
                  .body = RenderMetrics()};
        }
        if (path == "/healthz") {
          const bool draining = manager_->draining();
          return {.status = draining ? 503 : 200, .body = draining ? "draining\n" : "ok\n"};
        }
        return {.status = 404, .body = "not found: try /metrics or /healthz\n"};
      }));
  metrics_address_ = metrics_server_->address();
  return absl::OkStatus();
}

std::string Daemon::RenderMetrics() const {
  Exposition out;
  out.Family("kvtier_build_info", "gauge", "1, with the version of kvtierd in the labels.");
  out.Sample("kvtier_build_info", {{"version", KVTIER_VERSION_STRING}}, 1);
  out.Family("process_start_time_seconds", "gauge",
             "Start time of the process since the Unix epoch, seconds.");
  out.Sample("process_start_time_seconds", {},
             absl::ToDoubleSeconds(manager_->start_time() - absl::UnixEpoch()));
  manager_->WriteMetrics(out);
  rpc_metrics_->Write(out);
  out.Family("kvtier_attach_handshakes_total", "counter",
             "Shared-memory attach handshakes, by outcome (ok, a refusal's code, or dropped "
             "unanswered).");
  if (attach_server_ != nullptr) {
    for (const auto& [outcome, n] : attach_server_->Outcomes()) {
      out.Sample("kvtier_attach_handshakes_total", {{"outcome", outcome}},
                 static_cast<double>(n));
    }
  }
  return out.Take();
}

void Daemon::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (state_ != State::kServing) {
      stopped_.Await(
          &mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return state_ == State::kStopped; });
      return;
    }
    state_ = State::kStopping;
  }
  Stop();
  {
    MutexLock lock(&mu_);
    state_ = State::kStopped;
  }
  stopped_.SignalAll();
}

void Daemon::Wait() {
  MutexLock lock(&mu_);
  stopped_.Await(&mu_,
                 [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return state_ == State::kStopped; });
}

// gRPC's Shutdown stops accepting calls and lets those in flight run until the deadline, then
// cancels them; but it also waits for every connection to close, and an idle client closes its
// connection only once it notices the server's goaway, which can take seconds (a client's
// backup poller runs every 5 s). So once no call is in flight, every connection is closed at
// once: nothing is left that a client could lose.
void Daemon::StopGrpc() {
  const absl::Time deadline = absl::Now() + config_.shutdown_grace;
  std::thread shutdown([this, deadline] { server_->Shutdown(absl::ToChronoTime(deadline)); });
  const bool idle = service_->AwaitIdle(deadline);
  grpc_server_cancel_all_calls(server_->c_server());
  shutdown.join();
  server_->Wait();
  manager_->set_drain_listener(nullptr);  // it names the server's health service
  server_.reset();
  if (!idle) spdlog::warn("shutdown: calls still in flight after the grace period were cancelled");
}

void Daemon::Stop() {
  const absl::Time began = absl::Now();
  spdlog::info("shutdown: begin grace_ms={} inflight_calls={}",
               absl::ToInt64Milliseconds(config_.shutdown_grace),
               service_ != nullptr ? service_->InflightCalls() : 0);
  if (server_ != nullptr && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  // The metrics read every member below: the endpoint goes first.
  if (metrics_server_ != nullptr) {
    metrics_server_->Stop();
    metrics_server_.reset();
  }
  if (manager_ != nullptr) manager_->StartDrain();
  if (attach_server_ != nullptr) {
    attach_server_->Stop();
    spdlog::info("shutdown: attach socket closed granted={} refused={}", attach_server_->granted(),
                 attach_server_->refused());
    attach_server_.reset();
  }
  if (server_ != nullptr) {
    StopGrpc();
    spdlog::info("shutdown: gRPC stopped after {} ms",
                 absl::ToInt64Milliseconds(absl::Now() - began));
  }
  if (work_ != nullptr) work_->Shutdown();
  service_.reset();
  reflection_v1_.reset();
  work_.reset();
  if (manager_ != nullptr) {
    if (config_.cold_tier.enabled() && config_.cold_tier.persist_on_shutdown) {
      // No call runs any more: every session is demoted so that the next daemon finds it.
      const size_t demoted =
          manager_->PersistAllSessions(absl::Now() + config_.cold_tier.operation_timeout);
      spdlog::info("shutdown: demoted {} sessions to the cold tier", demoted);
    }
    const size_t closed = manager_->CloseAllSessions();
    manager_.reset();
    spdlog::info("shutdown: closed {} sessions, released {} tenant arenas", closed,
                 config_.tenants.size());
  }
  if (grpc_bound_) UnlinkIfPresent(config_.unix_socket);
  if (!attach_socket_.empty()) UnlinkIfPresent(attach_socket_);
  spdlog::info("shutdown: done in {} ms", absl::ToInt64Milliseconds(absl::Now() - began));
}

}  // namespace kvtier::daemon
