// DaemonConfig: everything kvtierd can be told, from its embedded default configuration, a
// TOML file (every key documented in deploy/kvtierd.example.toml) and command-line flags,
// in that order of precedence (flags win). Plain data; Validate() says what is wrong with
// the field and the limit.
//
// Thread-compatible value type.
#ifndef KVTIER_DAEMON_CONFIG_H_
#define KVTIER_DAEMON_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtier/options.h"

namespace kvtier::daemon {

// [cold_tier] (docs/service.md#the-cold-tier): a Redis Cluster behind the host tier.
struct ColdTierConfig {
  std::vector<std::string> nodes;     // seed nodes, "host:port"; empty: no cold tier
  std::string key_prefix = "kvtier";  // [A-Za-z0-9_.-]{1,32}, the first part of every key
  std::string user;                   // the daemon's AUTH user (Redis ACL); empty: default
  std::string password;               // AUTH password; empty: no AUTH
  absl::Duration connect_timeout = absl::Seconds(1);     // per TCP connect
  absl::Duration command_timeout = absl::Seconds(2);     // per network round trip
  absl::Duration operation_timeout = absl::Seconds(30);  // one session's demotion or promotion
  uint32_t min_replicas = 0;        // replicas (WAIT) a demotion must reach before it counts
  bool persist_on_shutdown = true;
  // The slot map (CLUSTER SLOTS) is reloaded this often, so replicas that join later are used
  // for replica reads; 0: only on routing errors and replica reads that find no replica.
  absl::Duration slot_map_refresh = absl::Seconds(30);
  // Suspended sessions are demoted once suspended this long, room needed or not (so they
  // outlive a daemon crash and free their host memory early); 0: only when the arena needs
  // the room.
  absl::Duration demote_suspended_after = absl::ZeroDuration();  // a clean shutdown demotes every session first
  bool enabled() const { return !nodes.empty(); }
  friend bool operator==(const ColdTierConfig&, const ColdTierConfig&) = default;
};

// One tenant: an isolated host-memory arena and its sessions.
struct TenantConfig {
  std::string name;                // [A-Za-z0-9_.-]{1,64}
  std::string token;               // required in x-kvtier-token when not empty
  uint64_t host_memory_bytes = 0;  // the tenant's arena (quota), > 0
  int numa_node = -1;              // bind the arena here; -1: from gpu_pci_bus_id, else none
  std::string gpu_pci_bus_id;      // e.g. "0000:3b:00.0": the node nearest this GPU
  std::string hugepages = "auto";  // "off" | "auto" | "require"
  bool lock = true;                // mlock the arena (best effort)
  // A file for the arena (tmpfs or hugetlbfs) so it survives a daemon restart; empty: an
  // anonymous memfd. An absolute path, at most 4000 bytes, one tenant's only.
  std::string arena_path;
  // Uids that may map the arena through the attach socket; empty: the daemon's own uid.
  std::vector<uint32_t> uids;
  // Bytes of this tenant's pages the cold tier may hold; 0: the tenant has no cold tier.
  uint64_t cold_quota_bytes = 0;
  // The tenant's own Redis ACL user for its keys ("~<key_prefix>:<tenant>:*"); empty: the
  // daemon's connection ([cold_tier] user/password) serves the tenant.
  std::string redis_user;
  std::string redis_password;

