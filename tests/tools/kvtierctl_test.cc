// The kvtierctl binary end to end: against the real kvtierd (a child process, as the client
// integration tests start it) for the gRPC commands and their exit codes, and against an
// in-process HttpServer serving a canned /metrics body for the HTTP commands.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/http.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "tests/client/daemon_process.h"
#include "tests/tools/canned_metrics.h"

namespace kvtier::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kToken[] = "tenant-secret";
constexpr char kAdminToken[] = "admin-secret";
constexpr absl::Duration kRunTimeout = absl::Seconds(60);  // never reached when things work

struct Result {
  int exit_code = -1;  // -1: killed or timed out
  std::string out, err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs kvtierctl with `args` and only `env` in its environment; stdout and stderr go to files.
Result RunCtl(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  std::string dir = ::testing::TempDir() + "kvtierctl-run-XXXXXX";
  EXPECT_NE(mkdtemp(dir.data()), nullptr);
  const std::string out_path = dir + "/out", err_path = dir + "/err";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT, 0600);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT, 0600);
  std::vector<std::string> argv = {KVTIERCTL_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv, cenv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::vector<std::string> envs = env;
  for (std::string& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  Result result;
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << argv[0] << ": " << std::strerror(rc);
    return result;
  }
  // Bounded wait on a pidfd; a hung kvtierctl is killed and fails the test.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{.fd = pidfd, .events = POLLIN, .revents = 0};
    int n;
    while ((n = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kRunTimeout)))) < 0 &&
           errno == EINTR) {
    }
    if (n == 0) {
      ADD_FAILURE() << "kvtierctl did not exit within " << kRunTimeout;
      kill(pid, SIGKILL);
    }
    close(pidfd);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  result.out = ReadFile(out_path);
  result.err = ReadFile(err_path);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return result;
}

std::string Describe(const Result& r) {
  return absl::StrCat("exit ", r.exit_code, "\nstdout:\n", r.out, "stderr:\n", r.err);
}

// One kvtierd for the suite: tenant "default" with a token and an admin token. The drain test
// drains it, so it runs last (gtest keeps the declaration order).
class KvtierctlDaemonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::DaemonProcessOptions o;
    o.kvtierd_path = KVTIERD_PATH;
    o.tenants = {{.name = "default", .token = kToken}};
    o.admin_token = kAdminToken;
    o.cpu_threads = 1;
    auto d = testing::DaemonProcess::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr); }

  // The global flags every call passes, then `args`.
  static std::vector<std::string> With(std::vector<std::string> args) {
    std::vector<std::string> all = {"--socket", daemon_->socket_path(), "--token", kToken};
    all.insert(all.end(), args.begin(), args.end());
    return all;
  }

  static testing::DaemonProcess* daemon_;
};
testing::DaemonProcess* KvtierctlDaemonTest::daemon_ = nullptr;

TEST_F(KvtierctlDaemonTest, HealthIsServing) {
  const Result r = RunCtl({"--socket", daemon_->socket_path(), "health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");
  // The same through unix:PATH, KVTIER_SOCKET, with the KvTier service named, and flags after
  // the command.
  const Result unix_form = RunCtl({"health", "--socket", "unix:" + daemon_->socket_path()});
  EXPECT_EQ(unix_form.exit_code, 0) << Describe(unix_form);
  const Result env = RunCtl({"health"}, {"KVTIER_SOCKET=" + daemon_->socket_path()});
  EXPECT_EQ(env.exit_code, 0) << Describe(env);
  const Result service = RunCtl(With({"health", "--service", "kvtier.v1.KvTier"}));
  EXPECT_EQ(service.exit_code, 0) << Describe(service);
  EXPECT_EQ(service.out, "SERVING\n");
}

TEST_F(KvtierctlDaemonTest, HealthOfAnUnknownServiceIsNotServing) {
  const Result r = RunCtl(With({"health", "--service", "no.such.Service"}));
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_EQ(r.out, "SERVICE_UNKNOWN\n");
}

TEST_F(KvtierctlDaemonTest, ListOnAnIdleDaemonShowsNoSessions) {
  const Result r = RunCtl(With({"list"}));
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "no sessions for tenant 'default'\n");
  const Result json = RunCtl(With({"--json", "list"}));
  EXPECT_EQ(json.exit_code, 0) << Describe(json);
  EXPECT_EQ(json.out, "{\"sessions\":[]}\n");
  const Result env_token =
      RunCtl({"--socket", daemon_->socket_path(), "list"}, {absl::StrCat("KVTIER_TOKEN=", kToken)});
  EXPECT_EQ(env_token.exit_code, 0) << Describe(env_token);
}

