#include "bench/ipc_scrape.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/decode_sessions.h"
#include "core/mutex.h"
#include "core/status.h"
#include "daemon/http.h"
#include "kernels/registry.h"
#include "kvtier/client.h"
#include "kvtier/protocol.h"
#include "kvtier/v1/kvtier.grpc.pb.h"

namespace kvtier::bench {
namespace {

namespace pb = ::kvtier::v1;

constexpr double kTarget = 0.99;  // without_over_with: scraping costs at most 1%
// Safety nets against a daemon that hangs, never measurements.
constexpr absl::Duration kScrapeTimeout = absl::Seconds(5);
constexpr absl::Duration kHelloTimeout = absl::Seconds(10);
constexpr char kStepsFamily[] = "kvtier_retrieval_steps_total";
constexpr size_t kKeptErrors = 5;  // failure messages kept for the report

// The daemon's Hello: where it serves /metrics (with the real port). FAILED_PRECONDITION
// when metrics are off.
absl::StatusOr<std::string> MetricsAddress(const std::string& unix_socket,
                                           const std::string& tenant) {
  auto stub = pb::KvTier::NewStub(
      grpc::CreateChannel("unix:" + unix_socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-kvtier-tenant", tenant);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kHelloTimeout));
  pb::HelloRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_client_name("kvtier-bench ipc");
  pb::HelloReply reply;
  const grpc::Status s = stub->Hello(&ctx, req, &reply);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("Hello: ", s.error_message()));
  }
  if (reply.metrics_address().empty()) {
    return absl::FailedPreconditionError("kvtierd serves no /metrics (Hello names no address)");
  }
  return reply.metrics_address();
}

// The value of `session`'s kvtier_retrieval_steps_total sample in the exposition `body`.
std::optional<double> SessionSteps(absl::string_view body, const std::string& session) {
  const std::string prefix = absl::StrCat(kStepsFamily, "{");
  const std::string label = absl::StrCat("session=\"", session, "\"");
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::StartsWith(line, prefix) || !absl::StrContains(line, label)) continue;
    double v = 0;
    const size_t space = line.rfind(' ');
    if (space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &v)) {
      return v;
    }
  }
  return std::nullopt;
}

// One scrape's outcome.
struct Scrape {
  double latency_us = 0;        // the GET, connect to last byte
  int64_t bytes = 0;            // the exposition's body
  std::optional<double> steps;  // the session's kvtier_retrieval_steps_total
  std::string error;            // empty: a good scrape
};

// GETs /metrics from `address`. A good scrape answers 200 with the kvtier_retrieval_steps_total
// family and, when `session` is not empty, that session's sample.
Scrape ScrapeOnce(const std::string& address, const std::string& session) {
  Scrape s;
  const absl::Time start = absl::Now();
  absl::StatusOr<daemon::HttpResponse> r = daemon::HttpGet(address, "/metrics", kScrapeTimeout);
  s.latency_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  if (!r.ok()) {
    s.error = r.status().ToString();
    return s;
  }
  s.bytes = static_cast<int64_t>(r->body.size());
  if (r->status != 200) {
    s.error = absl::StrCat("GET /metrics answered ", r->status);
  } else if (!absl::StrContains(r->body, kStepsFamily)) {
    s.error = absl::StrCat("the exposition has no ", kStepsFamily);
  } else if (!session.empty()) {
    s.steps = SessionSteps(r->body, session);
    if (!s.steps.has_value()) {
      s.error =
          absl::StrCat("the exposition has no ", kStepsFamily, " sample for session ", session);
    }
  }
  return s;
}

// What scrapes saw: the good ones' latencies and sizes, and the failures.
struct ScrapeLog {
  std::vector<double> latency_us;  // good scrapes
  std::vector<double> bytes;       // good scrapes
  int64_t failures = 0;
  std::vector<std::string> errors;  // the first kKeptErrors

  void Add(const Scrape& s) {
    if (s.error.empty()) {
      latency_us.push_back(s.latency_us);
      bytes.push_back(static_cast<double>(s.bytes));
      return;
    }
    ++failures;
    if (errors.size() < kKeptErrors) errors.push_back(s.error);
  }
  void Add(const ScrapeLog& other) {
    latency_us.insert(latency_us.end(), other.latency_us.begin(), other.latency_us.end());
    bytes.insert(bytes.end(), other.bytes.begin(), other.bytes.end());
    failures += other.failures;
    for (const std::string& e : other.errors) {
      if (errors.size() < kKeptErrors) errors.push_back(e);
    }
  }
};

