// `kvtier-run eval`: how much quality each retrieval mode and policy keeps on a real model
// (docs/eval.md). Held-out text is teacher-forced through the engine: a prefill of P tokens,
// then N decode steps, each scored on the next token of the text. Every (variant, budget)
// runs its own sequence; full mode runs first and is the reference.
//
// Per run: perplexity of the text; top-1 agreement and KL divergence of the next-token
// distribution against full KV; attention-mass recall of the working set against the oracle
// (the exact attention of the run's own queries over every token, eval_metrics.h) over the
// top budget tokens and over the top budget pages, per layer and overall; correction rate;
// recalled bytes and time per token.
//
// Thread-compatible: drives the engine from the calling thread.
#ifndef KVTIER_ENGINE_EVAL_H_
#define KVTIER_ENGINE_EVAL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/generate.h"
#include "kvtier/options.h"

namespace kvtier::engine {

// One way of keeping the working set: a mode with its correction trigger and policies.
struct EvalVariant {
  std::string name;
  SequenceOptions options;  // mode, τ or trigger, policy; the budget is set per run
};

// How a budget divides into sink, selected and recent pages, as parts of the whole (recent
// gets at least one page); all zero (the default): as SequenceOptions::SetBudgetTokens splits
// it (an eighth sinks, at least 1 page; an eighth recent, 2 pages to a quarter; the rest
// selected).
struct BudgetSplit {
  int32_t sink = 0, selected = 0, recent = 0;
  bool library() const { return sink == 0 && selected == 0 && recent == 0; }
};
// Sets o's three regions for a budget of `budget_tokens` (a multiple of 4 pages).
absl::Status SetBudget(SequenceOptions& o, int32_t budget_tokens, int32_t page_size,
                       const BudgetSplit& split);

struct EvalOptions {
  int64_t prefill_tokens = 0;    // P ≥ 1
  int64_t steps = 0;             // N ≥ 1 scored decode steps; the text needs P + N + 1 tokens
  std::vector<int32_t> budgets;  // working-set tokens per layer, split as `split` says
  int32_t page_size = 32;
  BudgetSplit split;
  // Oracle recall on every k-th step (all layers and query heads); the others are timed.
  int32_t recall_every = 4;
};

struct EvalResult {
  std::string variant;
  RetrievalMode mode = RetrievalMode::kFull;
  int32_t budget_tokens = 0;  // 0: full (everything resident)
  int64_t steps = 0;
  double perplexity = 0;
  double top1_agreement = 0;  // with full KV
  double kl = 0;              // mean KL(full ‖ this), nats
  double recall_tokens = 0;   // mean attention-mass recall over the top budget tokens
  double recall_pages = 0;    // ... over the top budget pages
  std::vector<double> layer_recall_tokens, layer_recall_pages;
  int64_t recall_steps = 0;  // steps measured
  double correction_rate = 0;
  int64_t checked_heads = 0, corrected_heads = 0;
  double recalled_bytes_per_token = 0;  // all layers, decode only
  double resident_bytes = 0;            // the working set's K+V, mean over measured steps
  double ms_per_token = 0;              // over the unmeasured steps
  // Not OK: the run failed with this status and its metrics are unset; the others ran on.
  absl::Status status;
};

// (run name, steps done, steps of the run), as a run starts (0 done) and after every step.
using EvalProgress = std::function<void(const std::string&, int64_t, int64_t)>;

// Runs full mode, then every variant at every budget, in-process: one result per run, full
// mode's first. A variant's run that fails is a result with its status (the other runs go
// on); full mode's failure fails the eval, since it is every run's reference. INVALID_ARGUMENT
// for a text shorter than P + N + 1 tokens, a context past the model's, or a budget that is
// not a positive multiple of 4 pages or is not below the context (naming the option).
absl::StatusOr<std::vector<EvalResult>> RunEval(Engine& engine, const std::vector<int32_t>& ids,
                                                const EvalOptions& options,
                                                const std::vector<EvalVariant>& variants,
                                                const EvalProgress& progress = {});

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_EVAL_H_
