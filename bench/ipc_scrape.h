// The /metrics section of `kvtier-bench ipc`: what scraping kvtierd's /metrics costs the
// engines, in one run, against the same replay unscraped.
//
// It runs against the daemon `kvtier-bench ipc` started (bench/kvtierd_child.h), which serves
// metrics on an ephemeral loopback TCP port (its address learnt from Hello). This process is
// the engine: the replay (bench/decode_replay.h) runs with speculative mode only, its sequence
// an SHM session of that daemon (bench/decode_sessions.h), so its Retriever publishes telemetry
// into the daemon-owned region after every layer-step exactly as an engine's does, and the
// daemon reads that block on every scrape. The replay runs `warmup` untimed times, then
// 2 × `repeats` times in ABBA order (off on on off off on ...) so that a linear drift cancels:
//   - on:  a background thread GETs /metrics every scrape_ms for the whole replay (trace,
//          prefill and decode);
//   - off: nothing scrapes (the baseline).
// Per run the metric is the median over decode steps of the speculative session's wall time
// per step (the replay's wall_us: the step's first Append to the end of the background work
// it left, drained; full mode, the replay's reference, runs locally and is not timed here).
// Per mode: the median over runs of the per-run medians, with p10/p90 and min/max; the
// ratio without_over_with = median off / median on; the target is ≥ 0.99 (scraping costs
// the engine at most 1%). Each ABBA pair's off / on is reported too (pair_without_over_with):
// adjacent runs, so the spread shows how far the machine's noise reaches. The replay runs on
// the cpu backend, so the daemon's scrape work competes with it for the same cores.
// Every scrape must answer 200 with the session's kvtier_retrieval_steps_total sample (once
// the session is open), and after every run one more scrape must show steps × layers
// layer-steps for it; each miss is a scrape failure.
//
// Not thread-safe; one section per call.
#ifndef KVTIER_BENCH_IPC_SCRAPE_H_
#define KVTIER_BENCH_IPC_SCRAPE_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/decode_replay.h"
#include "bench/report.h"
#include "bench/trace.h"

namespace kvtier::bench {

struct IpcScrapeOptions {
  // The replay's synthetic trace: Llama-3.1-8B's shape, 8K tokens of prefill, 64 steps.
  SyntheticTraceOptions synthetic = [] {
    SyntheticTraceOptions s;
    s.prefill_tokens = 8192;
    s.num_steps = 64;
    return s;
  }();
  int32_t layers = kDefaultSyntheticLayers;      // replayed (the first N of the trace's)
  int32_t budget_tokens = kDefaultBudgetTokens;  // working set per layer, tokens
  int32_t repeats = 5;                           // timed runs per mode, ≥ 1
  int32_t warmup = 1;                            // untimed runs first (scraping), ≥ 0
  int32_t scrape_ms = 100;                       // scrape period, start to start, ms, ≥ 1
  int threads = 0;                               // cpu backend threads; 0 = all
};

// INVALID_ARGUMENT naming the flag for options out of range.
absl::Status ValidateIpcScrapeOptions(const IpcScrapeOptions& o);
// What the daemon must allow for the section: the tenant's host memory (two regions of the
// replay's session at once, plus a margin for their directories; bytes) and the tokens of
// one session.
int64_t IpcScrapeHostBytes(const IpcScrapeOptions& o);
int64_t IpcScrapeSessionTokens(const IpcScrapeOptions& o);

struct IpcScrapeResult {
  JsonObject report;
  int64_t scrape_failures = 0;  // over every run, warm-up included
};

// Runs the section against the daemon listening on `unix_socket` (its tenant `tenant`, with
// metrics on), writing a human-readable report to `log`. INVALID_ARGUMENT for options out of
// range and the replay's own refusals; FAILED_PRECONDITION when the daemon serves no metrics
// or no shared memory. Failed scrapes are not errors: they are counted in the result (and
// the report).
absl::StatusOr<IpcScrapeResult> RunIpcScrape(const IpcScrapeOptions& o,
                                             const std::string& unix_socket,
                                             const std::string& tenant, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_IPC_SCRAPE_H_