// A background thread that scrapes `address` every `period`, start to start (a scrape that
// overruns the period is followed at once by the next), from Start until Stop.
// Thread-safe: SetSession may be called from any thread while it runs.
class Scraper {
 public:
  Scraper(std::string address, absl::Duration period)
      : address_(std::move(address)), period_(period) {}
  ~Scraper() { (void)Stop(); }
  Scraper(const Scraper&) = delete;
  Scraper& operator=(const Scraper&) = delete;

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }
  // From now on, every scrape must have `id`'s sample.
  void SetSession(std::string id) {
    MutexLock lock(&mu_);
    session_ = std::move(id);
  }
  // Stops and joins the thread (the scrape in flight finishes); returns what it saw.
  ScrapeLog Stop() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    wake_.SignalAll();
    if (thread_.joinable()) thread_.join();
    return std::move(log_);
  }

 private:
  void Loop() {
    absl::Time next = absl::Now();
    for (;;) {
      std::string session;
      {
        MutexLock lock(&mu_);
        if (wake_.AwaitWithTimeout(
                &mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; },
                next - absl::Now())) {
          return;
        }
        session = session_;
      }
      log_.Add(ScrapeOnce(address_, session));
      next = std::max(next + period_, absl::Now());
    }
  }

  const std::string address_;
  const absl::Duration period_;
  Mutex mu_;
  CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string session_ ABSL_GUARDED_BY(mu_);
  ScrapeLog log_;  // the thread's, until Stop has joined it
  std::thread thread_;
};

// One replay.
struct RunResult {
  bool on = false;     // scraped
  double wall_us = 0;  // median per decode step, the speculative session's
  double critical_us = 0;
  double drain_us = 0;
  ScrapeLog scrapes;        // the background scrapes (on), then the check scrape
  int64_t background = 0;   // background scrapes, good or not
  double steps_total = -1;  // the check scrape's kvtier_retrieval_steps_total (-1: none)
};

// ABBA order: off on, on off, off on, ... (run i of the timed ones).
bool ScrapedRun(int32_t i) { return (i % 2 == 1) != ((i / 2) % 2 == 1); }

// The runs of one benchmark, aggregated.
struct Summary {
  Spread wall[2], critical[2];  // [on]: over runs of the per-run medians, µs
  Spread pairs;                 // off / on per ABBA pair (adjacent runs)
  double ratio = 0;             // without_over_with: median off / median on
  std::vector<std::string> order;
  ScrapeLog on_scrapes;        // the timed "on" runs' background scrapes
  ScrapeLog all;               // every scrape: warm-up, background and checks
  Spread latency_us;           // on_scrapes'
  double scrapes_per_run = 0;  // median over the timed "on" runs
  double bytes = 0;            // exposition, median of on_scrapes'
  int64_t scrapes() const {
    return static_cast<int64_t>(on_scrapes.latency_us.size()) + on_scrapes.failures;
  }
};

Summary Summarize(const std::vector<RunResult>& runs, const ScrapeLog& warmup) {
  Summary s;
  s.all = warmup;
  std::vector<double> wall[2], critical[2], pairs, per_run;
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    wall[r.on].push_back(r.wall_us);
    critical[r.on].push_back(r.critical_us);
    s.order.push_back(r.on ? "on" : "off");
    s.all.Add(r.scrapes);
    if (r.on) {
      s.on_scrapes.Add(r.scrapes);
      per_run.push_back(static_cast<double>(r.background));
    }
    if (i % 2 == 1) {  // runs i-1 and i are one off and one on
      const RunResult& off = r.on ? runs[i - 1] : r;
      const RunResult& on = r.on ? r : runs[i - 1];
      pairs.push_back(on.wall_us > 0 ? off.wall_us / on.wall_us : 0);
    }
  }
  for (int on = 0; on < 2; ++on) {
    s.wall[on] = SpreadOf(wall[on]);
    s.critical[on] = SpreadOf(critical[on]);
  }
  s.pairs = SpreadOf(pairs);
  s.ratio = s.wall[1].median > 0 ? s.wall[0].median / s.wall[1].median : 0;
  s.latency_us = SpreadOf(s.on_scrapes.latency_us);
  s.scrapes_per_run = Median(per_run);
  s.bytes = Median(s.on_scrapes.bytes);
  return s;
}

