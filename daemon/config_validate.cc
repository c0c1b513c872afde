// DaemonConfig::Validate and the runtime paths (DefaultUnixSocketPath, ResolvePaths).
//
// Invariant: every message names the key ("limits.default_max_tokens", "tenant[2].name"), the value
// and the limit it broke, so an operator can fix the file from the message alone.
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "daemon/config.h"
#include "kvtier/geometry.h"
#include "offload/host_arena.h"

namespace kvtier::daemon {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
// sun_path holds the path and its terminating NUL.
constexpr size_t kMaxSocketPathBytes = sizeof(sockaddr_un::sun_path) - 1;
constexpr size_t kMaxTokenBytes = 1024;
constexpr int64_t kMaxThreads = 1024;
constexpr int64_t kMaxTenants = 1024;
constexpr int64_t kMaxNumaNode = 1023;
constexpr uint32_t kMaxSessionsPerTenant = 65536;
constexpr uint32_t kMaxTokensPerSession = uint32_t{1} << 24;
constexpr absl::Duration kMaxShutdownGrace = absl::Hours(1);
constexpr int64_t kMaxDeadlineMarginMs = 10000;
constexpr int64_t kMaxQueuedCalls = 1 << 20;
constexpr int64_t kMaxHandshakeMs = 60000;
constexpr int64_t kMaxAttachConnections = 65536;
constexpr int64_t kMaxInflightCallsPerTenant = 1 << 20;
constexpr int64_t kMaxColdTimeoutMs = 10 * 60 * 1000;  // 10 min
constexpr int64_t kMaxMinReplicas = 16;
constexpr size_t kMaxKeyPrefixBytes = 32;
constexpr size_t kMaxRedisUserBytes = 64;
constexpr size_t kMaxArenaPathBytes = 4000;  // tenant.arena_path (PATH_MAX is 4096)

// "key = value is out of range [lo, hi]" when value is outside [lo, hi].
absl::Status CheckRange(std::string_view key, int64_t value, int64_t lo, int64_t hi,
                        std::string_view why = "") {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat("%s = %d is out of range [%d, %d]%s%s", key,
                                                    value, lo, hi, why.empty() ? "" : ": ", why));
}

absl::Status CheckOneOf(std::string_view key, std::string_view value,
                        std::initializer_list<std::string_view> allowed) {
  for (std::string_view a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  std::string list;
  for (std::string_view a : allowed) list += absl::StrFormat("%s%s", list.empty() ? "" : " | ", a);
  return absl::InvalidArgumentError(
      absl::StrFormat("%s = \"%s\" is not one of %s", key, value, list));
}

absl::Status CheckSocketPath(std::string_view key, const std::string& path) {
  if (path.size() <= kMaxSocketPathBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s \"%s\" is %d bytes, longer than a Unix socket path allows (%d)", key,
                      path, path.size(), kMaxSocketPathBytes));
}

// gRPC metadata values must be printable ASCII.
absl::Status CheckToken(std::string_view key, std::string_view token) {
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is %d bytes, more than %d", key, token.size(), kMaxTokenBytes));
  }
  for (char c : token) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s holds a character outside printable ASCII (0x20-0x7e), which gRPC "
                          "metadata cannot carry",
                          key));
    }
  }
  return absl::OkStatus();
}

// "host:port" or "[v6]:port", port in [0, 65535] (0: any free port).
absl::Status CheckTcpAddress(std::string_view key, std::string_view address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(std::string(address.substr(colon + 1)), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = \"%s\" is not host:port with a port in [0, 65535] "
                        "(e.g. \"127.0.0.1:50551\", \"[::]:50551\")",
                        key, address));
  }
  return absl::OkStatus();
}

// The host of "host:port" is a loopback one (127.0.0.0/8, ::1, localhost).
bool IsLoopbackHost(std::string_view address) {
  std::string_view host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

constexpr std::string_view kUnixPrefix = "unix:";

bool IsNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
}

// `value` matches [A-Za-z0-9_.-]{1,max_bytes}.
bool IsName(std::string_view value, size_t max_bytes) {
  return !value.empty() && value.size() <= max_bytes &&
         std::all_of(value.begin(), value.end(), [](char c) { return IsNameChar(c); });
}

