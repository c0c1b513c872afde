#include "engine/eval_tasks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/status.h"
#include "engine/eval_metrics.h"

namespace kvtier::engine {
namespace {

// engine/model/train.py writes the same strings into the training data.
constexpr char kNeedle[] = " The pass key is {key}. Remember it. {key} is the pass key.";
constexpr char kQuestion[] = " What is the pass key? The pass key is";
constexpr char kNamedNeedle[] = " The pass key of {name} is {key}.";
constexpr char kNamedQuestion[] = " What is the pass key of {name}? The pass key of {name} is";
constexpr const char* kNames[] = {
    "the red door",   "the blue door",  "the green door", "the old house",   "the new house",
    "the north gate", "the south gate", "the east tower", "the west tower",  "the iron box",
    "the silver box", "the golden box", "the first ship", "the second ship", "the last ship",
    "the small room", "the great hall", "the high road",  "the low road",    "the white whale"};
constexpr int kNamedNeedles = 4;
constexpr char kValueNeedle[] = " One of the pass keys of {name} is {key}.";
constexpr char kValueQuestion[] =
    " What are all the pass keys of {name}? The pass keys of {name} are";

std::string RandomKey(std::mt19937_64& rng) {
  const int digits = std::uniform_int_distribution<int>(5, 7)(rng);
  int64_t lo = 1;
  for (int i = 1; i < digits; ++i) lo *= 10;
  return absl::StrCat(std::uniform_int_distribution<int64_t>(lo, lo * 10 - 1)(rng));
}

std::string Fill(const char* pattern, const std::string& key, const std::string& name = "") {
  return absl::StrReplaceAll(pattern, {{"{key}", key}, {"{name}", name}});
}

// Every run of digits in `text`.
std::vector<std::string> DigitRuns(std::string_view text) {
  std::vector<std::string> runs;
  for (size_t i = 0; i < text.size();) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    runs.emplace_back(text.substr(i, j - i));
    i = j;
  }
  return runs;
}

// A multivalue answer is complete at the end of its sentence.
bool ListDone(std::string_view text) {
  return !DigitRuns(text).empty() && text.find_first_of(".?\n") != std::string_view::npos;
}

// The answer is complete once it has something after its digits (or starts with no digit).
bool AnswerDone(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && text[i] == ' ') ++i;
  if (i == text.size()) return false;
  if (!std::isdigit(static_cast<unsigned char>(text[i]))) return true;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  return i < text.size();
}

// A run: full mode, or a variant at a budget divisor.
struct Run {
  const EvalVariant* variant;
  int32_t divisor;  // 0: full
};

// Full mode (every run's reference) first, then every variant at every budget.
std::vector<Run> Runs(const std::vector<EvalVariant>& variants, const TaskOptions& o) {
  static const EvalVariant* full = [] {
    auto* v = new EvalVariant;
    v->name = "full";
    v->options.mode = RetrievalMode::kFull;
    return v;
  }();
  std::vector<Run> runs = {{full, 0}};
  for (const EvalVariant& v : variants) {
    if (v.options.mode == RetrievalMode::kFull) continue;
    for (int32_t d : o.budget_divisors) runs.push_back({&v, d});
  }
  return runs;
}


// A sequence for one run of a prompt of `tokens` tokens (and `extra` more to come).
absl::StatusOr<std::unique_ptr<EngineSequence>> OpenRun(Engine& engine, const Run& run,
                                                        const TaskOptions& task, int64_t tokens,
                                                        int64_t extra, int32_t* budget) {
  const int32_t page_size = task.page_size;
  SequenceSpec spec;
  spec.options = run.variant->options;
  spec.page_size = page_size;
  spec.options.max_tokens =
      static_cast<int32_t>((tokens + extra + 2 * page_size) / page_size * page_size);
  *budget = BudgetTokens(tokens + extra, run.divisor, page_size);
  if (*budget >= tokens + extra) {
    return absl::InvalidArgumentError(
        absl::StrFormat("budget 1/%d: %d tokens is not below the context of %d tokens", run.divisor,
                        *budget, tokens + extra));
  }
  if (*budget > 0) KVTIER_RETURN_IF_ERROR(SetBudget(spec.options, *budget, page_size, task.split));
  return EngineSequence::Open(engine, spec, nullptr);
}

