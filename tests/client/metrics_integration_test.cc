// kvtierd's /metrics end to end (docs/metrics.md): the real kvtierd (a subprocess) serving
// metrics on a loopback port, an SHM session (its Retriever in this process, publishing
// through the region's telemetry block) and a GRPC session (the daemon's Retriever) driven
// through decode steps, and the counters read back two ways: scraped directly, where they
// must equal what each session's own Stats() says, and through a real Prometheus server
// (Debian's `prometheus`) that scrapes the daemon, queried over its HTTP API. The second test
// is skipped, saying why, when no prometheus binary is found.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/rpc_util.h"
#include "core/status.h"
#include "daemon/http.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/client.h"
#include "kvtier/protocol.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "tests/client/daemon_process.h"
#include "tests/client/integration_options.h"
#include "tests/client/session_trace.h"

namespace kvtier {
namespace {

using daemon::HttpGet;
using testing::DaemonProcess;
using testing::DaemonProcessOptions;
using testing::IntegrationSessionOptions;
using testing::IntegrationTrace;
using testing::Subprocess;
using testing::SyntheticTrace;

using Labels = std::map<std::string, std::string>;

// The samples of a Prometheus text exposition: name, labels, value. Enough for what kvtierd
// writes (label values without escapes); a line that does not parse fails the test.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

std::vector<Sample> ParseExposition(const std::string& text) {
  static const std::regex line_re(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$)");
  static const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)")re");
  std::vector<Sample> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty() || line[0] == '#') continue;
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) {
      ADD_FAILURE() << "not an exposition line: " << line;
      continue;
    }
    Sample s;
    s.name = m[1];
    const std::string labels = m[3];
    for (auto it = std::sregex_iterator(labels.begin(), labels.end(), label_re);
         it != std::sregex_iterator(); ++it) {
      s.labels[(*it)[1]] = (*it)[2];
    }
    const std::string v = m[4];
    if (v == "+Inf") {
      s.value = INFINITY;
    } else if (!absl::SimpleAtod(v, &s.value)) {
      ADD_FAILURE() << "bad value in: " << line;
    }
    out.push_back(std::move(s));
  }
  return out;
}

// The sum of the samples of `name` whose labels include `match`; nullopt when none does.
std::optional<double> Sum(const std::vector<Sample>& samples, const std::string& name,
                          const Labels& match) {
  std::optional<double> sum;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool ok = true;
    for (const auto& [k, v] : match) {
      auto it = s.labels.find(k);
      ok = ok && it != s.labels.end() && it->second == v;
    }
    if (ok) sum = sum.value_or(0) + s.value;
  }
  return sum;
}