// A Redis AUTH user or password: at most 1024 bytes, printable ASCII without spaces (it
// travels in AUTH and, in a per-tenant ACL, in an ACL SETUSER line).
absl::Status CheckRedisSecret(std::string_view key, std::string_view value) {
  if (value.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is %d bytes, more than %d", key, value.size(), kMaxTokenBytes));
  }
  for (char c : value) {
    if (c <= 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s holds a space or a character outside printable ASCII (0x21-0x7e)", key));
    }
  }
  return absl::OkStatus();
}

// A cold-tier seed: "host:port" with a non-empty host and a port in [1, 65535].
absl::Status CheckRedisNode(std::string_view key, std::string_view node) {
  const size_t colon = node.rfind(':');
  uint32_t port = 0;
  const bool host_ok = colon != std::string_view::npos && colon > 0 &&
                       std::none_of(node.begin(), node.begin() + colon,
                                    [](char c) { return c <= 0x20 || c > 0x7e; });
  if (!host_ok || !absl::SimpleAtoi(std::string(node.substr(colon + 1)), &port) || port < 1 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = \"%s\" is not host:port with a non-empty host and a port in "
                        "[1, 65535] (e.g. \"10.0.0.5:6379\")",
                        key, node));
  }
  return absl::OkStatus();
}

absl::Status ValidateColdTier(const ColdTierConfig& c) {
  for (size_t i = 0; i < c.nodes.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(CheckRedisNode(absl::StrFormat("cold_tier.nodes[%d]", i), c.nodes[i]));
  }
  if (!IsName(c.key_prefix, kMaxKeyPrefixBytes)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cold_tier.key_prefix = \"%s\" must match [A-Za-z0-9_.-]{1,%d}",
                        c.key_prefix, kMaxKeyPrefixBytes));
  }
  KVTIER_RETURN_IF_ERROR(CheckRedisSecret("cold_tier.user", c.user));
  KVTIER_RETURN_IF_ERROR(CheckRedisSecret("cold_tier.password", c.password));
  if (!c.user.empty() && c.password.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cold_tier.user = \"%s\" is set but cold_tier.password is empty: AUTH needs a password "
        "(a password alone authenticates the default user)",
        c.user));
  }
  const struct {
    std::string_view key;
    absl::Duration value;
  } timeouts[] = {{"cold_tier.connect_timeout_ms", c.connect_timeout},
                  {"cold_tier.command_timeout_ms", c.command_timeout},
                  {"cold_tier.operation_timeout_ms", c.operation_timeout}};
  for (const auto& [key, value] : timeouts) {
    KVTIER_RETURN_IF_ERROR(
        CheckRange(key, absl::ToInt64Milliseconds(value), 1, kMaxColdTimeoutMs, "1 ms to 10 min"));
  }
  KVTIER_RETURN_IF_ERROR(
      CheckRange("cold_tier.min_replicas", c.min_replicas, 0, kMaxMinReplicas));
  KVTIER_RETURN_IF_ERROR(CheckRange("cold_tier.slot_map_refresh_ms",
                                    absl::ToInt64Milliseconds(c.slot_map_refresh), 0,
                                    kMaxColdTimeoutMs, "0 (only on errors) to 10 min"));
  return CheckRange("cold_tier.demote_suspended_after_ms",
                    absl::ToInt64Milliseconds(c.demote_suspended_after), 0, int64_t{86'400'000},
                    "0 (only when the arena needs the room) to a day");
}

absl::Status ValidateMetrics(const DaemonConfig& c) {
  KVTIER_RETURN_IF_ERROR(CheckRange(
      "metrics.max_connections_per_peer", c.metrics_max_connections_per_peer, 1,
      kMetricsMaxConnections,
      absl::StrFormat("at most the %d connections the endpoint serves", kMetricsMaxConnections)));
  const std::string& a = c.metrics_address;
  if (a.empty() || a == "auto" || a == "off") return absl::OkStatus();
  if (a.starts_with(kUnixPrefix)) {
    const std::string path = a.substr(kUnixPrefix.size());
    if (path.empty() || path.front() != '/') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "metrics.address = \"%s\": a Unix socket address must be unix:/absolute/path", a));
    }
    return CheckSocketPath("metrics.address", path);
  }
  KVTIER_RETURN_IF_ERROR(CheckTcpAddress("metrics.address", a));
  if (!IsLoopbackHost(a) && !c.metrics_allow_remote) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "metrics.address = \"%s\" is not a loopback address: /metrics names tenants and "
        "sessions and has no authentication; set metrics.allow_remote = true to serve it there",
        a));
  }
  return absl::OkStatus();
}

