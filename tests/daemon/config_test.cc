// DaemonConfig: the embedded default, TOML parsing (overrides, tenants, every kind of error),
// Validate's limits, the runtime paths, the kvtierd flags, and the deploy files (example config and
// systemd unit) checked against the daemon's own parsers.
#include "daemon/config.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "daemon/cli.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload/host_arena.h"

namespace kvtier::daemon {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::string ReadSourceFile(const std::string& relative) {
  std::ifstream file(absl::StrCat(KVTIER_SOURCE_DIR, "/", relative));
  EXPECT_TRUE(file) << relative;
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// A fresh directory under the test's temporary directory.
std::string MakeTempDir() {
  std::string pattern = absl::StrCat(::testing::TempDir(), "kvtier_config_XXXXXX");
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  return pattern;
}

TenantConfig Tenant(std::string name, uint64_t host_memory_bytes) {
  TenantConfig tenant;
  tenant.name = std::move(name);
  tenant.host_memory_bytes = host_memory_bytes;
  return tenant;
}

DaemonConfig OneTenant() {
  DaemonConfig config;
  config.tenants.push_back(Tenant("t0", 16 * kMiB));
  return config;
}

absl::StatusOr<DaemonConfig> Parse(std::string_view text) {
  return ParseConfigToml(text, OneTenant());
}

TEST(DefaultConfigTest, EmbeddedTextParsesAndValidates) {
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(DefaultConfigToml(), DaemonConfig{});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->Validate().ok()) << config->Validate();
  EXPECT_EQ(*config, DefaultConfig());
}

TEST(DefaultConfigTest, MatchesTheStructDefaultsWithOneDefaultTenant) {
  DaemonConfig expected;
  expected.tenants.push_back(Tenant("default", uint64_t{1} << 30));
  const DaemonConfig config = DefaultConfig();
  EXPECT_EQ(config, expected);
  EXPECT_EQ(config.unix_socket, "");
  EXPECT_TRUE(config.tenants[0].token.empty());
  EXPECT_EQ(config.tenants[0].hugepages, "auto");
  EXPECT_TRUE(config.tenants[0].lock);
}

TEST(ParseConfigTest, EmptyTextKeepsTheBase) {
  absl::StatusOr<DaemonConfig> config = Parse("");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, OneTenant());
}

TEST(ParseConfigTest, KeysOverrideTheBaseAndOthersKeepIt) {
  absl::StatusOr<DaemonConfig> config = Parse(R"(
[server]
unix_socket = "/run/x.sock"
tcp_address = "127.0.0.1:0"
shm = false
max_message_bytes = 1_048_576
shutdown_grace_ms = 2500
[limits]
max_layers = 80
[metrics]
max_connections_per_peer = 2
[log]
level = "debug"
format = "json"
)");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->unix_socket, "/run/x.sock");
  EXPECT_EQ(config->tcp_address, "127.0.0.1:0");
  EXPECT_FALSE(config->shm);
  EXPECT_EQ(config->max_message_bytes, 1u << 20);
  EXPECT_EQ(config->shutdown_grace, absl::Milliseconds(2500));
  EXPECT_EQ(config->max_layers, 80u);
  EXPECT_EQ(config->metrics_max_connections_per_peer, 2u);
  EXPECT_EQ(config->log_level, "debug");
  EXPECT_EQ(config->log_format, "json");
  // Untouched keys keep the base's values.
  const DaemonConfig base = OneTenant();
  EXPECT_EQ(config->attach_socket, base.attach_socket);
  EXPECT_EQ(config->max_sessions_per_tenant, base.max_sessions_per_tenant);
  EXPECT_EQ(config->log_file, base.log_file);
  EXPECT_EQ(config->tenants, base.tenants);
}

TEST(ParseConfigTest, TenantTablesReplaceTheBaseTenants) {
  DaemonConfig base = OneTenant();
  base.tenants.push_back(Tenant("t1", 32 * kMiB));
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(R"(
[[tenant]]
name = "a"
token = "secret"
host_memory_bytes = 2097152
numa_node = 1
gpu_pci_bus_id = "0000:3b:00.0"
hugepages = "off"
lock = false
arena_path = "/dev/shm/kvtier-a.arena"
uids = [1000, 1001]
)",
                                                        base);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->tenants.size(), 1u);
  const TenantConfig& t = config->tenants[0];
  EXPECT_EQ(t.name, "a");
  EXPECT_EQ(t.token, "secret");
  EXPECT_EQ(t.host_memory_bytes, 2 * kMiB);
  EXPECT_EQ(t.numa_node, 1);
  EXPECT_EQ(t.gpu_pci_bus_id, "0000:3b:00.0");
  EXPECT_EQ(t.hugepages, "off");
  EXPECT_FALSE(t.lock);
  EXPECT_EQ(t.arena_path, "/dev/shm/kvtier-a.arena");
  EXPECT_EQ(t.uids, (std::vector<uint32_t>{1000, 1001}));
}

TEST(ValidateArenaPathTest, AbsolutePathsOfDifferentTenantsAreValid) {
  DaemonConfig config = OneTenant();
  config.tenants.push_back(Tenant("t1", 16 * kMiB));
  config.tenants.push_back(Tenant("t2", 16 * kMiB));
  config.tenants[0].arena_path = "/dev/shm/kvtier-t0.arena";
  config.tenants[1].arena_path = "/dev/hugepages/kvtier-t1.arena";
  config.tenants[2].arena_path = "";  // anonymous; several tenants may leave it empty
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  config.tenants[0].arena_path = "/" + std::string(3999, 'a');  // exactly 4000 bytes
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
}

TEST(ParseConfigTest, ArenaPathDefaultsToEmptyAndMustBeAString) {
  EXPECT_EQ(TenantConfig{}.arena_path, "");
  EXPECT_EQ(DefaultConfig().tenants.at(0).arena_path, "");
  absl::StatusOr<DaemonConfig> config = ParseConfigToml(
      "[[tenant]]\nname = \"b\"\nhost_memory_bytes = 1048576\narena_path = 5\n", OneTenant());
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("arena_path"));
}

