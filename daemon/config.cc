// ParseConfigToml: TOML text → DaemonConfig, driven by one table of known keys per section.
//
// toml++ is used header-only with TOML_EXCEPTIONS=0 (see daemon/CMakeLists.txt): parse() returns
// a parse_result and nothing here throws. Invariants: every key the parser accepts is in exactly
// one field table below, KnownConfigKeys() lists exactly those tables, and every error names the
// key ("server.rpc_threads", "tenant[1].uids") and its line.
#include "daemon/config.h"

#include <toml++/toml.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::daemon {
namespace {

std::string_view TypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time:
      return "a date/time";
    default:
      return "nothing";
  }
}

int64_t LineOf(const toml::node& node) { return node.source().begin.line; }

absl::Status WrongType(const toml::node& node, std::string_view key, std::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrFormat("line %d: %s must be %s, got %s", LineOf(node), key, want, TypeName(node)));
}

absl::Status ReadString(const toml::node& node, std::string_view key, std::string* out) {
  const auto* value = node.as_string();
  if (value == nullptr) return WrongType(node, key, "a string");
  *out = value->get();
  return absl::OkStatus();
}

absl::Status ReadBool(const toml::node& node, std::string_view key, bool* out) {
  const auto* value = node.as_boolean();
  if (value == nullptr) return WrongType(node, key, "a boolean (true or false)");
  *out = value->get();
  return absl::OkStatus();
}

// An integer that fits T; the key's own limits are Validate()'s business.
template <class T>
absl::Status ReadInt(const toml::node& node, std::string_view key, T* out) {
  const auto* value = node.as_integer();
  if (value == nullptr) return WrongType(node, key, "an integer");
  const int64_t v = value->get();
  constexpr int64_t kMin = static_cast<int64_t>(std::numeric_limits<T>::min());
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<T>::max());
  if (v < kMin || (v > 0 && static_cast<uint64_t>(v) > kMax)) {
    return absl::InvalidArgumentError(absl::StrFormat("line %d: %s = %d does not fit [%d, %d]",
                                                      LineOf(node), key, v, kMin, kMax));
  }
  *out = static_cast<T>(v);
  return absl::OkStatus();
}

absl::Status ReadMillis(const toml::node& node, std::string_view key, absl::Duration* out) {
  int64_t ms = 0;
  KVTIER_RETURN_IF_ERROR(ReadInt(node, key, &ms));
  *out = absl::Milliseconds(ms);
  return absl::OkStatus();
}

absl::Status ReadUids(const toml::node& node, std::string_view key, std::vector<uint32_t>* out) {
  const toml::array* array = node.as_array();
  if (array == nullptr) return WrongType(node, key, "an array of integers (uids)");
  out->clear();
  for (size_t i = 0; i < array->size(); ++i) {
    uint32_t uid = 0;
    KVTIER_RETURN_IF_ERROR(ReadInt((*array)[i], absl::StrFormat("%s[%d]", key, i), &uid));
    out->push_back(uid);
  }
  return absl::OkStatus();
}

absl::Status ReadStrings(const toml::node& node, std::string_view key,
                         std::vector<std::string>* out) {
  const toml::array* array = node.as_array();
  if (array == nullptr) return WrongType(node, key, "an array of strings");
  out->clear();
  for (size_t i = 0; i < array->size(); ++i) {
    std::string value;
    KVTIER_RETURN_IF_ERROR(ReadString((*array)[i], absl::StrFormat("%s[%d]", key, i), &value));
    out->push_back(std::move(value));
  }
  return absl::OkStatus();
}

// One known key of a section: reads `node` (named `key` in messages) into *T.
template <class T>
struct Field {
  std::string_view name;
  absl::Status (*read)(const toml::node& node, std::string_view key, T* out);
};

using ConfigField = Field<DaemonConfig>;
using TenantField = Field<TenantConfig>;

