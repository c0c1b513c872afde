// `kvtier-bench decode`'s policies workload: the policy sweep (docs/architecture.md#policies). One
// decode trace (the synthetic one by default, or a trace file) is replayed through one Retriever
// per (policy, budget), each on its own, and every run is scored against full mode (all KV
// resident, the reference) on
//   - memory: the working set's resident K+V bytes (SequenceStats::resident_bytes) after
//     each measured step, mean over the steps, also as a fraction of full mode's at that
//     step (all KV of the sequence);
//   - rel_error: ‖out − out_full‖ / ‖out_full‖ of the attention output per (step, layer):
//     mean, p95 and max over the replayed layers and measured steps;
//   - budget changes and evicted head-pages (the policies' decisions).
//
// The prompt: the trace's prefill plus its first `observation_tokens` (w) decode steps,
// whose K/V are appended as prompt and whose queries every Retriever observes
// (ObserveQueries, positions T .. T + w − 1): the observation window XKV, KV-Compress and
// Conf-KV's ranker read. Decode is measured from trace step w on.
//
// Runs (policy names of --policy-list), each in drop mode (no host tier; sinks + recent
// window + what the policies keep) at every budget below the context:
//   window        the default policy config: sinks + sliding window (StreamingLLM), baseline
//   h2o           residency h2o (accumulated attention), baseline
//   conf-kv       budget confidence + residency attention (Conf-KV)
//   epikv         residency epiphany, signal hidden_delta (EpiKV)
//   epikv-kv      residency epiphany, signal key_variance (from the appended keys)
//   xkv           budget xkv (per layer) + residency attention
//   kv-compress   budget and residency kv_compress (per head)
// and one tiered run, `speculative+conf`: speculative mode with a host tier (all KV kept
// there, the working set recalled by query), budget confidence: what the host tier buys.
// Full mode runs once, first.
//
// Engine signals are SYNTHETIC STAND-INS (a trace has no logits or hidden states), reported
// after every step (and once for the prompt's observation tokens):
//   - logits over a vocabulary of 1024: token 0 gets 12 · (1 − min(1, drift / 0.3)), the
//     others N(0, 1) from a fixed seed per step, where drift = mean over the replayed layers
//     and query heads of 1 − cos(q_t, q_{t−1}): peaked while the queries are stable, flat
//     when they drift (the confidence budget's input);
//   - hidden_delta[l] = ‖q_l(t) − q_l(t−1)‖ over all query heads of replayed layer l, the
//     query change standing in for the hidden-state change (EpiKV's input); prefill tokens
//     report nothing (the scorer starts at the first observation token).
#ifndef KVTIER_BENCH_DECODE_POLICIES_H_
#define KVTIER_BENCH_DECODE_POLICIES_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/report.h"
#include "bench/trace.h"
#include "kernels/backend.h"
#include "offload/retriever.h"

namespace kvtier::bench {

// Every run name --policy-list accepts, in the default order.
const std::vector<std::string>& PolicyReplayNames();

struct PolicyReplayOptions {
  std::string trace_path;  // empty: the synthetic trace below
  // Modest defaults for a 2-core machine (the sweep runs ~37 Retrievers one after another).
  SyntheticTraceOptions synthetic = [] {
    SyntheticTraceOptions s;
    s.prefill_tokens = 8192;
    s.num_steps = 40;
    return s;
  }();
  int32_t layers = 4;              // replay the first N layers; 0 = all
  int32_t observation_tokens = 8;  // w: trace steps appended as the prompt's tail
  std::vector<int32_t> budgets = {512, 1024, 2048, 4096};  // tokens; those ≥ context skipped
  std::vector<std::string> policies = PolicyReplayNames();
  int32_t vocab = 1024;                           // synthetic logits
  RecallStrategy recall = RecallStrategy::kAuto;  // speculative+conf
  DeviceKind backend = DeviceKind::kCpu;
  int threads = 0;        // cpu backend threads; 0 = all
  std::string plot_path;  // non-empty: write the memory / error plot (PNG) here
};

// Runs the sweep, writing the table to `log`; returns {"bench": "policies", ...,
// "runs": [{"policy", "budget_tokens", "memory_bytes", "memory_fraction", "rel_error",
// "rel_error_p95", "rel_error_max", ...}, ...]}. INVALID_ARGUMENT for inconsistent options
// (naming the option and the limit); the Retrievers' and the plot writer's errors.
absl::StatusOr<JsonObject> RunPolicyReplay(const PolicyReplayOptions& o, std::ostream& log);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_DECODE_POLICIES_H_