// A TCP port on loopback that nothing listens on now.
int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// The prometheus binary: $KVTIER_PROMETHEUS, else `prometheus` on PATH; empty when none.
std::string FindPrometheus() {
  if (const char* p = std::getenv("KVTIER_PROMETHEUS"); p != nullptr && *p != '\0') return p;
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string candidate = dirs.substr(start, end - start) + "/prometheus";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

// What one session did, by its own account (Sequence::Stats after Wait).
struct Driven {
  std::string id;
  std::string transport;
  SequenceStats stats;
  int64_t layer_steps = 0;
};

class MetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    backend_ = NewCpuBackend(2).release();
    DaemonProcessOptions o;
    o.kvtierd_path = KVTIERD_PATH;
    o.tenants = {{.name = "a", .token = "ta", .host_memory_bytes = uint64_t{64} << 20}};
    o.extra_toml = "[metrics]\naddress = \"127.0.0.1:0\"\n";
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(o);
    if (!d.ok()) {
      start_error_ = new absl::Status(d.status());
      return;
    }
    daemon_ = d->release();
    // Hello says where the metrics are (the port the daemon chose).
    auto stub = v1::KvTier::NewStub(grpc::CreateChannel("unix:" + daemon_->socket_path(),
                                                        grpc::InsecureChannelCredentials()));
    v1::HelloRequest req;
    req.set_protocol_version(kProtocolVersion);
    v1::HelloReply reply;
    auto ctx = NewCallContext("a", "ta", absl::Seconds(30));
    const grpc::Status st = stub->Hello(ctx.get(), req, &reply);
    if (!st.ok()) {
      start_error_ = new absl::Status(absl::UnavailableError(st.error_message()));
      return;
    }
    metrics_address_ = new std::string(reply.metrics_address());
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
    delete metrics_address_;
    metrics_address_ = nullptr;
    delete backend_;
    backend_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(start_error_, nullptr) << *start_error_;
    ASSERT_TRUE(daemon_->process().Running()) << "kvtierd died; its log:\n" << daemon_->Log();
  }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      std::string log = daemon_->Log();
      if (log.size() > 8000) log = log.substr(log.size() - 8000);
      std::cerr << "---- kvtierd log (tail) ----\n" << log << "\n----\n";
    }
  }

  static std::vector<Sample> Scrape() {
    absl::StatusOr<daemon::HttpResponse> r = HttpGet(*metrics_address_, "/metrics", absl::Seconds(10));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    EXPECT_EQ(r->status, 200);
    EXPECT_NE(r->content_type.find("version=0.0.4"), std::string::npos) << r->content_type;
    return ParseExposition(r->body);
  }

  // Opens a session of `transport`, appends the trace's prefill and runs `steps` decode
  // steps over every layer, then reads its statistics.
  static absl::StatusOr<Driven> Drive(Client& client, Transport transport, int32_t steps,
                                      std::unique_ptr<Session>* keep) {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s,
                            client.OpenSession(IntegrationSessionOptions(
                                transport, transport == Transport::kShm ? backend_ : nullptr)));
    const SyntheticTrace trace(IntegrationTrace());
    KVTIER_RETURN_IF_ERROR(testing::AppendTokens(*s, trace, 0, trace.options().prefill));
    KVTIER_RETURN_IF_ERROR(testing::RunDecode(*s, trace, 0, steps).status());
    KVTIER_RETURN_IF_ERROR(s->sequence().Wait());
    Driven d;
    d.id = s->id();
    d.transport = std::string(TransportName(transport));
    d.stats = s->sequence().Stats();
    d.layer_steps = int64_t{steps} * trace.options().geometry.num_layers;
    *keep = std::move(s);
    return d;
  }

  static DaemonProcess* daemon_;
  static absl::Status* start_error_;
  static std::string* metrics_address_;
  static Backend* backend_;
};

DaemonProcess* MetricsTest::daemon_ = nullptr;
absl::Status* MetricsTest::start_error_ = nullptr;
std::string* MetricsTest::metrics_address_ = nullptr;
Backend* MetricsTest::backend_ = nullptr;

// Every retrieval counter of `d` as /metrics (or Prometheus) reports it, against its stats.
void ExpectCountersMatch(const Driven& d,
                         const std::function<std::optional<double>(const std::string&,
                                                                   const Labels&)>& value) {
  const Labels who = {{"tenant", "a"}, {"session", d.id}, {"transport", d.transport}};
  SCOPED_TRACE(d.transport + " session " + d.id);
  const auto expect = [&](const std::string& name, int64_t want) {
    const std::optional<double> got = value(name, who);
    ASSERT_TRUE(got.has_value()) << name << " missing";
    EXPECT_EQ(*got, static_cast<double>(want)) << name;
  };
  EXPECT_EQ(d.stats.steps, d.layer_steps);
  // Every counter of kvtier/counters.h has its family (GetStats carries every one too, so a
  // GRPC session's are compared as an SHM session's are).
  for (const CounterInfo& c : SequenceCounters()) {
    expect("kvtier_retrieval_" + std::string(c.name) +
               (c.kind == CounterKind::kCounter ? "_total" : ""),
           d.stats.*c.field);
  }
  EXPECT_GT(value("kvtier_retrieval_resident_bytes", who).value_or(0), 0);
  expect("kvtier_retrieval_layer_step_duration_seconds_count", d.layer_steps);
  expect("kvtier_session_pages_committed_total", d.stats.offloaded_pages);
  // The trace makes speculation wrong sometimes: the counters moved, they are not zeros.
  EXPECT_GT(d.stats.recalled_bytes, 0);
  EXPECT_GT(d.stats.corrected_heads, 0);
  EXPECT_LT(d.stats.corrected_heads, d.stats.checked_heads);
}