// Greedy answer of one run to a needle prompt.
absl::StatusOr<std::string> Answer(Engine& engine, const NeedlePrompt& p, const Run& run,
                                   const NiahOptions& o, PrefillRecord& record, int32_t* budget) {
  const int64_t total = static_cast<int64_t>(p.context.size() + p.question.size());
  const bool list = p.keys.size() > 1;
  const int32_t max_answer = list ? 4 * o.max_answer_tokens : o.max_answer_tokens;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<EngineSequence> es,
                          OpenRun(engine, run, o.task, total, max_answer, budget));
  Sequence& seq = es->sequence();
  Decoder& dec = engine.decoder();
  std::vector<float> logits;
  absl::Status st = dec.Prefill(seq, p.context, &logits, {}, &record);
  for (size_t i = 0; st.ok() && i < p.question.size(); ++i)
    st = dec.Step({&seq}, {p.question[i]}, &logits);
  std::vector<int32_t> answer;
  const Tokenizer& tok = engine.tokenizer();
  for (int32_t i = 0; st.ok() && i < max_answer; ++i) {
    const int32_t next = ArgMax(logits);
    if (next == tok.eos()) break;
    answer.push_back(next);
    const std::string text = tok.Decode(answer);
    if ((list ? ListDone(text) : AnswerDone(text)) || i + 1 == max_answer) break;
    st = dec.Step({&seq}, {next}, &logits);
  }
  if (st.ok()) st = seq.Wait();
  absl::Status closed = es->Close();
  KVTIER_RETURN_IF_ERROR(st);
  KVTIER_RETURN_IF_ERROR(closed);
  return tok.Decode(answer);
}

}  // namespace

// Rounding down made 1/16 of a 4,080-token needle prompt 128 tokens at pages of 32 — the
// same budget as 1/32; to the nearest unit it is 256.
int32_t BudgetTokens(int64_t context, int32_t divisor, int32_t page_size) {
  if (divisor <= 0) return 0;
  const int64_t unit = 4 * int64_t{page_size};
  const int64_t span = int64_t{divisor} * unit;
  return static_cast<int32_t>(std::max(unit, (context + span / 2) / span * unit));
}

bool ParseNeedleKind(std::string_view name, NeedleKind* out) {
  if (name == "single") {
    *out = NeedleKind::kSingle;
  } else if (name == "multikey") {
    *out = NeedleKind::kMultiKey;
  } else if (name == "multivalue") {
    *out = NeedleKind::kMultiValue;
  } else {
    return false;
  }
  return true;
}

std::string_view NeedleKindName(NeedleKind kind) {
  switch (kind) {
    case NeedleKind::kSingle:
      return "single";
    case NeedleKind::kMultiKey:
      return "multikey";
    case NeedleKind::kMultiValue:
      return "multivalue";
  }
  return "?";
}

bool AnswerIsRight(const NeedlePrompt& p, NeedleKind kind, std::string_view answer) {
  if (kind != NeedleKind::kMultiValue) return AnswerKey(answer) == p.key;
  const std::vector<std::string> runs = DigitRuns(answer);
  for (const std::string& k : p.keys) {
    if (std::find(runs.begin(), runs.end(), k) == runs.end()) return false;
  }
  return true;
}

std::string AnswerKey(std::string_view answer) {
  size_t i = 0;
  while (i < answer.size() && answer[i] == ' ') ++i;
  size_t j = i;
  while (j < answer.size() && std::isdigit(static_cast<unsigned char>(answer[j]))) ++j;
  return std::string(answer.substr(i, j - i));
}