class ScrapeBench {
 public:
  ScrapeBench(const IpcScrapeOptions& o, std::string unix_socket, std::string tenant,
              std::ostream& log)
      : o_(o), unix_socket_(std::move(unix_socket)), tenant_(std::move(tenant)), log_(log) {}
  absl::StatusOr<IpcScrapeResult> Run();

 private:
  absl::Status Connect();
  absl::StatusOr<RunResult> RunReplay(bool on);
  void LogRun(const std::string& what, const RunResult& r) const;
  void LogSummary(const Summary& s) const;
  JsonObject ReportJson(const Summary& s, const std::vector<RunResult>& runs) const;

  const IpcScrapeOptions o_;
  const std::string unix_socket_;
  const std::string tenant_;
  std::ostream& log_;
  std::string metrics_address_;
  std::string device_;
  std::ostringstream detail_;  // the replays' and sessions' own logs, not shown
  std::unique_ptr<ReplaySessions> sessions_;
  ReplayBenchOptions replay_;
};

absl::Status ScrapeBench::Connect() {
  KVTIER_ASSIGN_OR_RETURN(metrics_address_, MetricsAddress(unix_socket_, tenant_));
  ClientOptions co;
  co.tenant = tenant_;
  co.client_name = "kvtier-bench ipc";
  KVTIER_ASSIGN_OR_RETURN(
      sessions_, ReplaySessions::Connect("unix://" + unix_socket_, co, Transport::kShm, detail_));
  if (!sessions_->capabilities().shm_available) {
    return absl::FailedPreconditionError("ipc /metrics: kvtierd offers no shared-memory attach");
  }
  return absl::OkStatus();
}

// One replay, scraped in the background when `on`, then one check scrape (untimed): the
// session's every layer-step must be visible to the daemon.
absl::StatusOr<RunResult> ScrapeBench::RunReplay(bool on) {
  ReplayBenchOptions ro = replay_;
  sessions_->Install(ro);
  Scraper scraper(metrics_address_, absl::Milliseconds(o_.scrape_ms));
  std::string session;
  ro.open_session = [&, open = std::move(ro.open_session)](
                        const std::string& name, const Geometry& g, const SequenceOptions& so,
                        Device& device) -> absl::StatusOr<std::unique_ptr<Session>> {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, open(name, g, so, device));
    session = s->id();
    scraper.SetSession(session);
    return s;
  };
  if (on) scraper.Start();
  std::vector<ReplayModeTimes> times;
  absl::StatusOr<JsonObject> replayed = RunReplayBench(ro, detail_, &times);
  RunResult r;
  r.on = on;
  r.scrapes = scraper.Stop();
  r.background = static_cast<int64_t>(r.scrapes.latency_us.size()) + r.scrapes.failures;
  if (!replayed.ok()) {
    (void)sessions_->CloseAll();
    return replayed.status();
  }
  const auto spec = std::find_if(times.begin(), times.end(),
                                 [](const ReplayModeTimes& t) { return t.name == "speculative"; });
  if (spec == times.end() || spec->wall_us.empty() || session.empty()) {
    (void)sessions_->CloseAll();
    return absl::InternalError(
        "ipc /metrics: the replay ran no timed speculative steps in a session");
  }
  r.wall_us = Median(spec->wall_us);
  r.critical_us = Median(spec->critical_us);
  r.drain_us = Median(spec->drain_us);
  Scrape check = ScrapeOnce(metrics_address_, session);
  const double want = static_cast<double>(o_.synthetic.num_steps) * o_.layers;
  if (check.error.empty() && check.steps != want) {
    check.error = absl::StrFormat(
        "session %s: %s = %g after the replay, want %g (%d steps x %d layers)", session,
        kStepsFamily, check.steps.value_or(-1), want, o_.synthetic.num_steps, o_.layers);
  }
  r.steps_total = check.steps.value_or(-1);
  r.scrapes.Add(check);
  KVTIER_RETURN_IF_ERROR(sessions_->CloseAll());
  return r;
}

