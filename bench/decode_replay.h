// `kvtier-bench decode`'s replay workload: the trace-driven evaluator of retrieval modes (full,
// speculative per τ, sync, drop). One decode trace (a synthetic one, or a trace file:
// docs/trace-format.md) is fed through one Retriever per mode, in lockstep, on one backend. Steps
// before the step range are decoded too (the KV cache and the modes' state must grow) but neither
// timed nor scored. Per mode, over the steps in range, it reports:
//   - attn_mass_recall_pages / attn_mass_recall_tokens: how much of the exact attention's
//     top-budget mass the working set held, over the heaviest budget/page_size pages and
//     over the heaviest budget tokens (engine/eval_metrics.h AttentionMassRecall), mean over
//     query heads, sampled layers (--mass-layers) and steps;
//   - rel_error: ‖out − out_full‖ / ‖out_full‖ of the attention output against full mode
//     (which is always run: it is the reference), mean over layers and steps;
//   - correction_rate: corrected / checked KV heads (speculative modes);
//   - layers: the four above per replayed layer (mass recall only on sampled layers);
//   - recall_bytes_per_step: recalled K+V bytes per decode step (all layers);
//   - critical_path_us_per_step: what the engine thread waits for per decode step (all
//     layers): append, BeginStep, attention up to its output, EndStep's launch; averaged
//     over the unprofiled steps (critical_path_us: their median, p10/p90, min/max). The
//     background work a step leaves (speculative mode's selection and recall) is drained
//     after each step and mode outside this timer, so it is not in this figure; on the cpu
//     backend that work runs on the same cores as the next step, so this flatters
//     speculative mode;
//   - wall_us_per_step / wall_us (median, p10/p90, min/max): wall time per decode step from
//     its first append to the end of that drain, i.e. the critical path plus the background
//     work the step caused (the accuracy metrics' readback comes after it, untimed);
//     drain_us_per_step is the drain alone. sync_over_speculative_wall (medians) is the
//     ratio to quote; sync_over_speculative_critical_path (means) is the critical path's;
//   - select_us / recall_us / attention_us per step: the split, measured on separate
//     profiled steps (every phase synchronised), so it shows cost, not overlap.
// Not thread-safe; one replay per call.
#ifndef KVTIER_BENCH_DECODE_REPLAY_H_
#define KVTIER_BENCH_DECODE_REPLAY_H_

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/report.h"
#include "bench/trace.h"
#include "kernels/backend.h"
#include "kvtier/client.h"
#include "kvtier/sequence.h"

namespace kvtier::bench {

// ReplayBenchOptions::layers / mass_layers: every layer (of the trace / of the replayed).
inline constexpr int32_t kEveryLayer = -1;
// The synthetic trace's default of ReplayBenchOptions::layers (each layer costs a host
// tier per mode).
inline constexpr int32_t kDefaultSyntheticLayers = 4;

// An explicit working-set split, in pages per layer (SequenceOptions' sink/selected/recent).
struct ReplayBudgetPages {
  int32_t sink = 0;      // ≥ 0
  int32_t selected = 0;  // ≥ 0
  int32_t recent = 1;    // ≥ 1: it holds the page being filled
};

struct ReplayBenchOptions {
  std::string trace_path;           // empty: the synthetic trace below
  SyntheticTraceOptions synthetic;  // geometry, context, steps, query process, seed
  // Replay the first N layers of the trace; kEveryLayer (or 0) = all of them. Unset:
  // kDefaultSyntheticLayers of the synthetic trace, all layers of a trace file.
  std::optional<int32_t> layers;
  // Working set per layer, in tokens. Without `pages` it is split as
  // SequenceOptions::SetBudgetTokens splits it and must be a positive multiple of 4 pages. With `pages` it is their sum
  // times the page size: 0 here takes that; any other value must equal it.
  int32_t budget_tokens = kDefaultBudgetTokens;
  std::optional<ReplayBudgetPages> pages;
  // Decode steps scored and timed: [step_begin, step_end) of the trace's; step_end < 0 =
  // the trace's last step. REQUIRES for a replay: 0 ≤ step_begin < step_end ≤ steps.
  int32_t step_begin = 0;
  int32_t step_end = -1;
  std::vector<float> taus = {
      kDefaultCorrectionThreshold};  // speculative mode per τ; the first is "speculative"
  bool sync = true;                  // also run sync mode
  bool drop = true;                  // also run drop mode (sinks + sliding window, no host tier)
  RecallStrategy recall = RecallStrategy::kAuto;
  // Replayed layers (evenly spaced) whose attention mass recall is measured: 0 = none,
  // kEveryLayer = all. Each costs exact attention over the context per step on the host.
  int32_t mass_layers = 4;
  int32_t profile_steps = 4;  // trailing steps of the range run with profiling for the split
  DeviceKind backend = DeviceKind::kCpu;
  int threads = 0;  // cpu backend threads; 0 = all
  // When set, the modes with a host tier (speculative, sync) run the sequence of a Session
  // this opens instead of a local sequence with a private host tier: the demo engine opens
  // kvtierd Sessions here (SHM: a local sequence over the daemon's arena; GRPC: a remote
  // one). Full and drop modes stay local. `name` is the mode's report name.
  std::function<absl::StatusOr<std::unique_ptr<Session>>(const std::string& name, const Geometry& g,
                                                         const SequenceOptions& ro, Device& device)>
      open_session;
};

// Opens the trace of a replay: the file at `path`, or the synthetic one when it is empty;
// *g is its geometry cut to the first `layers` layers (0 or kEveryLayer: all).
// INVALID_ARGUMENT for layers out of range; the trace's own errors otherwise.
absl::Status OpenReplayTrace(const std::string& path, const SyntheticTraceOptions& synthetic,
                             int32_t layers, std::unique_ptr<TraceSource>* trace, Geometry* g);

// One mode's timing samples behind the report's spreads, one per timed step (scored and
// unprofiled), in step order: µs.
struct ReplayModeTimes {
  std::string name;  // the report's mode name: "full", "speculative", ...
  std::vector<double> critical_us, wall_us, drain_us;
};

// Runs the replay, writing a human-readable table to `log`; returns
// {"modes": {"speculative": {...}, "sync": {...}, "full": {...}, ...}, ...}
// (docs/trace-format.md lists the keys), and when `times` is not null fills it with every
// mode's samples (for callers that aggregate several replays). INVALID_ARGUMENT for
// inconsistent options, naming the command-line flag and the limit (a budget the
// default split cannot express, a budget over the trace's prefill tokens, a step
// range outside the trace, ...); the backend's error, prefixed with "--backend", when it
// cannot be created (UNIMPLEMENTED for cuda in a build without CUDA); the trace's and the
// sequences' errors otherwise.
absl::StatusOr<JsonObject> RunReplayBench(const ReplayBenchOptions& o, std::ostream& log,
                                          std::vector<ReplayModeTimes>* times = nullptr);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_DECODE_REPLAY_H_
