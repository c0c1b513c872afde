// Test helpers: a deterministic synthetic decode trace (prefill K/V, then one token and one
// query per layer per step, the query drifting so that speculation is sometimes wrong and
// corrected) and a driver that runs a Session over it, recording what every step saw.
//
// Thread-compatible.
#ifndef KVTIER_TESTS_CLIENT_SESSION_TRACE_H_
#define KVTIER_TESTS_CLIENT_SESSION_TRACE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/client.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::testing {

struct TraceOptions {
  Geometry geometry;
  int32_t prefill = 600;  // tokens appended before the first step
  int32_t steps = 40;     // decode steps, each appending one token per layer
  uint64_t seed = 1;
  // Each step's query is 0.9·q_{t-1} + drift·N(0, 1); every `jump_every` steps it is fresh,
  // so the group cosine falls below τ and the step is corrected.
  float drift = 0.35f;
  int32_t jump_every = 6;
};

class SyntheticTrace {
 public:
  explicit SyntheticTrace(const TraceOptions& options);
  const TraceOptions& options() const { return o_; }
  int32_t total_tokens() const { return o_.prefill + o_.steps; }
  // K / V of `layer` from `token` on, NHD [.][Hkv][d].
  const void* K(int32_t layer, int32_t token) const;
  const void* V(int32_t layer, int32_t token) const;
  // The query of `layer` at decode step `step`, [Hq][d].
  const void* Query(int32_t layer, int32_t step) const;

 private:
  TraceOptions o_;
  size_t token_bytes_ = 0;
  size_t q_bytes_ = 0;
  std::vector<TypedBuffer> k_, v_;  // per layer
  std::vector<TypedBuffer> q_;      // per layer, [steps][Hq][d]
};

// What one layer-step saw.
struct StepRecord {
  std::vector<int32_t> slot_table;  // [Hkv][S] after BeginStep
  std::vector<uint8_t> output;      // [Hq][d] session dtype
  std::vector<float> lse;           // [Hq]
};

// Page `page` of `layer` as the host tier stores it: HND [Hkv][2][p][d] of the trace's K
// and V, in the trace's dtype.
std::vector<uint8_t> TraceHostPage(const SyntheticTrace& trace, int32_t layer, int64_t page);

// Appends tokens [from, to) of every layer.
absl::Status AppendTokens(Session& s, const SyntheticTrace& t, int32_t from, int32_t to);
// Runs the decode steps [first, last): per step and layer, Append one token, BeginStep,
// Attend, EndStep. Returns the records, [step][layer].
absl::StatusOr<std::vector<std::vector<StepRecord>>> RunDecode(Session& s, const SyntheticTrace& t,
                                                               int32_t first, int32_t last);

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLIENT_SESSION_TRACE_H_