TEST_F(KvtierctlDaemonTest, ListAndStatsShowAnOpenSession) {
  auto channel =
      grpc::CreateChannel("unix:" + daemon_->socket_path(), grpc::InsecureChannelCredentials());
  auto stub = v1::KvTier::NewStub(channel);
  v1::OpenSessionRequest open;
  open.set_tenant("default");
  v1::Geometry* g = open.mutable_geometry();
  g->set_num_layers(2);
  g->set_num_q_heads(2);
  g->set_num_kv_heads(1);
  g->set_head_dim(64);
  g->set_page_size(32);
  g->set_dtype(v1::DTYPE_FP16);
  open.set_transport(v1::TRANSPORT_GRPC);
  open.set_label("ctl-test");
  v1::OpenSessionReply opened;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "default");
    ctx.AddMetadata("x-kvtier-token", kToken);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    const grpc::Status st = stub->OpenSession(&ctx, open, &opened);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  const std::string id = opened.session().session_id();

  const Result list = RunCtl(With({"list"}));
  EXPECT_EQ(list.exit_code, 0) << Describe(list);
  EXPECT_THAT(list.out, StartsWith("SESSION "));
  EXPECT_THAT(list.out, HasSubstr(id));
  EXPECT_THAT(list.out, HasSubstr("grpc"));
  EXPECT_THAT(list.out, HasSubstr("open"));
  EXPECT_THAT(list.out, HasSubstr("ctl-test"));
  const Result json = RunCtl(With({"list", "--json"}));
  EXPECT_EQ(json.exit_code, 0) << Describe(json);
  EXPECT_THAT(json.out, HasSubstr("\"session_id\":\"" + id + "\""));

  const Result stats = RunCtl(With({"stats", id}));
  EXPECT_EQ(stats.exit_code, 0) << Describe(stats);
  EXPECT_THAT(stats.out, StartsWith("session              " + id + "\n"));
  EXPECT_THAT(stats.out, HasSubstr("  steps              0\n"));
  EXPECT_THAT(stats.out, HasSubstr("tenant               default\n"));
  EXPECT_THAT(stats.out, HasSubstr("  sessions           1\n"));
  const Result stats_json = RunCtl(With({"--json", "stats", id}));
  EXPECT_EQ(stats_json.exit_code, 0) << Describe(stats_json);
  EXPECT_THAT(stats_json.out, HasSubstr("\"uptime_s\""));

  // The daemon serves metrics by default (a Unix socket Hello names): their views show the
  // session too.
  const Result sessions = RunCtl(With({"sessions"}));
  ASSERT_EQ(sessions.exit_code, 0) << Describe(sessions);
  EXPECT_THAT(sessions.out, HasSubstr(id));
  const Result tenants = RunCtl(With({"--json", "tenants"}));
  EXPECT_EQ(tenants.exit_code, 0) << Describe(tenants);
  EXPECT_THAT(tenants.out, HasSubstr("{\"tenant\": \"default\", \"quota_bytes\": 67108864"));
  EXPECT_THAT(tenants.out, HasSubstr("\"sessions\": 1,"));

  // Suspended, it says so.
  {
    v1::SuspendSessionRequest suspend;
    suspend.set_session_id(id);
    v1::SuspendSessionReply suspended;
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-kvtier-tenant", "default");
    ctx.AddMetadata("x-kvtier-token", kToken);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    const grpc::Status st = stub->SuspendSession(&ctx, suspend, &suspended);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  const Result after = RunCtl(With({"list"}));
  EXPECT_EQ(after.exit_code, 0) << Describe(after);
  EXPECT_THAT(after.out, HasSubstr("suspended"));

  v1::CloseSessionRequest close_request;
  close_request.set_session_id(id);
  v1::CloseSessionReply closed;
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-kvtier-tenant", "default");
  ctx.AddMetadata("x-kvtier-token", kToken);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  const grpc::Status st = stub->CloseSession(&ctx, close_request, &closed);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

TEST_F(KvtierctlDaemonTest, AWrongTokenIsAnRpcErrorNamingTheCodeAndAddress) {
  const Result r = RunCtl({"--socket", daemon_->socket_path(), "--token", "wrong", "list"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, StartsWith("kvtierctl: unix:" + daemon_->socket_path() +
                                ": ListSessions: PERMISSION_DENIED: "));
  EXPECT_EQ(r.out, "");
}

TEST_F(KvtierctlDaemonTest, StatsOfAnUnknownSessionIsAnRpcError) {
  const Result r = RunCtl(With({"stats", "no-such-session"}));
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("GetStats: NOT_FOUND"));
}

TEST_F(KvtierctlDaemonTest, MetricsComeFromTheAddressHelloNames) {
  const Result r = RunCtl(With({"metrics"}));
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_THAT(r.out, HasSubstr("# TYPE kvtier_tenant_quota_bytes gauge\n"));
  EXPECT_THAT(r.out, HasSubstr("kvtier_tenant_quota_bytes{tenant=\"default\"} 67108864\n"));
}

TEST(KvtierctlNoMetricsTest, ADaemonWithMetricsOffSaysSo) {
  testing::DaemonProcessOptions o;
  o.kvtierd_path = KVTIERD_PATH;
  o.tenants = {{.name = "default", .token = kToken}};
  o.cpu_threads = 1;
  o.extra_toml = "[metrics]\naddress = \"off\"\n";
  auto d = testing::DaemonProcess::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  const Result r = RunCtl({"--socket", (*d)->socket_path(), "--token", kToken, "metrics"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("metrics are off on this daemon"));
}

TEST_F(KvtierctlDaemonTest, UsageErrorsExit2) {
  const Result missing_admin = RunCtl(With({"drain"}));
  EXPECT_EQ(missing_admin.exit_code, 2) << Describe(missing_admin);
  EXPECT_THAT(missing_admin.err, HasSubstr("--admin-token"));
  const Result no_command = RunCtl(With({}));
  EXPECT_EQ(no_command.exit_code, 2) << Describe(no_command);
  const Result bad_flag = RunCtl(With({"list", "--no-such-flag"}));
  EXPECT_EQ(bad_flag.exit_code, 2) << Describe(bad_flag);
  const Result bad_socket = RunCtl({"--socket", "host:99999", "health"});
  EXPECT_EQ(bad_socket.exit_code, 2) << Describe(bad_socket);
  const Result help = RunCtl({"--help"});
  EXPECT_EQ(help.exit_code, 0) << Describe(help);
  EXPECT_THAT(help.out, HasSubstr("drain"));
}

// Last: drains the suite's daemon.
TEST_F(KvtierctlDaemonTest, DrainNeedsTheAdminTokenThenTurnsHealthNotServing) {
  const Result wrong = RunCtl(With({"drain", "--admin-token", "not-it"}));
  EXPECT_EQ(wrong.exit_code, 1) << Describe(wrong);
  EXPECT_THAT(wrong.err, HasSubstr("Drain: PERMISSION_DENIED"));
  const Result still = RunCtl(With({"health"}));
  EXPECT_EQ(still.exit_code, 0) << Describe(still);

  const Result drained = RunCtl(With({"drain", "--timeout-ms-drain", "5000"}),
                                {absl::StrCat("KVTIER_ADMIN_TOKEN=", kAdminToken)});
  EXPECT_EQ(drained.exit_code, 0) << Describe(drained);
  EXPECT_THAT(drained.out, HasSubstr("drained"));
  EXPECT_THAT(drained.out, HasSubstr("yes"));
  const Result after = RunCtl(With({"health"}));
  EXPECT_EQ(after.exit_code, 1) << Describe(after);
  EXPECT_EQ(after.out, "NOT_SERVING\n");
}

// ---- without a daemon --------------------------------------------------------------------------

TEST(KvtierctlTest, AnUnreachableDaemonExits2NamingTheAddress) {
  const std::string absent = ::testing::TempDir() + "kvtierctl-absent.sock";
  for (const std::string command : {"health", "list", "stats"}) {
    SCOPED_TRACE(command);
    std::vector<std::string> args = {"--socket", absent, "--timeout-ms", "2000", command};
    if (command == "stats") args.push_back("s-1");
    const Result r = RunCtl(args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr("cannot reach kvtierd at unix:" + absent));
    EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  }
}

std::unique_ptr<daemon::HttpServer> CannedMetricsServer(const std::string& address) {
  auto server = daemon::HttpServer::Start({.address = address}, [](const daemon::HttpRequest& r) {
    if (r.target != "/metrics") return daemon::HttpResponse{.status = 404, .body = "no\n"};
    return daemon::HttpResponse{.content_type = "text/plain; version=0.0.4",
                                .body = testing::kCannedMetrics};
  });
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

TEST(KvtierctlTest, MetricsPrintsTheBodyVerbatim) {
  auto tcp = CannedMetricsServer("127.0.0.1:0");
  ASSERT_NE(tcp, nullptr);
  // No daemon is needed when --metrics names the endpoint.
  const Result r =
      RunCtl({"--socket", "/nonexistent/kvtierd.sock", "--metrics", tcp->address(), "metrics"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, testing::kCannedMetrics);

  const std::string path = ::testing::TempDir() + "kvtierctl-metrics.sock";
  auto unix_server = CannedMetricsServer("unix:" + path);
  ASSERT_NE(unix_server, nullptr);
  const Result u = RunCtl({"--metrics", unix_server->address(), "metrics"});
  EXPECT_EQ(u.exit_code, 0) << Describe(u);
  EXPECT_EQ(u.out, testing::kCannedMetrics);
}

TEST(KvtierctlTest, TenantsAndSessionsTabulateTheMetrics) {
  auto server = CannedMetricsServer("127.0.0.1:0");
  ASSERT_NE(server, nullptr);
  const Result tenants = RunCtl({"--metrics", server->address(), "tenants"});
  EXPECT_EQ(tenants.exit_code, 0) << Describe(tenants);
  EXPECT_THAT(tenants.out, StartsWith("TENANT "));
  EXPECT_THAT(tenants.out, HasSubstr("default     1.0 GiB  256.0 MiB  25.0%"));
  const Result sessions =
      RunCtl({"--metrics", server->address(), "sessions", "--tenant-filter", "default"});
  EXPECT_EQ(sessions.exit_code, 0) << Describe(sessions);
  EXPECT_THAT(sessions.out, HasSubstr("s-1"));
  EXPECT_THAT(sessions.out, HasSubstr("streamed"));
  EXPECT_THAT(sessions.out, ::testing::Not(HasSubstr("b-1")));
  const Result json = RunCtl({"--metrics", server->address(), "--json", "sessions"});
  EXPECT_EQ(json.exit_code, 0) << Describe(json);
  EXPECT_THAT(json.out, StartsWith("[\n  {\"tenant\": \"default\", \"session\": \"s-1\""));
}

TEST(KvtierctlTest, MetricsErrorsExitNonZero) {
  auto broken =
      daemon::HttpServer::Start({.address = "127.0.0.1:0"}, [](const daemon::HttpRequest&) {
        return daemon::HttpResponse{.status = 503, .body = "warming up\n"};
      });
  ASSERT_TRUE(broken.ok()) << broken.status();
  const Result r = RunCtl({"--metrics", (*broken)->address(), "metrics"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_THAT(r.err, HasSubstr("503"));
  EXPECT_THAT(r.err, HasSubstr("warming up"));

  auto garbage = daemon::HttpServer::Start(
      {.address = "127.0.0.1:0"},
      [](const daemon::HttpRequest&) { return daemon::HttpResponse{.body = "ok 1\nbroken{ 2\n"}; });
  ASSERT_TRUE(garbage.ok()) << garbage.status();
  const Result g = RunCtl({"--metrics", (*garbage)->address(), "tenants"});
  EXPECT_EQ(g.exit_code, 1) << Describe(g);
  EXPECT_THAT(g.err, HasSubstr("line 2"));

  const std::string absent = ::testing::TempDir() + "kvtierctl-no-metrics.sock";
  const Result gone = RunCtl({"--metrics", "unix:" + absent, "metrics"});
  EXPECT_EQ(gone.exit_code, 2) << Describe(gone);
  EXPECT_THAT(gone.err, HasSubstr(absent));
}

}  // namespace
}  // namespace kvtier::ctl
