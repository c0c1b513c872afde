// kvtier-bench: kvtier's benchmark driver. Each subcommand measures one thing against a
// baseline from the same run and prints a human report, or with --json one JSON object
// (the human report then goes to stderr).
//
//   kvtier-bench attention [--context N] [--batch B] [--json] ...
//   kvtier-bench devices
#include <fstream>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "bench/attention_bench.h"
#include "kernels/registry.h"

namespace {

using kvtier::BackendKind;

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

int ListDevices() {
  std::cout << "cuda backend built: " << (kvtier::CudaBackendBuilt() ? "yes" : "no")
            << ", usable cuda devices: " << kvtier::CudaDeviceCount() << "\n";
  for (BackendKind k : {BackendKind::kCpu, BackendKind::kCuda}) {
    auto b = kvtier::CreateBackend(k);
    std::cout << "  " << kvtier::BackendKindName(k) << ": "
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
  attn->add_option("--iters", ao.iters, "timed repetitions (median reported)")->capture_default_str();
  attn->add_option("--threads", ao.threads, "cpu backend threads (0 = all)")->capture_default_str();
  attn->add_option("--backend", backend, "cpu, cuda or auto")->capture_default_str();
  attn->add_option("--heavy-logit", ao.heavy_logit, "synthetic KV: logit boost of heavy pages")
      ->capture_default_str();
  attn->add_option("--heavy-pages", ao.heavy_pages, "synthetic KV: heavy pages per KV head")
      ->capture_default_str();
  attn->add_option("--seed", ao.seed)->capture_default_str();
  attn->add_flag("--json", json, "print one JSON object on stdout");
  attn->add_option("--out", out, "also write the JSON report to this file");

  auto* devices = app.add_subcommand("devices", "list the backends this build can use");

  CLI11_PARSE(app, argc, argv);
  if (*devices) return ListDevices();
  if (!kvtier::ParseDType(dtype, &ao.geometry.dtype)) {
    std::cerr << "kvtier-bench: --dtype must be fp16, bf16 or fp32 (got " << dtype << ")\n";
    return 2;
  }
  if (!kvtier::ParseBackendKind(backend, &ao.backend)) {
    std::cerr << "kvtier-bench: --backend must be cpu, cuda or auto (got " << backend << ")\n";
    return 2;
  }
  return RunAttention(ao, json, out);
}
