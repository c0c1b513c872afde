// Connection: what a Client and its sessions share — the gRPC channel and stub, the options,
// the daemon's capabilities, and (for SHM sessions) the tenant arena, attached once and
// mapped once per backend it is registered with. Sessions hold it by shared_ptr, so they
// keep working after the Client object is gone.
//
// Thread-safe.
#ifndef KVTIER_CLIENT_CONNECTION_H_
#define KVTIER_CLIENT_CONNECTION_H_

#include <memory>
#include <optional>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/shm_attach.h"
#include "core/mutex.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kernels/backend.h"
#include "kvtier/client.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "offload/host_arena.h"

namespace kvtier {

// One mapping of the tenant arena, registered with one backend. Members are destroyed in
// reverse order: the arena (which unregisters) before a backend the Client owns.
struct ArenaMapping {
  std::shared_ptr<Backend> owned_backend;  // the Client's CPU backend; null for an engine's
  Backend* backend = nullptr;              // the one registered with
  std::unique_ptr<HostArena> arena;
};

class Connection {
 public:
  // Parses `target`, opens the channel and says Hello (see Client::Connect for the errors).
  static absl::StatusOr<std::shared_ptr<Connection>> Open(std::string_view target,
                                                          const ClientOptions& options);
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  v1::KvTier::StubInterface& stub() const { return *stub_; }
  const ClientOptions& options() const { return options_; }
  const Capabilities& capabilities() const { return caps_; }
  // Bytes one message may carry: the smaller of the option and the daemon's limit.
  uint64_t max_message_bytes() const { return max_message_bytes_; }

  // A context with the tenant metadata and a deadline of `timeout` (default rpc_timeout).
  std::unique_ptr<grpc::ClientContext> Context() const;
  std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) const;

  // The tenant arena mapped and registered with `backend` (null: the Client's own CPU
  // backend, created on first use). The first call attaches over the attach socket;
  // mappings are shared while any session holds them. FAILED_PRECONDITION when the daemon
  // serves no attach socket; the attach errors of shm_attach.h otherwise.
  absl::StatusOr<std::shared_ptr<ArenaMapping>> ArenaFor(Backend* backend);

 private:
  Connection(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options,
             std::string unix_path);
  absl::Status Hello();
  absl::Status AttachLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClientOptions options_;
  std::string unix_path_;  // the socket this client connected through; empty for TCP
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvTier::StubInterface> stub_;
  Capabilities caps_;  // set by Hello before the Connection is shared
  uint64_t max_message_bytes_ = 0;

  Mutex mu_;
  std::optional<AttachedArena> attached_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Backend> cpu_backend_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Backend*, std::weak_ptr<ArenaMapping>> mappings_ ABSL_GUARDED_BY(mu_);
};

// The daemon's record of session `id` (from ListSessions): NOT_FOUND when the caller's
// tenant has no such session.
absl::StatusOr<SessionInfo> LookupSessionInfo(Connection& conn, std::string_view id);
// CloseSession by id: the daemon's status.
absl::Status CloseSessionById(Connection& conn, std::string_view id);
// SuspendSession by id: the daemon's record of the suspended session, or its status.
absl::StatusOr<SessionInfo> SuspendSessionById(Connection& conn, std::string_view id);
// Fetch by id: the pages of `layer` the daemon reads for session `id` (all committed ones
// when `pages` is empty), each checked to hold host_page_bytes of `g` (DATA_LOSS otherwise).
absl::StatusOr<std::vector<FetchedPage>> FetchPagesById(Connection& conn, std::string_view id,
                                                        const Geometry& g, int32_t layer,
                                                        const std::vector<int64_t>& pages);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_CONNECTION_H_
