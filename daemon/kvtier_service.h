// KvTierService: kvtier.v1.KvTier on gRPC's callback API, a thin adapter over the
// SessionManager (DESIGN.md §2, §7; STYLE.md 8). Each method reads the caller from the
// request metadata (x-kvtier-tenant, x-kvtier-token), validates and converts the proto, calls
// one SessionManager method and maps its absl::Status one-to-one onto a grpc::Status.
//
// Offload is a read reactor that feeds an OffloadStream (a stream that breaks or is
// cancelled discards its uncommitted chunks); Fetch a write reactor that sends the pages a
// message at a time, each at most max_message_bytes. The server should be built with
// SetMaxReceiveMessageSize / SetMaxSendMessageSize = config.max_message_bytes.
//
// Thread-safe. The SessionManager must outlive the service, and the service the server.
#ifndef KVTIER_DAEMON_KVTIER_SERVICE_H_
#define KVTIER_DAEMON_KVTIER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "daemon/config.h"
#include "daemon/session_manager.h"
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

class KvTierService final : public kvtier::v1::KvTier::CallbackService {
 public:
  // Hello reports shm as unavailable until set_shm_endpoint says otherwise.
  KvTierService(SessionManager& manager, const DaemonConfig& config);
  KvTierService(const KvTierService&) = delete;
  KvTierService& operator=(const KvTierService&) = delete;

  // Call before the server starts (not synchronized with calls).
  void set_shm_endpoint(ShmEndpoint endpoint) { shm_ = std::move(endpoint); }

  // RPCs in progress now (streams count until they finish).
  uint32_t InflightCalls() const { return inflight_.load(std::memory_order_acquire); }
  uint64_t rpcs() const { return rpcs_.load(std::memory_order_relaxed); }
  uint64_t rpc_errors() const { return errors_.load(std::memory_order_relaxed); }

  // The generated base also declares the synchronous overloads: keep them visible
  // (-Woverloaded-virtual), though only the callback ones are served.
  using v1::KvTier::CallbackService::CloseSession;
  using v1::KvTier::CallbackService::Drain;
  using v1::KvTier::CallbackService::Fetch;
  using v1::KvTier::CallbackService::GetStats;
  using v1::KvTier::CallbackService::Hello;
  using v1::KvTier::CallbackService::ListSessions;
  using v1::KvTier::CallbackService::Offload;
  using v1::KvTier::CallbackService::OpenSession;
  using v1::KvTier::CallbackService::Reattach;
  using v1::KvTier::CallbackService::Step;

  grpc::ServerUnaryReactor* Hello(grpc::CallbackServerContext* ctx, const v1::HelloRequest* request,
                                  v1::HelloReply* reply) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* ctx,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionReply* reply) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionReply* reply) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsReply* reply) override;
  grpc::ServerUnaryReactor* Reattach(grpc::CallbackServerContext* ctx,
                                     const v1::ReattachRequest* request,
                                     v1::ReattachReply* reply) override;
  grpc::ServerReadReactor<v1::OffloadRequest>* Offload(grpc::CallbackServerContext* ctx,
                                                       v1::OffloadReply* reply) override;
  grpc::ServerWriteReactor<v1::FetchReply>* Fetch(grpc::CallbackServerContext* ctx,
                                                  const v1::FetchRequest* request) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* request,
                                 v1::StepReply* reply) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsReply* reply) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* request,
                                  v1::DrainReply* reply) override;

 private:
  class OffloadReactor;
  class FetchReactor;

  // Counts the call in flight until End(); End counts its outcome.
  void Begin();
  grpc::Status End(const absl::Status& status);
  // Finishes a unary call with `status` (already converted into the reply when OK).
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status);
  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext* ctx) const;

  SessionManager& manager_;
  const DaemonConfig config_;
  ShmEndpoint shm_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<uint64_t> rpcs_{0};
  std::atomic<uint64_t> errors_{0};
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_KVTIER_SERVICE_H_
