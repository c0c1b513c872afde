// `kvtier-bench ipc`: what moving pages between an engine and kvtierd costs, in one run on
// loopback, against Redis as the peer baseline (offload services keep KV chunks in Redis):
//   - shm: page write + commit into the tenant arena mapped through the attach socket (the
//     SHM session's data path: copy the page into its slot, publish the generation stamp);
//   - grpc offload / fetch: pages streamed to a GRPC session (the daemon's Retriever appends
//     and offloads them) and streamed back, over the Unix socket;
//   - unary round trip (Hello) p50 / p99 over the Unix socket and over TCP;
//   - redis SET / GET of page-sized values on a private redis-server over its Unix socket,
//     pipelined (depth --redis-pipeline).
// Page sizes 16 KiB (one head-page slab at p = 32, d = 128, fp16: Hkv = 1) and 128 KiB
// (a Llama-3.1-8B host page: Hkv = 8). The daemon runs in this process on a private socket.
#ifndef KVTIER_BENCH_IPC_BENCH_H_
#define KVTIER_BENCH_IPC_BENCH_H_

#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/report.h"

namespace kvtier::bench {

struct IpcBenchOptions {
  int64_t bytes_per_run = int64_t{128} << 20;  // data moved per throughput measurement
  int32_t repeats = 3;                         // best of (throughput), all samples (latency)
  int32_t unary_calls = 2000;                  // per transport
  int32_t redis_pipeline = 16;                 // SET/GET commands in flight
  bool redis = true;                           // run the Redis baseline
  std::vector<int64_t> page_bytes = {16384, 131072};
};

// Runs everything; the human table goes to `log`. Top-level keys are the 128 KiB numbers
// (shm_gbps, grpc_offload_gbps, grpc_fetch_gbps, redis_set_gbps, redis_get_gbps), with
// every page size under "pages", and the unary latencies.
absl::StatusOr<JsonObject> RunIpcBench(const IpcBenchOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_IPC_BENCH_H_
