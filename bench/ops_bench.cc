#include "bench/ops_bench.h"

#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/host_memory.h"
#include "core/status.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/registry.h"
#include "tests/kernels/op_cases.h"

namespace kvtier::bench {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Where a host flush's sum goes, so that the read is not optimised away.
volatile uint64_t g_flush_sink = 0;

struct NamedBackend {
  std::string name;
  std::unique_ptr<Backend> backend;
  double copy_gbps = 0;  // device-to-device copy, read + write bytes per second
  bool host = false;     // a cpu backend: held to the host's read bandwidth too
};

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// The backends asked for, in order; cuda is left out (with a line in the log) when no device
// is usable.
absl::StatusOr<std::vector<NamedBackend>> MakeBackends(const OpsBenchOptions& o,
                                                       std::ostream& log) {
  std::vector<NamedBackend> out;
  for (const std::string& name : o.backends) {
    if (name == "cpu-scalar") {
      out.push_back({name, NewCpuBackend(o.threads, cpu::Isa::kScalar), 0, true});
    } else if (name == "cpu") {
      out.push_back({name, NewCpuBackend(o.threads), 0, true});
    } else if (name == "cuda") {
      if (CudaDeviceCount() == 0) {
        log << "ops: cuda skipped ("
            << (CudaBackendBuilt() ? "no usable CUDA device" : "built without the CUDA backend")
            << ")\n";
        continue;
      }
      KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, CreateBackend(DeviceKind::kCuda));
      out.push_back({name, std::move(b)});
    } else {
      return absl::InvalidArgumentError(
          absl::StrFormat("--backends: '%s' is not one of cpu-scalar, cpu, cuda", name));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("--backends: no usable backend");
  return out;
}

// The host's side of the run: a buffer of --flush-mib read on the cpu backends' threads, to
// measure the read bandwidth and to evict the caches before a cold rep.
class HostReader {
 public:
  HostReader(int threads, int64_t bytes)
      : pool_(threads), buf_(static_cast<size_t>(bytes / 8), 1) {}
  void Read() { g_flush_sink = g_flush_sink + ParallelReadSum(pool_, buf_.data(), bytes()); }
  // Bytes read per second, the median of `reps` reads after an untimed one.
  double Bandwidth(int32_t reps) {
    Read();
    std::vector<double> samples;
    for (int32_t r = 0; r < reps; ++r) {
      const absl::Time t0 = absl::Now();
      Read();
      samples.push_back(Seconds(absl::Now() - t0));
    }
    return static_cast<double>(bytes()) / Median(samples) / 1e9;
  }
  size_t bytes() const { return buf_.size() * sizeof(uint64_t); }
  int threads() const { return pool_.num_threads(); }

 private:
  ThreadPool pool_;
  std::vector<uint64_t> buf_;
};

// What a cold rep streams through the caches first: on the host for the cpu backends (the
// HostReader's read), on the device for cuda (a memset, which goes through L2).
class Flusher {
 public:
  static absl::StatusOr<Flusher> Make(Backend& b, HostReader* host, int64_t bytes) {
    Flusher f;
    f.bytes_ = bytes;
    if (b.kind() == DeviceKind::kCpu) {
      f.host_ = host;
    } else {
      KVTIER_ASSIGN_OR_RETURN(f.dev_buf_, b.Allocate(static_cast<size_t>(bytes)));
    }
    return f;
  }
  absl::Status Flush(Backend& b, Stream& s) {
    if (host_ != nullptr) {
      host_->Read();
      return absl::OkStatus();
    }
    KVTIER_RETURN_IF_ERROR(b.Memset(s, dev_buf_.data(), ++fill_, static_cast<size_t>(bytes_)));
    return s.Synchronize();
  }

 private:
  int64_t bytes_ = 0;
  HostReader* host_ = nullptr;
  DeviceBuffer dev_buf_;
  int fill_ = 0;
};

// The backend's device-to-device copy bandwidth (bytes read + written per second), median of
// the reps, over buffers of `bytes`.
absl::StatusOr<double> CopyBandwidth(Backend& b, int64_t bytes, int32_t reps) {
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer src, b.Allocate(static_cast<size_t>(bytes)));
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dst, b.Allocate(static_cast<size_t>(bytes)));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> s, b.CreateStream());
  KVTIER_RETURN_IF_ERROR(b.Memset(*s, src.data(), 1, static_cast<size_t>(bytes)));
  KVTIER_RETURN_IF_ERROR(b.Memset(*s, dst.data(), 2, static_cast<size_t>(bytes)));
  KVTIER_RETURN_IF_ERROR(s->Synchronize());
  std::vector<double> samples;
  for (int32_t r = 0; r < reps + 1; ++r) {
    const absl::Time t0 = absl::Now();
    KVTIER_RETURN_IF_ERROR(b.Copy(*s, dst.data(), src.data(), static_cast<size_t>(bytes)));
    KVTIER_RETURN_IF_ERROR(s->Synchronize());
    if (r > 0) samples.push_back(Seconds(absl::Now() - t0));
  }
  return 2.0 * static_cast<double>(bytes) / Median(samples) / 1e9;
}

