// AttachServer: the daemon's shared-memory attach socket (docs/architecture.md#processes). A local
// engine connects to this Unix socket and sends one length-prefixed kvtier.v1.AttachRequest
// (tenant, token); the server reads the peer's credentials with SO_PEERCRED, asks the
// authorizer, and answers one length-prefixed AttachReply — with the tenant arena's memfd
// attached as SCM_RIGHTS when the answer is OK, or the refusal's code and message (the
// connection is then closed). Wire format: proto/kvtier/v1/kvtier.proto, AttachRequest.
//
// Runs on its own Boost.Asio io_context thread; each connection has a deadline (a client
// that sends nothing is dropped) and a request-size limit. The server never trusts the
// request: lengths are checked before reading, bad messages get INVALID_ARGUMENT, a
// protocol version outside the daemon's range FAILED_PRECONDITION.
//
// Fairness (daemon/peer_table.h, keyed by process): the peer's credentials are read at
// accept. One peer process may hold at most max_connections_per_peer handshakes (further
// connections are closed at once), and when max_connections are taken, a new connection
// replaces the oldest one of the process that holds the most: a flood of silent connections
// from one client cannot keep another client's attach from being answered.
//
// Thread-safe. Stop() (or the destructor) closes the socket, unlinks its path, and waits
// for the thread.
#ifndef KVTIER_DAEMON_ATTACH_SERVER_H_
#define KVTIER_DAEMON_ATTACH_SERVER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/peer_table.h"

namespace kvtier::daemon {

// What an authorised peer receives. `fd` is borrowed: it must stay open until the reply is
// sent (the tenant's arena outlives the server).
struct AttachGrant {
  int fd = -1;
  uint64_t arena_bytes = 0;
  std::string arena_name;
};

// Decides an attach: the grant, or the refusal (PERMISSION_DENIED for a uid or token that
// may not, NOT_FOUND for an unknown tenant, UNAVAILABLE while draining).
using AttachAuthorizer = std::function<absl::StatusOr<AttachGrant>(
    const PeerCredentials& peer, std::string_view tenant, std::string_view token)>;

struct AttachServerOptions {
  absl::Duration handshake_timeout = absl::Seconds(2);  // per connection, > 0
  uint32_t max_request_bytes = 4096;                    // > 0
  // Handshakes in progress at once, > 0 (a flood of silent clients cannot exhaust the
  // daemon's descriptors), and per peer process, in [1, max_connections].
  uint32_t max_connections = 256;
  uint32_t max_connections_per_peer = 8;
  // AttachRequest.protocol_version must lie in [min, max].
  uint32_t min_protocol_version = 1;
  uint32_t max_protocol_version = 1;
};

class AttachServer {
 public:
  // Binds `path` (a stale socket file left by a dead daemon is replaced; a live one, or
  // any other file, is FAILED_PRECONDITION), mode 0660, and starts serving. INVALID_ARGUMENT
  // for a path longer than sun_path allows (saying the limit), an empty authorizer or an
  // option out of range. The authorizer runs on the server's thread, one call at a time.
  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(
      const std::string& path, AttachAuthorizer authorize, const AttachServerOptions& options = {});
  AttachServer(const AttachServer&) = delete;
  AttachServer& operator=(const AttachServer&) = delete;
  virtual ~AttachServer() = default;
  // Idempotent. REQUIRES: not called from the authorizer (it runs on the server's thread).
  virtual void Stop() = 0;
  virtual const std::string& path() const = 0;
  virtual uint64_t granted() const = 0;  // attaches answered OK
  virtual uint64_t refused() const = 0;  // attaches refused (any code)
  // Connections closed unanswered: over a peer's limit, replaced at the global limit, or
  // silent past the handshake timeout.
  virtual uint64_t dropped() const = 0;
  // Every handshake's outcome and how many ended so: "ok", a refusal's code in lower case
  // ("permission_denied", "not_found", "unavailable", "invalid_argument", ...), or a
  // connection closed unanswered ("dropped_peer_limit", "dropped_global_limit",
  // "dropped_timeout"). Outcomes that never happened are left out.
  virtual std::vector<std::pair<std::string, uint64_t>> Outcomes() const = 0;

 protected:
  AttachServer() = default;
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_ATTACH_SERVER_H_
