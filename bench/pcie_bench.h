// `kvtier-bench pcie`: what the host↔device link gives the host tier, measured on one
// backend in one run (on the cpu backend every number is a memcpy speed: a smoke run).
//
//   1. copies: pinned (registered, page-aligned) vs pageable (malloc'd) host memory, H2D and
//      D2H, for sizes min..max bytes in powers of 4; each sample enqueues a batch of copies
//      and synchronizes once. peak_h2d_gbps is the best pinned H2D of the large sizes; on a
//      GPU backend every other bandwidth is also reported as a fraction of it. On the cpu
//      backend that "peak" is a memcpy whose smaller sizes stay in cache, so the fractions
//      are null in the JSON and "n/a" in the log.
//   2. nhd_vs_hnd: the same selected (page, KV head) pairs recalled from an HND host area as
//      whole K+V slabs (one copy each) and from an NHD host area as per-token fragments
//      (one copy per token, K and V; and the same fragments as one CopyBatch).
//   3. recall: the three SlabRecaller strategies (offload/recall_strategy.h) for every
//      budget × churn, plans of random distinct host slabs into distinct working-set slots.
//   4. numa: pinned memory bound to the GPU's NUMA node vs another node (H2D and recall),
//      or "skipped" with the reason.
// Every bandwidth is the median of --iters timed samples, with their p10 and p90 (the
// JSON's <key>_p10 / <key>_p90). Optionally a PNG plot of bandwidth vs bytes per transfer.
#ifndef KVTIER_BENCH_PCIE_BENCH_H_
#define KVTIER_BENCH_PCIE_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "bench/report.h"
#include "kernels/registry.h"
#include "kvtier/geometry.h"

namespace kvtier::bench {

struct PcieBenchOptions {
  DeviceKind backend = DeviceKind::kCpu;
  int threads = 0;      // cpu backend threads; 0 = all
  int cuda_device = 0;  // cuda device ordinal
  int64_t min_bytes = 256;
  int64_t max_bytes = int64_t{64} << 20;
  // Bytes each timed sample of the copy sweep moves at least: a sample enqueues
  // max(1, sample_bytes / size) copies (at most 1024) and synchronizes once.
  int64_t sample_bytes = int64_t{16} << 20;
  int32_t iters = 5;  // timed samples per measurement (after one warm-up); the median counts
  // The transfer geometry: only num_kv_heads, head_dim, page_size and dtype matter.
  Geometry geometry = Llama31_8B();
  std::vector<int32_t> budgets = {1024, 2048, 4096};       // tokens per KV head
  std::vector<int32_t> churn_percent = {10, 25, 50, 100};  // share of the selection recalled
  int64_t host_pages = 0;    // pages of the host area; 0: 4096 on cuda, 1024 on cpu
  int32_t chunk_items = 64;  // SlabRecaller staging chunk (the Retriever's default)
  // {local, remote} NUMA nodes to compare instead of the GPU's node and another one (runs
  // even on one node or the cpu backend); empty: found from the device's PCI bus id.
  std::vector<int> numa_nodes;
  uint64_t seed = 1;
  std::string plot_path;  // empty: no plot
};

// Runs the benchmark, writing a human-readable report to `log`; returns the JSON report.
// INVALID_ARGUMENT for inconsistent options (naming the option and the limit).
absl::StatusOr<JsonObject> RunPcieBench(const PcieBenchOptions& o, std::ostream& log);

// Registers the `pcie` subcommand on `app`. When it is the one given on the command line,
// its callback runs the benchmark during parsing and stores the exit status in *rc.
CLI::App* AddPcieCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_PCIE_BENCH_H_