void ScrapeBench::LogRun(const std::string& what, const RunResult& r) const {
  log_ << absl::StreamFormat(
      "%-8s %-4s %14.3f %12.3f %10.3f %8d %10s %10s %9d %11g\n", what, r.on ? "on" : "off",
      r.wall_us / 1000, r.critical_us / 1000, r.drain_us / 1000, r.background,
      r.on ? absl::StrFormat("%.2f", Median(r.scrapes.latency_us) / 1000) : std::string("-"),
      r.on ? absl::StrFormat("%.1f", Median(r.scrapes.bytes) / 1024) : std::string("-"),
      r.scrapes.failures, r.steps_total);
}

absl::StatusOr<IpcScrapeResult> ScrapeBench::Run() {
  KVTIER_RETURN_IF_ERROR(ValidateIpcScrapeOptions(o_));
  KVTIER_RETURN_IF_ERROR(Connect());
  DeviceOptions bo;
  bo.cpu_threads = o_.threads;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(DeviceKind::kCpu, bo));
  device_ = backend->Describe();
  backend.reset();

  replay_.synthetic = o_.synthetic;
  replay_.layers = o_.layers;
  replay_.budget_tokens = o_.budget_tokens;
  replay_.taus = {kDefaultCorrectionThreshold};
  replay_.sync = false;
  replay_.drop = false;
  replay_.mass_layers = 0;    // no exact attention on the host between steps
  replay_.profile_steps = 0;  // every step timed, none synchronised phase by phase
  replay_.threads = o_.threads;

  log_ << absl::StreamFormat(
      "/metrics scrape cost: kvtierd %s, metrics at %s, scraped every %d ms in the \"on\" "
      "runs\n  replay: %s, %d layers, prefill %d tokens, %d steps, budget %d "
      "tokens, speculative mode as an SHM session (telemetry per layer-step); %s; commit %s\n"
      "  %d warm-up run(s), then %d runs in ABBA order (off on on off ...); per run the median "
      "over steps\n",
      sessions_->capabilities().server_version, metrics_address_, o_.scrape_ms,
      o_.synthetic.geometry.ToString(), o_.layers, o_.synthetic.prefill_tokens,
      o_.synthetic.num_steps, o_.budget_tokens, device_, Commit(), o_.warmup, 2 * o_.repeats);
  log_ << absl::StreamFormat("%-8s %-4s %14s %12s %10s %8s %10s %10s %9s %11s\n", "run", "mode",
                             "wall ms/step", "critical ms", "drain ms", "scrapes", "scrape ms",
                             "KiB", "failures", "steps_total");
  ScrapeLog warmup;
  for (int32_t i = 0; i < o_.warmup; ++i) {
    KVTIER_ASSIGN_OR_RETURN(const RunResult r, RunReplay(/*on=*/true));
    LogRun("warm-up", r);
    warmup.Add(r.scrapes);
  }
  std::vector<RunResult> runs;
  for (int32_t i = 0; i < 2 * o_.repeats; ++i) {
    KVTIER_ASSIGN_OR_RETURN(RunResult r, RunReplay(ScrapedRun(i)));
    LogRun(absl::StrCat(i + 1, "/", 2 * o_.repeats), r);
    runs.push_back(std::move(r));
  }
  const Summary summary = Summarize(runs, warmup);
  LogSummary(summary);
  IpcScrapeResult result{ReportJson(summary, runs), summary.all.failures};
  sessions_.reset();
  return result;
}

void ScrapeBench::LogSummary(const Summary& s) const {
  const auto ms = [](const Spread& w) {
    return absl::StrFormat("%.3f ms (p10-p90 %.3f-%.3f, min-max %.3f-%.3f, n %d)", w.median / 1000,
                           w.p10 / 1000, w.p90 / 1000, w.min / 1000, w.max / 1000, w.n);
  };
  log_ << "wall per decode step, median over runs of the per-run medians:\n"
       << absl::StreamFormat("  %-20s %s\n", "off (no scraping)", ms(s.wall[0]))
       << absl::StreamFormat("  %-20s %s\n", absl::StrCat("on (every ", o_.scrape_ms, " ms)"),
                             ms(s.wall[1]));
  log_ << absl::StreamFormat(
      "without_over_with = %.4f (off / on; target >= %.2f: %s); per ABBA pair off/on: median "
      "%.4f, min-max %.4f-%.4f\n",
      s.ratio, kTarget, s.ratio >= kTarget ? "met" : "NOT MET", s.pairs.median, s.pairs.min,
      s.pairs.max);
  log_ << absl::StreamFormat(
      "scrapes in the timed on runs: %d (median %g per run), latency median %.3f ms (p90 %.3f), "
      "exposition %.1f KiB; failed scrapes (all runs and checks): %d\n",
      s.scrapes(), s.scrapes_per_run, s.latency_us.median / 1000, s.latency_us.p90 / 1000,
      s.bytes / 1024, s.all.failures);
  for (const std::string& e : s.all.errors) log_ << "  SCRAPE FAILED: " << e << "\n";
}

