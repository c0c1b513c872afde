#include "engine/eval_metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvtier::engine {
namespace {

// Indices of the `k` largest values (ties: the lower index), in no particular order.
std::vector<int64_t> TopIndices(std::span<const double> v, int64_t k) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min<int64_t>(k, static_cast<int64_t>(v.size()));
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return v[a] != v[b] ? v[a] > v[b] : a < b;
  });
  idx.resize(k);
  return idx;
}

double LogSumExp(std::span<const float> x) {
  const float mx = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (float v : x) s += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(s);
}

}  // namespace

void AttentionProbs(const float* q, const float* k, int64_t n, int32_t kv_heads,
                    int32_t head_dim, int32_t kv_head, float scale, std::vector<float>* p) {
  p->resize(n);
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float* ki = k + (i * kv_heads + kv_head) * head_dim;
    float dot = 0;
    for (int32_t j = 0; j < head_dim; ++j) dot += q[j] * ki[j];
    (*p)[i] = dot * scale;
    mx = std::max(mx, (*p)[i]);
  }
  double sum = 0;
  for (float& v : *p) {
    v = std::exp(v - mx);
    sum += v;
  }
  for (float& v : *p) v = static_cast<float>(v / sum);
}

MassRecall AttentionMassRecall(std::span<const float> p, std::span<const uint8_t> held,
                               int64_t budget_tokens, int32_t page_size) {
  const int64_t n = static_cast<int64_t>(p.size());
  MassRecall r;
  std::vector<double> mass(p.begin(), p.end());
  double top = 0, got = 0;
  for (int64_t i : TopIndices(mass, budget_tokens)) {
    top += mass[i];
    if (held[i]) got += mass[i];
  }
  r.tokens = top > 0 ? got / top : 1.0;
  const int64_t pages = (n + page_size - 1) / page_size;
  std::vector<double> page_mass(pages, 0.0), page_held(pages, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    page_mass[i / page_size] += p[i];
    if (held[i]) page_held[i / page_size] += p[i];
  }
  top = got = 0;
  for (int64_t j : TopIndices(page_mass, (budget_tokens + page_size - 1) / page_size)) {
    top += page_mass[j];
    got += page_held[j];
  }
  r.pages = top > 0 ? got / top : 1.0;
  return r;
}

double LogProbAt(std::span<const float> logits, int32_t index) {
  return static_cast<double>(logits[index]) - LogSumExp(logits);
}

double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  const double lp = LogSumExp(p_logits), lq = LogSumExp(q_logits);
  double kl = 0;
  for (size_t i = 0; i < p_logits.size(); ++i) {
    const double a = p_logits[i] - lp, b = q_logits[i] - lq;
    kl += std::exp(a) * (a - b);
  }
  return std::max(0.0, kl);
}

int32_t ArgMax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace kvtier::engine