TEST(ParseConfigTest, NewTenantsStartFromTenantDefaultsNotFromTheBase) {
  DaemonConfig base = OneTenant();
  base.tenants[0].hugepages = "require";
  absl::StatusOr<DaemonConfig> config =
      ParseConfigToml("[[tenant]]\nname = \"b\"\nhost_memory_bytes = 1048576\n", base);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->tenants.size(), 1u);
  EXPECT_EQ(config->tenants[0].hugepages, "auto");
  EXPECT_TRUE(config->tenants[0].lock);
}

TEST(ColdTierConfigTest, DefaultsAreOffWithTheDocumentedValues) {
  const ColdTierConfig cold;
  EXPECT_TRUE(cold.nodes.empty());
  EXPECT_FALSE(cold.enabled());
  EXPECT_EQ(cold.key_prefix, "kvtier");
  EXPECT_EQ(cold.user, "");
  EXPECT_EQ(cold.password, "");
  EXPECT_EQ(cold.connect_timeout, absl::Seconds(1));
  EXPECT_EQ(cold.command_timeout, absl::Seconds(2));
  EXPECT_EQ(cold.operation_timeout, absl::Seconds(30));
  EXPECT_EQ(cold.min_replicas, 0u);
  EXPECT_TRUE(cold.persist_on_shutdown);
  const TenantConfig tenant;
  EXPECT_EQ(tenant.cold_quota_bytes, 0u);
  EXPECT_EQ(tenant.redis_user, "");
  EXPECT_EQ(tenant.redis_password, "");
  // The embedded default spells the same values out.
  const DaemonConfig config = DefaultConfig();
  EXPECT_EQ(config.cold_tier, ColdTierConfig{});
  EXPECT_FALSE(config.cold_tier.enabled());
  EXPECT_EQ(config.tenants[0].cold_quota_bytes, 0u);
  EXPECT_EQ(config.tenants[0].redis_user, "");
  EXPECT_EQ(config.tenants[0].redis_password, "");
}

TEST(ColdTierConfigTest, ParsesEveryKeyOfTheTableAndTheTenant) {
  absl::StatusOr<DaemonConfig> config = Parse(R"(
[cold_tier]
nodes = ["10.0.0.5:6379", "redis-1.example:7000", "[::1]:6380"]
key_prefix = "kv.prod-1_a"
user = "kvtierd"
password = "s3cret!"
connect_timeout_ms = 250
command_timeout_ms = 1500
operation_timeout_ms = 60000
min_replicas = 2
slot_map_refresh_ms = 5000
persist_on_shutdown = false
demote_suspended_after_ms = 1500
[[tenant]]
name = "a"
host_memory_bytes = 1048576
cold_quota_bytes = 17_179_869_184
redis_user = "kvtier-a"
redis_password = "tenant-secret"
[[tenant]]
name = "b"
host_memory_bytes = 1048576
)");
  ASSERT_TRUE(config.ok()) << config.status();
  const ColdTierConfig& cold = config->cold_tier;
  EXPECT_EQ(cold.nodes,
            (std::vector<std::string>{"10.0.0.5:6379", "redis-1.example:7000", "[::1]:6380"}));
  EXPECT_TRUE(cold.enabled());
  EXPECT_EQ(cold.key_prefix, "kv.prod-1_a");
  EXPECT_EQ(cold.user, "kvtierd");
  EXPECT_EQ(cold.password, "s3cret!");
  EXPECT_EQ(cold.connect_timeout, absl::Milliseconds(250));
  EXPECT_EQ(cold.command_timeout, absl::Milliseconds(1500));
  EXPECT_EQ(cold.operation_timeout, absl::Seconds(60));
  EXPECT_EQ(cold.min_replicas, 2u);
  EXPECT_FALSE(cold.persist_on_shutdown);
  EXPECT_EQ(cold.slot_map_refresh, absl::Seconds(5));
  EXPECT_EQ(cold.demote_suspended_after, absl::Milliseconds(1500));
  ASSERT_EQ(config->tenants.size(), 2u);
  EXPECT_EQ(config->tenants[0].cold_quota_bytes, uint64_t{16} << 30);
  EXPECT_EQ(config->tenants[0].redis_user, "kvtier-a");
  EXPECT_EQ(config->tenants[0].redis_password, "tenant-secret");
  // A tenant that names none of the keys keeps the defaults.
  EXPECT_EQ(config->tenants[1].cold_quota_bytes, 0u);
  EXPECT_EQ(config->tenants[1].redis_user, "");
  EXPECT_EQ(config->tenants[1].redis_password, "");
  EXPECT_TRUE(config->Validate().ok()) << config->Validate();
}

TEST(ColdTierConfigTest, KeysLeftOutKeepTheBase) {
  DaemonConfig base = OneTenant();
  base.cold_tier.nodes = {"a:1"};
  base.cold_tier.min_replicas = 3;
  absl::StatusOr<DaemonConfig> config = ParseConfigToml("[cold_tier]\nkey_prefix = \"x\"\n", base);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->cold_tier.nodes, std::vector<std::string>{"a:1"});
  EXPECT_EQ(config->cold_tier.min_replicas, 3u);
  EXPECT_EQ(config->cold_tier.key_prefix, "x");
  // An empty array turns the cold tier off again.
  config = ParseConfigToml("[cold_tier]\nnodes = []\n", base);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->cold_tier.enabled());
}

// Each bad document, and what the message must name.
struct BadToml {
  std::string name;
  std::string text;
  std::vector<std::string> message_has;
};

class BadTomlTest : public ::testing::TestWithParam<BadToml> {};