JsonObject ScrapeBench::ReportJson(const Summary& s, const std::vector<RunResult>& runs) const {
  std::vector<JsonObject> runs_json;
  for (const RunResult& r : runs) {
    JsonObject j;
    j.Add("mode", r.on ? "on" : "off")
        .Add("wall_us", r.wall_us)
        .Add("critical_path_us", r.critical_us)
        .Add("drain_us", r.drain_us)
        .Add("scrapes", r.background)
        .Add("scrape_failures", r.scrapes.failures)
        .Add("steps_total", r.steps_total);
    runs_json.push_back(std::move(j));
  }
  const auto mode = [&](int on) {
    JsonObject j;
    j.AddObject("wall_us", SpreadJson(s.wall[on]))
        .AddObject("critical_path_us", SpreadJson(s.critical[on]));
    return j;
  };
  JsonObject j;
  j.Add("device", device_)
      .Add("metrics_address", metrics_address_)
      .Add("replay",
           "speculative mode only, as an SHM session of the daemon (its Retriever publishes "
           "telemetry into the session's region after every layer-step)")
      .Add("geometry", o_.synthetic.geometry.ToString())
      .Add("layers", o_.layers)
      .Add("prefill_tokens", o_.synthetic.prefill_tokens)
      .Add("steps", o_.synthetic.num_steps)
      .Add("budget_tokens", o_.budget_tokens)
      .Add("repeats", o_.repeats)
      .Add("warmup", o_.warmup)
      .Add("scrape_ms", o_.scrape_ms)
      .Add("order", absl::StrJoin(s.order, ","))
      .Add("statistic",
           "per run: the median over decode steps of the speculative session's wall_us (first "
           "Append to the end of the drained background work); per mode: over runs")
      .AddObject("off", mode(0))
      .AddObject("on", mode(1))
      .Add("without_over_with", s.ratio)
      .AddObject("pair_without_over_with", SpreadJson(s.pairs))
      .Add("target", kTarget)
      .Add("target_met", s.ratio >= kTarget)
      .Add("scrapes", s.scrapes())
      .Add("scrapes_per_run", s.scrapes_per_run)
      .AddObject("scrape_latency_us", SpreadJson(s.latency_us))
      .Add("exposition_bytes", s.bytes)
      .Add("scrape_failures", s.all.failures)
      .Add("scrape_errors", absl::StrJoin(s.all.errors, "; "))
      .AddArray("runs", runs_json);
  return j;
}

}  // namespace

absl::Status ValidateIpcScrapeOptions(const IpcScrapeOptions& o) {
  if (o.repeats < 1 || o.warmup < 0 || o.scrape_ms < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ipc: --scrape-repeats = %d must be >= 1, --scrape-warmup = %d >= 0, --scrape-ms = %d "
        ">= 1",
        o.repeats, o.warmup, o.scrape_ms));
  }
  if (o.layers < 1 || o.layers > o.synthetic.geometry.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ipc: --scrape-layers = %d must be in [1, %d] (the model's layers)",
                        o.layers, o.synthetic.geometry.num_layers));
  }
  return absl::OkStatus();
}

int64_t IpcScrapeSessionTokens(const IpcScrapeOptions& o) {
  return int64_t{o.synthetic.prefill_tokens} + o.synthetic.num_steps +
         o.synthetic.geometry.page_size;
}

int64_t IpcScrapeHostBytes(const IpcScrapeOptions& o) {
  const Geometry& g = o.synthetic.geometry;
  const int64_t token_bytes = int64_t{2} * g.num_kv_heads * g.head_dim * g.element_bytes();
  return 2 * int64_t{o.layers} * IpcScrapeSessionTokens(o) * token_bytes + (int64_t{64} << 20);
}

absl::StatusOr<IpcScrapeResult> RunIpcScrape(const IpcScrapeOptions& o,
                                             const std::string& unix_socket,
                                             const std::string& tenant, std::ostream& log) {
  ScrapeBench bench(o, unix_socket, tenant, log);
  return bench.Run();
}

}  // namespace kvtier::bench
