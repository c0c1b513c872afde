// `kvtier-bench attention`: decode attention at long context, dense over the full KV vs
// sparse over a working set chosen by the scoring path (summaries → page scores → top-k →
// recall), in one process on one backend, with the ratio and the sparse output's error.
//
// Every phase is timed twice, named as such: warm, on the same buffers every iteration (a
// working set that fits in the last-level cache is then read from it), and cold, with a
// buffer larger than the cache streamed through it before each iteration, outside the timer
// (cpu backend: read; cuda: a device memset, which goes through L2). A decode step reads a
// layer's working set once, after every other layer's, so the cold times are the ones a
// real step sees; dense attention over a KV larger than the cache is cold either way.
#ifndef KVTIER_BENCH_ATTENTION_BENCH_H_
#define KVTIER_BENCH_ATTENTION_BENCH_H_

#include <cstdint>
#include <ostream>

#include "absl/status/statusor.h"
#include "bench/report.h"
#include "kernels/registry.h"
#include "kvtier/geometry.h"

namespace kvtier::bench {

struct AttentionBenchOptions {
  Geometry geometry = Llama31_8B();  // one layer of it is measured
  int32_t batch = 1;
  int32_t context = 32768;   // tokens per sequence
  int32_t sink_pages = 16;
  int32_t selected_pages = 32;
  int32_t recent_pages = 16;  // includes the partial page when context % page_size != 0
  int32_t iters = 5;          // timed repetitions; the median (and min, max) is reported
  bool cold = true;           // time the cold variants too
  int64_t evict_bytes = 0;    // cold: bytes streamed before each iteration;
                              // 0 = max(2 × last-level cache, 256 MiB)
  DeviceKind backend = DeviceKind::kCpu;
  int threads = 0;            // cpu backend threads; 0 = all
  float heavy_logit = 8.0f;
  int32_t heavy_pages = 24;
  uint64_t seed = 1;
};

// Runs the benchmark, writing a human-readable report to `log`; returns the JSON report.
// INVALID_ARGUMENT for inconsistent options (naming the option and the limit).
absl::StatusOr<JsonObject> RunAttentionBench(const AttentionBenchOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_ATTENTION_BENCH_H_