absl::StatusOr<NeedlePrompt> BuildNeedlePrompt(const Tokenizer& tok,
                                               const std::vector<int32_t>& filler, int64_t tokens,
                                               double depth, NeedleKind kind,
                                               std::mt19937_64& rng) {
  if (!(depth >= 0 && depth <= 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("needle depth %g is outside [0, 1]", depth));
  }
  NeedlePrompt p;
  p.key = RandomKey(rng);
  std::vector<std::vector<int32_t>> needles;
  if (kind == NeedleKind::kSingle) {
    needles.push_back(tok.Encode(Fill(kNeedle, p.key), /*add_special=*/false));
    p.question = tok.Encode(kQuestion, false);
  } else if (kind == NeedleKind::kMultiKey) {
    std::vector<int> names(std::size(kNames));
    for (size_t i = 0; i < names.size(); ++i) names[i] = static_cast<int>(i);
    std::shuffle(names.begin(), names.end(), rng);
    needles.push_back(tok.Encode(Fill(kNamedNeedle, p.key, kNames[names[0]]), false));
    for (int i = 1; i < kNamedNeedles; ++i) {
      needles.push_back(tok.Encode(Fill(kNamedNeedle, RandomKey(rng), kNames[names[i]]), false));
    }
    p.question = tok.Encode(Fill(kNamedQuestion, "", kNames[names[0]]), false);
  } else {
    const char* name = kNames[std::uniform_int_distribution<size_t>(0, std::size(kNames) - 1)(rng)];
    p.keys.push_back(p.key);
    while (p.keys.size() < kNamedNeedles) {
      std::string k = RandomKey(rng);
      if (std::find(p.keys.begin(), p.keys.end(), k) == p.keys.end())
        p.keys.push_back(std::move(k));
    }
    for (const std::string& k : p.keys)
      needles.push_back(tok.Encode(Fill(kValueNeedle, k, name), false));
    p.question = tok.Encode(Fill(kValueQuestion, "", name), false);
  }
  if (p.keys.empty()) p.keys.push_back(p.key);
  const bool bos = tok.add_bos() && tok.bos() >= 0;
  int64_t fixed = static_cast<int64_t>(p.question.size()) + (bos ? 1 : 0);
  for (const auto& n : needles) fixed += static_cast<int64_t>(n.size());
  const int64_t fill = tokens - fixed;
  if (fill < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a needle prompt of %d tokens cannot hold its needles and question (%d tokens)", tokens,
        fixed));
  }
  if (static_cast<int64_t>(filler.size()) < fill) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the filler text has %d tokens; a needle prompt of %d tokens needs %d",
                        filler.size(), tokens, fill));
  }
  const int64_t start =
      std::uniform_int_distribution<int64_t>(0, static_cast<int64_t>(filler.size()) - fill)(rng);
  // The asked needle at `depth` of the filler; the others anywhere.
  std::vector<std::pair<int64_t, size_t>> at = {
      {static_cast<int64_t>(std::floor(depth * fill)), 0}};
  for (size_t i = 1; i < needles.size(); ++i) {
    at.push_back({std::uniform_int_distribution<int64_t>(0, fill)(rng), i});
  }
  std::stable_sort(at.begin(), at.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (bos) p.context.push_back(tok.bos());
  int64_t prev = 0;
  for (const auto& [pos, i] : at) {
    p.context.insert(p.context.end(), filler.begin() + start + prev, filler.begin() + start + pos);
    if (i == 0) p.needle_position = static_cast<int64_t>(p.context.size());
    p.context.insert(p.context.end(), needles[i].begin(), needles[i].end());
    prev = pos;
  }
  p.context.insert(p.context.end(), filler.begin() + start + prev, filler.begin() + start + fill);
  return p;
}

absl::StatusOr<CopyPrompt> BuildCopyPrompt(const Tokenizer& tok, const std::vector<int32_t>& text,
                                           int64_t tokens, int64_t distance, int32_t passage,
                                           std::mt19937_64& rng) {
  const bool bos = tok.add_bos() && tok.bos() >= 0;
  const int64_t n = static_cast<int64_t>(text.size());
  const int64_t P = passage;
  const int64_t gap = distance - P;
  // Filler before the passage, so that every prompt fills `tokens` and the budgets are the
  // same fractions of it at every distance.
  const int64_t prefix = tokens - (bos ? 1 : 0) - distance - P;
  if (P < 1 || gap < 0 || prefix < 0 || n < tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy prompt: %d tokens cannot hold a passage of %d repeated %d tokens later from a "
        "text of %d tokens",
        tokens, P, distance, n));
  }
  // A passage, and filler from the rest of the text (so the passage's only earlier
  // occurrence is the one `distance` back).
  const int64_t ps = std::uniform_int_distribution<int64_t>(0, n - P)(rng);
  CopyPrompt cp;
  cp.passage.assign(text.begin() + ps, text.begin() + ps + P);
  std::vector<int32_t> rest(text.begin(), text.begin() + ps);
  rest.insert(rest.end(), text.begin() + ps + P, text.end());
  const int64_t fs = std::uniform_int_distribution<int64_t>(
      0, static_cast<int64_t>(rest.size()) - prefix - gap)(rng);
  if (bos) cp.context.push_back(tok.bos());
  cp.context.insert(cp.context.end(), rest.begin() + fs, rest.begin() + fs + prefix);
  cp.context.insert(cp.context.end(), cp.passage.begin(), cp.passage.end());
  cp.context.insert(cp.context.end(), rest.begin() + fs + prefix, rest.begin() + fs + prefix + gap);
  return cp;
}