// clang-format off
constexpr ConfigField kServerFields[] = {
    {"unix_socket", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->unix_socket); }},
    {"tcp_address", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->tcp_address); }},
    {"attach_socket", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->attach_socket); }},
    {"shm", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadBool(n, k, &c->shm); }},
    {"admin_token", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->admin_token); }},
    {"max_message_bytes", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_message_bytes); }},
    {"rpc_threads", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->rpc_threads); }},
    {"cpu_threads", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->cpu_threads); }},
    {"shutdown_grace_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->shutdown_grace); }},
    {"deadline_margin_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->deadline_margin); }},
    {"work_threads", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->work_threads); }},
    {"max_queued_calls", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_queued_calls); }},
    {"attach_handshake_timeout_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->attach_handshake_timeout); }},
    {"attach_max_connections", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->attach_max_connections); }},
    {"attach_max_connections_per_peer", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->attach_max_connections_per_peer); }},
};
constexpr ConfigField kLimitsFields[] = {
    {"max_sessions_per_tenant", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_sessions_per_tenant); }},
    {"max_tokens_per_session", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_tokens_per_session); }},
    {"default_max_tokens", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->default_max_tokens); }},
    {"max_layers", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_layers); }},
    {"max_tokens_per_offload", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_tokens_per_offload); }},
    {"max_inflight_calls_per_tenant", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->max_inflight_calls_per_tenant); }},
};
constexpr ConfigField kLogFields[] = {
    {"level", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->log_level); }},
    {"format", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->log_format); }},
    {"file", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->log_file); }},
};
constexpr ConfigField kMetricsFields[] = {
    {"address", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->metrics_address); }},
    {"allow_remote", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadBool(n, k, &c->metrics_allow_remote); }},
    {"max_connections_per_peer", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->metrics_max_connections_per_peer); }},
};
constexpr ConfigField kColdTierFields[] = {
    {"nodes", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadStrings(n, k, &c->cold_tier.nodes); }},
    {"key_prefix", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->cold_tier.key_prefix); }},
    {"user", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->cold_tier.user); }},
    {"password", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadString(n, k, &c->cold_tier.password); }},
    {"connect_timeout_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->cold_tier.connect_timeout); }},
    {"command_timeout_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->cold_tier.command_timeout); }},
    {"operation_timeout_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->cold_tier.operation_timeout); }},
    {"min_replicas", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadInt(n, k, &c->cold_tier.min_replicas); }},
    {"slot_map_refresh_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->cold_tier.slot_map_refresh); }},
    {"persist_on_shutdown", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadBool(n, k, &c->cold_tier.persist_on_shutdown); }},
    {"demote_suspended_after_ms", [](const toml::node& n, std::string_view k, DaemonConfig* c) { return ReadMillis(n, k, &c->cold_tier.demote_suspended_after); }},
};
constexpr TenantField kTenantFields[] = {
    {"name", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->name); }},
    {"token", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->token); }},
    {"host_memory_bytes", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadInt(n, k, &t->host_memory_bytes); }},
    {"numa_node", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadInt(n, k, &t->numa_node); }},
    {"gpu_pci_bus_id", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->gpu_pci_bus_id); }},
    {"hugepages", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->hugepages); }},
    {"lock", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadBool(n, k, &t->lock); }},
    {"arena_path", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->arena_path); }},
    {"uids", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadUids(n, k, &t->uids); }},
    {"cold_quota_bytes", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadInt(n, k, &t->cold_quota_bytes); }},
    {"redis_user", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->redis_user); }},
    {"redis_password", [](const toml::node& n, std::string_view k, TenantConfig* t) { return ReadString(n, k, &t->redis_password); }},
};
// clang-format on

struct Section {
  std::string_view name;
  std::span<const ConfigField> fields;
};
constexpr Section kSections[] = {{"server", kServerFields},
                                 {"limits", kLimitsFields},
                                 {"metrics", kMetricsFields},
                                 {"cold_tier", kColdTierFields},
                                 {"log", kLogFields}};
