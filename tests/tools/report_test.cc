// tools/kvtierctl/report.h and format.h on a canned /metrics body, and the address rules of
// commands.h: parse → rows → table or JSON, with what each cell shows when a series is absent.
#include "tools/kvtierctl/report.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/canned_metrics.h"
#include "tools/kvtierctl/commands.h"
#include "tools/kvtierctl/format.h"
#include "tools/kvtierctl/prometheus.h"

namespace kvtier::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

PromText Canned() {
  absl::StatusOr<PromText> t = ParsePrometheusText(testing::kCannedMetrics);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : PromText{};
}

TEST(TenantRowsTest, OneRowPerTenantWithSessionsSummedOverTransports) {
  const std::vector<TenantRow> rows = TenantRows(Canned());
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].tenant, "default");
  EXPECT_EQ(rows[0].quota_bytes, 1073741824.0);
  EXPECT_EQ(rows[0].used_bytes, 268435456.0);
  EXPECT_EQ(rows[0].sessions, 2.0);
  EXPECT_EQ(rows[0].refused_requests, 3.0);
  EXPECT_EQ(rows[0].hugepage_bytes, 2097152.0);
  EXPECT_EQ(rows[0].numa_node, 0.0);
  EXPECT_EQ(rows[0].locked, 1.0);
  EXPECT_EQ(rows[1].tenant, "team \"b\"");
  EXPECT_EQ(rows[1].numa_node, -1.0);
}

TEST(TenantRowsTest, FormatsATable) {
  EXPECT_EQ(FormatTenants(TenantRows(Canned()), false),
            "TENANT        QUOTA       USED  USED%  SESSIONS  REFUSED  HUGEPAGES  NUMA  LOCKED\n"
            "default     1.0 GiB  256.0 MiB  25.0%         2        3    2.0 MiB     0  yes\n"
            "team \"b\"  256.0 MiB        0 B   0.0%         1        0       none   any  no\n");
}

TEST(TenantRowsTest, FormatsJsonWithNullForAbsentSeries) {
  PromText t = *ParsePrometheusText("kvtier_tenant_quota_bytes{tenant=\"x\"} 5\n");
  EXPECT_EQ(
      FormatTenants(TenantRows(t), true),
      "[\n  {\"tenant\": \"x\", \"quota_bytes\": 5, \"used_bytes\": null, \"sessions\": null, "
      "\"refused_requests\": null, \"hugepage_bytes\": null, \"numa_node\": null, "
      "\"locked\": null}\n]\n");
  const std::string canned = FormatTenants(TenantRows(Canned()), true);
  EXPECT_THAT(canned, HasSubstr("\"numa_node\": 0, \"locked\": true}"));
  EXPECT_THAT(canned, HasSubstr("\"numa_node\": -1, \"locked\": false}"));
  EXPECT_EQ(FormatTenants({}, true), "[]\n");
  EXPECT_EQ(FormatTenants({}, false), "no tenants\n");
}

TEST(SessionRowsTest, AggregatesEverySeriesOfASession) {
  const std::vector<SessionRow> rows = SessionRows(Canned(), "");
  ASSERT_EQ(rows.size(), 3u);
  const SessionRow& s1 = rows[0];
  EXPECT_EQ(s1.tenant, "default");
  EXPECT_EQ(s1.session, "s-1");
  EXPECT_EQ(s1.transport, "grpc");
  EXPECT_EQ(s1.layer_steps, 640.0);
  EXPECT_EQ(s1.checked_heads, 2000.0);
  EXPECT_EQ(s1.corrected_heads, 60.0);
  EXPECT_DOUBLE_EQ(*s1.correction_rate(), 0.03);
  EXPECT_EQ(s1.recalled_bytes, 3145728.0);
  EXPECT_EQ(s1.committed_pages, 120.0);
  EXPECT_EQ(s1.resident_bytes, 1048576.0);
  EXPECT_EQ(s1.strategy, "streamed");
  EXPECT_DOUBLE_EQ(*s1.mean_step_seconds(), 0.0005);
  EXPECT_DOUBLE_EQ(*s1.mean_mass_recall(), 0.975);
  // A session with no checks, no steps timed and no estimates has no rates.
  const SessionRow& s2 = rows[1];
  EXPECT_EQ(s2.session, "s-2");
  EXPECT_FALSE(s2.correction_rate().has_value());
  EXPECT_FALSE(s2.mean_step_seconds().has_value());
  EXPECT_FALSE(s2.mean_mass_recall().has_value());
  EXPECT_EQ(rows[2].tenant, "team \"b\"");
}

TEST(SessionRowsTest, FiltersByTenant) {
  const std::vector<SessionRow> rows = SessionRows(Canned(), "team \"b\"");
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].session, "b-1");
  EXPECT_TRUE(SessionRows(Canned(), "nobody").empty());
}