TEST_P(BadTomlTest, IsInvalidArgumentNamingKeyAndLine) {
  absl::StatusOr<DaemonConfig> config = Parse(GetParam().text);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : GetParam().message_has) {
    EXPECT_THAT(config.status().message(), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllKinds, BadTomlTest,
    ::testing::Values(
        BadToml{"Syntax", "[server]\nunix_socket = \"x\n", {"line 2"}},
        BadToml{"UnknownKey",
                "[server]\n\nunix_sock = \"x\"\n",
                {"server.unix_sock", "line 3", "unix_socket"}},
        BadToml{"UnknownTable", "[sever]\nshm = true\n", {"sever", "line 1", "[server]"}},
        BadToml{"UnknownTopLevelKey", "shm = true\n", {"shm", "line 1"}},
        BadToml{"UnknownTenantKey",
                "[[tenant]]\nname = \"a\"\nhost_memory_bytes = 1048576\nnuma = 1\n",
                {"tenant[0].numa", "line 4"}},
        BadToml{"IntegerAsString",
                "[server]\nmax_message_bytes = \"8M\"\n",
                {"server.max_message_bytes", "line 2", "an integer", "a string"}},
        BadToml{"BoolAsString", "[server]\nshm = \"yes\"\n", {"server.shm", "a boolean"}},
        BadToml{"StringAsInteger", "[log]\nlevel = 3\n", {"log.level", "a string"}},
        BadToml{
            "FloatForInteger", "[limits]\nmax_layers = 1.5\n", {"limits.max_layers", "a float"}},
        BadToml{"NegativeUnsigned",
                "[limits]\nmax_layers = -1\n",
                {"limits.max_layers", "-1", "does not fit [0, 4294967295]"}},
        BadToml{"SectionNotATable", "server = 5\n", {"server", "a table"}},
        BadToml{"TenantNotAnArrayOfTables", "[tenant]\nname = \"a\"\n", {"tenant", "[[tenant]]"}},
        BadToml{"UidNotInteger",
                "[[tenant]]\nname = \"a\"\nhost_memory_bytes = 1048576\nuids = [1, \"root\"]\n",
                {"tenant[0].uids[1]", "line 4"}},
        BadToml{"TenantWithoutName",
                "[[tenant]]\nhost_memory_bytes = 1048576\n",
                {"tenant[0]", "name", "required", "line 1"}},
        BadToml{"TenantWithoutMemory",
                "[[tenant]]\nname = \"a\"\n",
                {"tenant[0]", "host_memory_bytes", "required"}},
        BadToml{"UnknownColdTierKey",
                "[cold_tier]\nseeds = [\"a:1\"]\n",
                {"cold_tier.seeds", "line 2", "nodes"}},
        BadToml{"ColdTierNotATable", "cold_tier = 1\n", {"cold_tier", "a table"}},
        BadToml{"ColdNodesNotAnArray",
                "[cold_tier]\nnodes = \"a:1\"\n",
                {"cold_tier.nodes", "line 2", "an array of strings"}},
        BadToml{"ColdNodeNotAString",
                "[cold_tier]\nnodes = [\"a:1\", 6379]\n",
                {"cold_tier.nodes[1]", "line 2", "a string", "an integer"}},
        BadToml{"ColdTimeoutAsString",
                "[cold_tier]\ncommand_timeout_ms = \"2s\"\n",
                {"cold_tier.command_timeout_ms", "an integer"}},
        BadToml{"ColdMinReplicasNegative",
                "[cold_tier]\nmin_replicas = -1\n",
                {"cold_tier.min_replicas", "does not fit"}},
        BadToml{"ColdPersistAsString",
                "[cold_tier]\npersist_on_shutdown = \"yes\"\n",
                {"cold_tier.persist_on_shutdown", "a boolean"}},
        BadToml{"ColdQuotaNegative",
                "[[tenant]]\nname = \"a\"\nhost_memory_bytes = 1048576\ncold_quota_bytes = -1\n",
                {"tenant[0].cold_quota_bytes", "line 4", "does not fit"}},
        BadToml{
            "ColdQuotaAsString",
            "[[tenant]]\nname = \"a\"\nhost_memory_bytes = 1048576\ncold_quota_bytes = \"1G\"\n",
            {"tenant[0].cold_quota_bytes", "an integer"}},
        BadToml{"RedisUserNotAString",
                "[[tenant]]\nname = \"a\"\nhost_memory_bytes = 1048576\nredis_user = 1\n",
                {"tenant[0].redis_user", "a string"}}),
    [](const ::testing::TestParamInfo<BadToml>& p) { return p.param.name; });

// Each mutation of a good config, and what Validate's message must name.
struct BadValue {
  std::string name;
  void (*mutate)(DaemonConfig*);
  std::vector<std::string> message_has;
};

class ValidateTest : public ::testing::TestWithParam<BadValue> {};

TEST_P(ValidateTest, IsInvalidArgumentNamingKeyAndLimit) {
  DaemonConfig config = OneTenant();
  ASSERT_TRUE(config.Validate().ok());
  GetParam().mutate(&config);
  const absl::Status status = config.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (const std::string& part : GetParam().message_has) {
    EXPECT_THAT(status.message(), HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Limits, ValidateTest,
    ::testing::Values(
        BadValue{"NoTenant", [](DaemonConfig* c) { c->tenants.clear(); }, {"at least one"}},
        BadValue{"TenantName",
                 [](DaemonConfig* c) { c->tenants[0].name = "a b"; },
                 {"tenant[0].name", "[A-Za-z0-9_.-]{1,64}"}},
        BadValue{"TenantNameTooLong",
                 [](DaemonConfig* c) { c->tenants[0].name = std::string(65, 'a'); },
                 {"tenant[0].name", "{1,64}"}},
        BadValue{"DuplicateTenant",
                 [](DaemonConfig* c) { c->tenants.push_back(c->tenants[0]); },
                 {"tenant[1].name", "unique"}},
        BadValue{"ArenaTooSmall",
                 [](DaemonConfig* c) { c->tenants[0].host_memory_bytes = kMiB - 1; },
                 {"tenant[0].host_memory_bytes", "[1048576, 4398046511104]"}},
        BadValue{
            "ArenaTooLarge",
            [](DaemonConfig* c) { c->tenants[0].host_memory_bytes = HostArena::kMaxBytes + 1; },
            {"tenant[0].host_memory_bytes", "4398046511104"}},
        BadValue{"Hugepages",
                 [](DaemonConfig* c) { c->tenants[0].hugepages = "yes"; },
                 {"tenant[0].hugepages", "off | auto | require"}},
        BadValue{"ArenaPathRelative",
                 [](DaemonConfig* c) { c->tenants[0].arena_path = "kvtier.arena"; },
                 {"tenant[0].arena_path", "kvtier.arena", "absolute path"}},
        BadValue{"ArenaPathTooLong",
                 [](DaemonConfig* c) {
                   c->tenants[0].arena_path = "/dev/shm/" + std::string(3992, 'a');
                 },
                 {"tenant[0].arena_path", "4001 bytes", "at most 4000"}},
        BadValue{"ArenaPathShared",
                 [](DaemonConfig* c) {
                   c->tenants[0].arena_path = "/dev/shm/kvtier.arena";
                   c->tenants.push_back(c->tenants[0]);
                   c->tenants[1].name = "second";
                 },
                 {"tenant[1].arena_path", "/dev/shm/kvtier.arena", "tenant[0].arena_path", "'t0'",
                  "'second'"}},
        BadValue{"NumaNode",
                 [](DaemonConfig* c) { c->tenants[0].numa_node = -2; },
                 {"tenant[0].numa_node", "[-1, 1023]"}},
        BadValue{"PciBusId",
                 [](DaemonConfig* c) { c->tenants[0].gpu_pci_bus_id = "gpu0"; },
                 {"tenant[0].gpu_pci_bus_id", "0000:3b:00.0"}},
        BadValue{"TokenControlChar",
                 [](DaemonConfig* c) { c->tenants[0].token = "a\nb"; },
                 {"tenant[0].token", "printable ASCII"}},
        BadValue{"InvalidUid",
                 [](DaemonConfig* c) { c->tenants[0].uids = {0xffffffffu}; },
                 {"tenant[0].uids[0]"}},
        BadValue{"MessageTooSmall",
                 [](DaemonConfig* c) { c->max_message_bytes = 65535; },
                 {"server.max_message_bytes", "[65536, 1073741824]"}},
        BadValue{"MessageTooLarge",
                 [](DaemonConfig* c) { c->max_message_bytes = (uint64_t{1} << 30) + 1; },
                 {"server.max_message_bytes", "1073741824"}},
        BadValue{"SocketPathTooLong",
                 [](DaemonConfig* c) { c->unix_socket = "/" + std::string(120, 's'); },
                 {"server.unix_socket", "107"}},
        BadValue{"AttachSameAsUnix",
                 [](DaemonConfig* c) { c->unix_socket = c->attach_socket = "/tmp/a.sock"; },
                 {"server.attach_socket", "server.unix_socket"}},
        BadValue{"TcpWithoutPort",
                 [](DaemonConfig* c) { c->tcp_address = "localhost"; },
                 {"server.tcp_address", "host:port"}},
        BadValue{"TcpPortTooLarge",
                 [](DaemonConfig* c) { c->tcp_address = "[::]:65536"; },
                 {"server.tcp_address", "65535"}},
        BadValue{"MetricsRemoteWithoutOptIn",
                 [](DaemonConfig* c) { c->metrics_address = "0.0.0.0:9464"; },
                 {"metrics.address", "metrics.allow_remote"}},
        BadValue{"MetricsBadTcp",
                 [](DaemonConfig* c) { c->metrics_address = "localhost"; },
                 {"metrics.address", "host:port"}},
        BadValue{"MetricsRelativeUnixPath",
                 [](DaemonConfig* c) { c->metrics_address = "unix:metrics.sock"; },
                 {"metrics.address", "unix:/absolute/path"}},
        BadValue{"MetricsUnixPathTooLong",
                 [](DaemonConfig* c) { c->metrics_address = "unix:/" + std::string(120, 'm'); },
                 {"metrics.address", "107"}},
        BadValue{"MetricsNoConnectionPerPeer",
                 [](DaemonConfig* c) { c->metrics_max_connections_per_peer = 0; },
                 {"metrics.max_connections_per_peer", "[1, 16]"}},
        BadValue{"MetricsMoreConnectionsPerPeerThanInAll",
                 [](DaemonConfig* c) { c->metrics_max_connections_per_peer = 17; },
                 {"metrics.max_connections_per_peer", "[1, 16]", "16 connections"}},
        BadValue{"AdminToken",
                 [](DaemonConfig* c) { c->admin_token = std::string(1025, 'x'); },
                 {"server.admin_token", "1024"}},
        BadValue{"RpcThreads",
                 [](DaemonConfig* c) { c->rpc_threads = -1; },
                 {"server.rpc_threads", "[0, 1024]"}},
        BadValue{"CpuThreads",
                 [](DaemonConfig* c) { c->cpu_threads = 1025; },
                 {"server.cpu_threads", "[0, 1024]"}},
        BadValue{"ShutdownGrace",
                 [](DaemonConfig* c) { c->shutdown_grace = absl::Hours(2); },
                 {"server.shutdown_grace_ms", "3600000"}},
        BadValue{"NoSessions",
                 [](DaemonConfig* c) { c->max_sessions_per_tenant = 0; },
                 {"limits.max_sessions_per_tenant", "[1, 65536]"}},
        BadValue{"SessionTokens",
                 [](DaemonConfig* c) { c->max_tokens_per_session = 1u << 25; },
                 {"limits.max_tokens_per_session", "16777216"}},
        BadValue{"DefaultAboveMax",
                 [](DaemonConfig* c) { c->default_max_tokens = c->max_tokens_per_session + 1; },
                 {"limits.default_max_tokens", "[1, 131072]", "max_tokens_per_session"}},
        BadValue{"Layers",
                 [](DaemonConfig* c) { c->max_layers = 1025; },
                 {"limits.max_layers", "[1, 1024]"}},
        BadValue{"OffloadTokens",
                 [](DaemonConfig* c) { c->max_tokens_per_offload = 0; },
                 {"limits.max_tokens_per_offload", "[1, 131072]"}},
        BadValue{"LogLevel",
                 [](DaemonConfig* c) { c->log_level = "verbose"; },
                 {"log.level", "trace | debug | info | warn | error | off"}},
        BadValue{"LogFormat",
                 [](DaemonConfig* c) { c->log_format = "xml"; },
                 {"log.format", "text | json"}}),
    [](const ::testing::TestParamInfo<BadValue>& p) { return p.param.name; });

// A cold tier with one node: the base the cold-tier mutations below start from.
void EnableColdTier(DaemonConfig* c) { c->cold_tier.nodes = {"10.0.0.5:6379"}; }

INSTANTIATE_TEST_SUITE_P(
    ColdTier, ValidateTest,
    ::testing::Values(
        BadValue{"NodeWithoutPort",
                 [](DaemonConfig* c) {
                   c->cold_tier.nodes = {"a:1", "b:2", "x"};
                 },
                 {"cold_tier.nodes[2] = \"x\"", "host:port", "[1, 65535]"}},
        BadValue{"NodeWithoutHost",
                 [](DaemonConfig* c) { c->cold_tier.nodes = {":6379"}; },
                 {"cold_tier.nodes[0]", "non-empty host"}},
        BadValue{"NodePortZero",
                 [](DaemonConfig* c) { c->cold_tier.nodes = {"redis:0"}; },
                 {"cold_tier.nodes[0] = \"redis:0\"", "[1, 65535]"}},
        BadValue{"NodePortTooLarge",
                 [](DaemonConfig* c) { c->cold_tier.nodes = {"redis:65536"}; },
                 {"cold_tier.nodes[0]", "[1, 65535]"}},
        BadValue{"NodePortNotANumber",
                 [](DaemonConfig* c) { c->cold_tier.nodes = {"redis:http"}; },
                 {"cold_tier.nodes[0]", "host:port"}},
        BadValue{"NodeEmpty",
                 [](DaemonConfig* c) { c->cold_tier.nodes = {""}; },
                 {"cold_tier.nodes[0]", "host:port"}},
        BadValue{"KeyPrefixEmpty",
                 [](DaemonConfig* c) { c->cold_tier.key_prefix = ""; },
                 {"cold_tier.key_prefix", "[A-Za-z0-9_.-]{1,32}"}},
        BadValue{"KeyPrefixColon",
                 [](DaemonConfig* c) { c->cold_tier.key_prefix = "kv:tier"; },
                 {"cold_tier.key_prefix = \"kv:tier\"", "[A-Za-z0-9_.-]{1,32}"}},
        BadValue{"KeyPrefixHashTag",
                 [](DaemonConfig* c) { c->cold_tier.key_prefix = "kv{x}"; },
                 {"cold_tier.key_prefix", "{1,32}"}},
        BadValue{"KeyPrefixTooLong",
                 [](DaemonConfig* c) { c->cold_tier.key_prefix = std::string(33, 'k'); },
                 {"cold_tier.key_prefix", "{1,32}"}},
        BadValue{"ConnectTimeoutZero",
                 [](DaemonConfig* c) { c->cold_tier.connect_timeout = absl::ZeroDuration(); },
                 {"cold_tier.connect_timeout_ms = 0", "[1, 600000]"}},
        BadValue{"CommandTimeoutTooLong",
                 [](DaemonConfig* c) {
                   c->cold_tier.command_timeout = absl::Minutes(10) + absl::Milliseconds(1);
                 },
                 {"cold_tier.command_timeout_ms = 600001", "[1, 600000]"}},
        BadValue{"OperationTimeoutNegative",
                 [](DaemonConfig* c) { c->cold_tier.operation_timeout = absl::Milliseconds(-5); },
                 {"cold_tier.operation_timeout_ms = -5", "[1, 600000]"}},
        BadValue{"MinReplicas",
                 [](DaemonConfig* c) { c->cold_tier.min_replicas = 17; },
                 {"cold_tier.min_replicas = 17", "[0, 16]"}},
        BadValue{"DemoteSuspendedAfterBeyondADay",
                 [](DaemonConfig* c) { c->cold_tier.demote_suspended_after = absl::Hours(25); },
                 {"cold_tier.demote_suspended_after_ms = 90000000", "a day"}},
        BadValue{"SlotMapRefreshBeyondTenMinutes",
                 [](DaemonConfig* c) { c->cold_tier.slot_map_refresh = absl::Minutes(11); },
                 {"cold_tier.slot_map_refresh_ms = 660000", "10 min"}},
        BadValue{"UserWithoutPassword",
                 [](DaemonConfig* c) { c->cold_tier.user = "kvtierd"; },
                 {"cold_tier.user", "cold_tier.password"}},
        BadValue{"PasswordWithSpace",
                 [](DaemonConfig* c) { c->cold_tier.password = "two words"; },
                 {"cold_tier.password", "space"}},
        BadValue{"PasswordControlChar",
                 [](DaemonConfig* c) { c->cold_tier.password = "a\nb"; },
                 {"cold_tier.password", "printable ASCII"}},
        BadValue{"PasswordTooLong",
                 [](DaemonConfig* c) { c->cold_tier.password = std::string(1025, 'p'); },
                 {"cold_tier.password", "1024"}},
        BadValue{"UserWithSpace",
                 [](DaemonConfig* c) {
                   c->cold_tier.user = "kv tier";
                   c->cold_tier.password = "p";
                 },
                 {"cold_tier.user", "space"}},
        BadValue{"ColdQuotaWithoutNodes",
                 [](DaemonConfig* c) { c->tenants[0].cold_quota_bytes = 1; },
                 {"tenant[0].cold_quota_bytes = 1", "cold_tier.nodes"}},
        BadValue{"SecondTenantColdQuotaWithoutNodes",
                 [](DaemonConfig* c) {
                   c->tenants.push_back(c->tenants[0]);
                   c->tenants[1].name = "t1";
                   c->tenants[1].cold_quota_bytes = kMiB;
                 },
                 {"tenant[1].cold_quota_bytes", "cold_tier.nodes"}},
        BadValue{"RedisUserWithoutPassword",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_user = "kvtier-t0";
                 },
                 {"tenant[0].redis_user", "tenant[0].redis_password"}},
        BadValue{"RedisPasswordWithoutUser",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_password = "secret";
                 },
                 {"tenant[0].redis_user", "tenant[0].redis_password"}},
        BadValue{"RedisUserBadChar",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_user = "kvtier:t0";
                   c->tenants[0].redis_password = "secret";
                 },
                 {"tenant[0].redis_user = \"kvtier:t0\"", "[A-Za-z0-9_.-]{1,64}"}},
        BadValue{"RedisUserTooLong",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_user = std::string(65, 'u');
                   c->tenants[0].redis_password = "secret";
                 },
                 {"tenant[0].redis_user", "{1,64}"}},
        BadValue{"RedisPasswordWithSpace",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_user = "kvtier-t0";
                   c->tenants[0].redis_password = "se cret";
                 },
                 {"tenant[0].redis_password", "space"}},
        BadValue{"RedisPasswordControlChar",
                 [](DaemonConfig* c) {
                   EnableColdTier(c);
                   c->tenants[0].redis_user = "kvtier-t0";
                   c->tenants[0].redis_password = "se\tcret";
                 },
                 {"tenant[0].redis_password", "printable ASCII"}}),
    [](const ::testing::TestParamInfo<BadValue>& p) { return p.param.name; });