// [[DDDD:]BB:DD.F] with hex digits, as nvidia-smi and sysfs print it.
bool IsPciBusId(std::string_view bus_id) {
  const std::string id = bus_id.size() == 7 ? absl::StrFormat("0000:%s", bus_id)  // BB:DD.F
                                            : std::string(bus_id);
  if (id.size() != 12 || id[4] != ':' || id[7] != ':' || id[10] != '.') return false;
  for (int i : {0, 1, 2, 3, 5, 6, 8, 9, 11}) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(id[i]))) return false;
  }
  return true;
}

absl::Status ValidateTenantColdTier(const TenantConfig& tenant, const std::string& key,
                                    const ColdTierConfig& cold_tier) {
  if (tenant.cold_quota_bytes > 0 && !cold_tier.enabled()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.cold_quota_bytes = %d needs a cold tier, but cold_tier.nodes is empty; set "
        "cold_tier.nodes or make the quota 0",
        key, tenant.cold_quota_bytes));
  }
  if (!tenant.redis_user.empty() && !IsName(tenant.redis_user, kMaxRedisUserBytes)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.redis_user = \"%s\" must match [A-Za-z0-9_.-]{1,%d}", key,
                        tenant.redis_user, kMaxRedisUserBytes));
  }
  KVTIER_RETURN_IF_ERROR(
      CheckRedisSecret(absl::StrCat(key, ".redis_password"), tenant.redis_password));
  if (tenant.redis_user.empty() != tenant.redis_password.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.redis_user and %s.redis_password go together: set both (the tenant's own ACL user) "
        "or neither (the daemon's connection serves the tenant)",
        key, key));
  }
  return absl::OkStatus();
}

absl::Status ValidateTenant(const TenantConfig& tenant, size_t index,
                            const ColdTierConfig& cold_tier) {
  const std::string key = absl::StrCat("tenant[", index, "]");
  if (!IsName(tenant.name, 64)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.name = \"%s\" must match [A-Za-z0-9_.-]{1,64}", key, tenant.name));
  }
  KVTIER_RETURN_IF_ERROR(CheckToken(absl::StrCat(key, ".token"), tenant.token));
  if (tenant.host_memory_bytes < kMiB || tenant.host_memory_bytes > HostArena::kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.host_memory_bytes = %d is out of range [%d, %d] (1 MiB to 4 TiB)", key,
                        tenant.host_memory_bytes, kMiB, HostArena::kMaxBytes));
  }
  KVTIER_RETURN_IF_ERROR(CheckRange(absl::StrCat(key, ".numa_node"), tenant.numa_node, -1,
                                    kMaxNumaNode, "-1 means no explicit node"));
  if (!tenant.gpu_pci_bus_id.empty() && !IsPciBusId(tenant.gpu_pci_bus_id)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.gpu_pci_bus_id = \"%s\" is not a PCI bus id like \"0000:3b:00.0\"", key,
                        tenant.gpu_pci_bus_id));
  }
  KVTIER_RETURN_IF_ERROR(
      CheckOneOf(absl::StrCat(key, ".hugepages"), tenant.hugepages, {"off", "auto", "require"}));
  if (!tenant.arena_path.empty() && tenant.arena_path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.arena_path = \"%s\" must be an absolute path (e.g. /dev/shm/kvtier-%s.arena), or "
        "\"\" for an anonymous arena",
        key, absl::CHexEscape(tenant.arena_path), tenant.name));
  }
  if (tenant.arena_path.size() > kMaxArenaPathBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.arena_path is %d bytes long; at most %d",
                                                      key, tenant.arena_path.size(),
                                                      kMaxArenaPathBytes));
  }
  for (size_t i = 0; i < tenant.uids.size(); ++i) {
    if (tenant.uids[i] == static_cast<uint32_t>(-1)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.uids[%d] = 4294967295 is not a valid uid", key, i));
    }
  }
  return ValidateTenantColdTier(tenant, key, cold_tier);
}

