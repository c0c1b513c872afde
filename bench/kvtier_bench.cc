// kvtier-bench: kvtier's benchmark driver. Each subcommand measures one thing against a
// baseline from the same run and prints a human report, or with --json one JSON object
// (the human report then goes to stderr).
//
//   kvtier-bench decode [--workloads replay,step,policies] [--context N] [--steps N]
//                       [--budget B] [--tau 0.9,0.8] [--backend cuda] [--json] ...
//   kvtier-bench decode --workloads replay --trace F [--layers all] [--step-range A:B]
//                       [--sink S --selected K --recent R]   # a trace file (docs/trace-format.md)
//   kvtier-bench decode --workloads replay --connect unix:///path/kvtierd.sock  # via kvtierd
//   kvtier-bench decode --workloads step --batch 1,8 [--graphs]  # per-layer decode step times
//   kvtier-bench decode --workloads policies [--budgets 512,1024] [--policy-list window,h2o]
//   kvtier-bench ipc [--bytes N] [--kvtierd PATH] [--scrape-ms 100] [--no-scrape] [--json]
//   kvtier-bench tier [--masters 3] [--page-bytes N] [--pages N] [--json]  # cold tier vs Redis
//   kvtier-bench pcie [--backend cuda] [--json] [--plot F]   # host↔device transfers, recall
//   kvtier-bench ops [--ops REGEX] [--backends cpu-scalar,cpu,cuda] [--cold] [--json]  # the
//                    op table's cases timed per backend: decode-size ops (`_decode_`, the
//                    default), the roofline set (`_roofline_`: CPU ops vs read bandwidth)
//   kvtier-bench devices
#include <fstream>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "bench/decode_bench.h"
#include "bench/ipc_bench.h"
#include "bench/ops_bench.h"
#include "bench/pcie_bench.h"
#include "bench/tier_bench.h"
#include "kernels/registry.h"

namespace {

using kvtier::DeviceKind;

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

  bool json = false;
  std::string out;

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

  int pcie_rc = 0, decode_rc = 0;
  auto* pcie = kvtier::bench::AddPcieCommand(app, &pcie_rc);
  auto* decode = kvtier::bench::AddDecodeCommand(app, &decode_rc);
  int ops_rc = 0;
  auto* ops = kvtier::bench::AddOpsCommand(app, &ops_rc);
  int tier_rc = 0;
  auto* tier = kvtier::bench::AddTierCommand(app, &tier_rc);

  auto* devices = app.add_subcommand("devices", "list the backends this build can use");

  CLI11_PARSE(app, argc, argv);
  if (*devices) return ListDevices();
  if (*pcie) return pcie_rc;
  if (*decode) return decode_rc;
  if (*ops) return ops_rc;
  if (*tier) return tier_rc;
  io.redis = !no_redis;
  io.scrape = !no_scrape;
  return RunIpc(io, json, out);
}