TEST(ValidateTest, AcceptsTheEdgesOfEachRange) {
  DaemonConfig config = OneTenant();
  config.tenants[0].host_memory_bytes = kMiB;
  config.tenants[0].gpu_pci_bus_id = "af:00.0";
  config.max_message_bytes = 64 * 1024;
  config.default_max_tokens = config.max_tokens_per_session;
  config.max_tokens_per_offload = config.max_tokens_per_session;
  config.tcp_address = "[::1]:0";
  config.shutdown_grace = absl::ZeroDuration();
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  for (uint32_t per_peer : {1u, kMetricsMaxConnections}) {
    config.metrics_max_connections_per_peer = per_peer;
    EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  }
}

TEST(ValidateTest, AcceptsTheEdgesOfEachColdTierRange) {
  DaemonConfig config = OneTenant();
  config.cold_tier.nodes = {"a:1", "redis.example:65535", "[::1]:6379", "10.0.0.5:6379"};
  config.cold_tier.key_prefix = std::string(32, 'k');
  config.cold_tier.connect_timeout = absl::Milliseconds(1);
  config.cold_tier.command_timeout = absl::Minutes(10);
  config.cold_tier.operation_timeout = absl::Minutes(10);
  config.cold_tier.min_replicas = 16;
  config.tenants[0].cold_quota_bytes = ~uint64_t{0};
  config.tenants[0].redis_user = std::string(64, 'u');
  config.tenants[0].redis_password = std::string(1024, '!');
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  // A password alone (AUTH password, the default user) is fine at the daemon's level.
  config.cold_tier.password = "~!@#$%^&*()_+{}|:<>?";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  config.cold_tier.user = "kvtierd";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
  // A tenant without a quota needs no cold tier, and key_prefix is checked even when off.
  DaemonConfig off = OneTenant();
  off.cold_tier.key_prefix = "a";
  EXPECT_TRUE(off.Validate().ok()) << off.Validate();
}