TEST_F(MetricsTest, ScrapedCountersEqualEachSessionsOwnStatistics) {
  ClientOptions co;
  co.tenant = "a";
  co.token = "ta";
  auto client = Client::Connect(daemon_->target(), co);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<Sample> before = Scrape();
  const double step_rpcs_before =
      Sum(before, "kvtier_rpcs_total", {{"method", "/kvtier.v1.KvTier/Step"}}).value_or(0);

  std::unique_ptr<Session> shm_session, grpc_session;
  absl::StatusOr<Driven> shm = Drive(**client, Transport::kShm, 24, &shm_session);
  ASSERT_TRUE(shm.ok()) << shm.status();
  absl::StatusOr<Driven> grpc = Drive(**client, Transport::kGrpc, 12, &grpc_session);
  ASSERT_TRUE(grpc.ok()) << grpc.status();

  const std::vector<Sample> after = Scrape();
  const auto value = [&](const std::string& name, const Labels& l) { return Sum(after, name, l); };
  ExpectCountersMatch(*shm, value);
  ExpectCountersMatch(*grpc, value);

  // The SHM session published 48 layer-steps with no Step RPC: the only Steps are the GRPC
  // session's, one per layer-step.
  EXPECT_EQ(Sum(after, "kvtier_rpcs_total", {{"method", "/kvtier.v1.KvTier/Step"}}).value_or(0) -
                step_rpcs_before,
            static_cast<double>(grpc->layer_steps));
  EXPECT_EQ(Sum(after, "kvtier_rpcs_total",
                {{"method", "/kvtier.v1.KvTier/Step"}, {"code", "OK"}})
                .value_or(0) -
                step_rpcs_before,
            static_cast<double>(grpc->layer_steps));
  EXPECT_GE(Sum(after, "kvtier_rpc_duration_seconds_count",
                {{"method", "/kvtier.v1.KvTier/OpenSession"}})
                .value_or(0),
            2);
  EXPECT_GE(Sum(after, "kvtier_attach_handshakes_total", {{"outcome", "ok"}}).value_or(0), 1);
  EXPECT_EQ(Sum(after, "kvtier_tenant_sessions", {{"tenant", "a"}, {"transport", "shm"}}), 1);
  EXPECT_EQ(Sum(after, "kvtier_tenant_sessions", {{"tenant", "a"}, {"transport", "grpc"}}), 1);
  EXPECT_GE(Sum(after, "kvtier_sessions_opened_total", {{"tenant", "a"}}).value_or(0), 2);
  EXPECT_GT(Sum(after, "kvtier_tenant_used_bytes", {{"tenant", "a"}}).value_or(0), 0);
  EXPECT_EQ(Sum(after, "kvtier_tenant_quota_bytes", {{"tenant", "a"}}),
            static_cast<double>(uint64_t{64} << 20));
  EXPECT_EQ(Sum(after, "kvtier_session_committed_pages", {{"session", shm->id}}),
            static_cast<double>(shm->stats.offloaded_pages));
  // A closed session leaves the per-session series and counts as closed.
  ASSERT_TRUE(grpc_session->Close().ok());
  const std::vector<Sample> closed = Scrape();
  EXPECT_FALSE(Sum(closed, "kvtier_retrieval_steps_total", {{"session", grpc->id}}).has_value());
  EXPECT_GE(Sum(closed, "kvtier_sessions_closed_total", {{"transport", "grpc"}}).value_or(0), 1);
}