absl::StatusOr<std::vector<NiahCell>> RunNiah(Engine& engine, const std::vector<int32_t>& filler,
                                              const NiahOptions& o,
                                              const std::vector<EvalVariant>& variants,
                                              const EvalProgress& progress) {
  if (o.depths < 1 || o.trials < 1 || o.contexts.empty() || o.kinds.empty() ||
      o.max_answer_tokens < 1) {
    return absl::InvalidArgumentError(
        "niah: --depths, --trials and the answer length must be at least 1, with a context and "
        "a needle kind");
  }
  const int64_t model_context = engine.config().context;
  int32_t answer = o.max_answer_tokens;
  for (NeedleKind k : o.kinds) {
    if (k == NeedleKind::kMultiValue) answer = 4 * o.max_answer_tokens;
  }
  for (int64_t c : o.contexts) {
    if (c < 64 || (model_context > 0 && c + answer > model_context)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "niah: --contexts %d: a prompt needs at least 64 tokens, and with its answer (%d) at "
          "most the model's context of %d",
          c, answer, model_context));
    }
  }
  const std::vector<Run> runs = Runs(variants, o.task);
  // Cells in the order (run, kind, context, depth); prompts in (context, kind, depth, trial).
  std::vector<NiahCell> cells;
  auto cell_index = [&](size_t run, size_t kind, size_t context, int32_t depth) {
    return ((run * o.kinds.size() + kind) * o.contexts.size() + context) * o.depths + depth;
  };
  for (const Run& r : runs) {
    for (NeedleKind k : o.kinds) {
      for (int64_t c : o.contexts) {
        for (int32_t d = 0; d < o.depths; ++d) {
          NiahCell cell;
          cell.variant = r.variant->name;
          cell.mode = r.variant->options.mode;
          cell.budget_divisor = r.divisor;
          cell.budget_tokens = BudgetTokens(c + o.max_answer_tokens, r.divisor, o.task.page_size);
          cell.kind = k;
          cell.context = c;
          cell.depth = o.depths == 1 ? 0.5 : static_cast<double>(d) / (o.depths - 1);
          cells.push_back(std::move(cell));
        }
      }
    }
  }
  std::mt19937_64 rng(o.task.seed);
  const int64_t prompts =
      static_cast<int64_t>(o.contexts.size() * o.kinds.size()) * o.depths * o.trials;
  int64_t done = 0;
  for (size_t ci = 0; ci < o.contexts.size(); ++ci) {
    for (size_t ki = 0; ki < o.kinds.size(); ++ki) {
      for (int32_t d = 0; d < o.depths; ++d) {
        for (int32_t t = 0; t < o.trials; ++t) {
          const double depth = cells[cell_index(0, ki, ci, d)].depth;
          KVTIER_ASSIGN_OR_RETURN(
              NeedlePrompt p, BuildNeedlePrompt(engine.tokenizer(), filler, o.contexts[ci], depth,
                                                o.kinds[ki], rng));
          PrefillRecord record;  // the prompt's forward pass, run once for every run
          for (size_t ri = 0; ri < runs.size(); ++ri) {
            NiahCell& cell = cells[cell_index(ri, ki, ci, d)];
            if (!cell.status.ok()) continue;
            int32_t budget = 0;
            absl::StatusOr<std::string> a = Answer(engine, p, runs[ri], o, record, &budget);
            if (!a.ok()) {
              if (ri == 0) return a.status();  // full mode is the reference
              cell.status = a.status();
              continue;
            }
            cell.budget_tokens = budget;
            ++cell.trials;
            if (AnswerIsRight(p, o.kinds[ki], *a)) {
              ++cell.correct;
            } else {
              cell.misses.push_back({t, absl::StrJoin(p.keys, ","), *a});
            }
            cell.last_answer = *a;
          }
          if (progress) progress("niah", ++done, prompts);
        }
      }
    }
  }
  return cells;
}

