// `kvtier-bench tier`: the cold tier's demote and promote throughput and per-page latency,
// against plain Redis and the host tier's recall, in one run.
//
// The cluster: one started for the run on loopback (tests/testutil/redis_cluster_process.h:
// --masters, --replicas per master), or an existing one (--seeds). The pages: `sessions` ×
// `layers` × `pages` pages of `page_bytes` each (default 64 KiB; a 32-token fp16 page of
// Hkv 8 × d 128 would be 128 KiB), pseudo-random bytes, distinct per page.
//
// Each repeat measures, in an order that alternates between repeats (cold first, then plain
// first) so that a drift cancels:
//   - demote:  ColdTier::Put of every page, one call per (session, layer) — one pipeline to
//              the node owning that layer's hash tag; the pages carry the repeat's generation;
//   - promote: ColdTier::Get of the same pages with that generation, one call per
//              (session, layer);
//   - plain SET / GET: the same bytes through the same RedisCluster::Pipeline, one pipeline
//              per (session, layer), with keys of the same hash-tag layout but the value the
//              bare page (no header, no checksum), so demote / plain SET and promote / plain
//              GET isolate the cost of kvtier's value format and checksums;
//   - host recall: memcpy of the same bytes, page by page, from one host buffer to another
//              (the host tier's recall copies slabs out of its arena).
// The timers cover the calls (building the commands included); every page read back is
// compared byte for byte with what was written, outside the timers. Per operation: GB/s
// (10^9 bytes/s) per repeat, reported as the median over repeats with its spread; the ratios
// demote_over_plain_set and promote_over_plain_get of the medians, target ≥ 0.8.
//
// Per-page latency: `latency_pages` single-page calls of each kind (cold Put, cold Get, plain
// SET, plain GET), interleaved, each timed alone: p50 and p99 in µs.
//
// Decode (bench/tier_decode.h): step time with host_drop = demote over a small host tier
// against a host tier that holds everything, in the same run, over the same cluster.
//
// Not thread-safe; one benchmark per call.
#ifndef KVTIER_BENCH_TIER_BENCH_H_
#define KVTIER_BENCH_TIER_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "bench/report.h"
#include "bench/tier_decode.h"

namespace kvtier::bench {

struct TierBenchOptions {
  // An existing cluster's nodes ("host:port"); empty: start one on loopback.
  std::vector<std::string> seeds;
  int32_t masters = 3;   // of the started cluster, ≥ 3 (redis-cli --cluster create)
  int32_t replicas = 0;  // per master of the started cluster, 0 or 1
  int64_t page_bytes = 65536;
  int32_t pages = 256;  // per layer
  int32_t layers = 8;
  int32_t sessions = 2;
  int32_t repeats = 5;          // timed rounds, ≥ 1
  int32_t latency_pages = 200;  // single-page calls per kind, ≥ 1
  bool decode = true;           // the decode section (bench/tier_decode.h)
  TierDecodeOptions decode_options;
};

struct TierBenchResult {
  JsonObject report;
  int64_t mismatches = 0;  // pages read back wrong or not at all, cold and plain
};

// Runs the benchmark, writing a human-readable report to `log`. INVALID_ARGUMENT for options
// out of range (naming the flag); NOT_FOUND when a cluster is to be started and redis-server
// is missing; the cluster's errors (a write that fails is an error; a read that fails or
// returns other bytes is a mismatch, counted in the result).
absl::StatusOr<TierBenchResult> RunTierBench(const TierBenchOptions& o, std::ostream& log);

// Registers the `tier` subcommand on `app`. When it is the one given on the command line, its
// callback runs the benchmark during parsing and stores the exit status in *rc: 0; 1 for a
// failure or any mismatch; 2 for options refused.
CLI::App* AddTierCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_TIER_BENCH_H_