struct Row {
  std::string backend;
  Spread seconds;
  double gbps = 0, gflops = 0, of_copy = 0, speedup = 0;
  std::optional<double> of_read;  // cpu backends
};

// The cases whose names match `filter`: the op table's, then its perf cases.
std::vector<const testing::OpCase*> Matching(const std::regex& filter) {
  std::vector<const testing::OpCase*> out;
  for (const auto* table : {&testing::OpCases(), &testing::PerfOpCases()}) {
    for (const testing::OpCase& c : *table) {
      if (std::regex_search(c.name, filter)) out.push_back(&c);
    }
  }
  return out;
}

// What the derived figures read: each case's rows by backend.
using Timed = std::map<std::string, std::map<std::string, Row>>;

const Row* Find(const Timed& timed, const std::string& name, const std::string& backend) {
  auto c = timed.find(name);
  if (c == timed.end()) return nullptr;
  auto r = c->second.find(backend);
  return r == c->second.end() ? nullptr : &r->second;
}

// A figure over several rows, with its target where one is stated.
struct Derived {
  std::string name, backend;
  double value = 0;
  std::string unit;         // "x", "of read bandwidth", "x per doubling"
  std::string target_text;  // e.g. ">= 10": empty when no target
  std::optional<bool> met;  // judged (cold runs only)
};

