// Decode traces: the input of the trace-driven evaluator (`kvtier-bench decode`'s replay
// workload). A trace is one sequence's prefill followed by decode steps, per layer: the
// prefill's K and V, and for every step the query and the new token's K and V. The query of
// step t attends over the prefill and the tokens of steps 0..t (its own included).
//
// Traces are large (Llama-3.1-8B at 32K tokens: 4 GiB of prefill), so a TraceSource is
// lazy: it produces one layer's prefill or one (step, layer) record on request, and never
// holds the whole trace. Two sources exist: a synthetic one (structure like a real decode
// phase, deterministic from a seed) and a trace file (docs/trace-format.md), which
// WriteTraceFile produces from any source.
//
// A TraceSource is not thread-safe (sources keep caches): use one per thread.
#ifndef KVTIER_BENCH_TRACE_H_
#define KVTIER_BENCH_TRACE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/geometry.h"

namespace kvtier::bench {

// Limits of a trace, so every byte offset of a trace file fits int64 with room to spare.
inline constexpr int32_t kMaxTracePrefillTokens = 1 << 24;
inline constexpr int32_t kMaxTraceSteps = 1 << 24;

class TraceSource {
 public:
  virtual ~TraceSource() = default;

  // A validated geometry: layers, Hq, Hkv, d, page size and the dtype of every tensor.
  virtual const Geometry& geometry() const = 0;
  virtual int32_t prefill_tokens() const = 0;  // T ≥ 1
  virtual int32_t num_steps() const = 0;       // N ≥ 0

  // Replaces *k and *v with the prefill K and V of `layer`, NHD [T][Hkv][d] in
  // geometry().dtype (bytes). OUT_OF_RANGE for a layer outside [0, L); DATA_LOSS or
  // another code when the underlying storage fails.
  virtual absl::Status Prefill(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) = 0;

  // Replaces *q with the query [Hq][d] of decode step `step` of `layer`, and *k, *v with
  // the new token's key and value [Hkv][d] (the token at position T + step). OUT_OF_RANGE
  // for a step outside [0, N) or a layer outside [0, L).
  virtual absl::Status Step(int32_t step, int32_t layer, std::vector<uint8_t>* q,
                            std::vector<uint8_t>* k, std::vector<uint8_t>* v) = 0;
};

// The synthetic decode trace. Per (layer, KV head) there are `num_topics` latent unit
// directions ("topics") and a sink direction. Scaled logits q·k/√d of a query are about:
//   - sink_logit (× U(0.7, 1) per token) for the tokens of page 0 (attention sinks);
//   - heavy_logit (× U(0.5, 1)) for the tokens of the heavy pages of the topic that
//     dominates the query now; less, and varying, for the other topics' heavy pages;
//   - recent_logit for the query's own token, decaying over ~2·recent_tokens of age;
//   - topic_logit (× U(0, 1)) for every other token whose background topic is the
//     dominant one: a prefill page has a random background topic, a decode token the topic
//     that dominated when it was generated (so pages written during decode can matter later);
//   - on top of all of these, noise: N(0, key_noise²).
// Queries follow an autoregressive process whose consecutive cosine is step_cosine on
// average, and the dominant topic of each KV head jumps to another with probability
// jump_probability per step (the query group of a KV head jumps together). Values are
// N(0, 1). Every element is a pure function of (seed, layer, position, head), except that
// the query process of a layer is iterated from step 0 (cached, so reading steps in order
// is O(1) per step). The defaults give Llama-3.1-8B at 32K tokens a decode phase in which
// the best 2048 tokens hold about 96 % of the attention mass. docs/trace-format.md
// describes the model in full.
struct SyntheticTraceOptions {
  Geometry geometry = Llama31_8B();
  int32_t prefill_tokens = 32768;
  int32_t num_steps = 64;
  int32_t num_topics = 8;              // per KV head, in [1, min(64, d − 2)]
  double heavy_page_fraction = 0.025;  // of the full prefill pages, per KV head, in [0, 0.5]
  float sink_logit = 10.0f;            // logit boosts, each in [0, 20]
  float heavy_logit = 9.5f;
  float recent_logit = 7.5f;
  float topic_logit = 4.0f;
  int32_t recent_tokens = 32;      // recency decay length (tokens), ≥ 1
  float key_noise = 1.0f;          // std of the noise logits, in [0, 10]
  double step_cosine = 0.95;       // mean cos(q_t, q_{t−1}) without jumps, in [0.55, 1]
  double jump_probability = 0.02;  // per step and KV head, in [0, 1]
  uint64_t seed = 1;
};

// INVALID_ARGUMENT naming the first option out of range (geometry included).
absl::StatusOr<std::unique_ptr<TraceSource>> MakeSyntheticTrace(const SyntheticTraceOptions& o);

// Ground truth of the synthetic trace: the dominant topic of (layer, kv_head) at each step,
// [num_steps] indices in [0, num_topics). A change between consecutive steps is a jump.
absl::StatusOr<std::vector<int32_t>> SyntheticDominantTopics(const SyntheticTraceOptions& o,
                                                             int32_t layer, int32_t kv_head);

// Opens a trace file (docs/trace-format.md). Errors: NOT_FOUND (no such file), DATA_LOSS
// (truncated, or its size is not the one the header implies), INVALID_ARGUMENT (bad magic,
// header or geometry), UNIMPLEMENTED (a format version this build does not read). The
// source reads with pread on demand; it keeps the file open until destroyed.
absl::StatusOr<std::unique_ptr<TraceSource>> OpenTraceFile(const std::string& path);

// Writes all of `src` to `path` (prefill layer by layer, then steps), through a temporary
// file renamed into place, so `path` never holds a partial trace. Returns the first error of
// `src` or of the file system; INVALID_ARGUMENT when src's geometry or sizes are invalid.
absl::Status WriteTraceFile(TraceSource& src, const std::string& path);

// Statistics of a trace, computed on the host in float/double, for tests and reports.
//
// Element t − 1 is the mean over query heads of cos(q_t, q_{t−1}) of `layer`, t ∈ [1, N).
absl::StatusOr<std::vector<double>> StepCosines(TraceSource& src, int32_t layer);

struct TopBudgetMass {
  double tokens = 0;  // share of the softmax mass in the budget's heaviest tokens
  double pages = 0;   // share in the budget / page_size heaviest pages (oracle page top-k)
};
// Exact softmax attention of the query of (step, layer) over the prefill and steps 0..step:
// mean over query heads of the mass the best `budget_tokens` tokens (and pages) hold. Reads
// the layer's whole prefill and steps 0..step (slow at full size: seconds per call).
// INVALID_ARGUMENT for budget_tokens < page_size.
absl::StatusOr<TopBudgetMass> MeasureTopBudgetMass(TraceSource& src, int32_t step, int32_t layer,
                                                   int32_t budget_tokens);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_TRACE_H_
