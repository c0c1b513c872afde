// Connection: what a Client and its sessions share — the gRPC channel and stub, the options,
// the daemon's capabilities, and (for SHM sessions) the tenant arena, attached and mapped
// once: its mappings stay for the Connection's life, and only their registration with a
// backend follows the sessions. Sessions hold it by shared_ptr, so they keep working after
// the Client object is gone.
//
// Thread-safe.
#ifndef KVTIER_CLIENT_CONNECTION_H_
#define KVTIER_CLIENT_CONNECTION_H_

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
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

class ArenaMappings;

// The tenant arena as the sessions on one backend use it: a mapping registered with that
// backend while this lives. The mapping itself belongs to the Connection's ArenaMappings and
// outlives this: the destructor only unregisters it and hands it back, so the next session
// (on any backend) finds the arena mapped and its page tables filled.
struct ArenaMapping {
  ArenaMapping() = default;
  ArenaMapping(const ArenaMapping&) = delete;
  ArenaMapping& operator=(const ArenaMapping&) = delete;
  ~ArenaMapping();

  std::shared_ptr<Backend> owned_backend;  // the Client's CPU backend; null for an engine's
  Backend* backend = nullptr;              // the one registered with
  HostArena* arena = nullptr;              // owned by `mappings`
  std::shared_ptr<ArenaMappings> mappings;
};

// Every mapping of the tenant arena one Connection made, each kept until the last holder
// (the Connection or an ArenaMapping) is gone, and registered with one backend at a time
// (HostArena's limit): a second mapping is made only while two backends are in use at once.
//
// Thread-safe.
class ArenaMappings : public std::enable_shared_from_this<ArenaMappings> {
 public:
  // `first`: the attach's mapping (HostArena::Map of the received descriptor, populated).
  explicit ArenaMappings(std::unique_ptr<HostArena> first);
  ArenaMappings(const ArenaMappings&) = delete;
  ArenaMappings& operator=(const ArenaMappings&) = delete;

  // The mapping registered with `backend` for as long as the result lives: the one already
  // registered with it, else an unused one registered now, else a new mapping of the arena.
  // `owned`: kept by the result (the Client's CPU backend). Errors: HostArena::Map's and
  // RegisterWith's.
  absl::StatusOr<std::shared_ptr<ArenaMapping>> For(Backend& backend,
                                                    std::shared_ptr<Backend> owned);
  // Mappings of the arena made so far, the attach's included.
  int64_t maps() const;

 private:
  friend struct ArenaMapping;
  struct Entry {
    std::unique_ptr<HostArena> arena;
    Backend* backend = nullptr;          // registered with; null: unused
    std::weak_ptr<ArenaMapping> user{};  // the holder while `backend` is set
  };
  // ~ArenaMapping: unregisters `arena` and marks it unused.
  void Release(HostArena* arena);

  mutable Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);  // never empty; [0] is the attach's
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
  // backend, created on first use), shared by the sessions on that backend. The first call
  // attaches over the attach socket and maps the arena; later ones reuse the mapping
  // (ArenaMappings). FAILED_PRECONDITION when the daemon serves no attach socket; the attach
  // errors of shm_attach.h otherwise.
  absl::StatusOr<std::shared_ptr<ArenaMapping>> ArenaFor(Backend* backend);
  // Mappings of the arena this Connection made (0 before the first SHM session).
  int64_t arena_maps() const;

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

  mutable Mutex mu_;
  std::shared_ptr<ArenaMappings> mappings_ ABSL_GUARDED_BY(mu_);  // set by the attach
  std::shared_ptr<Backend> cpu_backend_ ABSL_GUARDED_BY(mu_);
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