absl::Status ValidateServer(const DaemonConfig& c) {
  KVTIER_RETURN_IF_ERROR(CheckSocketPath("server.unix_socket", c.unix_socket));
  KVTIER_RETURN_IF_ERROR(CheckSocketPath("server.attach_socket", c.attach_socket));
  if (!c.unix_socket.empty() && c.unix_socket == c.attach_socket) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "server.attach_socket = \"%s\" is the same path as server.unix_socket", c.attach_socket));
  }
  if (!c.tcp_address.empty()) {
    KVTIER_RETURN_IF_ERROR(CheckTcpAddress("server.tcp_address", c.tcp_address));
  }
  KVTIER_RETURN_IF_ERROR(CheckToken("server.admin_token", c.admin_token));
  if (c.max_message_bytes < 64 * 1024 || c.max_message_bytes > kGiB) {
    return absl::InvalidArgumentError(
        absl::StrFormat("server.max_message_bytes = %d is out of range [%d, %d] (64 KiB to 1 GiB)",
                        c.max_message_bytes, 64 * 1024, kGiB));
  }
  KVTIER_RETURN_IF_ERROR(
      CheckRange("server.rpc_threads", c.rpc_threads, 0, kMaxThreads, "0 means gRPC's default"));
  KVTIER_RETURN_IF_ERROR(
      CheckRange("server.cpu_threads", c.cpu_threads, 0, kMaxThreads, "0 means all cores"));
  KVTIER_RETURN_IF_ERROR(CheckRange("server.shutdown_grace_ms",
                                    absl::ToInt64Milliseconds(c.shutdown_grace), 0,
                                    absl::ToInt64Milliseconds(kMaxShutdownGrace)));
  KVTIER_RETURN_IF_ERROR(CheckRange("server.deadline_margin_ms",
                                    absl::ToInt64Milliseconds(c.deadline_margin), 0,
                                    kMaxDeadlineMarginMs));
  KVTIER_RETURN_IF_ERROR(CheckRange("server.work_threads", c.work_threads, 0, kMaxThreads,
                                    "0 means one per core, at least 2"));
  KVTIER_RETURN_IF_ERROR(
      CheckRange("server.max_queued_calls", c.max_queued_calls, 1, kMaxQueuedCalls));
  KVTIER_RETURN_IF_ERROR(CheckRange("server.attach_handshake_timeout_ms",
                                    absl::ToInt64Milliseconds(c.attach_handshake_timeout), 1,
                                    kMaxHandshakeMs));
  KVTIER_RETURN_IF_ERROR(CheckRange("server.attach_max_connections", c.attach_max_connections, 1,
                                    kMaxAttachConnections));
  return CheckRange("server.attach_max_connections_per_peer", c.attach_max_connections_per_peer, 1,
                    c.attach_max_connections, "at most server.attach_max_connections");
}

absl::Status ValidateLimits(const DaemonConfig& c) {
  KVTIER_RETURN_IF_ERROR(CheckRange("limits.max_sessions_per_tenant", c.max_sessions_per_tenant, 1,
                                    kMaxSessionsPerTenant));
  KVTIER_RETURN_IF_ERROR(CheckRange("limits.max_tokens_per_session", c.max_tokens_per_session, 1,
                                    kMaxTokensPerSession));
  KVTIER_RETURN_IF_ERROR(CheckRange("limits.default_max_tokens", c.default_max_tokens, 1,
                                    c.max_tokens_per_session,
                                    "at most limits.max_tokens_per_session"));
  KVTIER_RETURN_IF_ERROR(
      CheckRange("limits.max_layers", c.max_layers, 1, Geometry::kMaxLayers, "Geometry's limit"));
  KVTIER_RETURN_IF_ERROR(CheckRange("limits.max_tokens_per_offload", c.max_tokens_per_offload, 1,
                                    c.max_tokens_per_session,
                                    "at most limits.max_tokens_per_session"));
  return CheckRange("limits.max_inflight_calls_per_tenant", c.max_inflight_calls_per_tenant, 1,
                    kMaxInflightCallsPerTenant);
}

absl::Status ValidateLog(const DaemonConfig& c) {
  KVTIER_RETURN_IF_ERROR(
      CheckOneOf("log.level", c.log_level, {"trace", "debug", "info", "warn", "error", "off"}));
  return CheckOneOf("log.format", c.log_format, {"text", "json"});
}

