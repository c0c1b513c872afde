#include "bench/ops_bench.h"

#include <fstream>
#include <iostream>
#include <memory>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/isa.h"
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
};

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// The backends asked for, in order; cuda is left out (with a line in the log) when no device
// is usable.
absl::StatusOr<std::vector<NamedBackend>> MakeBackends(const OpsBenchOptions& o,
                                                       std::ostream& log) {
  std::vector<NamedBackend> out;
  for (const std::string& name : o.backends) {
    if (name == "cpu-scalar") {
      out.push_back({name, NewCpuBackend(o.threads, cpu::Isa::kScalar)});
    } else if (name == "cpu") {
      out.push_back({name, NewCpuBackend(o.threads)});
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
      return absl::InvalidArgumentError(absl::StrFormat(
          "--backends: '%s' is not one of cpu-scalar, cpu, cuda", name));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("--backends: no usable backend");
  return out;
}

// What a cold rep streams through the caches first: on the host for the cpu backends (a
// read of every cache line), on the device for cuda (a memset, which goes through L2).
class Flusher {
 public:
  static absl::StatusOr<Flusher> Make(Backend& b, int64_t bytes) {
    Flusher f;
    f.bytes_ = bytes;
    f.host_ = b.kind() == DeviceKind::kCpu;
    if (f.host_) {
      f.host_buf_.assign(static_cast<size_t>(bytes / 8), 1);
    } else {
      KVTIER_ASSIGN_OR_RETURN(f.dev_buf_, b.Allocate(static_cast<size_t>(bytes)));
    }
    return f;
  }
  absl::Status Flush(Backend& b, Stream& s) {
    if (host_) {
      uint64_t sum = 0;
      for (uint64_t v : host_buf_) sum += v;
      g_flush_sink = g_flush_sink + sum;
      return absl::OkStatus();
    }
    KVTIER_RETURN_IF_ERROR(b.Memset(s, dev_buf_.data(), ++fill_, static_cast<size_t>(bytes_)));
    return s.Synchronize();
  }

 private:
  int64_t bytes_ = 0;
  bool host_ = true;
  std::vector<uint64_t> host_buf_;
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
};

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
    return absl::InvalidArgumentError(absl::StrFormat("--reps = %d: must be in [1, 100000]", o.reps));
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
  std::vector<const testing::OpCase*> cases;
  for (const testing::OpCase& c : testing::OpCases()) {
    if (std::regex_search(c.name, filter)) cases.push_back(&c);
  }
  if (cases.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ops '%s' matches no case of the op table", o.ops));
  }
  KVTIER_ASSIGN_OR_RETURN(std::vector<NamedBackend> backends, MakeBackends(o, log));
  const int64_t flush_bytes = int64_t{o.flush_mib} * kMiB;
  std::vector<JsonObject> backends_json;
  log << absl::StrFormat("ops: %d case(s) matching \"%s\", %d reps after %d warm-up, %s\n",
                         cases.size(), o.ops, o.reps, o.warmup,
                         o.cold ? absl::StrFormat("cold (%d MiB flushed before each rep)",
                                                  o.flush_mib)
                                : std::string("warm (the same buffers every rep)"));
  log << absl::StrFormat("host: %s; commit %s\n", HostCpu(), Commit());
  for (NamedBackend& nb : backends) {
    KVTIER_ASSIGN_OR_RETURN(nb.copy_gbps, CopyBandwidth(*nb.backend, flush_bytes, 5));
    log << absl::StrFormat("  %-10s  %s; device-to-device copy %.1f GB/s (%d MiB, read + write)\n",
                           nb.name, nb.backend->Describe(), nb.copy_gbps, o.flush_mib);
    backends_json.push_back(JsonObject()
                                .Add("name", nb.name)
                                .Add("device", nb.backend->Describe())
                                .Add("copy_gbps", nb.copy_gbps));
  }
  const std::string& base = backends.front().name;
  log << absl::StrFormat("\n%-34s %-10s %11s %19s %8s %8s %9s %8s\n", "case", "backend",
                         "median µs", "p10–p90 µs", "GB/s", "of copy", "GFLOP/s",
                         ("× " + base).c_str());
  std::vector<JsonObject> cases_json;
  for (const testing::OpCase* c : cases) {
    const testing::OpRun run = c->make();
    std::vector<Row> rows;
    double base_median = 0;
    for (NamedBackend& nb : backends) {
      std::unique_ptr<Flusher> flusher;
      if (o.cold) {
        KVTIER_ASSIGN_OR_RETURN(Flusher f, Flusher::Make(*nb.backend, flush_bytes));
        flusher = std::make_unique<Flusher>(std::move(f));
      }
      absl::StatusOr<std::vector<double>> samples = TimeCase(run, *nb.backend, flusher.get(), o);
      if (!samples.ok()) {
        // A case whose op fails (the table's error cases) is reported, not timed.
        log << absl::StrFormat("%-34s %-10s not timed: %s\n", c->name, nb.name,
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
      row.speedup = base_median > 0 ? base_median / t : 0;
      log << absl::StrFormat("%-34s %-10s %11.1f %9.1f–%-9.1f %8s %8s %9s %8s\n", c->name,
                             nb.name, t * 1e6, row.seconds.p10 * 1e6, row.seconds.p90 * 1e6,
                             run.bytes > 0 ? absl::StrFormat("%.2f", row.gbps) : "-",
                             run.bytes > 0 ? absl::StrFormat("%.2f", row.of_copy) : "-",
                             run.flops > 0 ? absl::StrFormat("%.1f", row.gflops) : "-",
                             row.speedup > 0 ? absl::StrFormat("%.2f", row.speedup) : "-");
      rows.push_back(row);
    }
    std::vector<JsonObject> runs;
    for (const Row& r : rows) {
      JsonObject seconds = SpreadJson(r.seconds);
      runs.push_back(JsonObject()
                         .Add("backend", r.backend)
                         .AddObject("seconds", seconds)
                         .Add("gbps", r.gbps)
                         .Add("of_copy", r.of_copy)
                         .Add("gflops", r.gflops)
                         .Add("speedup_vs_" + base, r.speedup));
    }
    cases_json.push_back(JsonObject()
                             .Add("name", c->name)
                             .Add("bytes", run.bytes)
                             .Add("flops", run.flops)
                             .AddArray("runs", runs));
  }
  return JsonObject()
      .Add("bench", "ops")
      .Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("filter", o.ops)
      .Add("reps", o.reps)
      .Add("warmup", o.warmup)
      .Add("cold", o.cold)
      .Add("flush_mib", o.flush_mib)
      .Add("baseline", base)
      .AddArray("backends", backends_json)
      .AddArray("cases", cases_json);
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
      "ops", "the op table's cases timed on every backend (by default the decode-size ones), "
             "against the scalar CPU kernels of the same run");
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
        for (const testing::OpCase& c : testing::OpCases()) {
          if (std::regex_search(c.name, filter)) std::cout << c.name << "\n";
        }
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
