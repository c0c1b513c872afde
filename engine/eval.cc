#include "engine/eval.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "engine/eval_metrics.h"

namespace kvtier::engine {
namespace {

// What the oracle needs, taken from the decoder's layer observer: every layer's keys so far
// (F32, the engine's own values before kvtier's KV dtype) and the latest decode query.
class OracleRecorder {
 public:
  OracleRecorder(const LlamaConfig& c, int64_t capacity)
      : row_(int64_t{c.kv_heads} * c.head_dim), keys_(c.layers), queries_(c.layers) {
    for (auto& k : keys_) k.resize(capacity * row_);
    for (auto& q : queries_) q.resize(int64_t{c.q_heads} * c.head_dim);
  }

  absl::Status Take(const LayerRows& r) {
    std::vector<float>& k = keys_[r.layer];
    for (int64_t i = 0; i < r.rows; ++i) {
      const int64_t pos = r.positions[i];
      if ((pos + 1) * row_ > static_cast<int64_t>(k.size())) {
        return absl::OutOfRangeError(absl::StrFormat("eval: position %d past the oracle's capacity", pos));
      }
      std::copy(r.k + i * row_, r.k + (i + 1) * row_, k.begin() + pos * row_);
    }
    if (r.rows == 1) std::copy(r.q, r.q + queries_[r.layer].size(), queries_[r.layer].begin());
    return absl::OkStatus();
  }

  const float* keys(int32_t layer) const { return keys_[layer].data(); }
  const float* query(int32_t layer) const { return queries_[layer].data(); }

 private:
  const int64_t row_;
  std::vector<std::vector<float>> keys_;     // [layer][pos][Hkv][d]
  std::vector<std::vector<float>> queries_;  // [layer][Hq][d]
};

// Sums of one run's per-step measures.
struct Accumulator {
  double nll = 0, kl = 0;
  int64_t agree = 0, steps = 0;
  std::vector<double> layer_tokens, layer_pages;
  int64_t recall_steps = 0, recall_samples_per_layer = 0;
  double resident = 0;
  double timed_seconds = 0;
  int64_t timed_steps = 0;
};

}  // namespace

absl::Status SetBudget(SequenceOptions& o, int32_t budget_tokens, int32_t page_size,
                       const BudgetSplit& split) {
  KVTIER_RETURN_IF_ERROR(o.SetBudgetTokens(budget_tokens, page_size));
  if (split.library()) return absl::OkStatus();
  const int32_t parts = split.sink + split.selected + split.recent;
  if (split.sink < 0 || split.selected < 0 || split.recent < 0 || parts <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "budget split %d:%d:%d: sink, selected and recent parts must be >= 0 with a positive sum",
        split.sink, split.selected, split.recent));
  }
  const int32_t pages = o.budget_pages();
  o.sink_pages = pages * split.sink / parts;
  o.recent_pages = std::max(1, pages * split.recent / parts);
  o.selected_pages = pages - o.sink_pages - o.recent_pages;
  if (o.selected_pages < 0) {
    o.sink_pages += o.selected_pages;
    o.selected_pages = 0;
  }
  return absl::OkStatus();
}

