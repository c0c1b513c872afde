// kvtier-bench: kvtier's benchmark driver. Each subcommand measures one thing against a
// baseline from the same run and prints a human report, or with --json one JSON object
// (the human report then goes to stderr).
//
//   kvtier-bench attention [--context N] [--batch B] [--json] ...
//   kvtier-bench replay [--context N] [--steps N] [--budget B] [--tau 0.9,0.8] [--json] ...
//   kvtier-bench replay --trace F [--layers all] [--step-range A:B] [--sink S --selected K
//                       --recent R] [--backend cuda]        # a trace file (docs/trace-format.md)
//   kvtier-bench replay --connect unix:///path/kvtierd.sock   # through kvtierd sessions
//   kvtier-bench replay --policies [--budgets 512,1024] [--policy-list window,h2o] [--plot F]
//   kvtier-bench ipc [--bytes N] [--kvtierd PATH] [--scrape-ms 100] [--no-scrape] [--json]
//   kvtier-bench tier [--masters 3] [--page-bytes N] [--pages N] [--json]  # cold tier vs Redis
//   kvtier-bench pcie [--backend cuda] [--json] [--plot F]   # host↔device transfers, recall
//   kvtier-bench step [--backend cuda] [--context N] [--json]  # per-layer decode step times
//   kvtier-bench roofline [--contexts 32768,131072] [--json]  # cpu ops vs read bandwidth
//   kvtier-bench devices
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/attention_bench.h"
#include "bench/ipc_bench.h"
#include "bench/pcie_bench.h"
#include "bench/policy_replay.h"
#include "bench/replay_bench.h"
#include "bench/replay_session.h"
#include "bench/roofline_bench.h"
#include "bench/step_bench.h"
#include "bench/tier_bench.h"
#include "kernels/registry.h"