TEST(LoadConfigFileTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = MakeTempDir() + "/absent.toml";
  absl::StatusOr<DaemonConfig> config = LoadConfigFile(path, OneTenant());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(config.status().message(), HasSubstr(path));
}

TEST(LoadConfigFileTest, ErrorsNameTheFileAndLine) {
  const std::string path = MakeTempDir() + "/bad.toml";
  std::ofstream(path) << "[log]\nlevel = \"info\"\ncolour = true\n";
  absl::StatusOr<DaemonConfig> config = LoadConfigFile(path, OneTenant());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(),
              AllOf(HasSubstr(path), HasSubstr("line 3"), HasSubstr("log.colour")));
}

TEST(KnownConfigKeysTest, AreUniqueAndQualified) {
  const std::vector<std::string> keys = KnownConfigKeys();
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()).size(), keys.size());
  // 15 server, 6 limits, 3 metrics, 10 cold_tier, 3 log, 12 tenant
  EXPECT_EQ(keys.size(), 50u);
  for (const std::string& key : keys) EXPECT_NE(key.find('.'), std::string::npos) << key;
}

// The "table.key" of every uncommented `key = value` line, by the [table] or [[table]] it follows.
std::set<std::string> KeysSetIn(const std::string& text) {
  std::set<std::string> keys;
  std::string table;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      table = std::string(absl::StripSuffix(absl::StripPrefix(line, "[["), "]]"));
      table = std::string(absl::StripSuffix(absl::StripPrefix(table, "["), "]"));
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) continue;
    keys.insert(absl::StrCat(table, ".", absl::StripAsciiWhitespace(line.substr(0, eq))));
  }
  return keys;
}

