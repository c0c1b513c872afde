// `kvtier-bench decode`'s step workload: the per-layer decode step time of the Retriever at long
// context, side by side in one run and on one backend, per decode batch size:
//
//   dense        DenseAttention over the full KV, resident on the backend (the full-KV
//                baseline): one batched launch per layer;
//   resident     SparseAttention over a working set of budget/p slots per sequence with no
//                selection or recall at all (the ideal the Retriever approaches): one
//                batched launch per layer; resident_per_seq: one batch-1 launch per sequence
//                and layer, as the Retriever's Attend issues them;
//   speculative  one Retriever per sequence (all on one compute stream), speculative mode:
//                per layer and sequence Append(1 token), BeginStep, Attend, EndStep, so the
//                background recall of layer l overlaps the other layers' work;
//   sync         the same in sync mode (selection and recall before attention).
//
// A decode step runs every layer; the compute stream is synchronised before the first timed
// step and at the end of each step (host wall clock), and the per-layer time is the wall
// time over steps × layers (the median, p10/p90 and min/max of the per-step times are
// reported too). Background work overlaps the following steps, as in an engine; what the
// last timed step leaves is waited for inside the timer, so no work the timed steps started
// is left out. The targets speculative / resident ≤ 1.15 and sync / speculative ≥ 5 are GPU
// targets: judged only on a GPU backend (on the cpu backend the report says they do not
// apply and the JSON has null for them). Queries drift:
// q_t = |q|·normalize(q̂_{t−1} + noise) with cos(q_t, q_{t−1}) ≈ step_cosine per query head,
// and now and then (jump_probability per step, layer, sequence and KV head) a KV head's
// query group jumps to fresh directions, so speculative correction happens sometimes.
#ifndef KVTIER_BENCH_DECODE_STEP_H_
#define KVTIER_BENCH_DECODE_STEP_H_

#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/report.h"
#include "kernels/registry.h"
#include "kvtier/geometry.h"
#include "offload/retriever.h"

namespace kvtier::bench {

struct StepBenchOptions {
  // num_layers is the number of layers per decode step (--layers).
  Geometry geometry = [] {
    Geometry g = Llama31_8B();
    g.num_layers = 4;
    return g;
  }();
  int32_t context = 32768;                       // prefill tokens per sequence and layer
  int32_t budget_tokens = kDefaultBudgetTokens;  // working set (SequenceOptions::SetBudgetTokens)
  std::vector<int32_t> batches = {1, 8};         // decode batch sizes, each measured in turn
  int32_t steps = 32;                            // timed decode steps
  int32_t warmup = 4;                            // untimed decode steps before them
  double step_cosine = 0.95;                     // cos(q_t, q_{t−1}) per query head without jumps
  double jump_probability = 0.02;                // per step, layer, sequence and KV head
  float tau = kDefaultCorrectionThreshold;       // correction threshold (speculative mode)
  RecallStrategy recall = RecallStrategy::kAuto;
  bool sync = true;  // measure sync mode
  // Speculative sequences capture their layer-steps as graphs (SequenceOptions::
  // capture_graphs; only with zero-copy recall, which --recall zero_copy forces).
  bool graphs = false;
  DeviceKind backend = DeviceKind::kCpu;
  int threads = 0;  // cpu backend threads; 0 = all
  uint64_t seed = 1;
};

// Runs the benchmark, writing a human-readable report to `log`; returns the JSON report.
// INVALID_ARGUMENT for inconsistent options (naming the option and the limit);
// RESOURCE_EXHAUSTED when the run would need more host memory than is available.
absl::StatusOr<JsonObject> RunStepBench(const StepBenchOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_DECODE_STEP_H_
