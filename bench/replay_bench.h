// `kvtier-bench replay`: the trace-driven evaluator of retrieval modes (full, speculative per
// τ, sync, drop). One decode trace (a
// synthetic one, or a trace file: docs/trace-format.md) is fed through one Retriever per
// mode, in lockstep, on one backend. Per mode it reports:
//   - attn_mass_recall: the exact softmax mass on the working set's pages over the mass on
//     the exact top-budget pages (oracle page top-k), mean over query heads, sampled layers
//     and steps;
//   - rel_error: ‖out − out_full‖ / ‖out_full‖ of the attention output against full mode
//     (which is always run: it is the reference), mean over layers and steps;
//   - correction_rate: corrected / checked KV heads (speculative modes);
//   - recall_bytes_per_step: recalled K+V bytes per decode step (all layers);
//   - critical_path_us_per_step: what an engine waits for per decode step (all layers):
//     append, BeginStep, attention up to its output, EndStep's launch; background work of
//     speculative mode overlaps it. Averaged over the unprofiled steps;
//   - select_us / recall_us / attention_us per step: the split, measured on separate
//     profiled steps (every phase synchronised), so it shows cost, not overlap.
#ifndef KVTIER_BENCH_REPLAY_BENCH_H_
#define KVTIER_BENCH_REPLAY_BENCH_H_

#include <functional>
#include <memory>
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

struct ReplayBenchOptions {
  std::string trace_path;           // empty: the synthetic trace below
  SyntheticTraceOptions synthetic;  // geometry, context, steps, query process, seed
  // Replay only the first N layers (modest by default: every layer costs a host tier per
  // mode); 0 = all.
  int32_t layers = 4;
  int32_t budget_tokens = kDefaultBudgetTokens;  // working set: 1/4 sinks, 1/2 selected, 1/4 recent
  std::vector<float> taus = {
      kDefaultCorrectionThreshold};  // speculative mode per τ; the first is "speculative"
  bool sync = true;                  // also run sync mode
  bool drop = true;                  // also run drop mode (sinks + sliding window, no host tier)
  RecallStrategy recall = RecallStrategy::kAuto;
  int32_t mass_layers = 4;    // layers (evenly spaced) for attn_mass_recall
  int32_t profile_steps = 4;  // trailing steps run with profiling for the split
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
// *g is its geometry cut to the first `layers` layers (0: all). INVALID_ARGUMENT for layers
// out of range; the trace's own errors otherwise.
absl::Status OpenReplayTrace(const std::string& path, const SyntheticTraceOptions& synthetic,
                             int32_t layers, std::unique_ptr<TraceSource>* trace, Geometry* g);

// Runs the replay, writing a human-readable table to `log`; returns
// {"modes": {"speculative": {...}, "sync": {...}, "full": {...}, ...}, ...}.
// INVALID_ARGUMENT for inconsistent options (naming the option and the limit).
absl::StatusOr<JsonObject> RunReplayBench(const ReplayBenchOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_REPLAY_BENCH_H_
