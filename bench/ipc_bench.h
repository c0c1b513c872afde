// `kvtier-bench ipc`: what moving pages between an engine and kvtierd costs, in one run on
// loopback, against Redis as the peer baseline (offload services keep KV chunks in Redis).
// kvtierd runs as its own process (the binary this build made, started on a private socket
// directory and configuration, stopped at the end); this process is the engine:
//   - shm: an SHM session through the client library, as an engine drives one: Connect,
//     OpenSession (the tenant arena attached over the daemon's attach socket and mapped),
//     then the pages' tokens appended 2048 per call on a cpu device, as a chunked prefill
//     (the sequence offloads each full page into the session's region and commits it) and
//     Flush (every commit visible to the daemon, which is asked for its count afterwards).
//     shm_gbps times Append through Flush; shm_open_ms the OpenSession (the arena's attach
//     and mapping included, which the Client does once: the first run's); shm_close_ms Close
//     and the session's destruction;
//   - grpc offload / fetch: pages streamed to a GRPC session (the daemon's Retriever appends
//     and offloads them) and streamed back, over the Unix socket;
//   - unary round trip (Hello) p50 / p99 over the Unix socket and over TCP;
//   - redis SET / GET of page-sized values on a private redis-server over its Unix socket,
//     pipelined (depth --redis-pipeline);
//   - memcpy: the same bytes between two private buffers, the ceiling of any copy-in path;
//   - offload op: the shm path's data on the cpu device at its floor, the offload op alone on
//     one thread (4 pages per op, as a session's stream runs it) from the rows straight into
//     host pages: one read of K and V, one write of the HND page, the keys read again for the
//     summaries (offload_floor_gbps; floor_fraction_of_memcpy is the most shm can reach of
//     memcpy, shm_fraction_of_floor how much of that it does).
// Every throughput is the median over --repeats runs, with p10 / p90 (<key>_p10, <key>_p90).
// Page sizes 16 KiB (one head-page slab at p = 32, d = 128, fp16: Hkv = 1) and 128 KiB
// (a Llama-3.1-8B host page: Hkv = 8).
// Then, unless turned off, the /metrics section against the same daemon (bench/ipc_scrape.h):
// what a scrape every 100 ms costs a replay's decode step through an SHM session, against
// the same replay unscraped, interleaved ABBA.
#ifndef KVTIER_BENCH_IPC_BENCH_H_
#define KVTIER_BENCH_IPC_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/ipc_scrape.h"
#include "bench/report.h"

namespace kvtier::bench {

struct IpcBenchOptions {
  int64_t bytes_per_run = int64_t{128} << 20;  // data moved per throughput measurement
  int32_t repeats = 5;                         // runs per throughput (median and spread)
  int32_t unary_calls = 2000;                  // per transport
  int32_t redis_pipeline = 16;                 // SET/GET commands in flight
  bool redis = true;                           // run the Redis baseline
  std::vector<int64_t> page_bytes = {16384, 131072};
  bool scrape = true;         // run the /metrics section
  IpcScrapeOptions scraping;  // its replay and scrape period
  // The kvtierd binary; empty: kvtierd next to this executable, else daemon/kvtierd in the
  // build tree beside its bench/ directory.
  std::string kvtierd;
};

struct IpcBenchResult {
  JsonObject report;
  int64_t scrape_failures = 0;  // the /metrics section's (IpcScrapeResult)
};

// Runs everything; the human table goes to `log`. The report's top-level keys are the
// 128 KiB numbers (shm_gbps, grpc_offload_gbps, grpc_fetch_gbps, redis_set_gbps,
// redis_get_gbps, shm_open_ms, shm_close_ms, each with _p10 / _p90), with every page size
// under "pages" (the offload op's and memcpy's there too), the unary latencies, and the
// /metrics section under "scrape" (absent when turned off). INVALID_ARGUMENT naming the flag
// for options out of range; NOT_FOUND when there is no kvtierd binary (saying where it
// looked); the daemon's start-up failure with the tail of its log. Failed scrapes are not
// errors: they are counted in the result.
absl::StatusOr<IpcBenchResult> RunIpcBench(const IpcBenchOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_IPC_BENCH_H_
