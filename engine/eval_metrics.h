// What `kvtier-run eval` and `kvtier-bench decode` (replay) measure of one decode step: the exact
// attention of a query head over every token (the oracle), how much of the oracle's
// top-budget mass a working set holds (over tokens and over pages), and how far one
// next-token distribution is from another. docs/eval.md defines each metric.
//
// Pure functions on host arrays; thread-safe.
#ifndef KVTIER_ENGINE_EVAL_METRICS_H_
#define KVTIER_ENGINE_EVAL_METRICS_H_

#include <cstdint>
#include <span>
#include <vector>

namespace kvtier::engine {

// Softmax of scale · q·k_i over tokens i < n of KV head `kv_head` of keys [n][kv_heads][d]
// into p[n] (resized). q is one query head [d].
void AttentionProbs(const float* q, const float* k, int64_t n, int32_t kv_heads,
                    int32_t head_dim, int32_t kv_head, float scale, std::vector<float>* p);

// Attention-mass recall of a working set against the oracle.
//   tokens: T = the `budget_tokens` tokens of highest p (ties: the lower index);
//           Σ_{i ∈ T, held} p_i / Σ_{i ∈ T} p_i
//   pages:  G = the ⌈budget_tokens / page_size⌉ pages of highest mass m_j = Σ_{i ∈ page j} p_i
//           (the last page may be partial); Σ_{j ∈ G} Σ_{i ∈ j, held} p_i / Σ_{j ∈ G} m_j
// Both are in [0, 1] and 1 exactly when the working set holds all of T (resp. G); a budget
// at least the context makes T (G) everything. `held[i]` is nonzero for tokens the working
// set holds. REQUIRES: held.size() == p.size(), budget_tokens ≥ 1, page_size ≥ 1.
struct MassRecall {
  double tokens = 0;
  double pages = 0;
};
MassRecall AttentionMassRecall(std::span<const float> p, std::span<const uint8_t> held,
                               int64_t budget_tokens, int32_t page_size);

// log softmax(logits)[index].
double LogProbAt(std::span<const float> logits, int32_t index);
// KL(P ‖ Q) in nats of P = softmax(p_logits), Q = softmax(q_logits). REQUIRES: equal sizes.
double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits);
// The index of the largest logit (the lowest such index).
int32_t ArgMax(std::span<const float> logits);

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_EVAL_METRICS_H_