constexpr std::string_view kTenantTable = "tenant";

template <class T>
std::string FieldNames(std::span<const Field<T>> fields) {
  std::string names;
  for (const Field<T>& f : fields) {
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
}

// Reads every key of `table` with `fields`; `prefix` names the table in messages.
template <class T>
absl::Status ReadTable(const toml::table& table, std::string_view prefix,
                       std::span<const Field<T>> fields, T* out) {
  for (auto&& [key, node] : table) {
    const std::string name = absl::StrFormat("%s.%s", prefix, key.str());
    const Field<T>* field = nullptr;
    for (const Field<T>& f : fields) {
      if (f.name == key.str()) field = &f;
    }
    if (field == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("line %d: unknown key %s (known in this table: %s)",
                          key.source().begin.line, name, FieldNames(fields)));
    }
    KVTIER_RETURN_IF_ERROR(field->read(node, name, out));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TenantConfig>> ReadTenants(const toml::node& node) {
  const toml::array* array = node.as_array();
  if (array == nullptr || !array->is_array_of_tables()) {
    return WrongType(node, kTenantTable, "an array of tables ([[tenant]])");
  }
  std::vector<TenantConfig> tenants;
  for (size_t i = 0; i < array->size(); ++i) {
    const toml::table& table = *(*array)[i].as_table();
    const std::string prefix = absl::StrFormat("%s[%d]", kTenantTable, i);
    TenantConfig tenant;
    KVTIER_RETURN_IF_ERROR(
        ReadTable(table, prefix, std::span<const TenantField>(kTenantFields), &tenant));
    for (std::string_view required : {"name", "host_memory_bytes"}) {
      if (!table.contains(required)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("line %d: %s has no %s (required)", LineOf(table), prefix, required));
      }
    }
    tenants.push_back(std::move(tenant));
  }
  return tenants;
}

absl::Status ReadRoot(const toml::table& root, DaemonConfig* config) {
  for (auto&& [key, node] : root) {
    if (key.str() == kTenantTable) {
      KVTIER_ASSIGN_OR_RETURN(config->tenants, ReadTenants(node));
      continue;
    }
    const Section* section = nullptr;
    for (const Section& s : kSections) {
      if (s.name == key.str()) section = &s;
    }
    if (section == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "line %d: unknown key %s (known tables: [server], [limits], [metrics], [cold_tier], "
          "[log], [[tenant]])",
          key.source().begin.line, key.str()));
    }
    if (!node.is_table()) return WrongType(node, key.str(), "a table");
    KVTIER_RETURN_IF_ERROR(ReadTable(*node.as_table(), section->name, section->fields, config));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DaemonConfig> ParseConfigToml(std::string_view text, const DaemonConfig& base) {
  toml::parse_result parsed = toml::parse(text);
  if (!parsed) {
    const toml::parse_error& error = parsed.error();
    return absl::InvalidArgumentError(
        absl::StrFormat("line %d column %d: %s", error.source().begin.line,
                        error.source().begin.column, error.description()));
  }
  DaemonConfig config = base;
  KVTIER_RETURN_IF_ERROR(ReadRoot(parsed.table(), &config));
  return config;
}

absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path, const DaemonConfig& base) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::NotFoundError(
        absl::StrCat("config file ", path, ": cannot open it (", std::strerror(errno), ")"));
  }
  std::ostringstream text;
  text << file.rdbuf();
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(text.str(), base);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

std::vector<std::string> KnownConfigKeys() {
  std::vector<std::string> keys;
  for (const Section& section : kSections) {
    for (const ConfigField& f : section.fields)
      keys.push_back(absl::StrFormat("%s.%s", section.name, f.name));
  }
  for (const TenantField& f : kTenantFields)
    keys.push_back(absl::StrFormat("%s.%s", kTenantTable, f.name));
  return keys;
}

}  // namespace kvtier::daemon