TEST(ExampleConfigTest, ParsesWithTheDaemonsParserAndValidates) {
  absl::StatusOr<DaemonConfig> config = LoadConfigFile(
      absl::StrCat(KVTIER_SOURCE_DIR, "/deploy/kvtierd.example.toml"), DefaultConfig());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->Validate().ok()) << config->Validate();
  // The cold tier is documented but off, at its defaults.
  EXPECT_EQ(config->cold_tier, ColdTierConfig{});
  EXPECT_EQ(config->tenants[0].cold_quota_bytes, 0u);
}

TEST(KnownConfigKeysTest, ListTheColdTierKeys) {
  const std::vector<std::string> keys = KnownConfigKeys();
  const std::set<std::string> known(keys.begin(), keys.end());
  for (const char* key :
       {"cold_tier.nodes", "cold_tier.key_prefix", "cold_tier.user", "cold_tier.password",
        "cold_tier.connect_timeout_ms", "cold_tier.command_timeout_ms",
        "cold_tier.operation_timeout_ms", "cold_tier.min_replicas", "cold_tier.persist_on_shutdown",
        "cold_tier.demote_suspended_after_ms", "cold_tier.slot_map_refresh_ms",
        "tenant.cold_quota_bytes", "tenant.redis_user", "tenant.redis_password"}) {
    EXPECT_TRUE(known.count(key)) << key;
  }
}