// The figures the rows support (ops_bench.h). `judge`: the run is cold.
std::vector<Derived> DeriveFigures(const Timed& timed, const std::vector<NamedBackend>& backends,
                                   bool judge) {
  std::vector<Derived> out;
  const auto add = [&](std::string name, const std::string& backend, double value, std::string unit,
                       double target, bool at_least) {
    Derived d;
    d.name = std::move(name);
    d.backend = backend;
    d.value = value;
    d.unit = std::move(unit);
    if (target > 0) {
      d.target_text = absl::StrFormat("%s %g", at_least ? ">=" : "<=", target);
      if (judge) d.met = at_least ? d.value >= target : d.value <= target;
    }
    out.push_back(std::move(d));
  };
  for (const NamedBackend& nb : backends) {
    const std::string& b = nb.name;
    const bool cpu = nb.name == "cpu";  // the CPU targets are the production kernels'
    // A decode step: dense attention over the context against the sparse step.
    for (const char* ctx : {"32k", "128k"}) {
      const std::string c = ctx;
      const Row* dense = Find(timed, "DenseAttention_decode_ctx" + c, b);
      const Row* sparse = Find(timed, "SparseAttention_decode_ws2k", b);
      if (dense == nullptr || sparse == nullptr) continue;
      add("decode_ctx" + c + ": dense / sparse attention (working set 2k)", b,
          dense->seconds.median / sparse->seconds.median, "x", cpu ? 10.0 : 0.0, true);
      const Row* score = Find(timed, "ScorePages_decode_ctx" + c, b);
      const Row* topk = Find(timed, "TopK_decode_ctx" + c + "_k32", b);
      const Row* recall = Find(timed, "Recall_decode_256items", b);
      if (score == nullptr || topk == nullptr || recall == nullptr) continue;
      const double step = score->seconds.median + topk->seconds.median + recall->seconds.median +
                          sparse->seconds.median;
      add("decode_ctx" + c + ": sparse step (score + top-k + recall 256 + attention), ms", b,
          step * 1e3, "ms", 0, true);
      add("decode_ctx" + c + ": dense / sparse step", b, dense->seconds.median / step, "x", 0,
          true);
    }
    // What the default summary's scoring costs over the bounds' (key codes read a quarter of
    // the keys where the bounds read two rows a page).
    for (const char* ctx : {"32k", "128k"}) {
      const std::string c = ctx;
      const Row* bounds = Find(timed, "ScorePages_decode_ctx" + c, b);
      const Row* codes = Find(timed, "ScorePages_keycodes_decode_ctx" + c, b);
      if (bounds == nullptr || codes == nullptr) continue;
      add("decode_ctx" + c + ": ScorePages with key codes / with bounds", b,
          codes->seconds.median / bounds->seconds.median, "x", 0, true);
    }
    // The roofline set.
    for (const char* ctx : {"32k", "128k"}) {
      const std::string c = ctx;
      for (const auto& [op, target] :
           {std::pair<std::string, double>{"DenseAttention_roofline_ctx" + c, 0.6},
            {"SparseAttention_roofline_ctx" + c + "_ws" + (c == "32k" ? "4k" : "16k"), 0.5}}) {
        const Row* r = Find(timed, op, b);
        if (r == nullptr || !r->of_read.has_value()) continue;
        add(op + ": of the read bandwidth", b, *r->of_read, "of read bandwidth", cpu ? target : 0.0,
            true);
      }
    }
    if (const Row* dense = Find(timed, "DenseAttention_roofline_ctx32k", b);
        dense != nullptr && b != backends.front().name && dense->speedup > 0) {
      add("DenseAttention_roofline_ctx32k: over " + backends.front().name, b, dense->speedup, "x",
          cpu && backends.front().name == "cpu-scalar" ? 3.0 : 0.0, true);
    }
    const std::vector<std::pair<std::string, int>> sel = {{"8k", 8}, {"32k", 32}, {"128k", 128}};
    for (size_t i = 0; i + 1 < sel.size(); ++i) {
      const Row* a = Find(timed, "Selection_roofline_ctx" + sel[i].first, b);
      const Row* z = Find(timed, "Selection_roofline_ctx" + sel[i + 1].first, b);
      if (a == nullptr || z == nullptr) continue;
      const double doublings = std::log2(static_cast<double>(sel[i + 1].second) / sel[i].second);
      add("Selection_roofline: ctx" + sel[i].first + " -> ctx" + sel[i + 1].first +
              ", time per doubling",
          b, std::pow(z->seconds.median / a->seconds.median, 1.0 / doublings), "x", cpu ? 2.2 : 0.0,
          false);
    }
  }
  return out;
}

// Times one case on one backend: the samples in seconds.
absl::StatusOr<std::vector<double>> TimeCase(const testing::OpRun& run, Backend& b,
                                             Flusher* flusher, const OpsBenchOptions& o) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<testing::PlacedBuffers> placed,
                          testing::PlacedBuffers::Place(b, run.in));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> s, b.CreateStream());
  std::vector<double> samples;
  for (int32_t r = 0; r < o.warmup + o.reps; ++r) {
    if (flusher != nullptr) KVTIER_RETURN_IF_ERROR(flusher->Flush(b, *s));
    const absl::Time t0 = absl::Now();
    KVTIER_RETURN_IF_ERROR(run.op(b, *s, placed->ptrs()));
    KVTIER_RETURN_IF_ERROR(s->Synchronize());
    if (r >= o.warmup) samples.push_back(Seconds(absl::Now() - t0));
  }
  return samples;
}

}  // namespace

