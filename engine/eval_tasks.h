// kvtier-run eval's retrieval tasks (docs/eval.md): does a working set keep what the model
// needs thousands of tokens back, which a drop policy loses?
//
//   niah  pass-key retrieval, RULER style: a random 5–7 digit key stated once in held-out
//         filler at a depth of the context, asked for at the end; exact-match accuracy of the
//         greedy answer per (variant, budget, context, depth). The multi-key needle states
//         four named keys and asks for one, so the working set must hold the right one.
//   copy  the loss on a held-out passage repeated `distance` tokens after its first
//         occurrence, at the end of a context-long prompt (a model that uses its context
//         copies it), per (variant, budget, distance), against the same passage's loss at its
//         first occurrence.
//
// Prompts are built with the model's own tokenizer, so the tasks run on any GGUF model
// kvtier-run loads. The model sees the context through a prefill and the question (niah)
// or the repeat (copy) through decode steps, so kvtier's selection decides what the answer
// can see; every variant starts from one recorded prefill of each prompt (PrefillRecord):
// the prompt's forward pass runs once, not once per variant.
//
// The needle strings are the ones the project's training script teaches
// (engine/model/train.py); keep the two in step.
//
// Thread-compatible: drives the engine from the calling thread.
#ifndef KVTIER_ENGINE_EVAL_TASKS_H_
#define KVTIER_ENGINE_EVAL_TASKS_H_

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/eval.h"
#include "engine/generate.h"

namespace kvtier::engine {

enum class NeedleKind : uint8_t {
  kSingle,    // " The pass key is K. Remember it. K is the pass key." ... " The pass key is"
  kMultiKey,  // four " The pass key of NAME is K." at random depths, one asked for
  // four " One of the pass keys of NAME is K." (one NAME, four keys) at random depths, all
  // asked for: right when the answer holds every key (RULER's multi-value needle)
  kMultiValue,
};
// "single", "multikey", "multivalue"
bool ParseNeedleKind(std::string_view name, NeedleKind* out);
std::string_view NeedleKindName(NeedleKind kind);

struct NeedlePrompt {
  std::vector<int32_t> context;   // BOS (when the model has one), filler and needle(s)
  std::vector<int32_t> question;  // decoded step by step, ending where the key follows
  std::string key;                // the expected answer's digits (the asked needle's)
  std::vector<std::string> keys;  // every key the answer must hold (multivalue: four)
  int64_t needle_position = 0;    // token index of the asked needle in `context`
};

// A prompt of `tokens` tokens in all (context + question) with the asked needle at `depth`
// (0: the start, 1: just before the question) of the filler, drawn from a random window of
// `filler` (token ids of held-out text). INVALID_ARGUMENT when the filler is shorter than
// the prompt needs or `tokens` cannot hold the needles and the question.
absl::StatusOr<NeedlePrompt> BuildNeedlePrompt(const Tokenizer& tok,
                                               const std::vector<int32_t>& filler, int64_t tokens,
                                               double depth, NeedleKind kind, std::mt19937_64& rng);

// The key an answer gives: its first run of digits after leading spaces (empty if none).
std::string AnswerKey(std::string_view answer);
// Whether an answer is right: its key is the prompt's (single, multikey), or every one of
// the prompt's keys is among the answer's runs of digits (multivalue).
bool AnswerIsRight(const NeedlePrompt& p, NeedleKind kind, std::string_view answer);

// The working-set budget of 1/`divisor` of a context of `context` tokens: to the nearest
// whole unit of 4 pages, at least one unit (0 when divisor <= 0: full KV).
int32_t BudgetTokens(int64_t context, int32_t divisor, int32_t page_size);

struct TaskOptions {
  std::vector<int32_t> budget_divisors = {32, 16, 8, 4};  // budgets: context / d, to 4 pages
  int32_t page_size = 32;
  BudgetSplit split;  // the budget's sink : selected : recent parts
  uint64_t seed = 1;
};

struct NiahOptions {
  TaskOptions task;
  std::vector<int64_t> contexts = {4096};  // prompt lengths (context + question) in tokens
  int32_t depths = 10;                     // evenly from 0 to 1
  int32_t trials = 3;                      // prompts per (context, depth, kind)
  std::vector<NeedleKind> kinds = {NeedleKind::kSingle, NeedleKind::kMultiKey};
  int32_t max_answer_tokens = 12;  // a multivalue answer gets four times as many
};

// One (variant, budget, kind, context, depth) cell.
// A trial a run answered wrong: what it was asked for and what it said.
struct NiahMiss {
  int32_t trial = 0;
  std::string key;     // the asked key (multi-value: every key, comma-separated)
  std::string answer;  // the generated text
};

struct NiahCell {
  std::string variant;  // "full" for the reference
  RetrievalMode mode = RetrievalMode::kFull;
  int32_t budget_divisor = 0;  // 0: full
  int32_t budget_tokens = 0;
  NeedleKind kind = NeedleKind::kSingle;
  int64_t context = 0;
  double depth = 0;
  int32_t trials = 0, correct = 0;
  std::string last_answer;  // the last trial's generated text (for the reader)
  std::vector<NiahMiss> misses;  // every trial answered wrong, in trial order
  absl::Status status;      // not OK: a run failed; its trials after the failure are not counted
};

// Runs full mode and every variant at every budget on every prompt. A failing variant's
// cell keeps its error and the others go on; full mode's failure fails the task.
absl::StatusOr<std::vector<NiahCell>> RunNiah(Engine& engine, const std::vector<int32_t>& filler,
                                              const NiahOptions& o,
                                              const std::vector<EvalVariant>& variants,
                                              const EvalProgress& progress = {});

struct CopyOptions {
  TaskOptions task;
  std::vector<int64_t> distances = {512, 1024, 2048, 3072};  // first occurrence to repeat
  int32_t passage = 128;                                     // tokens
  int32_t skip = 16;   // first tokens of each occurrence not scored
  int32_t trials = 2;  // passages per distance
  // Tokens of each prompt, the repeat included (filler comes first, then the passage, the
  // gap and the repeat), so the budgets are the same fractions at every distance. 0: the
  // model's context.
  int64_t context = 0;
};

struct CopyPrompt {
  std::vector<int32_t> context;  // BOS, filler, the passage, `distance − passage` more filler
  std::vector<int32_t> passage;  // its repeat follows the context, scored token by token
};
// A copy prompt of `tokens` tokens in all (the repeat included) from random windows of `text`
// (token ids of held-out text; the passage's tokens do not recur in the filler).
// INVALID_ARGUMENT when the text or `tokens` cannot hold it.
absl::StatusOr<CopyPrompt> BuildCopyPrompt(const Tokenizer& tok, const std::vector<int32_t>& text,
                                           int64_t tokens, int64_t distance, int32_t passage,
                                           std::mt19937_64& rng);

// One (variant, budget, distance) cell: mean loss (nats per token) over the trials.
struct CopyCell {
  std::string variant;
  RetrievalMode mode = RetrievalMode::kFull;
  int32_t budget_divisor = 0;
  int32_t budget_tokens = 0;
  int64_t distance = 0;
  int32_t trials = 0;
  double first_loss = 0;   // the passage at its first occurrence (full KV, the same for all)
  double repeat_loss = 0;  // the passage at its repeat, with this variant's working set
  absl::Status status;
};

absl::StatusOr<std::vector<CopyCell>> RunCopy(Engine& engine, const std::vector<int32_t>& text,
                                              const CopyOptions& o,
                                              const std::vector<EvalVariant>& variants,
                                              const EvalProgress& progress = {});

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_EVAL_TASKS_H_