TEST(SessionRowsTest, FormatsATable) {
  EXPECT_EQ(
      FormatSessions(SessionRows(Canned(), ""), false),
      "TENANT    SESSION  TRANSPORT  LAYER-STEPS  CORRECTED  RECALLED  PAGES  RESIDENT  STRATEGY"
      "   STEP  MASS-RECALL\n"
      "default   s-1      grpc               640       3.0%   3.0 MiB    120   1.0 MiB  streamed"
      "  500us        0.975\n"
      "default   s-2      shm                  0          -         -      4         -  -       "
      "      -            -\n"
      "team \"b\"  b-1      shm                 32       0.0%     512 B      8         -  pages   "
      "      -            -\n");
  EXPECT_EQ(FormatSessions({}, false), "no sessions\n");
}

TEST(SessionRowsTest, FormatsJson) {
  const std::string json = FormatSessions(SessionRows(Canned(), "default"), true);
  EXPECT_THAT(json,
              HasSubstr("{\"tenant\": \"default\", \"session\": \"s-1\", \"transport\": "
                        "\"grpc\", \"layer_steps\": 640, \"checked_heads\": 2000, "
                        "\"corrected_heads\": 60, \"correction_rate\": 0.029999999999999999"));
  EXPECT_THAT(json, HasSubstr("\"recall_strategy\": \"streamed\""));
  EXPECT_THAT(json, HasSubstr("\"session\": \"s-2\""));
  EXPECT_THAT(json, HasSubstr("\"recall_strategy\": null"));
  EXPECT_THAT(json, Not(HasSubstr("b-1")));
  EXPECT_EQ(json.front(), '[');
}

// ---- format.h ----------------------------------------------------------------------------------

TEST(FormatTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(double{1} * (1 << 30)), "1.0 GiB");
  EXPECT_EQ(HumanBytes(std::nullopt), "-");
}

TEST(FormatTest, HumanDuration) {
  EXPECT_EQ(HumanDuration(absl::Nanoseconds(850)), "850ns");
  EXPECT_EQ(HumanDuration(absl::Nanoseconds(45200)), "45.2us");
  EXPECT_EQ(HumanDuration(absl::Microseconds(1300)), "1.30ms");
  EXPECT_EQ(HumanDuration(absl::Milliseconds(2500)), "2.50s");
  EXPECT_EQ(HumanDuration(absl::Seconds(192)), "3m12s");
  EXPECT_EQ(HumanDuration(absl::Minutes(302)), "5h02m");
  EXPECT_EQ(HumanDuration(absl::Hours(76)), "3d04h");
}

TEST(FormatTest, RenderTableAlignsAndTrims) {
  EXPECT_EQ(
      RenderTable({{"A"}, {"NUM", true}, {"Z"}}, {{"long-name", "7", ""}, {"x", "1234", "z"}}),
      "A           NUM  Z\n"
      "long-name     7\n"
      "x          1234  z\n");
}

TEST(FormatTest, JsonNumbersAndStrings) {
  EXPECT_EQ(JsonNumber(3), "3");
  EXPECT_EQ(JsonNumber(-0.5), "-0.5");
  EXPECT_EQ(JsonNumber(std::nullopt), "null");
  EXPECT_EQ(JsonNumber(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(JsonString("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
}

// ---- commands.h: addresses ---------------------------------------------------------------------

TEST(ParseDaemonAddressTest, PathsUnixAndTcp) {
  struct Case {
    std::string socket, target;
    bool tcp;
  };
  for (const Case& c : std::vector<Case>{
           {"/run/kvtier/kvtierd.sock", "unix:/run/kvtier/kvtierd.sock", false},
           {"unix:/run/k.sock", "unix:/run/k.sock", false},
           {"unix:///run/k.sock", "unix:/run/k.sock", false},
           {"kvtierd.sock", "unix:kvtierd.sock", false},
           {"./dir:with:colons/k.sock", "unix:./dir:with:colons/k.sock", false},
           {"localhost:50051", "localhost:50051", true},
           {"[::1]:50051", "[::1]:50051", true},
       }) {
    SCOPED_TRACE(c.socket);
    absl::StatusOr<DaemonAddress> a = ParseDaemonAddress(c.socket);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->target, c.target);
    EXPECT_EQ(a->display, c.target);
    EXPECT_EQ(a->tcp.has_value(), c.tcp);
  }
  for (const std::string bad : {"", "unix:", "host:99999", "a b:1"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(ParseDaemonAddress(bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(MetricsAddressTest, AnUnspecifiedHostIsTheDaemonsHostOrLoopback) {
  const DaemonAddress local = *ParseDaemonAddress("/run/k.sock");
  const DaemonAddress remote = *ParseDaemonAddress("node7:50051");
  EXPECT_EQ(*MetricsAddress("0.0.0.0:9464", local), "127.0.0.1:9464");
  EXPECT_EQ(*MetricsAddress("[::]:9464", local), "[::1]:9464");
  EXPECT_EQ(*MetricsAddress("0.0.0.0:9464", remote), "node7:9464");
  EXPECT_EQ(*MetricsAddress("10.0.0.5:9464", remote), "10.0.0.5:9464");
  EXPECT_EQ(*MetricsAddress("unix:/run/m.sock", remote), "unix:/run/m.sock");
  EXPECT_EQ(MetricsAddress("nonsense", local).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::ctl