namespace {

using kvtier::DeviceKind;

int RunAttention(const kvtier::bench::AttentionBenchOptions& o, bool json, const std::string& out) {
  auto report = kvtier::bench::RunAttentionBench(o, json ? std::cerr : std::cout);
  if (!report.ok()) {
    std::cerr << "kvtier-bench attention: " << report.status() << "\n";
    return 1;
  }
  if (json) std::cout << report->ToString() << "\n";
  if (!out.empty()) std::ofstream(out) << report->ToString() << "\n";
  return 0;
}

// Exit 2 for options the replay refused (INVALID_ARGUMENT) and a backend this build or
// machine lacks (UNIMPLEMENTED); 1 for every other failure.
int RunReplay(const kvtier::bench::ReplayBenchOptions& o, bool json, const std::string& out) {
  auto report = kvtier::bench::RunReplayBench(o, json ? std::cerr : std::cout);
  if (!report.ok()) {
    std::cerr << "kvtier-bench replay: " << report.status() << "\n";
    const absl::Status& st = report.status();
    return absl::IsInvalidArgument(st) || absl::IsUnimplemented(st) ? 2 : 1;
  }
  if (json) std::cout << report->ToString() << "\n";
  if (!out.empty()) std::ofstream(out) << report->ToString() << "\n";
  return 0;
}

// The replay through kvtierd: the host-tier modes become Sessions of the daemon at `target`.
int RunReplayConnected(kvtier::bench::ReplayBenchOptions o, const std::string& target,
                       const kvtier::ClientOptions& co, kvtier::Transport transport, bool json,
                       const std::string& out) {
  std::ostream& log = json ? std::cerr : std::cout;
  auto sessions = kvtier::bench::ReplaySessions::Connect(target, co, transport, log);
  if (!sessions.ok()) {
    std::cerr << "kvtier-bench replay: " << sessions.status() << "\n";
    return 1;
  }
  (*sessions)->Install(o);
  const int rc = RunReplay(o, json, out);
  const absl::Status closed = (*sessions)->CloseAll();
  if (!closed.ok()) {
    std::cerr << "kvtier-bench replay: closing sessions: " << closed << "\n";
    return rc == 0 ? 1 : rc;
  }
  return rc;
}

int RunPolicies(const kvtier::bench::PolicyReplayOptions& o, bool json, const std::string& out) {
  auto report = kvtier::bench::RunPolicyReplay(o, json ? std::cerr : std::cout);
  if (!report.ok()) {
    std::cerr << "kvtier-bench replay --policies: " << report.status() << "\n";
    return 1;
  }
  if (json) std::cout << report->ToString() << "\n";
  if (!out.empty()) std::ofstream(out) << report->ToString() << "\n";
  return 0;
}

// Exit 2 for options refused, 1 for every other failure and for any failed scrape.
int RunIpc(const kvtier::bench::IpcBenchOptions& o, bool json, const std::string& out) {
  auto result = kvtier::bench::RunIpcBench(o, json ? std::cerr : std::cout);
  if (!result.ok()) {
    std::cerr << "kvtier-bench ipc: " << result.status() << "\n";
    return absl::IsInvalidArgument(result.status()) ? 2 : 1;
  }
  const std::string report = result->report.ToString();
  if (json) std::cout << report << "\n";
  if (!out.empty()) std::ofstream(out) << report << "\n";
  if (result->scrape_failures > 0) {
    std::cerr << "kvtier-bench ipc: " << result->scrape_failures << " scrape(s) failed\n";
    return 1;
  }
  return 0;
}

// The replay's flags that are not plain fields of ReplayBenchOptions.
struct ReplayFlags {
  std::string layers, mass_layers, step_range, backend = "cpu";
  int32_t sink = 0, selected = 0, recent = 0;
};

// The flags that describe the synthetic trace. With --trace, those that change what is
// replayed (its sizes and geometry) are errors, the query process and seed a warning.
struct SyntheticFlag {
  const char* name;
  bool error;
  const char* hint;
};
constexpr SyntheticFlag kSyntheticFlags[] = {
    {"--context", true, ""},
    {"--steps", true, " (--step-range replays part of it)"},
    {"--model-layers", true, " (--layers replays part of it)"},
    {"--q-heads", true, ""},
    {"--kv-heads", true, ""},
    {"--head-dim", true, ""},
    {"--page-size", true, ""},
    {"--dtype", true, ""},
    {"--step-cosine", false, ""},
    {"--jump-probability", false, ""},
    {"--seed", false, ""},
};

// "all" → kEveryLayer; otherwise an integer ≥ 0.
bool ParseLayerCount(const std::string& s, int32_t* out) {
  if (s == "all") {
    *out = kvtier::bench::kEveryLayer;
    return true;
  }
  return absl::SimpleAtoi(s, out) && *out >= 0;
}

// "A:B", "A:" (to the trace's end) or ":B" (from step 0), integers ≥ 0.
bool ParseStepRange(const std::string& s, int32_t* begin, int32_t* end) {
  const std::vector<std::string> parts = absl::StrSplit(s, ':');
  if (parts.size() != 2) return false;
  *begin = 0;
  *end = -1;
  if (!parts[0].empty() && (!absl::SimpleAtoi(parts[0], begin) || *begin < 0)) return false;
  if (!parts[1].empty() && (!absl::SimpleAtoi(parts[1], end) || *end < 0)) return false;
  return true;
}

// Checks and applies the replay flags that need to know which were given; 0, or the exit
// code (2) after telling why.
int ResolveReplayFlags(const CLI::App& replay, const ReplayFlags& f, bool policies,
                       kvtier::bench::ReplayBenchOptions* ro) {
  const auto given = [&](const char* name) { return replay.get_option(name)->count() > 0; };
  const auto refuse = [](const std::string& why) {
    std::cerr << "kvtier-bench replay: " << why << "\n";
    return 2;
  };
  if (!ro->trace_path.empty()) {
    for (const SyntheticFlag& s : kSyntheticFlags) {
      if (!given(s.name)) continue;
      if (s.error) {
        return refuse(
            absl::StrCat(s.name, " is for the synthetic trace; a trace file has its own", s.hint));
      }
      std::cerr << "kvtier-bench replay: warning: " << s.name
                << " is for the synthetic trace; ignored with --trace\n";
    }
    if (given("--write-trace")) {
      return refuse("--write-trace writes the synthetic trace; it cannot be used with --trace");
    }
  }
  if (policies) {
    for (const char* name : {"--sink", "--selected", "--recent", "--step-range"}) {
      if (given(name)) return refuse(absl::StrCat(name, " is not used by --policies"));
    }
  }
  if (given("--layers")) {
    int32_t n = 0;
    if (!ParseLayerCount(f.layers, &n)) {
      return refuse("--layers must be a layer count (>= 1; 0 = all) or all, got " + f.layers);
    }
    ro->layers = n;
  }
  if (!ParseLayerCount(f.mass_layers, &ro->mass_layers)) {
    return refuse("--mass-layers must be a layer count (>= 0) or all, got " + f.mass_layers);
  }
  const int split = given("--sink") + given("--selected") + given("--recent");
  if (split != 0 && split != 3) {
    return refuse(
        "--sink, --selected and --recent go together (pages): give all three, or "
        "--budget alone");
  }
  if (split == 3) {
    ro->pages = kvtier::bench::ReplayBudgetPages{f.sink, f.selected, f.recent};
    if (!given("--budget")) ro->budget_tokens = 0;  // their sum
  }
  if (given("--step-range") && !ParseStepRange(f.step_range, &ro->step_begin, &ro->step_end)) {
    return refuse("--step-range must be A:B (half-open, A:, :B) with integers >= 0, got " +
                  f.step_range);
  }
  if (!kvtier::ParseDeviceKind(f.backend, &ro->backend)) {
    return refuse("--backend must be cpu, cuda or auto, got " + f.backend);
  }
  if (ro->backend == DeviceKind::kCuda && !kvtier::CudaBackendBuilt()) {
    return refuse(
        "--backend cuda: this build has no CUDA backend (configure with "
        "-DKVTIER_WITH_CUDA=ON where nvcc is installed)");
  }
  if (ro->backend == DeviceKind::kCuda && kvtier::CudaDeviceCount() == 0) {
    return refuse("--backend cuda: no usable CUDA device (kvtier-bench devices lists them)");
  }
  return 0;
}

int ListDevices() {
  std::cout << "cuda backend built: " << (kvtier::CudaBackendBuilt() ? "yes" : "no")
            << ", usable cuda devices: " << kvtier::CudaDeviceCount() << "\n";
  for (DeviceKind k : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    auto b = kvtier::CreateBackend(k);
    std::cout << "  " << kvtier::DeviceKindName(k) << ": "
              << (b.ok() ? (*b)->Describe() : b.status().ToString()) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier-bench: kvtier benchmarks, each against a same-run baseline"};
  app.require_subcommand(1);

  kvtier::bench::AttentionBenchOptions ao;
  bool json = false;
  std::string out, backend = "cpu", dtype = "fp16";
  auto* attn = app.add_subcommand(
      "attention", "CPU dense vs sparse decode attention at long context (one layer)");
  attn->add_option("--context", ao.context, "tokens per sequence")->capture_default_str();
  attn->add_option("--batch", ao.batch, "sequences in the decode batch")->capture_default_str();
  attn->add_option("--sink-pages", ao.sink_pages)->capture_default_str();
  attn->add_option("--selected-pages", ao.selected_pages)->capture_default_str();
  attn->add_option("--recent-pages", ao.recent_pages)->capture_default_str();
  attn->add_option("--page-size", ao.geometry.page_size)->capture_default_str();
  attn->add_option("--q-heads", ao.geometry.num_q_heads)->capture_default_str();
  attn->add_option("--kv-heads", ao.geometry.num_kv_heads)->capture_default_str();
  attn->add_option("--head-dim", ao.geometry.head_dim)->capture_default_str();
  attn->add_option("--dtype", dtype, "fp16, bf16 or fp32")->capture_default_str();
  attn->add_option("--iters", ao.iters, "timed repetitions (median reported)")
      ->capture_default_str();
  attn->add_option("--threads", ao.threads, "cpu backend threads (0 = all)")->capture_default_str();
  bool no_cold = false;
  int64_t evict_mib = 0;
  attn->add_flag("--no-cold", no_cold, "skip the cold-cache variants");
  attn->add_option("--evict-mib", evict_mib,
                   "cold: bytes streamed through the cache before each iteration (0 = "
                   "max(2 x last-level cache, 256 MiB))")
      ->capture_default_str();
  attn->add_option("--backend", backend, "cpu, cuda or auto")->capture_default_str();
  attn->add_option("--heavy-logit", ao.heavy_logit, "synthetic KV: logit boost of heavy pages")
      ->capture_default_str();
  attn->add_option("--heavy-pages", ao.heavy_pages, "synthetic KV: heavy pages per KV head")
      ->capture_default_str();
  attn->add_option("--seed", ao.seed)->capture_default_str();
  attn->add_flag("--json", json, "print one JSON object on stdout");
  attn->add_option("--out", out, "also write the JSON report to this file");

  kvtier::bench::ReplayBenchOptions ro;
  std::string taus = absl::StrCat(kvtier::kDefaultCorrectionThreshold), recall = "auto",
              write_trace, rdtype = "fp16";
  bool no_sync = false, no_drop = false;
  auto* replay =
      app.add_subcommand("replay",
                         "trace-driven evaluation of the retrieval modes side by side (full, "
                         "speculative per tau, sync): accuracy, recall traffic, critical path");
  auto& so = ro.synthetic;
  so.num_steps = 16;  // modest by default; --steps for longer runs
  replay->add_option("--trace", ro.trace_path,
                     "read this trace file instead of the synthetic "
                     "trace (docs/trace-format.md)");
  replay->add_option("--write-trace", write_trace,
                     "write the synthetic trace to this file "
                     "and exit");
  replay->add_option("--context", so.prefill_tokens, "synthetic: prefill tokens")
      ->capture_default_str();
  replay->add_option("--steps", so.num_steps, "synthetic: decode steps")->capture_default_str();
  ReplayFlags rf;
  replay->add_option("--layers", rf.layers,
                     "replay the first N layers, or all (default: 4 of the synthetic trace, all "
                     "of a trace file)");
  replay->add_option("--model-layers", so.geometry.num_layers, "synthetic: layers of the shape")
      ->capture_default_str();
  replay->add_option("--q-heads", so.geometry.num_q_heads)->capture_default_str();
  replay->add_option("--kv-heads", so.geometry.num_kv_heads)->capture_default_str();
  replay->add_option("--head-dim", so.geometry.head_dim)->capture_default_str();
  replay->add_option("--page-size", so.geometry.page_size)->capture_default_str();
  replay->add_option("--dtype", rdtype, "fp16, bf16 or fp32")->capture_default_str();
  replay->add_option("--step-cosine", so.step_cosine, "synthetic: mean cos(q_t, q_t-1)")
      ->capture_default_str();
  replay
      ->add_option("--jump-probability", so.jump_probability,
                   "synthetic: topic jumps per step and KV head")
      ->capture_default_str();
  replay->add_option("--seed", so.seed)->capture_default_str();
  replay
      ->add_option("--budget", ro.budget_tokens,
                   "working-set budget in tokens, split 1/4 sinks : 1/2 selected : 1/4 recent "
                   "(a multiple of 4 pages)")
      ->capture_default_str();
  replay->add_option("--sink,--sink-pages", rf.sink,
                     "sink pages per layer (with --selected and --recent: the budget is their "
                     "sum)");
  replay->add_option("--selected,--selected-pages", rf.selected, "selected pages per layer");
  replay->add_option("--recent,--recent-pages", rf.recent,
                     "recent pages per layer (>= 1: the page being filled is one)");
  replay->add_option("--step-range", rf.step_range,
                     "score and time steps A..B-1 only (A:B, A:, :B); earlier steps are decoded "
                     "unscored");
  replay->add_option("--backend", rf.backend, "cpu, cuda or auto")->capture_default_str();
  replay
      ->add_option("--tau", taus,
                   "comma-separated correction thresholds, one speculative "
                   "mode each; the first is reported as \"speculative\"")
      ->capture_default_str();
  replay->add_flag("--no-sync", no_sync, "skip sync mode");
  replay->add_flag("--no-drop", no_drop, "skip drop mode (sinks + sliding window)");
  replay
      ->add_option("--recall", recall, "recall strategy: auto, batched_dma or zero_copy")
      ->capture_default_str();
  rf.mass_layers = std::to_string(ro.mass_layers);
  replay
      ->add_option("--mass-layers", rf.mass_layers,
                   "replayed layers (evenly spaced) scored for attention mass recall, or all")
      ->capture_default_str();
  replay
      ->add_option("--profile-steps", ro.profile_steps,
                   "trailing steps run with profiling "
                   "for the select/recall/attention split")
      ->capture_default_str();
  replay->add_option("--threads", ro.threads, "cpu backend threads (0 = all)")
      ->capture_default_str();
  replay->add_flag("--json", json, "print one JSON object on stdout");
  replay->add_option("--out", out, "also write the JSON report to this file");
  std::string connect, transport = "shm";
  kvtier::ClientOptions client_options;
  replay->add_option("--connect", connect,
                     "run speculative and sync modes as sessions of the "
                     "kvtierd at this target (unix:///path or host:port)");
  replay->add_option("--tenant", client_options.tenant, "with --connect: the tenant")
      ->capture_default_str();
  replay->add_option("--token", client_options.token, "with --connect: the tenant's token");
  replay->add_option("--transport", transport, "with --connect: shm or grpc")
      ->capture_default_str();
  // The policy sweep (bench/policy_replay.h): its own defaults for --context and --steps.
  kvtier::bench::PolicyReplayOptions po;
  bool policies = false;
  std::string policy_list = absl::StrJoin(kvtier::bench::PolicyReplayNames(), ","),
              budgets = "512,1024,2048,4096";
  replay->add_flag("--policies", policies,
                   "run the policy sweep instead: memory vs attention error vs full KV per "
                   "policy and budget, drop mode (default --context 8192 --steps 40)");
  replay->add_option("--policy-list", policy_list, "with --policies: the runs")
      ->capture_default_str();
  replay
      ->add_option("--budgets", budgets,
                   "with --policies: working-set budgets in tokens "
                   "(those not below the context are skipped)")
      ->capture_default_str();
  replay->add_option("--plot", po.plot_path,
                     "with --policies: write a PNG of rel_error vs "
                     "memory fraction here");

  kvtier::bench::IpcBenchOptions io;
  auto* ipc = app.add_subcommand(
      "ipc",
      "page movement engine <-> kvtierd (its own process) on loopback (shared memory through "
      "the client library, gRPC streams, unary round trips) against Redis SET/GET as the peer "
      "baseline; then what a /metrics scrape every --scrape-ms costs a replay's decode step (an "
      "SHM session of the same daemon), against the same replay unscraped, ABBA");
  ipc->add_option("--bytes", io.bytes_per_run, "bytes moved per throughput measurement")
      ->capture_default_str();
  ipc->add_option("--repeats", io.repeats, "runs per measurement (median and p10/p90 reported)")
      ->capture_default_str();
  ipc->add_option("--unary-calls", io.unary_calls, "Hello calls per transport")
      ->capture_default_str();
  ipc->add_option("--redis-pipeline", io.redis_pipeline, "Redis commands in flight")
      ->capture_default_str();
  ipc->add_option("--kvtierd", io.kvtierd,
                  "the kvtierd binary to start (default: next to kvtier-bench, or the build "
                  "tree's daemon/kvtierd)");
  bool no_redis = false, no_scrape = false;
  ipc->add_flag("--no-redis", no_redis, "skip the Redis baseline");
  kvtier::bench::IpcScrapeOptions& sc = io.scraping;
  ipc->add_flag("--no-scrape", no_scrape, "skip the /metrics section");
  ipc->add_option("--scrape-context", sc.synthetic.prefill_tokens,
                  "/metrics section: the replay's prefill tokens")
      ->capture_default_str();
  ipc->add_option("--scrape-steps", sc.synthetic.num_steps, "/metrics section: decode steps")
      ->capture_default_str();
  ipc->add_option("--scrape-layers", sc.layers,
                  "/metrics section: layers replayed (the first N of the model's)")
      ->capture_default_str();
  ipc->add_option("--scrape-budget", sc.budget_tokens,
                  "/metrics section: working-set budget in tokens (a multiple of 4 x page size)")
      ->capture_default_str();
  ipc->add_option("--scrape-repeats", sc.repeats,
                  "/metrics section: timed replays per mode (off and on)")
      ->capture_default_str();
  ipc->add_option("--scrape-warmup", sc.warmup, "/metrics section: untimed replays first (scraped)")
      ->capture_default_str();
  ipc->add_option("--scrape-ms", sc.scrape_ms, "/metrics section: scrape period of the on runs, ms")
      ->capture_default_str();
  ipc->add_option("--threads", sc.threads,
                  "/metrics section: cpu backend threads of the replay (0 = all)")
      ->capture_default_str();
  ipc->add_flag("--json", json, "print one JSON object on stdout");
  ipc->add_option("--out", out, "also write the JSON report to this file");

  int pcie_rc = 0, step_rc = 0;
  auto* pcie = kvtier::bench::AddPcieCommand(app, &pcie_rc);
  auto* step = kvtier::bench::AddStepCommand(app, &step_rc);
  int roofline_rc = 0;
  auto* roofline = kvtier::bench::AddRooflineCommand(app, &roofline_rc);
  int tier_rc = 0;
  auto* tier = kvtier::bench::AddTierCommand(app, &tier_rc);

  auto* devices = app.add_subcommand("devices", "list the backends this build can use");

  CLI11_PARSE(app, argc, argv);
  if (*devices) return ListDevices();
  if (*pcie) return pcie_rc;
  if (*step) return step_rc;
  if (*roofline) return roofline_rc;
  if (*tier) return tier_rc;
  if (*ipc) {
    io.redis = !no_redis;
    io.scrape = !no_scrape;
    return RunIpc(io, json, out);
  }
  if (*replay) {
    if (const int rc = ResolveReplayFlags(*replay, rf, policies, &ro); rc != 0) return rc;
    if (!kvtier::ParseDType(rdtype, &so.geometry.dtype)) {
      std::cerr << "kvtier-bench replay: --dtype must be fp16, bf16 or fp32\n";
      return 2;
    }
    ro.taus.clear();
    for (absl::string_view t : absl::StrSplit(taus, ',')) {
      float v = 0;
      if (!absl::SimpleAtof(t, &v)) {
        std::cerr << "kvtier-bench replay: --tau: '" << t << "' is not a number\n";
        return 2;
      }
      ro.taus.push_back(v);
    }
    ro.sync = !no_sync;
    ro.drop = !no_drop;
    if (!kvtier::ParseRecallStrategy(recall, &ro.recall)) {
      std::cerr << "kvtier-bench replay: --recall must be auto, batched_dma or zero_copy\n";
      return 2;
    }
    if (!write_trace.empty()) {
      auto src = kvtier::bench::MakeSyntheticTrace(so);
      absl::Status st = src.ok() ? kvtier::bench::WriteTraceFile(**src, write_trace) : src.status();
      if (!st.ok()) {
        std::cerr << "kvtier-bench replay: " << st << "\n";
        return 1;
      }
      return 0;
    }
    if (policies) {
      if (!connect.empty()) {
        std::cerr << "kvtier-bench replay: --policies runs locally; drop --connect\n";
        return 2;
      }
      po.trace_path = ro.trace_path;
      po.synthetic = so;
      if (replay->get_option("--context")->count() == 0) po.synthetic.prefill_tokens = 8192;
      if (replay->get_option("--steps")->count() == 0) po.synthetic.num_steps = 40;
      po.layers =
          ro.layers.value_or(ro.trace_path.empty() ? kvtier::bench::kDefaultSyntheticLayers : 0);
      if (po.layers == kvtier::bench::kEveryLayer) po.layers = 0;
      po.backend = ro.backend;
      po.threads = ro.threads;
      po.recall = ro.recall;
      po.policies.clear();
      for (absl::string_view p : absl::StrSplit(policy_list, ',', absl::SkipEmpty())) {
        po.policies.push_back(std::string(p));
      }
      po.budgets.clear();
      for (absl::string_view b : absl::StrSplit(budgets, ',', absl::SkipEmpty())) {
        int32_t v = 0;
        if (!absl::SimpleAtoi(b, &v)) {
          std::cerr << "kvtier-bench replay: --budgets: '" << std::string(b)
                    << "' is not an integer\n";
          return 2;
        }
        po.budgets.push_back(v);
      }
      return RunPolicies(po, json, out);
    }
    if (!connect.empty()) {
      if (transport != "shm" && transport != "grpc") {
        std::cerr << "kvtier-bench replay: --transport must be shm or grpc\n";
        return 2;
      }
      return RunReplayConnected(
          ro, connect, client_options,
          transport == "grpc" ? kvtier::Transport::kGrpc : kvtier::Transport::kShm, json, out);
    }
    return RunReplay(ro, json, out);
  }
  if (!kvtier::ParseDType(dtype, &ao.geometry.dtype)) {
    std::cerr << "kvtier-bench: --dtype must be fp16, bf16 or fp32 (got " << dtype << ")\n";
    return 2;
  }
  if (!kvtier::ParseDeviceKind(backend, &ao.backend)) {
    std::cerr << "kvtier-bench: --backend must be cpu, cuda or auto (got " << backend << ")\n";
    return 2;
  }
  ao.cold = !no_cold;
  ao.evict_bytes = evict_mib * (int64_t{1} << 20);
  return RunAttention(ao, json, out);
}
