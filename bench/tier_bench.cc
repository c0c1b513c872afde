#include "bench/tier_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"
#include "tests/testutil/redis_cluster_process.h"

namespace kvtier::bench {
namespace {

using daemon::ColdPage;
using daemon::ColdPageRef;
using daemon::ColdTier;
using daemon::RedisCluster;
using daemon::RedisReply;

constexpr double kTarget = 0.8;  // cold / plain Redis throughput
constexpr char kTenant[] = "bench";
constexpr char kColdPrefix[] = "kvtierbench";
constexpr char kPlainPrefix[] = "plainbench";
// A safety net per call against a cluster that hangs, never a measurement.
constexpr absl::Duration kCallTimeout = absl::Seconds(120);

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Fills `out` with pseudo-random bytes (splitmix64).
void Fill(char* out, size_t n, uint64_t seed) {
  uint64_t x = seed;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(out + i, &z, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<char>(i * 131 + seed);
}

// Per-operation throughput samples (GB/s per repeat).
enum Op { kDemote, kPromote, kPlainSet, kPlainGet, kMemcpy, kOps };
constexpr const char* kOpNames[kOps] = {"demote", "promote", "plain_set", "plain_get",
                                        "host_memcpy"};
constexpr const char* kOpText[kOps] = {"demote (ColdTier::Put)", "promote (ColdTier::Get)",
                                       "plain SET (pipelined)", "plain GET (pipelined)",
                                       "host recall (memcpy)"};

class TierBench {
 public:
  TierBench(const TierBenchOptions& o, std::ostream& log) : o_(o), log_(log) {}
  absl::StatusOr<TierBenchResult> Run();

 private:
  absl::Status Validate() const;
  absl::Status Connect();
  std::string Session(int32_t s) const { return absl::StrCat(run_id_, "s", s); }
  std::string_view PageData(int32_t s, int32_t l, int32_t p) const {
    const size_t index = (static_cast<size_t>(s) * static_cast<size_t>(o_.layers) +
                          static_cast<size_t>(l)) *
                             static_cast<size_t>(o_.pages) +
                         static_cast<size_t>(p);
    return std::string_view(src_.data() + index * page_bytes(), page_bytes());
  }
  size_t page_bytes() const { return static_cast<size_t>(o_.page_bytes); }
  int64_t total_bytes() const {
    return int64_t{o_.sessions} * o_.layers * o_.pages * o_.page_bytes;
  }
  absl::Time Deadline() const { return absl::Now() + kCallTimeout; }

  // One (session, layer) each: the call timed, returned in seconds.
  absl::StatusOr<double> Demote(int32_t s, int32_t l, uint64_t generation);
  double Promote(int32_t s, int32_t l, uint64_t generation);  // counts mismatches
  absl::StatusOr<double> PlainSet(int32_t s, int32_t l);
  double PlainGet(int32_t s, int32_t l);  // counts mismatches
  // Every (session, layer): GB/s.
  absl::StatusOr<double> Pass(Op op, uint64_t generation);
  double Memcpy();
  absl::Status Latency();
  absl::Status Cleanup();
  JsonObject ReportJson() const;
  void LogSummary() const;

  const TierBenchOptions& o_;
  std::ostream& log_;
  std::string run_id_;
  std::unique_ptr<testing::RedisClusterProcess> process_;
  std::unique_ptr<RedisCluster> cluster_;
  std::unique_ptr<ColdTier> cold_;
  std::string cluster_text_;
  std::vector<char> src_, dst_;
  std::vector<double> gbps_[kOps];
  Spread gbps_spread_[kOps];
  std::vector<double> latency_us_[4];  // kDemote .. kPlainGet
  int64_t cold_mismatches_ = 0, plain_mismatches_ = 0;
  std::vector<std::string> errors_;  // the first few mismatches, said
  std::vector<std::string> order_;
  double startup_s_ = 0;

  void Mismatch(int64_t* counter, std::string what) {
    ++*counter;
    if (errors_.size() < 5) errors_.push_back(std::move(what));
  }
};

absl::Status TierBench::Validate() const {
  const auto refuse = [](const std::string& why) { return absl::InvalidArgumentError(why); };
  if (o_.seeds.empty() && o_.masters < 3) return refuse("--masters must be >= 3");
  if (o_.seeds.empty() && (o_.replicas < 0 || o_.replicas > 1)) {
    return refuse("--replicas must be 0 or 1");
  }
  if (o_.page_bytes < 1 || o_.page_bytes > (int64_t{64} << 20)) {
    return refuse("--page-bytes must be in [1, 64 MiB]");
  }
  if (o_.pages < 1) return refuse("--pages must be >= 1");
  if (o_.layers < 1) return refuse("--layers must be >= 1");
  if (o_.sessions < 1) return refuse("--sessions must be >= 1");
  if (o_.repeats < 1) return refuse("--repeats must be >= 1");
  if (o_.latency_pages < 1) return refuse("--latency-pages must be >= 1");
  const int64_t need = 2 * total_bytes();
  const int64_t available = HostMemAvailable();
  if (available >= 0 && need > available / 2) {
    return refuse(absl::StrFormat(
        "%d MiB of pages (twice: source and the memcpy's destination) is more than half of the "
        "host's available %d MiB: lower --pages, --layers, --sessions or --page-bytes",
        need >> 20, available >> 20));
  }
  if (o_.decode) KVTIER_RETURN_IF_ERROR(CheckTierDecode(o_.decode_options));
  return absl::OkStatus();
}

absl::Status TierBench::Connect() {
  const Clock::time_point start = Clock::now();
  std::vector<std::string> seeds = o_.seeds;
  if (seeds.empty()) {
    testing::RedisClusterProcessOptions po;
    po.masters = o_.masters;
    po.replicas_per_master = o_.replicas;
    KVTIER_ASSIGN_OR_RETURN(process_, testing::RedisClusterProcess::Start(po));
    seeds = process_->seeds();
    cluster_text_ = absl::StrFormat(
        "started for this run on loopback: %d masters, %d replica(s) each, no persistence",
        o_.masters, o_.replicas);
  }
  daemon::RedisClusterOptions co;
  co.seeds = seeds;
  co.command_timeout = absl::Seconds(10);  // a round trip carries a whole layer
  KVTIER_ASSIGN_OR_RETURN(cluster_, RedisCluster::Connect(co));
  KVTIER_ASSIGN_OR_RETURN(cold_, ColdTier::Create(cluster_.get(), kColdPrefix));
  if (process_ == nullptr) {
    cluster_text_ = absl::StrFormat("existing, seeds %s (%d nodes in the slot map)",
                                    absl::StrJoin(seeds, ","), cluster_->node_count());
  }
  startup_s_ = SecondsSince(start);
  return absl::OkStatus();
}

absl::StatusOr<double> TierBench::Demote(int32_t s, int32_t l, uint64_t generation) {
  std::vector<ColdPageRef> refs(static_cast<size_t>(o_.pages));
  for (int32_t p = 0; p < o_.pages; ++p) {
    refs[static_cast<size_t>(p)] = ColdPageRef{l, p, generation, PageData(s, l, p)};
  }
  const std::string session = Session(s);
  const Clock::time_point start = Clock::now();
  const absl::Status put = cold_->Put(kTenant, session, refs, Deadline());
  const double seconds = SecondsSince(start);
  if (!put.ok()) return put;
  return seconds;
}

double TierBench::Promote(int32_t s, int32_t l, uint64_t generation) {
  std::vector<int64_t> pages(static_cast<size_t>(o_.pages));
  for (int32_t p = 0; p < o_.pages; ++p) pages[static_cast<size_t>(p)] = p;
  const std::vector<uint64_t> generations(pages.size(), generation);
  const std::string session = Session(s);
  const Clock::time_point start = Clock::now();
  std::vector<absl::StatusOr<ColdPage>> got =
      cold_->Get(kTenant, session, l, pages, generations, Deadline());
  const double seconds = SecondsSince(start);
  for (int32_t p = 0; p < o_.pages; ++p) {
    const size_t i = static_cast<size_t>(p);
    if (i >= got.size()) {
      Mismatch(&cold_mismatches_, absl::StrFormat("cold session %d layer %d page %d: no reply",
                                                  s, l, p));
    } else if (!got[i].ok()) {
      Mismatch(&cold_mismatches_, absl::StrFormat("cold session %d layer %d page %d: %s", s, l,
                                                  p, got[i].status().ToString()));
    } else if (got[i]->data != PageData(s, l, p)) {
      Mismatch(&cold_mismatches_,
               absl::StrFormat("cold session %d layer %d page %d: other bytes", s, l, p));
    }
  }
  return seconds;
}

absl::StatusOr<double> TierBench::PlainSet(int32_t s, int32_t l) {
  const std::string session = Session(s);
  const Clock::time_point start = Clock::now();
  std::vector<std::vector<std::string>> commands;
  commands.reserve(static_cast<size_t>(o_.pages));
  for (int32_t p = 0; p < o_.pages; ++p) {
    commands.push_back({"SET", daemon::ColdKey(kPlainPrefix, kTenant, session, l, p),
                        std::string(PageData(s, l, p))});
  }
  std::vector<absl::StatusOr<RedisReply>> replies = cluster_->Pipeline(commands, Deadline());
  const double seconds = SecondsSince(start);
  for (size_t i = 0; i < replies.size(); ++i) {
    if (!replies[i].ok()) {
      return absl::Status(replies[i].status().code(),
                          absl::StrFormat("plain SET of session %d layer %d page %d: %s", s, l, i,
                                          replies[i].status().message()));
    }
  }
  return seconds;
}

double TierBench::PlainGet(int32_t s, int32_t l) {
  const std::string session = Session(s);
  const Clock::time_point start = Clock::now();
  std::vector<std::vector<std::string>> commands;
  commands.reserve(static_cast<size_t>(o_.pages));
  for (int32_t p = 0; p < o_.pages; ++p) {
    commands.push_back({"GET", daemon::ColdKey(kPlainPrefix, kTenant, session, l, p)});
  }
  std::vector<absl::StatusOr<RedisReply>> replies = cluster_->Pipeline(commands, Deadline());
  const double seconds = SecondsSince(start);
  for (int32_t p = 0; p < o_.pages; ++p) {
    const size_t i = static_cast<size_t>(p);
    if (i >= replies.size()) {
      Mismatch(&plain_mismatches_,
               absl::StrFormat("plain session %d layer %d page %d: no reply", s, l, p));
    } else if (!replies[i].ok()) {
      Mismatch(&plain_mismatches_, absl::StrFormat("plain session %d layer %d page %d: %s", s, l,
                                                   p, replies[i].status().ToString()));
    } else if (replies[i]->type != RedisReply::Type::kString ||
               replies[i]->str != PageData(s, l, p)) {
      Mismatch(&plain_mismatches_,
               absl::StrFormat("plain session %d layer %d page %d: other bytes", s, l, p));
    }
  }
  return seconds;
}

absl::StatusOr<double> TierBench::Pass(Op op, uint64_t generation) {
  double seconds = 0;
  for (int32_t s = 0; s < o_.sessions; ++s) {
    for (int32_t l = 0; l < o_.layers; ++l) {
      switch (op) {
        case kDemote: {
          KVTIER_ASSIGN_OR_RETURN(const double t, Demote(s, l, generation));
          seconds += t;
          break;
        }
        case kPromote:
          seconds += Promote(s, l, generation);
          break;
        case kPlainSet: {
          KVTIER_ASSIGN_OR_RETURN(const double t, PlainSet(s, l));
          seconds += t;
          break;
        }
        case kPlainGet:
          seconds += PlainGet(s, l);
          break;
        default:
          return absl::InternalError("not a cluster operation");
      }
    }
  }
  return seconds > 0 ? static_cast<double>(total_bytes()) / seconds / 1e9 : 0;
}

double TierBench::Memcpy() {
  const size_t n = static_cast<size_t>(total_bytes()) / page_bytes();
  const Clock::time_point start = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(dst_.data() + i * page_bytes(), src_.data() + i * page_bytes(), page_bytes());
  }
  const double seconds = SecondsSince(start);
  if (std::memcmp(dst_.data(), src_.data(), dst_.size()) != 0) {
    Mismatch(&cold_mismatches_, "host memcpy: other bytes");  // never expected
  }
  return seconds > 0 ? static_cast<double>(total_bytes()) / seconds / 1e9 : 0;
}

// Single-page calls on layer 0 of session 0's pages, interleaved: cold Put, plain SET,
// cold Get, plain GET (the cold and plain order alternating per page).
absl::Status TierBench::Latency() {
  const std::string session = absl::StrCat(run_id_, "lat");
  const uint64_t generation = static_cast<uint64_t>(o_.repeats) + 1;
  for (int32_t p = 0; p < o_.latency_pages; ++p) {
    const std::string_view data = PageData(0, 0, p % o_.pages);
    const std::string plain_key = daemon::ColdKey(kPlainPrefix, kTenant, session, 0, p);
    const auto cold_put = [&]() -> absl::Status {
      const ColdPageRef ref{0, p, generation, data};
      const Clock::time_point start = Clock::now();
      const absl::Status st = cold_->Put(kTenant, session, {&ref, 1}, Deadline());
      latency_us_[kDemote].push_back(SecondsSince(start) * 1e6);
      return st;
    };
    const auto plain_set = [&]() -> absl::Status {
      const Clock::time_point start = Clock::now();
      const std::vector<std::vector<std::string>> cmd = {{"SET", plain_key, std::string(data)}};
      std::vector<absl::StatusOr<RedisReply>> r = cluster_->Pipeline(cmd, Deadline());
      latency_us_[kPlainSet].push_back(SecondsSince(start) * 1e6);
      return r.empty() ? absl::InternalError("no reply") : r[0].status();
    };
    const auto cold_get = [&] {
      const int64_t page = p;
      const Clock::time_point start = Clock::now();
      std::vector<absl::StatusOr<ColdPage>> got =
          cold_->Get(kTenant, session, 0, {&page, 1}, {&generation, 1}, Deadline());
      latency_us_[kPromote].push_back(SecondsSince(start) * 1e6);
      if (got.size() != 1 || !got[0].ok() || got[0]->data != data) {
        Mismatch(&cold_mismatches_, absl::StrFormat("cold latency page %d: %s", p,
                                                    got.size() == 1 && !got[0].ok()
                                                        ? got[0].status().ToString()
                                                        : std::string("other bytes")));
      }
    };
    const auto plain_get = [&] {
      const Clock::time_point start = Clock::now();
      const std::vector<std::vector<std::string>> cmd = {{"GET", plain_key}};
      std::vector<absl::StatusOr<RedisReply>> r = cluster_->Pipeline(cmd, Deadline());
      latency_us_[kPlainGet].push_back(SecondsSince(start) * 1e6);
      if (r.size() != 1 || !r[0].ok() || r[0]->str != data) {
        Mismatch(&plain_mismatches_, absl::StrFormat("plain latency page %d: %s", p,
                                                     r.size() == 1 && !r[0].ok()
                                                         ? r[0].status().ToString()
                                                         : std::string("other bytes")));
      }
    };
    if (p % 2 == 0) {
      KVTIER_RETURN_IF_ERROR(cold_put());
      KVTIER_RETURN_IF_ERROR(plain_set());
      cold_get();
      plain_get();
    } else {
      KVTIER_RETURN_IF_ERROR(plain_set());
      KVTIER_RETURN_IF_ERROR(cold_put());
      plain_get();
      cold_get();
    }
  }
  return absl::OkStatus();
}

// Removes every key this run wrote (an existing cluster keeps nothing of it).
absl::Status TierBench::Cleanup() {
  std::vector<int64_t> layer_pages(static_cast<size_t>(o_.pages));
  for (int32_t p = 0; p < o_.pages; ++p) layer_pages[static_cast<size_t>(p)] = p;
  std::vector<int64_t> latency_pages(static_cast<size_t>(o_.latency_pages));
  for (int32_t p = 0; p < o_.latency_pages; ++p) latency_pages[static_cast<size_t>(p)] = p;
  struct Layer {
    std::string session;
    int32_t layer;
    const std::vector<int64_t>* pages;
  };
  std::vector<Layer> layers;
  for (int32_t s = 0; s < o_.sessions; ++s) {
    for (int32_t l = 0; l < o_.layers; ++l) layers.push_back({Session(s), l, &layer_pages});
  }
  layers.push_back({absl::StrCat(run_id_, "lat"), 0, &latency_pages});
  for (const Layer& layer : layers) {
    const std::string& session = layer.session;
    const int32_t l = layer.layer;
    const std::vector<int64_t>& pages = *layer.pages;
    KVTIER_RETURN_IF_ERROR(cold_->Delete(kTenant, session, l, pages, Deadline()));
    std::vector<std::vector<std::string>> commands;
    for (int64_t p : pages) {
      commands.push_back({"DEL", daemon::ColdKey(kPlainPrefix, kTenant, session, l, p)});
    }
    for (const absl::StatusOr<RedisReply>& r : cluster_->Pipeline(commands, Deadline())) {
      KVTIER_RETURN_IF_ERROR(r.status());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TierBenchResult> TierBench::Run() {
  KVTIER_RETURN_IF_ERROR(Validate());
  run_id_ = absl::StrCat("b", ::getpid(), "-", absl::ToUnixMillis(absl::Now()), "-");
  src_.resize(static_cast<size_t>(total_bytes()));
  dst_.assign(src_.size(), 0);  // touched: the memcpy measures copies, not page faults
  const size_t n = src_.size() / page_bytes();
  for (size_t i = 0; i < n; ++i) Fill(src_.data() + i * page_bytes(), page_bytes(), i + 1);
  KVTIER_RETURN_IF_ERROR(Connect());

  log_ << absl::StreamFormat(
      "kvtier-bench tier: cold tier (ColdTier over RedisCluster) vs plain pipelined Redis "
      "SET/GET and host memcpy; %s; commit %s\n"
      "  cluster: %s (ready in %.1f s)\n"
      "  %d session(s) x %d layers x %d pages x %d bytes = %.1f MiB per pass; one pipeline per "
      "(session, layer); %d repeats, cold/plain order alternating; %d single-page calls per "
      "kind for latency\n",
      HostCpu(), Commit(), cluster_text_, startup_s_, o_.sessions, o_.layers, o_.pages,
      o_.page_bytes, static_cast<double>(total_bytes()) / (1 << 20), o_.repeats,
      o_.latency_pages);

  // Warm-up, untimed: every node's connection opened, one layer of each kind.
  KVTIER_RETURN_IF_ERROR(Demote(0, 0, 1).status());
  KVTIER_RETURN_IF_ERROR(PlainSet(0, 0).status());
  (void)Promote(0, 0, 1);
  (void)PlainGet(0, 0);
  (void)Memcpy();

  log_ << absl::StreamFormat("%-8s %-6s %10s %10s %10s %10s %10s   GB/s\n", "repeat", "first",
                             "demote", "promote", "plain SET", "plain GET", "memcpy");
  for (int32_t r = 0; r < o_.repeats; ++r) {
    const uint64_t generation = static_cast<uint64_t>(r) + 2;  // the warm-up wrote 1
    const bool cold_first = r % 2 == 0;
    order_.push_back(cold_first ? "cold" : "plain");
    const Op writes[2] = {cold_first ? kDemote : kPlainSet, cold_first ? kPlainSet : kDemote};
    const Op reads[2] = {cold_first ? kPromote : kPlainGet, cold_first ? kPlainGet : kPromote};
    double g[kOps] = {};
    for (Op op : {writes[0], writes[1], reads[0], reads[1]}) {
      KVTIER_ASSIGN_OR_RETURN(g[op], Pass(op, generation));
    }
    g[kMemcpy] = Memcpy();
    for (int op = 0; op < kOps; ++op) gbps_[op].push_back(g[op]);
    log_ << absl::StreamFormat("%-8s %-6s %10.3f %10.3f %10.3f %10.3f %10.3f\n",
                               absl::StrCat(r + 1, "/", o_.repeats), order_.back(), g[kDemote],
                               g[kPromote], g[kPlainSet], g[kPlainGet], g[kMemcpy]);
  }
  for (int op = 0; op < kOps; ++op) gbps_spread_[op] = SpreadOf(gbps_[op]);
  KVTIER_RETURN_IF_ERROR(Latency());
  LogSummary();
  TierBenchResult result{ReportJson(), cold_mismatches_ + plain_mismatches_};
  if (o_.decode) {
    KVTIER_ASSIGN_OR_RETURN(TierDecodeResult decode,
                            RunTierDecode(cluster_.get(), cold_.get(), kColdPrefix,
                                          Session(9999), o_.decode_options, log_));
    result.report.AddObject("decode", decode.report);
    result.mismatches += decode.mismatches;
  }
  KVTIER_RETURN_IF_ERROR(Cleanup());
  cold_.reset();
  cluster_.reset();
  process_.reset();
  return result;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

void TierBench::LogSummary() const {
  log_ << "throughput, median over repeats (p10-p90, min-max):\n";
  for (int op = 0; op < kOps; ++op) {
    const Spread& s = gbps_spread_[op];
    log_ << absl::StreamFormat("  %-24s %8.3f GB/s (%.3f-%.3f, %.3f-%.3f, n %d)\n", kOpText[op],
                               s.median, s.p10, s.p90, s.min, s.max, s.n);
  }
  const double set_ratio = Ratio(gbps_spread_[kDemote].median, gbps_spread_[kPlainSet].median);
  const double get_ratio = Ratio(gbps_spread_[kPromote].median, gbps_spread_[kPlainGet].median);
  log_ << absl::StreamFormat(
      "demote_over_plain_set = %.3f, promote_over_plain_get = %.3f (target >= %.2f: %s)\n",
      set_ratio, get_ratio, kTarget,
      set_ratio >= kTarget && get_ratio >= kTarget ? "met" : "NOT MET");
  log_ << absl::StreamFormat("per-page latency, one page per call (%d bytes, %d calls each):\n",
                             o_.page_bytes, o_.latency_pages);
  const char* names[4] = {"cold Put (demote)", "cold Get (promote)", "plain SET", "plain GET"};
  for (int k = 0; k < 4; ++k) {
    log_ << absl::StreamFormat("  %-20s p50 %8.1f us   p99 %8.1f us\n", names[k],
                               Quantile(latency_us_[k], 0.5), Quantile(latency_us_[k], 0.99));
  }
  log_ << absl::StreamFormat("mismatches: cold %d, plain %d\n", cold_mismatches_,
                             plain_mismatches_);
  for (const std::string& e : errors_) log_ << "  MISMATCH: " << e << "\n";
}

JsonObject TierBench::ReportJson() const {
  const double set_ratio = Ratio(gbps_spread_[kDemote].median, gbps_spread_[kPlainSet].median);
  const double get_ratio = Ratio(gbps_spread_[kPromote].median, gbps_spread_[kPlainGet].median);
  JsonObject gbps;
  for (int op = 0; op < kOps; ++op) gbps.AddObject(kOpNames[op], SpreadJson(gbps_spread_[op]));
  JsonObject latency;
  const char* keys[4] = {"demote", "promote", "plain_set", "plain_get"};
  for (int k = 0; k < 4; ++k) {
    JsonObject j;
    j.Add("p50", Quantile(latency_us_[k], 0.5))
        .Add("p99", Quantile(latency_us_[k], 0.99))
        .Add("n", static_cast<int64_t>(latency_us_[k].size()));
    latency.AddObject(keys[k], j);
  }
  JsonObject j;
  j.Add("bench", "tier")
      .Add("device", "cpu (Redis Cluster on loopback)")
      .Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("cluster", cluster_text_)
      .Add("cluster_nodes", static_cast<int64_t>(cluster_->node_count()))
      .Add("masters", process_ != nullptr ? int64_t{o_.masters} : int64_t{-1})
      .Add("replicas_per_master", process_ != nullptr ? int64_t{o_.replicas} : int64_t{-1})
      .Add("page_bytes", o_.page_bytes)
      .Add("pages_per_layer", o_.pages)
      .Add("layers", o_.layers)
      .Add("sessions", o_.sessions)
      .Add("total_bytes", total_bytes())
      .Add("repeats", o_.repeats)
      .Add("order", absl::StrJoin(order_, ","))
      .Add("statistic",
           "per repeat: bytes of every (session, layer) over the summed time of their calls (one "
           "pipeline per layer), GB/s = 1e9 B/s; per operation: over repeats")
      .AddObject("gbps", gbps)
      .Add("demote_over_plain_set", set_ratio)
      .Add("promote_over_plain_get", get_ratio)
      .Add("target", kTarget)
      .Add("target_met", set_ratio >= kTarget && get_ratio >= kTarget)
      .AddObject("latency_us", latency)
      .Add("latency_calls", o_.latency_pages)
      .Add("mismatches", cold_mismatches_ + plain_mismatches_)
      .Add("cold_mismatches", cold_mismatches_)
      .Add("plain_mismatches", plain_mismatches_)
      .Add("mismatch_errors", absl::StrJoin(errors_, "; "));
  return j;
}

// The command line of `tier` (AddTierCommand).
struct TierFlags {
  TierBenchOptions o;
  std::string seeds;
  bool json = false;
  std::string out;
};

int RunTierCommand(TierFlags& f) {
  if (!f.seeds.empty()) f.o.seeds = absl::StrSplit(f.seeds, ',', absl::SkipEmpty());
  auto result = RunTierBench(f.o, f.json ? std::cerr : std::cout);
  if (!result.ok()) {
    std::cerr << "kvtier-bench tier: " << result.status() << "\n";
    return absl::IsInvalidArgument(result.status()) ? 2 : 1;
  }
  const std::string report = result->report.ToString();
  if (f.json) std::cout << report << "\n";
  if (!f.out.empty()) std::ofstream(f.out) << report << "\n";
  if (result->mismatches > 0) {
    std::cerr << "kvtier-bench tier: " << result->mismatches
              << " page(s) read back wrong or not at all\n";
    return 1;
  }
  return 0;
}

}  // namespace

absl::StatusOr<TierBenchResult> RunTierBench(const TierBenchOptions& o, std::ostream& log) {
  TierBench bench(o, log);
  return bench.Run();
}

CLI::App* AddTierCommand(CLI::App& app, int* rc) {
  auto flags = std::make_shared<TierFlags>();
  TierFlags& f = *flags;
  auto* cmd = app.add_subcommand(
      "tier",
      "the cold tier's demote / promote throughput and per-page latency (ColdTier over a Redis "
      "Cluster on loopback) against plain pipelined Redis SET/GET of the same bytes and a host "
      "memcpy");
  cmd->add_option("--seeds", f.seeds,
                  "host:port,... of an existing cluster (default: start one on loopback)");
  cmd->add_option("--masters", f.o.masters, "masters of the started cluster (>= 3)")
      ->capture_default_str();
  cmd->add_option("--replicas", f.o.replicas, "replicas per master of the started cluster (0, 1)")
      ->capture_default_str();
  cmd->add_option("--page-bytes", f.o.page_bytes,
                  "bytes per page (64 KiB; a 32-token fp16 page of 8 KV heads x 128 is 128 KiB)")
      ->capture_default_str();
  cmd->add_option("--pages", f.o.pages, "pages per layer")->capture_default_str();
  cmd->add_option("--layers", f.o.layers, "layers per session")->capture_default_str();
  cmd->add_option("--sessions", f.o.sessions, "sessions")->capture_default_str();
  cmd->add_option("--repeats", f.o.repeats, "timed rounds of every operation")
      ->capture_default_str();
  cmd->add_option("--latency-pages", f.o.latency_pages, "single-page calls per kind")
      ->capture_default_str();
  TierDecodeOptions& d = f.o.decode_options;
  cmd->add_flag("!--no-decode", f.o.decode, "skip the decode section (step time with demotion)");
  cmd->add_option("--decode-layers", d.layers, "decode: layers")->capture_default_str();
  cmd->add_option("--decode-prefill", d.prefill, "decode: tokens per layer before the steps")
      ->capture_default_str();
  cmd->add_option("--decode-steps", d.steps, "decode: steps")->capture_default_str();
  cmd->add_option("--decode-host-pages", d.host_pages,
                  "decode: pages per layer the demoting sequence's host tier holds")
      ->capture_default_str();
  cmd->add_option("--decode-budget", d.budget_tokens, "decode: working-set tokens per layer")
      ->capture_default_str();
  cmd->add_option("--decode-drift", d.drift,
                  "decode: how far each step's query moves from the planted one, in [0, 1]")
      ->capture_default_str();
  cmd->add_flag("--json", f.json, "print one JSON object on stdout");
  cmd->add_option("--out", f.out, "also write the JSON report to this file");
  cmd->callback([flags, rc] { *rc = RunTierCommand(*flags); });
  return cmd;
}

}  // namespace kvtier::bench
