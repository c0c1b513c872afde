// The embedded default configuration (kvtierd --print-default-config) and DefaultConfig().
//
// Invariant: the text parses over a value-initialised DaemonConfig and validates; config_test
// guards it, and DefaultConfig() aborts if a broken build ever ships.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "daemon/config.h"

namespace kvtier::daemon {
namespace {

constexpr std::string_view kDefaultConfigToml =
    R"toml(# kvtierd's built-in configuration: what it runs with when given no --config file.
# A file given with --config is read over it (keys it sets win; [[tenant]] tables, when it
# has any, replace the tenant below); command-line flags win over both. Every key, with
# its unit and meaning: deploy/kvtierd.example.toml.

[server]
unix_socket = ""          # "": $XDG_RUNTIME_DIR/kvtier/kvtierd.sock or /tmp/kvtier-<uid>/kvtierd.sock
tcp_address = ""          # "": no TCP listener
attach_socket = ""        # "": <unix_socket>.attach
shm = true
admin_token = ""          # "": Drain is refused
max_message_bytes = 8388608
rpc_threads = 0
cpu_threads = 0
shutdown_grace_ms = 10000
deadline_margin_ms = 2
work_threads = 0          # 0: one per core, at least 2
max_queued_calls = 256
attach_handshake_timeout_ms = 2000
attach_max_connections = 256
attach_max_connections_per_peer = 8

[limits]
max_sessions_per_tenant = 64
max_tokens_per_session = 131072
default_max_tokens = 32768
max_layers = 256
max_tokens_per_offload = 4096
max_inflight_calls_per_tenant = 64

[metrics]
address = "auto"          # a Unix socket beside the gRPC one: <unix_socket>.metrics
allow_remote = false
max_connections_per_peer = 4

[cold_tier]
nodes = []                # []: no cold tier
key_prefix = "kvtier"
user = ""
password = ""             # "": no AUTH
connect_timeout_ms = 1000
command_timeout_ms = 2000
operation_timeout_ms = 30000
min_replicas = 0
slot_map_refresh_ms = 30000     # 0: only on routing errors and replica misses
persist_on_shutdown = true
demote_suspended_after_ms = 0   # 0: only when the arena needs the room

[log]
level = "info"
format = "text"
file = ""                 # "": stderr

[[tenant]]
name = "default"
token = ""
host_memory_bytes = 1073741824  # 1 GiB
numa_node = -1
gpu_pci_bus_id = ""
hugepages = "auto"
lock = true
arena_path = ""           # "": an anonymous memfd, lost when the daemon exits
uids = []                 # []: only the daemon's own uid may attach
cold_quota_bytes = 0      # 0: no cold tier for this tenant
redis_user = ""           # "": the daemon's own connection serves the tenant
redis_password = ""
)toml";

}  // namespace

std::string_view DefaultConfigToml() { return kDefaultConfigToml; }

DaemonConfig DefaultConfig() {
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(kDefaultConfigToml, DaemonConfig{});
  if (config.ok()) return *std::move(config);
  // Only a broken build gets here (config_test parses the same text).
  std::fprintf(stderr, "kvtierd: the embedded default configuration is broken: %s\n",
               std::string(config.status().message()).c_str());
  std::abort();
}

}  // namespace kvtier::daemon
