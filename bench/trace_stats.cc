// Trace statistics (bench/trace.h): step cosines and exact top-budget attention mass, in
// plain host float/double arithmetic. Reference quality, not speed.
#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/str_format.h"
#include "bench/synthetic_kv.h"
#include "bench/trace.h"
#include "core/status.h"

namespace kvtier::bench {
namespace {

std::vector<float> ToFloats(const std::vector<uint8_t>& data, DType t) {
  std::vector<float> out(data.size() / DTypeSize(t));
  for (size_t i = 0; i < out.size(); ++i) out[i] = LoadAsFloat(data, t, static_cast<int64_t>(i));
  return out;
}

double Dot(const float* a, const float* b, int32_t d) {
  double s = 0;
  for (int32_t i = 0; i < d; ++i) s += double{a[i]} * b[i];
  return s;
}

// Sum of the `k` largest of `x` (all of them when k ≥ size); reorders x.
double SumOfLargest(std::vector<double>& x, size_t k) {
  k = std::min(k, x.size());
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(k), x.end(),
                   std::greater<>());
  double s = 0;
  for (size_t i = 0; i < k; ++i) s += x[i];
  return s;
}

}  // namespace

absl::StatusOr<std::vector<double>> StepCosines(TraceSource& src, int32_t layer) {
  const Geometry& g = src.geometry();
  const int32_t d = g.head_dim;
  std::vector<uint8_t> q, k, v;
  std::vector<float> prev, cur;
  std::vector<double> cosines;
  for (int32_t t = 0; t < src.num_steps(); ++t) {
    KVTIER_RETURN_IF_ERROR(src.Step(t, layer, &q, &k, &v));
    cur = ToFloats(q, g.dtype);
    if (t > 0) {
      double sum = 0;
      for (int32_t h = 0; h < g.num_q_heads; ++h) {
        const float* a = cur.data() + static_cast<int64_t>(h) * d;
        const float* b = prev.data() + static_cast<int64_t>(h) * d;
        sum += Dot(a, b, d) / std::sqrt(Dot(a, a, d) * Dot(b, b, d));
      }
      cosines.push_back(sum / g.num_q_heads);
    }
    prev.swap(cur);
  }
  return cosines;
}

absl::StatusOr<TopBudgetMass> MeasureTopBudgetMass(TraceSource& src, int32_t step, int32_t layer,
                                                   int32_t budget_tokens) {
  const Geometry& g = src.geometry();
  const int32_t d = g.head_dim, p = g.page_size, Hkv = g.num_kv_heads;
  if (budget_tokens < p) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "budget_tokens = %d: must hold at least one page of %d tokens", budget_tokens, p));
  }
  if (step < 0 || step >= src.num_steps()) {
    return absl::OutOfRangeError(absl::StrFormat("step %d outside [0, %d)", step, src.num_steps()));
  }
  std::vector<uint8_t> q, k, v;
  KVTIER_RETURN_IF_ERROR(src.Prefill(layer, &k, &v));
  std::vector<float> keys = ToFloats(k, g.dtype);  // [n][Hkv][d]
  for (int32_t s = 0; s <= step; ++s) {
    KVTIER_RETURN_IF_ERROR(src.Step(s, layer, &q, &k, &v));
    const std::vector<float> row = ToFloats(k, g.dtype);
    keys.insert(keys.end(), row.begin(), row.end());
  }
  const std::vector<float> query = ToFloats(q, g.dtype);
  const int64_t n = int64_t{src.prefill_tokens()} + step + 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> w(static_cast<size_t>(n)), page_mass;
  TopBudgetMass mass;
  for (int32_t qh = 0; qh < g.num_q_heads; ++qh) {
    const int32_t h = qh / g.group_size();
    const float* qv = query.data() + static_cast<int64_t>(qh) * d;
    for (int64_t t = 0; t < n; ++t) {
      w[static_cast<size_t>(t)] = scale * Dot(qv, keys.data() + (t * Hkv + h) * d, d);
    }
    const double max = *std::max_element(w.begin(), w.end());
    double total = 0;
    for (double& x : w) total += (x = std::exp(x - max));
    page_mass.assign(static_cast<size_t>((n + p - 1) / p), 0.0);
    for (size_t t = 0; t < w.size(); ++t) page_mass[t / static_cast<size_t>(p)] += w[t];
    mass.pages += SumOfLargest(page_mass, static_cast<size_t>(budget_tokens / p)) / total;
    mass.tokens += SumOfLargest(w, static_cast<size_t>(budget_tokens)) / total;
  }
  mass.tokens /= g.num_q_heads;
  mass.pages /= g.num_q_heads;
  return mass;
}

}  // namespace kvtier::bench