namespace {

// Adds the attention-mass recall of one decode step: every layer, every query head.
absl::Status AddRecall(const LlamaConfig& c, Sequence& seq, const OracleRecorder& oracle,
                       int64_t n, int64_t budget, int32_t page_size, Accumulator* acc) {
  const int32_t group = c.q_heads / c.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::vector<float> p;
  std::vector<uint8_t> held(n);
  for (int32_t l = 0; l < c.layers; ++l) {
    const StepStats st = seq.LastStep(l);
    if (st.num_slots <= 0 ||
        st.slot_table.size() != static_cast<size_t>(c.kv_heads) * st.num_slots) {
      return absl::InternalError(absl::StrFormat("eval: layer %d reported no slot table", l));
    }
    for (int32_t kh = 0; kh < c.kv_heads; ++kh) {
      std::fill(held.begin(), held.end(), 0);
      for (int32_t s = 0; s < st.num_slots; ++s) {
        const int64_t page = st.slot_table[kh * st.num_slots + s];
        if (page < 0) continue;
        const int64_t lo = page * page_size, hi = std::min<int64_t>(n, lo + page_size);
        for (int64_t i = lo; i < hi; ++i) held[i] = 1;
      }
      for (int32_t g = 0; g < group; ++g) {
        const float* q = oracle.query(l) + (int64_t{kh} * group + g) * c.head_dim;
        AttentionProbs(q, oracle.keys(l), n, c.kv_heads, c.head_dim, kh, scale, &p);
        const MassRecall r = AttentionMassRecall(p, held, std::min(budget, n), page_size);
        acc->layer_tokens[l] += r.tokens;
        acc->layer_pages[l] += r.pages;
      }
    }
  }
  acc->recall_samples_per_layer += c.q_heads;
  ++acc->recall_steps;
  return absl::OkStatus();
}

EvalResult Summarise(const EvalVariant& v, int32_t budget, const Accumulator& a,
                     const SequenceStats& before, const SequenceStats& after, int32_t layers) {
  EvalResult r;
  r.variant = v.name;
  r.mode = v.options.mode;
  r.budget_tokens = budget;
  r.steps = a.steps;
  r.perplexity = std::exp(a.nll / a.steps);
  r.top1_agreement = static_cast<double>(a.agree) / a.steps;
  r.kl = a.kl / a.steps;
  r.recall_steps = a.recall_steps;
  for (int32_t l = 0; l < layers; ++l) {
    const double n = std::max<int64_t>(1, a.recall_samples_per_layer);
    r.layer_recall_tokens.push_back(a.layer_tokens[l] / n);
    r.layer_recall_pages.push_back(a.layer_pages[l] / n);
    r.recall_tokens += r.layer_recall_tokens.back() / layers;
    r.recall_pages += r.layer_recall_pages.back() / layers;
  }
  r.checked_heads = after.checked_heads - before.checked_heads;
  r.corrected_heads = after.corrected_heads - before.corrected_heads;
  r.correction_rate =
      r.checked_heads > 0 ? static_cast<double>(r.corrected_heads) / r.checked_heads : 0.0;
  r.recalled_bytes_per_token =
      static_cast<double>(after.recalled_bytes - before.recalled_bytes) / a.steps;
  r.resident_bytes = a.recall_steps > 0 ? a.resident / a.recall_steps : 0.0;
  r.ms_per_token = a.timed_steps > 0 ? 1e3 * a.timed_seconds / a.timed_steps : 0.0;
  return r;
}

struct RunSpec {
  const EvalVariant* variant;
  int32_t budget;  // 0: full
  std::string name;
};

// One (variant, budget): prefill, then N teacher-forced steps. `reference` is full mode's
// logits per step: filled when `record` (the full run), read otherwise.
absl::StatusOr<EvalResult> RunOne(Engine& engine, const std::vector<int32_t>& ids,
                                  const EvalOptions& o, const RunSpec& run, bool record,
                                  std::vector<std::vector<float>>* reference,
                                  const EvalProgress& progress) {
  const LlamaConfig& c = engine.config();
  SequenceSpec spec;
  spec.options = run.variant->options;
  spec.page_size = o.page_size;
  const int64_t context = o.prefill_tokens + o.steps;
  spec.options.max_tokens =
      static_cast<int32_t>((context + 2 * o.page_size) / o.page_size * o.page_size);
  if (run.budget > 0) {
    KVTIER_RETURN_IF_ERROR(SetBudget(spec.options, run.budget, o.page_size, o.split));
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<EngineSequence> es, EngineSequence::Open(engine, spec, nullptr));
  Sequence& seq = es->sequence();
  auto oracle = std::make_unique<OracleRecorder>(c, context + 1);
  Decoder& dec = engine.decoder();
  dec.SetLayerObserver([&](const LayerRows& r) { return oracle->Take(r); });
  struct ObserverReset {
    Decoder& d;
    ~ObserverReset() { d.SetLayerObserver({}); }
  } reset{dec};

  std::vector<int32_t> prompt(ids.begin(), ids.begin() + o.prefill_tokens);
  std::vector<float> logits;
  KVTIER_RETURN_IF_ERROR(dec.Prefill(seq, prompt, &logits));
  KVTIER_RETURN_IF_ERROR(seq.Wait());
  const SequenceStats before = seq.Stats();
  Accumulator acc;
  acc.layer_tokens.assign(c.layers, 0.0);
  acc.layer_pages.assign(c.layers, 0.0);
  if (record) reference->clear();
  const int64_t budget = run.budget > 0 ? run.budget : context + 1;
  for (int64_t t = 0; t < o.steps; ++t) {
    const bool measure = t % o.recall_every == 0;
    const absl::Time t0 = absl::Now();
    KVTIER_RETURN_IF_ERROR(dec.Step({&seq}, {ids[o.prefill_tokens + t]}, &logits));
    if (measure) {
      KVTIER_RETURN_IF_ERROR(seq.Wait());
    } else {
      acc.timed_seconds += absl::ToDoubleSeconds(absl::Now() - t0);
      ++acc.timed_steps;
    }
    const int32_t next = ids[o.prefill_tokens + t + 1];
    if (record) reference->push_back(logits);
    const std::vector<float>& ref = (*reference)[t];
    acc.nll -= LogProbAt(logits, next);
    acc.agree += ArgMax(logits) == ArgMax(ref);
    acc.kl += KlDivergence(ref, logits);
    ++acc.steps;
    if (measure) {
      const int64_t n = o.prefill_tokens + t + 1;
      KVTIER_RETURN_IF_ERROR(AddRecall(c, seq, *oracle, n, budget, o.page_size, &acc));
      acc.resident += static_cast<double>(seq.Stats().resident_bytes);
    }
    if (progress) progress(run.name, t + 1, o.steps);
  }
  KVTIER_RETURN_IF_ERROR(seq.Wait());
  const SequenceStats after = seq.Stats();
  KVTIER_RETURN_IF_ERROR(es->Close());
  return Summarise(*run.variant, run.budget, acc, before, after, c.layers);
}

absl::Status Validate(const LlamaConfig& c, const std::vector<int32_t>& ids, const EvalOptions& o) {
  if (o.prefill_tokens < 1 || o.steps < 1 || o.recall_every < 1 || o.page_size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "eval: --prefill (%d), --steps (%d), --recall-every (%d) and --page-size (%d) must be "
        "at least 1",
        o.prefill_tokens, o.steps, o.recall_every, o.page_size));
  }
  const int64_t need = o.prefill_tokens + o.steps + 1;
  if (static_cast<int64_t>(ids.size()) < need) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "eval: the text has %d tokens; --prefill %d + --steps %d needs %d", ids.size(),
        o.prefill_tokens, o.steps, need));
  }
  if (c.context > 0 && need - 1 > c.context) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "eval: --prefill %d + --steps %d = %d tokens exceeds the model's context of %d",
        o.prefill_tokens, o.steps, need - 1, c.context));
  }
  const int64_t unit = 4 * int64_t{o.page_size};
  for (int32_t b : o.budgets) {
    if (b < unit || b % unit != 0 || b >= o.prefill_tokens + o.steps) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "eval: --budgets %d: each must be a positive multiple of 4 pages (%d tokens) below "
          "the context of %d tokens",
          b, unit, o.prefill_tokens + o.steps));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<EvalResult>> RunEval(Engine& engine, const std::vector<int32_t>& ids,
                                                const EvalOptions& o,
                                                const std::vector<EvalVariant>& variants,
                                                const EvalProgress& progress) {
  KVTIER_RETURN_IF_ERROR(Validate(engine.config(), ids, o));
  EvalVariant full;
  full.name = "full";
  full.options.mode = RetrievalMode::kFull;
  std::vector<RunSpec> runs = {{&full, 0, "full"}};
  for (const EvalVariant& v : variants) {
    if (v.options.mode == RetrievalMode::kFull) continue;  // the reference, run once
    for (int32_t b : o.budgets) runs.push_back({&v, b, absl::StrCat(v.name, "@", b)});
  }
  std::vector<std::vector<float>> reference;
  std::vector<EvalResult> results;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (progress) progress(runs[i].name, 0, o.steps);  // counted even if it fails at once
    absl::StatusOr<EvalResult> r = RunOne(engine, ids, o, runs[i], i == 0, &reference, progress);
    if (r.ok()) {
      results.push_back(*std::move(r));
      continue;
    }
    // Full mode is the reference every other run is scored against.
    if (i == 0) return r.status();
    // One variant's failure is its own row: the runs already made, and those after it
    // (each a fresh sequence), still count.
    EvalResult failed;
    failed.variant = runs[i].variant->name;
    failed.mode = runs[i].variant->options.mode;
    failed.budget_tokens = runs[i].budget;
    failed.status = r.status();
    results.push_back(std::move(failed));
  }
  return results;
}

}  // namespace kvtier::engine
