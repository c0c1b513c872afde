// `kvtier-bench scrape`: what scraping kvtierd's /metrics costs the engines, in one run.
//
// kvtierd runs as its own process (bench/kvtierd_child.h) with metrics on an ephemeral
// loopback TCP port (its address learnt from Hello). This process is the engine: the replay
// (bench/replay_bench.h) runs with speculative mode only, its sequence an SHM session of that
// daemon (bench/replay_session.h), so its Retriever publishes telemetry into the daemon-owned
// region after every layer-step exactly as an engine's does, and the daemon reads that block
// on every scrape. The replay runs `warmup` untimed times, then 2 × `repeats` times in ABBA
// order (off on on off off on ...) so that a linear drift cancels:
//   - on:  a background thread GETs /metrics every scrape_ms for the whole replay (trace,
//          prefill and decode);
//   - off: nothing scrapes.
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
// Not thread-safe; one benchmark per call.
#ifndef KVTIER_BENCH_SCRAPE_BENCH_H_
#define KVTIER_BENCH_SCRAPE_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "bench/replay_bench.h"
#include "bench/report.h"
#include "bench/trace.h"

namespace kvtier::bench {

struct ScrapeBenchOptions {
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
  // The kvtierd binary; empty: as `kvtier-bench ipc` finds it (bench/kvtierd_child.h).
  std::string kvtierd;
};

struct ScrapeBenchResult {
  JsonObject report;
  int64_t scrape_failures = 0;  // over every run, warm-up included
};

// Runs the benchmark, writing a human-readable report to `log`. INVALID_ARGUMENT for
// options out of range (naming the flag) and the replay's own refusals; NOT_FOUND when
// there is no kvtierd binary; FAILED_PRECONDITION when the daemon serves no metrics or no
// shared memory; the daemon's start-up failure with the tail of its log. Failed scrapes are
// not errors: they are counted in the result (and the report).
absl::StatusOr<ScrapeBenchResult> RunScrapeBench(const ScrapeBenchOptions& o, std::ostream& log);

// Registers the `scrape` subcommand on `app`. When it is the one given on the command line,
// its callback runs the benchmark during parsing and stores the exit status in *rc: 0; 1 for
// a failure or any failed scrape; 2 for options refused.
CLI::App* AddScrapeCommand(CLI::App& app, int* rc);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_SCRAPE_BENCH_H_