absl::StatusOr<JsonObject> RunOpsBench(const OpsBenchOptions& o, std::ostream& log) {
  if (o.reps < 1 || o.reps > 100000) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--reps = %d: must be in [1, 100000]", o.reps));
  }
  if (o.warmup < 0 || o.warmup > 1000) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--warmup = %d: must be in [0, 1000]", o.warmup));
  }
  if (o.flush_mib < 1 || o.flush_mib > 16384) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--flush-mib = %d: must be in [1, 16384]", o.flush_mib));
  }
  std::regex filter;
  try {
    filter = std::regex(o.ops, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(absl::StrFormat("--ops '%s': %s", o.ops, e.what()));
  }
  const std::vector<const testing::OpCase*> cases = Matching(filter);
  if (cases.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ops '%s' matches no case of the op table", o.ops));
  }
  KVTIER_ASSIGN_OR_RETURN(std::vector<NamedBackend> backends, MakeBackends(o, log));
  const int64_t flush_bytes = int64_t{o.flush_mib} * kMiB;
  std::unique_ptr<HostReader> reader;
  double read_gbps = 0;
  for (const NamedBackend& nb : backends) {
    if (nb.host && reader == nullptr) {
      reader = std::make_unique<HostReader>(o.threads, flush_bytes);
      read_gbps = reader->Bandwidth(5);
    }
  }
  std::vector<JsonObject> backends_json;
  log << absl::StrFormat("ops: %d case(s) matching \"%s\", %d reps after %d warm-up, %s\n",
                         cases.size(), o.ops, o.reps, o.warmup,
                         o.cold
                             ? absl::StrFormat("cold (%d MiB flushed before each rep)", o.flush_mib)
                             : std::string("warm (the same buffers every rep)"));
  log << absl::StrFormat("host: %s; commit %s\n", HostCpu(), Commit());
  if (reader != nullptr) {
    const CacheInfo llc = LastLevelCache();
    log << absl::StrFormat(
        "  host read bandwidth %.1f GB/s (%d MiB on %d threads, median of 5); "
        "last-level cache %.1f MiB (%s)\n",
        read_gbps, o.flush_mib, reader->threads(), static_cast<double>(llc.bytes) / kMiB,
        llc.source);
  }
  for (NamedBackend& nb : backends) {
    KVTIER_ASSIGN_OR_RETURN(nb.copy_gbps, CopyBandwidth(*nb.backend, flush_bytes, 5));
    log << absl::StrFormat("  %-10s  %s; device-to-device copy %.1f GB/s (%d MiB, read + write)\n",
                           nb.name, nb.backend->Describe(), nb.copy_gbps, o.flush_mib);
    JsonObject b = JsonObject()
                       .Add("name", nb.name)
                       .Add("device", nb.backend->Describe())
                       .Add("copy_gbps", nb.copy_gbps);
    if (nb.host) b.Add("read_gbps", read_gbps);
    backends_json.push_back(std::move(b));
  }
  const std::string& base = backends.front().name;
  log << absl::StrFormat("\n%-42s %-10s %11s %19s %8s %8s %8s %9s %8s\n", "case", "backend",
                         "median µs", "p10–p90 µs", "GB/s", "of copy", "of read", "GFLOP/s",
                         ("× " + base).c_str());
  std::vector<JsonObject> cases_json;
  Timed timed;
  for (const testing::OpCase* c : cases) {
    const testing::OpRun run = c->make();
    std::vector<Row> rows;
    double base_median = 0;
    for (NamedBackend& nb : backends) {
      std::unique_ptr<Flusher> flusher;
      if (o.cold) {
        KVTIER_ASSIGN_OR_RETURN(Flusher f, Flusher::Make(*nb.backend, reader.get(), flush_bytes));
        flusher = std::make_unique<Flusher>(std::move(f));
      }
      absl::StatusOr<std::vector<double>> samples = TimeCase(run, *nb.backend, flusher.get(), o);
      if (!samples.ok()) {
        // A case whose op fails (the table's error cases) is reported, not timed.
        log << absl::StrFormat("%-42s %-10s not timed: %s\n", c->name, nb.name,
                               samples.status().ToString());
        continue;
      }
      Row row;
      row.backend = nb.name;
      row.seconds = SpreadOf(*samples);
      const double t = row.seconds.median;
      if (&nb == &backends.front()) base_median = t;
      row.gbps = run.bytes > 0 ? static_cast<double>(run.bytes) / t / 1e9 : 0;
      row.gflops = run.flops > 0 ? run.flops / t / 1e9 : 0;
      row.of_copy = nb.copy_gbps > 0 ? row.gbps / nb.copy_gbps : 0;
      if (nb.host && run.bytes > 0 && read_gbps > 0) row.of_read = row.gbps / read_gbps;
      row.speedup = base_median > 0 ? base_median / t : 0;
      log << absl::StrFormat("%-42s %-10s %11.1f %9.1f–%-9.1f %8s %8s %8s %9s %8s\n", c->name,
                             nb.name, t * 1e6, row.seconds.p10 * 1e6, row.seconds.p90 * 1e6,
                             run.bytes > 0 ? absl::StrFormat("%.2f", row.gbps) : "-",
                             run.bytes > 0 ? absl::StrFormat("%.2f", row.of_copy) : "-",
                             row.of_read ? absl::StrFormat("%.3f", *row.of_read) : "-",
                             run.flops > 0 ? absl::StrFormat("%.1f", row.gflops) : "-",
                             row.speedup > 0 ? absl::StrFormat("%.2f", row.speedup) : "-");
      rows.push_back(row);
      timed[c->name][nb.name] = row;
    }
    std::vector<JsonObject> runs;
    for (const Row& r : rows) {
      JsonObject seconds = SpreadJson(r.seconds);
      JsonObject run_json = JsonObject()
                                .Add("backend", r.backend)
                                .AddObject("seconds", seconds)
                                .Add("gbps", r.gbps)
                                .Add("of_copy", r.of_copy)
                                .Add("gflops", r.gflops)
                                .Add("speedup_vs_" + base, r.speedup);
      if (r.of_read.has_value()) run_json.Add("of_read", *r.of_read);
      runs.push_back(std::move(run_json));
    }
    cases_json.push_back(JsonObject()
                             .Add("name", c->name)
                             .Add("bytes", run.bytes)
                             .Add("flops", run.flops)
                             .AddArray("runs", runs));
  }
  double read_gbps_end = 0;
  if (reader != nullptr) {
    read_gbps_end = reader->Bandwidth(5);
    log << absl::StrFormat("\nhost read bandwidth again at the end: %.1f GB/s\n", read_gbps_end);
  }
  const std::vector<Derived> derived = DeriveFigures(timed, backends, o.cold);
  std::vector<JsonObject> derived_json;
  if (!derived.empty()) {
    log << absl::StrFormat("\nfigures over several rows%s:\n",
                           o.cold ? "" : " (targets are judged cold: run with --cold)");
  }
  for (const Derived& d : derived) {
    std::string verdict;
    if (!d.target_text.empty()) {
      verdict = absl::StrFormat("  target %s: %s", d.target_text,
                                !d.met.has_value() ? "not judged (warm)"
                                : *d.met           ? "met"
                                                   : "MISSED");
    }
    log << absl::StrFormat("  %-72s %-10s %9.3f %s%s\n", d.name, d.backend, d.value, d.unit,
                           verdict);
    JsonObject j = JsonObject()
                       .Add("name", d.name)
                       .Add("backend", d.backend)
                       .Add("value", d.value)
                       .Add("unit", d.unit);
    if (!d.target_text.empty()) j.Add("target", d.target_text);
    if (d.met.has_value()) j.Add("met", *d.met);
    derived_json.push_back(std::move(j));
  }
  JsonObject report = JsonObject()
                          .Add("bench", "ops")
                          .Add("host", HostCpu())
                          .Add("commit", Commit())
                          .Add("time", UtcNow())
                          .Add("filter", o.ops)
                          .Add("reps", o.reps)
                          .Add("warmup", o.warmup)
                          .Add("cold", o.cold)
                          .Add("flush_mib", o.flush_mib);
  if (reader != nullptr) {
    report.Add("read_gbps", read_gbps).Add("read_gbps_end", read_gbps_end);
  }
  return report.Add("baseline", base)
      .AddArray("backends", backends_json)
      .AddArray("cases", cases_json)
      .AddArray("derived", derived_json);
}