  friend bool operator==(const TenantConfig&, const TenantConfig&) = default;
};

// Connections the metrics endpoint serves at once, all peers together.
inline constexpr uint32_t kMetricsMaxConnections = 16;

struct DaemonConfig {
  // [server]
  std::string unix_socket;    // gRPC on this Unix socket; empty: the runtime default
                              // ($XDG_RUNTIME_DIR/kvtier/kvtierd.sock or
                              // /tmp/kvtier-<uid>/kvtierd.sock)
  std::string tcp_address;    // optional gRPC on "host:port"; empty: none
  std::string attach_socket;  // shm attach socket; empty: <unix_socket>.attach
  bool shm = true;            // serve the attach socket at all
  std::string admin_token;    // Drain needs it in x-kvtier-token; empty: Drain refused
  uint64_t max_message_bytes = 8ull << 20;  // per gRPC message, both directions
  int32_t rpc_threads = 0;                  // gRPC callback threads hint; 0: gRPC's default
  int32_t cpu_threads = 0;                  // the CPU backend of GRPC sessions; 0: all cores
  absl::Duration shutdown_grace = absl::Seconds(10);  // SIGTERM: finish in-flight calls
  // Work starts or commits only while at least this much of the call's deadline is left.
  absl::Duration deadline_margin = absl::Milliseconds(2);
  int32_t work_threads = 0;         // workers running OpenSession, Step, commits; 0: cores (≥ 2)
  uint32_t max_queued_calls = 256;  // calls waiting for a worker, all tenants together
  absl::Duration attach_handshake_timeout = absl::Seconds(2);  // per attach connection
  uint32_t attach_max_connections = 256;         // attach handshakes in progress at once
  uint32_t attach_max_connections_per_peer = 8;  // ... per peer process
  // [limits]
  uint32_t max_sessions_per_tenant = 64;
  uint32_t max_tokens_per_session = kDefaultMaxTokens;  // per layer
  uint32_t default_max_tokens = 32768;                  // when OpenSession leaves max_tokens 0
  uint32_t max_layers = 256;
  uint32_t max_tokens_per_offload = 4096;       // tokens in one OffloadRequest
  uint32_t max_inflight_calls_per_tenant = 64;  // calls (streams included) at once
  // [metrics] (docs/metrics.md)
  // Where GET /metrics is served: "auto" (a Unix socket, <unix_socket>.metrics), "off",
  // "unix:/path" or "host:port". A TCP address that is not loopback is refused unless
  // metrics_allow_remote: the metrics name tenants and sessions.
  std::string metrics_address = "auto";
  bool metrics_allow_remote = false;
  // Connections one peer (a uid on a Unix socket, an IP address on TCP) may hold at once, of
  // the endpoint's kMetricsMaxConnections.
  uint32_t metrics_max_connections_per_peer = 4;
  // [cold_tier]
  ColdTierConfig cold_tier;
  // [log]
  std::string log_level = "info";   // trace | debug | info | warn | error | off
  std::string log_format = "text";  // text | json
  std::string log_file;             // empty: stderr
  // [[tenant]]
  std::vector<TenantConfig> tenants;

  // INVALID_ARGUMENT naming the key and the limit.
  absl::Status Validate() const;

  friend bool operator==(const DaemonConfig&, const DaemonConfig&) = default;
};

// The configuration kvtierd runs with when given no file: one tenant "default" with no
// token and 1 GiB of host memory, gRPC on the runtime-default Unix socket, shm attach on.
DaemonConfig DefaultConfig();
// The embedded default configuration as TOML text (DefaultConfig() parses it).
std::string_view DefaultConfigToml();

// Parses TOML text over `base` (keys absent from the text keep base's values; [[tenant]]
// tables, when present, replace base's tenants). INVALID_ARGUMENT with the key, the line and
// what was expected, for syntax errors, unknown keys and bad values.
absl::StatusOr<DaemonConfig> ParseConfigToml(std::string_view text, const DaemonConfig& base);
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path, const DaemonConfig& base);

// The runtime-default paths described above, resolved now.
std::string DefaultUnixSocketPath();

// `config` with the empty socket paths filled in (unix_socket: DefaultUnixSocketPath();
// attach_socket: unix_socket + ".attach"; metrics_address "auto": "unix:" + unix_socket +
// ".metrics", "off": "") and the directories that hold them created (mode
// 0700 when this creates them). FAILED_PRECONDITION when a directory cannot be created, or
// when the runtime-default directory exists but belongs to another user; INVALID_ARGUMENT
// when a resolved path is longer than a Unix socket address allows.
absl::StatusOr<DaemonConfig> ResolvePaths(DaemonConfig config);

// Every key the parser knows, as "table.key" ("server.unix_socket", ..., "tenant.name" for
// the keys of [[tenant]] tables), in the order deploy/kvtierd.example.toml documents them.
std::vector<std::string> KnownConfigKeys();

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_CONFIG_H_