TEST_F(MetricsTest, PrometheusScrapesTheRetrievalCountersAsTheSessionsMoveThem) {
  const std::string prometheus = FindPrometheus();
  if (prometheus.empty()) {
    GTEST_SKIP() << "no prometheus binary (Debian package `prometheus`, which scripts/setup "
                    "installs; or set KVTIER_PROMETHEUS): the Prometheus round trip is not tested";
  }
  const int port = FreeLoopbackPort();
  ASSERT_NE(port, 0);
  const std::string dir = daemon_->dir() + "/prometheus";
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  {
    std::ofstream cfg(dir + "/prometheus.yml");
    cfg << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        << "scrape_configs:\n  - job_name: kvtierd\n    static_configs:\n"
        << "      - targets: ['" << *metrics_address_ << "']\n";
  }
  const std::string web = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<Subprocess>> server = Subprocess::Spawn(
      {prometheus, "--config.file=" + dir + "/prometheus.yml",
       "--storage.tsdb.path=" + dir + "/data", "--web.listen-address=" + web,
       "--log.level=warn"},
      dir + "/prometheus.log");
  ASSERT_TRUE(server.ok()) << server.status();
  const auto log = [&] {
    std::ifstream f(dir + "/prometheus.log");
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  // Ready within a minute (it answers /-/ready with 200 once its storage is open).
  const absl::Time ready_by = absl::Now() + absl::Seconds(60);
  bool ready = false;
  while (!ready && absl::Now() < ready_by && (*server)->Running()) {
    absl::StatusOr<daemon::HttpResponse> r = HttpGet(web, "/-/ready", absl::Seconds(2));
    ready = r.ok() && r->status == 200;
    if (!ready) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(ready) << "prometheus did not become ready; its log:\n" << log();

  // The value of an instant query that returns one sample; nullopt while it returns none.
  const auto query = [&](const std::string& promql) -> std::optional<double> {
    absl::StatusOr<daemon::HttpResponse> r =
        HttpGet(web, "/api/v1/query?query=" + daemon::UrlEncode(promql), absl::Seconds(5));
    if (!r.ok() || r->status != 200) return std::nullopt;
    static const std::regex value_re(R"re("value":\[[0-9.e+]+,"([^"]+)"\])re");
    std::smatch m;
    if (!std::regex_search(r->body, m, value_re)) return std::nullopt;
    double v = 0;
    if (!absl::SimpleAtod(std::string(m[1]), &v)) return std::nullopt;
    return v;
  };
  // Waits (bounded) until Prometheus has scraped a value equal to `want`: the last value
  // seen when it never does.
  const auto eventually = [&](const std::string& promql, double want) -> std::optional<double> {
    const absl::Time until = absl::Now() + absl::Seconds(30);
    std::optional<double> got;
    while (absl::Now() < until) {
      got = query(promql);
      if (got.has_value() && *got == want) return got;
      absl::SleepFor(absl::Milliseconds(200));
    }
    return got;
  };

  ClientOptions co;
  co.tenant = "a";
  co.token = "ta";
  auto client = Client::Connect(daemon_->target(), co);
  ASSERT_TRUE(client.ok()) << client.status();
  // Two rounds: the counters Prometheus holds follow the sessions as they step further.
  std::unique_ptr<Session> shm_session, grpc_session;
  absl::StatusOr<Driven> shm = Drive(**client, Transport::kShm, 8, &shm_session);
  ASSERT_TRUE(shm.ok()) << shm.status();
  absl::StatusOr<Driven> grpc = Drive(**client, Transport::kGrpc, 8, &grpc_session);
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  for (const Driven* d : {&*shm, &*grpc}) {
    const std::string sel = absl::StrCat("{session=\"", d->id, "\"}");
    EXPECT_EQ(eventually("sum(kvtier_retrieval_steps_total" + sel + ")",
                         static_cast<double>(d->stats.steps)),
              static_cast<double>(d->stats.steps))
        << d->transport;
    EXPECT_EQ(eventually("sum(kvtier_retrieval_corrected_heads_total" + sel + ")",
                         static_cast<double>(d->stats.corrected_heads)),
              static_cast<double>(d->stats.corrected_heads))
        << d->transport;
    EXPECT_EQ(eventually("sum(kvtier_retrieval_recalled_bytes_total" + sel + ")",
                         static_cast<double>(d->stats.recalled_bytes)),
              static_cast<double>(d->stats.recalled_bytes))
        << d->transport;
  }
  // The SHM session steps on: Prometheus sees its counters move past the first round's.
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_TRUE(testing::RunDecode(*shm_session, trace, 8, 20).ok());
  ASSERT_TRUE(shm_session->sequence().Wait().ok());
  const SequenceStats more = shm_session->sequence().Stats();
  ASSERT_GT(more.steps, shm->stats.steps);
  ASSERT_GE(more.corrected_heads, shm->stats.corrected_heads);
  const std::string sel = absl::StrCat("{session=\"", shm->id, "\"}");
  EXPECT_EQ(eventually("sum(kvtier_retrieval_steps_total" + sel + ")",
                       static_cast<double>(more.steps)),
            static_cast<double>(more.steps));
  EXPECT_EQ(eventually("sum(kvtier_retrieval_corrected_heads_total" + sel + ")",
                       static_cast<double>(more.corrected_heads)),
            static_cast<double>(more.corrected_heads));
  EXPECT_EQ(eventually("sum(kvtier_retrieval_recalled_bytes_total" + sel + ")",
                       static_cast<double>(more.recalled_bytes)),
            static_cast<double>(more.recalled_bytes));
  // And the target is up as far as Prometheus is concerned.
  EXPECT_EQ(eventually("up{job=\"kvtierd\"}", 1), 1);
  if (HasFailure()) std::cerr << "---- prometheus log ----\n" << log() << "\n----\n";
  EXPECT_TRUE((*server)->Stop(SIGTERM, absl::Seconds(30)).ok());
}

}  // namespace
}  // namespace kvtier
