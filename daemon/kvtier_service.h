// KvTierService: kvtier.v1.KvTier on gRPC's callback API, a thin adapter over the
// SessionManager (docs/architecture.md#processes, docs/architecture.md#errors-and-integrity). Every
// method is registered raw (its messages arrive as bytes) so that the service, not gRPC, parses
// them: a request that does not parse is INVALID_ARGUMENT naming the message type (and the field,
// for invalid UTF-8), never a silent end of stream or an empty UNIMPLEMENTED. Each call then reads
// the caller from the request metadata (x-kvtier-tenant, x-kvtier-token), takes one of the tenant's
// in-flight slots, sets the caller's deadline (the call's, less server.deadline_margin) and
// cancellation, calls one SessionManager method and maps its absl::Status one-to-one onto a
// grpc::Status, sending the status's trailers (caller.h) as trailing metadata.
//
// Calls that do real work run on the WorkQueue: OpenSession, Step and the commits of an
// Offload stream. The rest (cheap reads and bookkeeping) answer on gRPC's callback thread.
// Offload is a read reactor that feeds an OffloadStream; Fetch a write reactor that sends the
// pages a message at a time, each at most max_message_bytes. The server should be built
// with SetMaxReceiveMessageSize / SetMaxSendMessageSize = config.max_message_bytes.
//
// Thread-safe. The SessionManager and the WorkQueue must outlive the service, and the
// service the server.
#ifndef KVTIER_DAEMON_KVTIER_SERVICE_H_
#define KVTIER_DAEMON_KVTIER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/config.h"
#include "daemon/session_manager.h"
#include "daemon/work_queue.h"
#include "grpcpp/grpcpp.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "proto/convert.h"

namespace kvtier::daemon {

inline constexpr uint32_t kServerProtocolVersion = 1;
inline constexpr uint32_t kMinProtocolVersion = 1;
inline constexpr char kTenantMetadata[] = "x-kvtier-tenant";
inline constexpr char kTokenMetadata[] = "x-kvtier-token";

// The canonical code and message, unchanged (shared with the client: proto/convert.h).
using ::kvtier::ToGrpcStatus;

// What Hello reports about the attach socket.
struct ShmEndpoint {
  bool available = false;  // the attach socket is up
  std::string path;
};

// Routes protobuf's own log lines (it logs, for example, every string field with invalid
// UTF-8 it refuses to parse) into the daemon's rate-limited logger. Call once, at start-up.
void RouteProtobufLogs();

// Every method of kvtier.v1.KvTier, raw.
using RawKvTierService = v1::KvTier::WithRawCallbackMethod_Hello<
    v1::KvTier::WithRawCallbackMethod_OpenSession<v1::KvTier::WithRawCallbackMethod_CloseSession<
        v1::KvTier::WithRawCallbackMethod_ListSessions<v1::KvTier::WithRawCallbackMethod_Reattach<
            v1::KvTier::WithRawCallbackMethod_Offload<v1::KvTier::WithRawCallbackMethod_Fetch<
                v1::KvTier::WithRawCallbackMethod_Step<v1::KvTier::WithRawCallbackMethod_GetStats<
                    v1::KvTier::WithRawCallbackMethod_Drain<
                        v1::KvTier::WithRawCallbackMethod_SuspendSession<
                            v1::KvTier::WithRawCallbackMethod_DemotePages<
                                v1::KvTier::WithRawCallbackMethod_PromotePages<
                                    v1::KvTier::WithRawCallbackMethod_ReportSignals<
                                        v1::KvTier::Service>>>>>>>>>>>>>>;

class KvTierService final : public RawKvTierService {
 public:
  // Hello reports shm as unavailable until set_shm_endpoint says otherwise.
  KvTierService(SessionManager& manager, WorkQueue& work, const DaemonConfig& config);
  KvTierService(const KvTierService&) = delete;
  KvTierService& operator=(const KvTierService&) = delete;

  // Call before the server starts (not synchronized with calls).
  void set_shm_endpoint(ShmEndpoint endpoint) { shm_ = std::move(endpoint); }
  // Where /metrics is served, for Hello (empty: off). Call before the server starts.
  void set_metrics_address(std::string address) { metrics_address_ = std::move(address); }

  // RPCs in progress now (streams count until they finish).
  uint32_t InflightCalls() const { return inflight_.load(std::memory_order_acquire); }
  // Blocks until no RPC is in progress or `deadline` passes; true when none is.
  bool AwaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(idle_mu_);
  uint64_t rpcs() const { return rpcs_.load(std::memory_order_relaxed); }
  uint64_t rpc_errors() const { return errors_.load(std::memory_order_relaxed); }