TEST(ExampleConfigTest, SetsEveryKnownKeyWithTheDefaultTenant) {
  const std::set<std::string> in_example = KeysSetIn(ReadSourceFile("deploy/kvtierd.example.toml"));
  for (const std::string& key : KnownConfigKeys()) {
    EXPECT_TRUE(in_example.count(key)) << key << " is not documented in the example";
  }
  for (const std::string& key : in_example) {
    const std::vector<std::string> known = KnownConfigKeys();
    EXPECT_NE(std::find(known.begin(), known.end(), key), known.end()) << key;
  }
}

TEST(ExampleConfigTest, DocumentsTheDefaultOfEveryKeyInTheEmbeddedDefault) {
  // The embedded default also sets every key, so --print-default-config shows them all.
  const std::set<std::string> in_default = KeysSetIn(std::string(DefaultConfigToml()));
  for (const std::string& key : KnownConfigKeys()) EXPECT_TRUE(in_default.count(key)) << key;
}

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* old = std::getenv("XDG_RUNTIME_DIR");
    if (old != nullptr) saved_ = old;
  }
  void TearDown() override {
    if (saved_) {
      ::setenv("XDG_RUNTIME_DIR", saved_->c_str(), 1);
    } else {
      ::unsetenv("XDG_RUNTIME_DIR");
    }
  }
  std::optional<std::string> saved_;
};

TEST_F(EnvTest, DefaultSocketIsUnderAWritableRuntimeDir) {
  const std::string dir = MakeTempDir();
  ::setenv("XDG_RUNTIME_DIR", dir.c_str(), 1);
  EXPECT_EQ(DefaultUnixSocketPath(), dir + "/kvtier/kvtierd.sock");
}

TEST_F(EnvTest, DefaultSocketFallsBackToTmpPerUser) {
  ::unsetenv("XDG_RUNTIME_DIR");
  const std::string fallback = absl::StrCat("/tmp/kvtier-", ::getuid(), "/kvtierd.sock");
  EXPECT_EQ(DefaultUnixSocketPath(), fallback);
  ::setenv("XDG_RUNTIME_DIR", (MakeTempDir() + "/absent").c_str(), 1);
  EXPECT_EQ(DefaultUnixSocketPath(), fallback);
}

TEST_F(EnvTest, ResolvePathsFillsTheDefaultsAndMakesAPrivateDirectory) {
  const std::string dir = MakeTempDir();
  ::setenv("XDG_RUNTIME_DIR", dir.c_str(), 1);
  absl::StatusOr<DaemonConfig> config = ResolvePaths(OneTenant());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->unix_socket, dir + "/kvtier/kvtierd.sock");
  EXPECT_EQ(config->attach_socket, dir + "/kvtier/kvtierd.sock.attach");
  struct stat st;
  ASSERT_EQ(::stat((dir + "/kvtier").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST(ResolvePathsTest, KeepsGivenPathsAndCreatesMissingParents) {
  const std::string dir = MakeTempDir();
  DaemonConfig config = OneTenant();
  config.unix_socket = dir + "/a/b/grpc.sock";
  config.attach_socket = dir + "/c/attach.sock";
  absl::StatusOr<DaemonConfig> resolved = ResolvePaths(config);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->unix_socket, config.unix_socket);
  EXPECT_EQ(resolved->attach_socket, config.attach_socket);
  struct stat st;
  EXPECT_EQ(::stat((dir + "/a/b").c_str(), &st), 0);
  EXPECT_EQ(::stat((dir + "/c").c_str(), &st), 0);
}

TEST(ResolvePathsTest, MetricsAutoIsAUnixSocketBesideTheGrpcOneAndOffIsEmpty) {
  const std::string dir = MakeTempDir();
  DaemonConfig config = OneTenant();
  config.unix_socket = dir + "/grpc.sock";
  ASSERT_EQ(config.metrics_address, "auto");  // the default
  absl::StatusOr<DaemonConfig> resolved = ResolvePaths(config);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->metrics_address, "unix:" + dir + "/grpc.sock.metrics");
  config.metrics_address = "off";
  resolved = ResolvePaths(config);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->metrics_address, "");
  // Loopback TCP needs no opt-in; another address does.
  for (const char* loopback : {"127.0.0.1:0", "localhost:9464", "[::1]:9464"}) {
    config.metrics_address = loopback;
    EXPECT_TRUE(config.Validate().ok()) << loopback << ": " << config.Validate();
  }
  config.metrics_address = "0.0.0.0:9464";
  EXPECT_FALSE(config.Validate().ok());
  config.metrics_allow_remote = true;
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();
}

TEST(ResolvePathsTest, ReportsADirectoryThatCannotBeMade) {
  const std::string dir = MakeTempDir();
  std::ofstream(dir + "/file") << "x";
  DaemonConfig config = OneTenant();
  config.unix_socket = dir + "/file/grpc.sock";
  absl::StatusOr<DaemonConfig> resolved = ResolvePaths(config);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(resolved.status().message(), HasSubstr(dir + "/file"));
}