absl::StatusOr<std::vector<CopyCell>> RunCopy(Engine& engine, const std::vector<int32_t>& text,
                                              const CopyOptions& o,
                                              const std::vector<EvalVariant>& variants,
                                              const EvalProgress& progress) {
  if (o.passage < 2 || o.skip < 0 || o.skip >= o.passage || o.trials < 1 || o.distances.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy: --passage (%d) must be at least 2 and above --skip (%d), --trials (%d) at least 1, "
        "with a distance",
        o.passage, o.skip, o.trials));
  }
  const int64_t model_context = engine.config().context;
  const int64_t n = static_cast<int64_t>(text.size());
  const int64_t context_tokens = o.context > 0 ? o.context : model_context;
  if (context_tokens < 1 || (model_context > 0 && context_tokens > model_context)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy: --context %d: must be positive and at most the model's context of %d", o.context,
        model_context));
  }
  if (context_tokens > n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy: the text has %d tokens; a context of %d needs as many", n, context_tokens));
  }
  for (int64_t d : o.distances) {
    if (d <= o.passage || 1 + d + o.passage > context_tokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "copy: --distances %d: must exceed the passage (%d tokens) and fit the context (%d) "
          "with the passage and its repeat",
          d, o.passage, context_tokens));
    }
  }
  const std::vector<Run> runs = Runs(variants, o.task);
  std::vector<CopyCell> cells;
  for (const Run& r : runs) {
    for (int64_t d : o.distances) {
      CopyCell c;
      c.variant = r.variant->name;
      c.mode = r.variant->options.mode;
      c.budget_divisor = r.divisor;
      c.distance = d;
      cells.push_back(std::move(c));
    }
  }
  const Tokenizer& tok = engine.tokenizer();
  const bool bos = tok.add_bos() && tok.bos() >= 0;
  Decoder& dec = engine.decoder();
  std::mt19937_64 rng(o.task.seed);
  const int64_t prompts = static_cast<int64_t>(o.distances.size()) * o.trials;
  int64_t done = 0;
  const int32_t P = o.passage;
  for (size_t di = 0; di < o.distances.size(); ++di) {
    for (int32_t t = 0; t < o.trials; ++t) {
      KVTIER_ASSIGN_OR_RETURN(CopyPrompt cp,
                              BuildCopyPrompt(tok, text, context_tokens, o.distances[di], P, rng));
      const std::vector<int32_t>& passage = cp.passage;
      const std::vector<int32_t>& context = cp.context;
      // The first occurrence's loss: full attention over the dense cache.
      double first = 0;
      {
        KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<DenseKv> kv,
                                DenseKv::Create(engine.config(), engine.device(), P + 2));
        std::vector<float> logits;
        const int32_t i0 = bos ? 0 : 1;  // without BOS, the first token is the prompt
        KVTIER_RETURN_IF_ERROR(dec.PrefillDense(*kv, {bos ? tok.bos() : passage[0]}, &logits));
        for (int32_t i = i0; i < P; ++i) {
          if (i >= o.skip) first -= LogProbAt(logits, passage[i]);
          if (i + 1 < P) KVTIER_RETURN_IF_ERROR(dec.StepDense(*kv, passage[i], &logits));
        }
        first /= P - std::max(o.skip, i0);
      }
      PrefillRecord record;
      for (size_t ri = 0; ri < runs.size(); ++ri) {
        CopyCell& cell = cells[ri * o.distances.size() + di];
        if (!cell.status.ok()) continue;
        int32_t budget = 0;
        absl::StatusOr<std::unique_ptr<EngineSequence>> es = OpenRun(
            engine, runs[ri], o.task, static_cast<int64_t>(context.size()), P, &budget);
        absl::Status st = es.status();
        double loss = 0;
        if (st.ok()) {
          Sequence& seq = (*es)->sequence();
          std::vector<float> logits;
          st = dec.Prefill(seq, context, &logits, {}, &record);
          for (int32_t i = 0; st.ok() && i < P; ++i) {
            if (i >= o.skip) loss -= LogProbAt(logits, passage[i]);
            if (i + 1 < P) st = dec.Step({&seq}, {passage[i]}, &logits);
          }
          if (st.ok()) st = seq.Wait();
          absl::Status closed = (*es)->Close();
          if (st.ok()) st = closed;
        }
        if (!st.ok()) {
          if (ri == 0) return st;
          cell.status = st;
          continue;
        }
        cell.budget_tokens = budget;
        cell.first_loss += first;
        cell.repeat_loss += loss / (P - o.skip);
        ++cell.trials;
      }
      if (progress) progress("copy", ++done, prompts);
    }
  }
  for (CopyCell& c : cells) {
    if (c.trials > 0) {
      c.first_loss /= c.trials;
      c.repeat_loss /= c.trials;
    }
  }
  return cells;
}

}  // namespace kvtier::engine