  // The generated bases also declare the synchronous overloads: keep them visible
  // (-Woverloaded-virtual), though only the raw callback ones are served.
  using RawKvTierService::CloseSession;
  using RawKvTierService::Drain;
  using RawKvTierService::Fetch;
  using RawKvTierService::GetStats;
  using RawKvTierService::Hello;
  using RawKvTierService::ListSessions;
  using RawKvTierService::Offload;
  using RawKvTierService::OpenSession;
  using RawKvTierService::Reattach;
  using RawKvTierService::Step;
  using RawKvTierService::SuspendSession;
  using RawKvTierService::DemotePages;
  using RawKvTierService::PromotePages;
  using RawKvTierService::ReportSignals;

  using Raw = grpc::ByteBuffer;
  grpc::ServerUnaryReactor* Hello(grpc::CallbackServerContext* ctx, const Raw* in,
                                  Raw* out) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx, const Raw* in,
                                        Raw* out) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const Raw* in,
                                         Raw* out) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx, const Raw* in,
                                         Raw* out) override;
  grpc::ServerUnaryReactor* Reattach(grpc::CallbackServerContext* ctx, const Raw* in,
                                     Raw* out) override;
  grpc::ServerReadReactor<Raw>* Offload(grpc::CallbackServerContext* ctx, Raw* out) override;
  grpc::ServerWriteReactor<Raw>* Fetch(grpc::CallbackServerContext* ctx, const Raw* in) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const Raw* in,
                                 Raw* out) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const Raw* in,
                                     Raw* out) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const Raw* in,
                                  Raw* out) override;
  grpc::ServerUnaryReactor* SuspendSession(grpc::CallbackServerContext* ctx, const Raw* in,
                                           Raw* out) override;
  grpc::ServerUnaryReactor* DemotePages(grpc::CallbackServerContext* ctx, const Raw* in,
                                        Raw* out) override;
  grpc::ServerUnaryReactor* PromotePages(grpc::CallbackServerContext* ctx, const Raw* in,
                                         Raw* out) override;
  grpc::ServerUnaryReactor* ReportSignals(grpc::CallbackServerContext* ctx, const Raw* in,
                                          Raw* out) override;

 private:
  class OffloadReactor;
  class FetchReactor;
  template <typename Request, typename Reply>
  struct UnaryCall;

  // Where a unary call runs.
  enum class Where { kInline, kWorkQueue };

  // Parses `in` as a Request, authenticates (unless `tenant` is false: Drain), admits and
  // runs `handler` where it belongs, then finishes the call with its status and reply.
  template <typename Request, typename Reply>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* ctx, const Raw* in, Raw* out,
                                  Where where, bool tenant,
                                  absl::Status (KvTierService::*handler)(const Caller&,
                                                                         const Request&, Reply*));

  absl::Status DoHello(const Caller& caller, const v1::HelloRequest& request,
                       v1::HelloReply* reply);
  absl::Status DoOpenSession(const Caller& caller, const v1::OpenSessionRequest& request,
                             v1::OpenSessionReply* reply);
  absl::Status DoCloseSession(const Caller& caller, const v1::CloseSessionRequest& request,
                              v1::CloseSessionReply* reply);
  absl::Status DoListSessions(const Caller& caller, const v1::ListSessionsRequest& request,
                              v1::ListSessionsReply* reply);
  absl::Status DoReattach(const Caller& caller, const v1::ReattachRequest& request,
                          v1::ReattachReply* reply);
  absl::Status DoStep(const Caller& caller, const v1::StepRequest& request, v1::StepReply* reply);
  absl::Status DoGetStats(const Caller& caller, const v1::GetStatsRequest& request,
                          v1::GetStatsReply* reply);
  absl::Status DoDrain(const Caller& caller, const v1::DrainRequest& request,
                       v1::DrainReply* reply);
  absl::Status DoSuspendSession(const Caller& caller, const v1::SuspendSessionRequest& request,
                                v1::SuspendSessionReply* reply);
  absl::Status DoDemotePages(const Caller& caller, const v1::DemotePagesRequest& request,
                             v1::DemotePagesReply* reply);
  absl::Status DoPromotePages(const Caller& caller, const v1::PromotePagesRequest& request,
                              v1::PromotePagesReply* reply);
  absl::Status DoReportSignals(const Caller& caller, const v1::ReportSignalsRequest& request,
                               v1::ReportSignalsReply* reply);

  // Counts the call in flight until End(); End counts its outcome.
  void Begin();
  grpc::Status End(const absl::Status& status);
  // The caller of `ctx` (authenticated unless `tenant` is false) with the call's deadline
  // less the margin and its cancellation.
  absl::StatusOr<Caller> CallerOf(grpc::CallbackServerContext* ctx, bool tenant) const;
  // Adds the status's trailers to the call's trailing metadata.
  static void AddTrailers(grpc::CallbackServerContext* ctx, const absl::Status& status);

  SessionManager& manager_;
  WorkQueue& work_;
  const DaemonConfig config_;
  ShmEndpoint shm_;
  std::string metrics_address_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<uint64_t> rpcs_{0};
  std::atomic<uint64_t> errors_{0};
  Mutex idle_mu_;
  CondVar idle_;  // signalled when inflight_ drops to 0
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_KVTIER_SERVICE_H_