TEST(ResolvePathsTest, DerivedAttachPathMustFitASocketAddress) {
  DaemonConfig config = OneTenant();
  config.unix_socket = "/" + std::string(104, 's');  // fits; + ".attach" does not
  absl::StatusOr<DaemonConfig> resolved = ResolvePaths(config);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(resolved.status().message(), HasSubstr("server.attach_socket"));
}

absl::StatusOr<CommandLine> ParseArgs(std::vector<std::string> args) {
  args.insert(args.begin(), "kvtierd");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseCommandLine(static_cast<int>(argv.size()), argv.data());
}

TEST(CommandLineTest, FlagsOverrideTheFile) {
  const std::string path = MakeTempDir() + "/k.toml";
  std::ofstream(path)
      << "[server]\nunix_socket = \"/from/file.sock\"\ncpu_threads = 2\n[log]\nlevel = \"warn\"\n";
  absl::StatusOr<CommandLine> flags = ParseArgs(
      {"--config", path, "--unix-socket", "/from/flag.sock", "--tcp", "127.0.0.1:0",
       "--attach-socket", "/a.sock", "--no-shm", "--log-format", "json", "--cpu-threads", "3"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  absl::StatusOr<DaemonConfig> config = ConfigFromCommandLine(*flags);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->unix_socket, "/from/flag.sock");
  EXPECT_EQ(config->tcp_address, "127.0.0.1:0");
  EXPECT_EQ(config->attach_socket, "/a.sock");
  EXPECT_FALSE(config->shm);
  EXPECT_EQ(config->log_level, "warn");  // from the file: no flag
  EXPECT_EQ(config->log_format, "json");
  EXPECT_EQ(config->cpu_threads, 3);
  EXPECT_EQ(config->tenants, DefaultConfig().tenants);
}

TEST(CommandLineTest, NoFlagsIsTheEmbeddedDefault) {
  absl::StatusOr<CommandLine> flags = ParseArgs({});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_FALSE(flags->check_config);
  absl::StatusOr<DaemonConfig> config = ConfigFromCommandLine(*flags);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, DefaultConfig());
}

TEST(CommandLineTest, BadFlagsAreInvalidArgumentNamingTheFlag) {
  absl::StatusOr<CommandLine> unknown = ParseArgs({"--colour"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("--colour"));
  absl::StatusOr<CommandLine> not_int = ParseArgs({"--cpu-threads", "many"});
  EXPECT_EQ(not_int.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_int.status().message(), HasSubstr("cpu-threads"));
}

TEST(CommandLineTest, FlagValuesAreValidated) {
  absl::StatusOr<CommandLine> flags = ParseArgs({"--log-level", "loud"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  absl::StatusOr<DaemonConfig> config = ConfigFromCommandLine(*flags);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("log.level"));
}

TEST(CommandLineTest, HelpAndVersionAreTextToPrint) {
  absl::StatusOr<CommandLine> help = ParseArgs({"--help"});
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_THAT(help->info_text, AllOf(HasSubstr("--config"), HasSubstr("--check-config")));
  absl::StatusOr<CommandLine> version = ParseArgs({"--version"});
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_THAT(version->info_text, HasSubstr("kvtierd"));
}

// The systemd unit's `Key=value` lines (several values per key when repeated).
std::multimap<std::string, std::string> UnitEntries(const std::string& text) {
  std::multimap<std::string, std::string> entries;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    const size_t eq = line.find('=');
    if (line.empty() || line[0] == '#' || line[0] == '[' || eq == absl::string_view::npos) continue;
    entries.emplace(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
  }
  return entries;
}

TEST(SystemdUnitTest, ExecLinesUseFlagsTheDaemonAccepts) {
  const auto entries = UnitEntries(ReadSourceFile("deploy/kvtierd.service"));
  ASSERT_EQ(entries.count("ExecStart"), 1u);
  for (const char* key : {"ExecStart", "ExecStartPre"}) {
    for (auto [it, end] = entries.equal_range(key); it != end; ++it) {
      std::vector<std::string> words = absl::StrSplit(it->second, ' ', absl::SkipEmpty());
      ASSERT_FALSE(words.empty());
      EXPECT_EQ(words[0], "/usr/local/bin/kvtierd") << key;
      words.erase(words.begin());
      absl::StatusOr<CommandLine> flags = ParseArgs(words);
      ASSERT_TRUE(flags.ok()) << key << ": " << flags.status();
      EXPECT_EQ(flags->config_file, "/etc/kvtier/kvtierd.toml") << key;
    }
  }
}

TEST(SystemdUnitTest, StopsGracefullyWithUnlimitedMemlock) {
  const auto entries = UnitEntries(ReadSourceFile("deploy/kvtierd.service"));
  auto value = [&](const std::string& key) {
    auto it = entries.find(key);
    return it == entries.end() ? std::string() : it->second;
  };
  EXPECT_EQ(value("LimitMEMLOCK"), "infinity");
  EXPECT_EQ(value("KillSignal"), "SIGTERM");
  EXPECT_EQ(value("RuntimeDirectory"), "kvtier");
  // The example config (installed as the unit's config) must finish its grace period before
  // systemd's stop timeout kills the daemon.
  int64_t timeout_s = 0;
  ASSERT_TRUE(absl::SimpleAtoi(value("TimeoutStopSec"), &timeout_s)) << value("TimeoutStopSec");
  absl::StatusOr<DaemonConfig> example = LoadConfigFile(
      absl::StrCat(KVTIER_SOURCE_DIR, "/deploy/kvtierd.example.toml"), DefaultConfig());
  ASSERT_TRUE(example.ok()) << example.status();
  EXPECT_LT(example->shutdown_grace, absl::Seconds(timeout_s));
  // Its sockets live in the unit's RuntimeDirectory.
  EXPECT_EQ(example->unix_socket.rfind("/run/kvtier/", 0), 0u) << example->unix_socket;
}

}  // namespace
}  // namespace kvtier::daemon