// Creates `dir` and its missing parents, mode 0700. `owned_by_us`: an existing `dir` must belong to
// this uid (a shared /tmp is not to be trusted).
absl::Status MakeSocketDirectory(const std::string& dir, bool owned_by_us) {
  if (dir.empty()) return absl::OkStatus();
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("socket directory ", dir, " exists and is not a directory"));
    }
    if (owned_by_us && st.st_uid != ::getuid()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("socket directory %s belongs to uid %d, not to this user (uid %d); "
                          "remove it or set server.unix_socket",
                          dir, st.st_uid, ::getuid()));
    }
    return absl::OkStatus();
  }
  const size_t slash = dir.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    KVTIER_RETURN_IF_ERROR(MakeSocketDirectory(dir.substr(0, slash), /*owned_by_us=*/false));
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create socket directory ", dir, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status DaemonConfig::Validate() const {
  KVTIER_RETURN_IF_ERROR(ValidateServer(*this));
  KVTIER_RETURN_IF_ERROR(ValidateLimits(*this));
  KVTIER_RETURN_IF_ERROR(ValidateMetrics(*this));
  KVTIER_RETURN_IF_ERROR(ValidateColdTier(cold_tier));
  KVTIER_RETURN_IF_ERROR(ValidateLog(*this));
  if (tenants.empty()) {
    return absl::InvalidArgumentError("no [[tenant]]: at least one tenant is required");
  }
  KVTIER_RETURN_IF_ERROR(CheckRange("number of [[tenant]] tables",
                                    static_cast<int64_t>(tenants.size()), 1, kMaxTenants));
  std::set<std::string_view> names;
  std::map<std::string_view, size_t> arena_paths;  // → the index of the tenant using it
  for (size_t i = 0; i < tenants.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(ValidateTenant(tenants[i], i, cold_tier));
    if (!names.insert(tenants[i].name).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tenant[%d].name = \"%s\" is used by an earlier tenant; names must be unique", i,
          tenants[i].name));
    }
    if (tenants[i].arena_path.empty()) continue;
    const auto [it, inserted] = arena_paths.emplace(tenants[i].arena_path, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tenant[%d].arena_path = \"%s\" is also tenant[%d].arena_path: tenants '%s' and '%s' "
          "cannot share an arena file",
          i, absl::CHexEscape(tenants[i].arena_path), it->second, tenants[it->second].name,
          tenants[i].name));
    }
  }
  return absl::OkStatus();
}

std::string DefaultUnixSocketPath() {
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] != '\0' && ::access(runtime_dir, W_OK) == 0) {
    return absl::StrCat(runtime_dir, "/kvtier/kvtierd.sock");
  }
  return absl::StrCat("/tmp/kvtier-", ::getuid(), "/kvtierd.sock");
}

absl::StatusOr<DaemonConfig> ResolvePaths(DaemonConfig config) {
  const bool runtime_default = config.unix_socket.empty();
  if (runtime_default) config.unix_socket = DefaultUnixSocketPath();
  if (config.attach_socket.empty()) config.attach_socket = config.unix_socket + ".attach";
  KVTIER_RETURN_IF_ERROR(CheckSocketPath("server.unix_socket", config.unix_socket));
  KVTIER_RETURN_IF_ERROR(CheckSocketPath("server.attach_socket", config.attach_socket));
  if (config.metrics_address == "off") config.metrics_address.clear();
  if (config.metrics_address == "auto") {
    config.metrics_address = std::string(kUnixPrefix) + config.unix_socket + ".metrics";
    KVTIER_RETURN_IF_ERROR(ValidateMetrics(config));
  }
  KVTIER_RETURN_IF_ERROR(MakeSocketDirectory(DirectoryOf(config.unix_socket), runtime_default));
  if (config.metrics_address.starts_with(kUnixPrefix)) {
    KVTIER_RETURN_IF_ERROR(
        MakeSocketDirectory(DirectoryOf(config.metrics_address.substr(kUnixPrefix.size())), false));
  }
  if (config.shm) {
    KVTIER_RETURN_IF_ERROR(MakeSocketDirectory(DirectoryOf(config.attach_socket), false));
  }
  return config;
}

}  // namespace kvtier::daemon