CLI::App* AddOpsCommand(CLI::App& app, int* rc) {
  struct Flags {
    OpsBenchOptions o;
    std::string backends = "cpu-scalar,cpu,cuda";
    bool list = false, json = false;
    std::string out;
  };
  auto flags = std::make_shared<Flags>();
  Flags& f = *flags;
  auto* cmd = app.add_subcommand(
      "ops",
      "the op table's cases and its perf cases timed on every backend, against the scalar CPU "
      "kernels of the same run: by default the decode-size ones (a decode step at 32K and 128K: "
      "dense vs sparse); --ops _roofline_: the CPU ops against the host's read bandwidth");
  cmd->add_option("--ops", f.o.ops, "regex of the case names to time")->capture_default_str();
  cmd->add_option("--backends", f.backends,
                  "comma-separated, the first is the baseline: cpu-scalar, cpu, cuda (skipped "
                  "without a device)")
      ->capture_default_str();
  cmd->add_option("--reps", f.o.reps, "timed reps per case and backend (median reported)")
      ->capture_default_str();
  cmd->add_option("--warmup", f.o.warmup, "untimed reps first")->capture_default_str();
  cmd->add_option("--threads", f.o.threads, "cpu backends' threads (0 = all)")
      ->capture_default_str();
  cmd->add_flag("--cold", f.o.cold, "flush the caches before each rep (outside the timer)");
  cmd->add_option("--flush-mib", f.o.flush_mib,
                  "MiB streamed by a cold flush; also the copy-bandwidth buffer")
      ->capture_default_str();
  cmd->add_flag("--list", f.list, "list the matching cases and exit");
  cmd->add_flag("--json", f.json, "print one JSON object on stdout");
  cmd->add_option("--out", f.out, "also write the JSON report to this file");
  cmd->callback([flags, rc] {
    Flags& g = *flags;
    std::vector<std::string> backends = absl::StrSplit(g.backends, ',', absl::SkipEmpty());
    g.o.backends = std::move(backends);
    if (g.list) {
      try {
        const std::regex filter(g.o.ops, std::regex::ECMAScript);
        for (const testing::OpCase* c : Matching(filter)) std::cout << c->name << "\n";
      } catch (const std::regex_error& e) {
        std::cerr << "kvtier-bench ops: --ops '" << g.o.ops << "': " << e.what() << "\n";
        *rc = 2;
        return;
      }
      *rc = 0;
      return;
    }
    absl::StatusOr<JsonObject> report = RunOpsBench(g.o, g.json ? std::cerr : std::cout);
    if (!report.ok()) {
      std::cerr << "kvtier-bench ops: " << report.status() << "\n";
      *rc = absl::IsInvalidArgument(report.status()) ? 2 : 1;
      return;
    }
    if (g.json) std::cout << report->ToString() << "\n";
    if (!g.out.empty()) std::ofstream(g.out) << report->ToString() << "\n";
    *rc = 0;
  });
  return cmd;
}

}  // namespace kvtier::bench
