#include "tests/client/session_trace.h"

#include <cmath>
#include <cstring>
#include <random>

#include "core/status.h"

namespace kvtier::testing {

SyntheticTrace::SyntheticTrace(const TraceOptions& o) : o_(o) {
  const Geometry& g = o.geometry;
  token_bytes_ = static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  q_bytes_ = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  const int64_t per_token = int64_t{g.num_kv_heads} * g.head_dim;
  const int64_t per_q = int64_t{g.num_q_heads} * g.head_dim;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    k_.emplace_back(g.dtype, per_token * total_tokens());
    v_.emplace_back(g.dtype, per_token * total_tokens());
    k_.back().FillNormal(rng());
    v_.back().FillNormal(rng());
    TypedBuffer q(g.dtype, per_q * o.steps);
    std::vector<float> cur(static_cast<size_t>(per_q));
    for (int32_t s = 0; s < o.steps; ++s) {
      const bool jump = s == 0 || (o.jump_every > 0 && s % o.jump_every == 0);
      for (float& x : cur) x = jump ? normal(rng) : 0.9f * x + o.drift * normal(rng);
      for (int64_t i = 0; i < per_q; ++i) q.Set(s * per_q + i, cur[static_cast<size_t>(i)]);
    }
    q_.push_back(std::move(q));
  }
}

const void* SyntheticTrace::K(int32_t layer, int32_t token) const {
  return static_cast<const char*>(k_[static_cast<size_t>(layer)].data()) + token * token_bytes_;
}
const void* SyntheticTrace::V(int32_t layer, int32_t token) const {
  return static_cast<const char*>(v_[static_cast<size_t>(layer)].data()) + token * token_bytes_;
}
const void* SyntheticTrace::Query(int32_t layer, int32_t step) const {
  return static_cast<const char*>(q_[static_cast<size_t>(layer)].data()) + step * q_bytes_;
}

absl::Status AppendTokens(Session& s, const SyntheticTrace& t, int32_t from, int32_t to) {
  if (to <= from) return absl::OkStatus();
  for (int32_t l = 0; l < t.options().geometry.num_layers; ++l) {
    KVTIER_RETURN_IF_ERROR(s.sequence().Append(l, t.K(l, from), t.V(l, from), to - from));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<StepRecord>>> RunDecode(Session& s, const SyntheticTrace& t,
                                                               int32_t first, int32_t last) {
  const Geometry& g = t.options().geometry;
  const size_t out_bytes = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  std::vector<std::vector<StepRecord>> records;
  Sequence& seq = s.sequence();
  for (int32_t step = first; step < last; ++step) {
    const int32_t token = t.options().prefill + step;
    std::vector<StepRecord>& per_layer = records.emplace_back();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const void* q = t.Query(l, step);
      KVTIER_RETURN_IF_ERROR(seq.Append(l, t.K(l, token), t.V(l, token), 1));
      StepRecord r;
      r.output.resize(out_bytes);
      r.lse.resize(static_cast<size_t>(g.num_q_heads));
      KVTIER_RETURN_IF_ERROR(seq.Decode(l, q, r.output.data(), r.lse.data()));
      // The output (and the step's record) are written by the sequence's streams.
      KVTIER_RETURN_IF_ERROR(seq.Wait());
      r.slot_table = seq.LastStep(l).slot_table;
      per_layer.push_back(std::move(r));
    }
  }
  return records;
}

std::vector<uint8_t> TraceHostPage(const SyntheticTrace& trace, int32_t layer, int64_t page) {
  const Geometry& g = trace.options().geometry;
  const size_t heads = static_cast<size_t>(g.num_kv_heads), p = static_cast<size_t>(g.page_size);
  const size_t row = static_cast<size_t>(g.head_dim) * g.element_bytes();
  std::vector<uint8_t> out(heads * 2 * p * row);
  for (size_t h = 0; h < heads; ++h) {
    for (size_t t = 0; t < p; ++t) {
      const auto token = static_cast<int32_t>(static_cast<size_t>(page) * p + t);
      const auto* k = static_cast<const uint8_t*>(trace.K(layer, token)) + h * row;
      const auto* v = static_cast<const uint8_t*>(trace.V(layer, token)) + h * row;
      std::memcpy(&out[((h * 2 + 0) * p + t) * row], k, row);
      std::memcpy(&out[((h * 2 + 1) * p + t) * row], v, row);
    }
  }
  return out;
}

}  // namespace kvtier::testing
