#include "engine/run_eval.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/json.h"
#include "core/plot.h"
#include "core/status.h"
#include "engine/eval.h"
#include "engine/eval_tasks.h"
#include "engine/generate.h"
#include "engine/trace_writer.h"

#ifndef KVTIER_GIT_COMMIT
#define KVTIER_GIT_COMMIT "unknown"
#endif

namespace kvtier::engine {
namespace {

// The evaluated variants, in the default order; docs/eval.md describes each.
const std::vector<std::string>& VariantNames() {
  static const auto* names = new std::vector<std::string>{"sync",
                                                          "speculative",
                                                          "speculative-mass",
                                                          "speculative-never",
                                                          "speculative+conf",
                                                          "window",
                                                          "h2o",
                                                          "conf-kv",
                                                          "epikv",
                                                          "xkv",
                                                          "kv-compress"};
  return *names;
}

// A variant's name, optionally with its trigger parameter: "speculative:tau=0.7",
// "speculative-mass:loss=0.1" (for sweeps).
// --split S:SEL:R, three integers.
absl::StatusOr<BudgetSplit> ParseSplit(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  BudgetSplit b;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &b.sink) ||
      !absl::SimpleAtoi(parts[1], &b.selected) || !absl::SimpleAtoi(parts[2], &b.recent) ||
      b.sink < 0 || b.selected < 0 || b.recent < 0 || b.sink + b.selected + b.recent <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--split '%s': sink:selected:recent, three integers >= 0 with a positive sum (e.g. 1:6:1)",
        text));
  }
  return b;
}

// --split into *out (none: the library's), or false after saying why.
bool SplitOf(const EvalFlags& f, BudgetSplit* out) {
  if (f.split.empty()) {
    *out = BudgetSplit();
    return true;
  }
  absl::StatusOr<BudgetSplit> split = ParseSplit(f.split);
  if (!split.ok()) {
    std::cerr << "kvtier-run eval: " << split.status().message() << "\n";
    return false;
  }
  *out = *split;
  return true;
}

absl::StatusOr<EvalVariant> MakeVariant(const std::string& spec, const EvalFlags& f) {
  const std::vector<std::string> parts = absl::StrSplit(spec, absl::MaxSplits(':', 1));
  const std::string& name = parts[0];
  float tau = f.tau, loss = f.max_loss;
  if (parts.size() == 2) {
    const std::vector<std::string> kv = absl::StrSplit(parts[1], absl::MaxSplits('=', 1));
    float value = 0;
    const bool number = kv.size() == 2 && absl::SimpleAtof(kv[1], &value) && std::isfinite(value);
    if (number && kv[0] == "tau" && (name == "speculative" || name == "speculative+conf")) {
      tau = value;
    } else if (number && kv[0] == "loss" && name == "speculative-mass" && value >= 0) {
      loss = value;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--variants: '%s': a parameter is tau=<number> (speculative, speculative+conf) or "
          "loss=<number ≥ 0> (speculative-mass)",
          spec));
    }
  }
  EvalVariant v;
  v.name = spec;
  SequenceOptions& o = v.options;
  PolicyConfig& p = o.policy;
  o.correction_threshold = tau;
  if (!f.summary.empty() && !ParseSummaryMode(f.summary, &o.summary)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--summary: '%s': must be key-codes (the default), center-mad or minmax",
        f.summary));
  }
  if (name == "sync") {
    o.mode = RetrievalMode::kSync;
  } else if (name == "speculative") {
    o.mode = RetrievalMode::kSpeculative;
  } else if (name == "speculative-mass") {
    o.mode = RetrievalMode::kSpeculative;
    o.correction_trigger = CorrectionTrigger::kMass;
    if (loss >= 0) o.correction_max_loss = loss;
  } else if (name == "speculative-never") {
    o.mode = RetrievalMode::kSpeculative;
    o.correction_threshold = -2.0f;  // never corrects
  } else if (name == "speculative+conf") {
    o.mode = RetrievalMode::kSpeculative;
    p.budget = "confidence";
  } else if (name == "window") {
    o.mode = RetrievalMode::kDrop;
  } else if (name == "h2o") {
    o.mode = RetrievalMode::kDrop;
    p.residency = "h2o";
  } else if (name == "conf-kv") {
    o.mode = RetrievalMode::kDrop;
    p.budget = "confidence";
    p.residency = "attention";
  } else if (name == "epikv") {
    o.mode = RetrievalMode::kDrop;
    p.residency = "epiphany";
  } else if (name == "xkv") {
    o.mode = RetrievalMode::kDrop;
    p.budget = "xkv";
    p.residency = "attention";
  } else if (name == "kv-compress") {
    o.mode = RetrievalMode::kDrop;
    p.budget = "kv_compress";
    p.residency = "kv_compress";
  } else {
    return absl::InvalidArgumentError(absl::StrFormat("--variants: unknown '%s' (%s)", name,
                                                      absl::StrJoin(VariantNames(), ", ")));
  }
  return v;
}

// The engine and the text's tokens, or an exit code.
struct Loaded {
  std::unique_ptr<Engine> engine;
  std::vector<int32_t> ids;
};
int Load(const ModelFlags& m, const char* cmd, Loaded* out) {
  absl::StatusOr<EngineOptions> eo =
      EngineOptionsFrom(m.model, m.kv_dtype, m.device, m.threads, m.prefill_chunk, 1);
  if (!eo.ok()) {
    std::cerr << "kvtier-run " << cmd << ": " << eo.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<std::string> text = ReadText(m.text_file);
  if (!text.ok()) {
    std::cerr << "kvtier-run " << cmd << ": --text: " << text.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Open(*eo);
  if (!engine.ok()) {
    std::cerr << "kvtier-run " << cmd << ": " << engine.status() << "\n";
    return 1;
  }
  out->ids = (*engine)->tokenizer().Encode(*text);
  out->engine = *std::move(engine);
  return 0;
}

void PrintTable(const std::vector<EvalResult>& rs, int64_t context, std::ostream& os) {
  const EvalResult& full = rs.front();
  os << absl::StrFormat("%-18s %7s %8s %7s %6s %8s %7s %7s %6s %9s %9s %7s\n", "variant", "budget",
                        "ppl", "Δppl%", "top1", "KL", "rec_tok", "rec_pg", "corr", "KB/tok",
                        "resid KB", "ms/tok");
  for (const EvalResult& r : rs) {
    const std::string budget = r.budget_tokens > 0
                                   ? absl::StrFormat("1/%.3g", double(context) / r.budget_tokens)
                                   : std::string("all");
    if (!r.status.ok()) {
      os << absl::StrFormat("%-18s %7s FAILED: %s\n", r.variant, budget, r.status.ToString());
      continue;
    }
    os << absl::StrFormat(
        "%-18s %7s %8.3f %+7.2f %6.3f %8.5f %7.4f %7.4f %6.3f %9.1f %9.1f %7.2f\n", r.variant,
        budget, r.perplexity, 100.0 * (r.perplexity / full.perplexity - 1), r.top1_agreement, r.kl,
        r.recall_tokens, r.recall_pages, r.correction_rate, r.recalled_bytes_per_token / 1024,
        r.resident_bytes / 1024, r.ms_per_token);
  }
}

std::string ResultJson(const EvalResult& r, const EvalResult& full) {
  std::ostringstream j;
  j << "{\"variant\": \"" << JsonEscape(r.variant) << "\", \"mode\": \""
    << RetrievalModeName(r.mode) << "\", \"budget_tokens\": " << r.budget_tokens;
  if (!r.status.ok()) {  // a failed run has its error and no metrics
    j << ", \"error\": \"" << JsonEscape(r.status.ToString()) << "\"}";
    return j.str();
  }
  j << ", \"steps\": " << r.steps << ", \"perplexity\": " << r.perplexity
    << ", \"perplexity_vs_full\": " << r.perplexity / full.perplexity
    << ", \"top1_agreement\": " << r.top1_agreement << ", \"kl\": " << r.kl
    << ", \"attn_mass_recall_tokens\": " << r.recall_tokens
    << ", \"attn_mass_recall_pages\": " << r.recall_pages
    << ", \"recall_steps\": " << r.recall_steps << ", \"correction_rate\": " << r.correction_rate
    << ", \"checked_heads\": " << r.checked_heads << ", \"corrected_heads\": " << r.corrected_heads
    << ", \"recalled_bytes_per_token\": " << r.recalled_bytes_per_token
    << ", \"resident_bytes\": " << r.resident_bytes << ", \"ms_per_token\": " << r.ms_per_token
    << ", \"layers\": [";
  for (size_t l = 0; l < r.layer_recall_tokens.size(); ++l) {
    j << (l ? ", " : "") << "{\"layer\": " << l
      << ", \"attn_mass_recall_tokens\": " << r.layer_recall_tokens[l]
      << ", \"attn_mass_recall_pages\": " << r.layer_recall_pages[l] << "}";
  }
  j << "]}";
  return j.str();
}

// One line per variant over the budgets (as fractions of the context); full and the drop
// variants dashed. Perplexity, KL from full KV, and token recall.
absl::Status WritePlots(const std::string& prefix, const std::vector<EvalResult>& rs,
                        int64_t context) {
  std::map<std::string, PlotSeries> ppl, kl, recall;
  std::vector<std::string> order;
  std::vector<int32_t> budgets;
  for (const EvalResult& r : rs) {
    if (r.budget_tokens == 0 || !r.status.ok()) continue;
    if (!ppl.count(r.variant)) order.push_back(r.variant);
    const double x = double(r.budget_tokens) / context;
    for (auto [series, y] : {std::pair{&ppl, r.perplexity}, std::pair{&kl, r.kl},
                             std::pair{&recall, r.recall_tokens}}) {
      PlotSeries& s = (*series)[r.variant];
      s.name = r.variant;
      s.dashed = r.mode == RetrievalMode::kDrop;
      s.x.push_back(x);
      s.y.push_back(y);
    }
    budgets.push_back(r.budget_tokens);
  }
  if (order.empty()) return absl::OkStatus();
  const auto [lo, hi] = std::minmax_element(budgets.begin(), budgets.end());
  PlotSeries full_ppl{"full",
                      {double(*lo) / context, double(*hi) / context},
                      {rs.front().perplexity, rs.front().perplexity},
                      true};
  std::vector<PlotSeries> a = {full_ppl}, b, k;
  for (const std::string& n : order) {
    a.push_back(ppl[n]);
    b.push_back(recall[n]);
    k.push_back(kl[n]);
  }
  PlotOptions o;
  o.log_x = true;
  o.x_label = "working-set budget / context";
  o.title = "perplexity vs budget (held-out text, lower is better)";
  o.y_label = "perplexity";
  KVTIER_RETURN_IF_ERROR(WriteLinePlot(prefix + "-ppl.png", o, a));
  o.title = "KL divergence from full KV of the next-token distribution (lower is better)";
  o.y_label = "KL (nats)";
  o.log_y = true;
  KVTIER_RETURN_IF_ERROR(WriteLinePlot(prefix + "-kl.png", o, k));
  o.log_y = false;
  o.title = "attention-mass recall over the top budget tokens";
  o.y_label = "recall";
  return WriteLinePlot(prefix + "-recall.png", o, b);
}

}  // namespace

absl::StatusOr<EngineOptions> EngineOptionsFrom(const std::string& model,
                                                const std::string& kv_dtype,
                                                const std::string& device, int threads,
                                                int32_t prefill_chunk, int32_t max_batch) {
  EngineOptions eo;
  if (!ParseDType(kv_dtype, &eo.decoder.kv_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-dtype: unknown '%s' (fp16, bf16, fp32)", kv_dtype));
  }
  if (!ParseDeviceKind(device, &eo.device)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--device: unknown '%s' (cpu, cuda, auto)", device));
  }
  eo.model_path = model;
  eo.threads = threads;
  eo.decoder.prefill_chunk = prefill_chunk;
  eo.decoder.max_batch = std::max(1, max_batch);
  return eo;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrFormat("cannot read %s", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CLI::App* AddEvalCommand(CLI::App& app, EvalFlags* f) {
  CLI::App* c = app.add_subcommand(
      "eval", "quality of every mode and policy against full KV on held-out text");
  c->footer(
      "A run that fails (a variant at a budget) is a FAILED row with its error in the table "
      "and the JSON; the other runs, the JSON and the plots are still written, and the exit "
      "status is then 1 (2 when every failure was an invalid option). Full mode is the "
      "reference: if it fails, nothing is written.");
  c->add_option("--model", f->m.model, "GGUF file")->required();
  c->add_option("--text", f->m.text_file, "held-out text (not seen in training)")->required();
  c->add_option("--steps", f->steps, "scored decode steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  c->add_option("--prefill", f->prefill,
                "prompt tokens before the steps (0: the context minus the steps)");
  c->add_option("--context", f->context,
                "prefill + steps (0: the model's, or what the text holds)");
  c->add_option("--budgets", f->budgets,
                "working-set budgets in tokens (default: 1/32, 1/16, 1/8 and 1/4 of the context)")
      ->delimiter(',');
  c->add_option("--variants", f->variants,
                absl::StrCat("comma-separated, default all: ", absl::StrJoin(VariantNames(), ", "),
                             "; sweeps: speculative:tau=X, speculative-mass:loss=X"));
  c->add_option("--tau", f->tau, "τ of the cosine trigger (speculative, speculative+conf)");
  c->add_option("--max-loss", f->max_loss, "the mass trigger's tolerated loss (speculative-mass)");
  c->add_option("--recall-every", f->recall_every, "oracle recall on every k-th step")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--page-size", f->m.page_size, "tokens per page");
  c->add_option("--split", f->split,
                "the budget's sink:selected:recent parts, e.g. 1:2:1 (default: the library's, "
                "SequenceOptions::SetBudgetTokens: an eighth sinks (at least 1 page), an eighth "
                "recent (2 pages to a quarter), the rest selected)");
  c->add_option("--summary", f->summary,
                "page summaries: key-codes (the default: the bounds and a 4-bit code per key and "
                "dimension; a page scores by its decoded keys' share of the attention), center-mad "
                "(ArkVale's) or minmax (Quest's per-dimension bounds)");
  c->add_option("--kv-dtype", f->m.kv_dtype, "fp16, bf16 or fp32");
  c->add_option("--device", f->m.device, "cpu, cuda or auto");
  c->add_option("--threads", f->m.threads, "CPU threads (0: all cores)");
  c->add_option("--prefill-chunk", f->m.prefill_chunk, "prompt tokens per forward pass");
  c->add_option("--json", f->json, "write the results as JSON");
  c->add_option("--plot", f->plot,
                "PNG path prefix: PREFIX-ppl.png, PREFIX-kl.png, PREFIX-recall.png");
  c->add_flag("--quiet", f->m.quiet, "no progress on stderr");
  c->add_option("--task", f->task,
                "ppl: perplexity and KL of the text against full KV; niah: pass-key retrieval "
                "across context depths; copy: loss on a passage repeated at a distance")
      ->check(CLI::IsMember({"ppl", "niah", "copy"}));
  c->add_option("--budget-divisors", f->divisors,
                "niah, copy: budgets as 1/d of each prompt's context (default 32,16,8,4)")
      ->delimiter(',');
  c->add_option("--contexts", f->contexts,
                "niah: prompt lengths in tokens (default: the model's context)")
      ->delimiter(',');
  c->add_option("--depths", f->depths, "niah: needle depths, evenly from 0 to 1")
      ->check(CLI::Range(1, 1000));
  c->add_option("--trials", f->trials, "niah, copy: prompts per cell (default 3 and 2)")
      ->check(CLI::Range(0, 100000));
  c->add_option("--needles", f->needles,
                "niah: needle kinds, comma-separated: single, multikey, multivalue (default "
                "single,multikey)");
  c->add_option(
       "--distances", f->distances,
       "copy: tokens from a passage to its repeat (default 512, 1024, 2048 and 3/4 of the context)")
      ->delimiter(',');
  c->add_option("--passage", f->passage, "copy: passage length in tokens");
  c->add_option("--seed", f->seed, "niah, copy: the prompts' random seed");
  return c;
}

namespace {

std::string BudgetName(int32_t divisor) {
  return divisor > 0 ? absl::StrCat("1/", divisor) : std::string("all");
}

// The variants' order as given (full first) and the budget divisors seen.
template <typename Cell>
void Axes(const std::vector<Cell>& cells, std::vector<std::string>* variants,
          std::vector<int32_t>* divisors) {
  for (const Cell& c : cells) {
    if (std::find(variants->begin(), variants->end(), c.variant) == variants->end()) {
      variants->push_back(c.variant);
    }
    if (c.budget_divisor > 0 &&
        std::find(divisors->begin(), divisors->end(), c.budget_divisor) == divisors->end()) {
      divisors->push_back(c.budget_divisor);
    }
  }
}

// niah: accuracy per variant and budget (over every depth and context), per needle kind;
// then accuracy per depth for each variant at each budget.
void PrintNiah(const std::vector<NiahCell>& cells, std::ostream& os) {
  std::vector<std::string> variants;
  std::vector<int32_t> divisors;
  Axes(cells, &variants, &divisors);
  std::vector<NeedleKind> kinds;
  std::vector<double> depths;
  for (const NiahCell& c : cells) {
    if (std::find(kinds.begin(), kinds.end(), c.kind) == kinds.end()) kinds.push_back(c.kind);
    if (std::find(depths.begin(), depths.end(), c.depth) == depths.end()) depths.push_back(c.depth);
  }
  auto accuracy = [&](const std::string& v, int32_t d, NeedleKind k, double depth) {
    int64_t n = 0, ok = 0;
    bool failed = false;
    for (const NiahCell& c : cells) {
      if (c.variant != v || c.budget_divisor != d || c.kind != k) continue;
      if (depth >= 0 && c.depth != depth) continue;
      n += c.trials;
      ok += c.correct;
      failed |= !c.status.ok();
    }
    if (failed) return std::string("FAIL");
    return n > 0 ? absl::StrFormat("%.3f", double(ok) / n) : std::string("-");
  };
  os << "needle accuracy (exact match of the greedy answer), over every depth\n";
  os << absl::StrFormat("%-20s %-10s", "variant", "needle");
  for (int32_t d : divisors) os << absl::StrFormat(" %7s", BudgetName(d));
  os << "\n";
  for (NeedleKind k : kinds) {
    for (const std::string& v : variants) {
      os << absl::StrFormat("%-20s %-10s", v, NeedleKindName(k));
      if (v == "full") {
        os << absl::StrFormat(" %7s", accuracy(v, 0, k, -1)) << "  (every budget: all)\n";
        continue;
      }
      for (int32_t d : divisors) os << absl::StrFormat(" %7s", accuracy(v, d, k, -1));
      os << "\n";
    }
  }
  os << "\naccuracy per needle depth (0: the context's start)\n";
  os << absl::StrFormat("%-20s %-10s %-6s", "variant", "needle", "budget");
  for (double dp : depths) os << absl::StrFormat(" %5.2f", dp);
  os << "\n";
  for (NeedleKind k : kinds) {
    for (const std::string& v : variants) {
      std::vector<int32_t> ds = v == "full" ? std::vector<int32_t>{0} : divisors;
      for (int32_t d : ds) {
        os << absl::StrFormat("%-20s %-10s %-6s", v, NeedleKindName(k), BudgetName(d));
        for (double dp : depths) {
          const std::string a = accuracy(v, d, k, dp);
          os << absl::StrFormat(" %5s", a.size() > 5 ? a.substr(0, 4) : a);
        }
        os << "\n";
      }
    }
  }
  for (const NiahCell& c : cells) {
    if (!c.status.ok()) {
      os << absl::StrFormat("FAILED %s@%s: %s\n", c.variant, BudgetName(c.budget_divisor),
                            c.status.ToString());
      break;
    }
  }
}

// copy: the repeat's loss per variant and budget at each distance, and full KV's first
// occurrence.
void PrintCopy(const std::vector<CopyCell>& cells, std::ostream& os) {
  std::vector<std::string> variants;
  std::vector<int32_t> divisors;
  Axes(cells, &variants, &divisors);
  std::vector<int64_t> distances;
  for (const CopyCell& c : cells) {
    if (std::find(distances.begin(), distances.end(), c.distance) == distances.end()) {
      distances.push_back(c.distance);
    }
  }
  os << "loss on the repeated passage (nats/token) by distance to its first occurrence\n";
  os << absl::StrFormat("%-20s %-6s", "variant", "budget");
  for (int64_t d : distances) os << absl::StrFormat(" %8lld", static_cast<long long>(d));
  os << "\n";
  auto row = [&](const std::string& name, const std::string& budget, auto value) {
    os << absl::StrFormat("%-20s %-6s", name, budget);
    for (int64_t d : distances) os << absl::StrFormat(" %8s", value(d));
    os << "\n";
  };
  auto find = [&](const std::string& v, int32_t div, int64_t d) -> const CopyCell* {
    for (const CopyCell& c : cells) {
      if (c.variant == v && c.budget_divisor == div && c.distance == d) return &c;
    }
    return nullptr;
  };
  row("first occurrence", "all", [&](int64_t d) {
    const CopyCell* c = find("full", 0, d);
    return c ? absl::StrFormat("%.3f", c->first_loss) : std::string("-");
  });
  for (const std::string& v : variants) {
    std::vector<int32_t> ds = v == "full" ? std::vector<int32_t>{0} : divisors;
    for (int32_t div : ds) {
      row(v, BudgetName(div), [&](int64_t d) {
        const CopyCell* c = find(v, div, d);
        if (c == nullptr) return std::string("-");
        if (!c->status.ok()) return std::string("FAIL");
        return absl::StrFormat("%.3f", c->repeat_loss);
      });
    }
  }
}

std::string NiahJson(const NiahCell& c) {
  std::string j = absl::StrFormat(
      "{\"variant\": \"%s\", \"mode\": \"%s\", \"budget_divisor\": %d, \"budget_tokens\": %d, "
      "\"needle\": \"%s\", \"context\": %d, \"depth\": %.4f, \"trials\": %d, \"correct\": %d",
      JsonEscape(c.variant), RetrievalModeName(c.mode), c.budget_divisor, c.budget_tokens,
      NeedleKindName(c.kind), c.context, c.depth, c.trials, c.correct);
  if (c.trials > 0) absl::StrAppendFormat(&j, ", \"accuracy\": %.4f", double(c.correct) / c.trials);
  absl::StrAppend(&j, ", \"last_answer\": \"", JsonEscape(c.last_answer), "\"");
  // The trials answered wrong, so that a miss can be looked at (which key, what was said).
  absl::StrAppend(&j, ", \"misses\": [");
  for (size_t i = 0; i < c.misses.size(); ++i) {
    const NiahMiss& m = c.misses[i];
    absl::StrAppendFormat(&j, "%s{\"trial\": %d, \"key\": \"%s\", \"answer\": \"%s\"}",
                          i == 0 ? "" : ", ", m.trial, JsonEscape(m.key), JsonEscape(m.answer));
  }
  absl::StrAppend(&j, "]");
  if (!c.status.ok()) absl::StrAppend(&j, ", \"error\": \"", JsonEscape(c.status.ToString()), "\"");
  return j + "}";
}

std::string CopyJson(const CopyCell& c) {
  std::string j = absl::StrFormat(
      "{\"variant\": \"%s\", \"mode\": \"%s\", \"budget_divisor\": %d, \"budget_tokens\": %d, "
      "\"distance\": %d, \"trials\": %d, \"first_loss\": %.5f, \"repeat_loss\": %.5f",
      JsonEscape(c.variant), RetrievalModeName(c.mode), c.budget_divisor, c.budget_tokens,
      c.distance, c.trials, c.first_loss, c.repeat_loss);
  if (!c.status.ok()) absl::StrAppend(&j, ", \"error\": \"", JsonEscape(c.status.ToString()), "\"");
  return j + "}";
}

// niah: accuracy against the budget per variant (single needles, every depth); copy: the
// repeat's loss against the distance per variant at the 1/16 budget (or the first one).
absl::Status WriteTaskPlots(const std::string& prefix, const std::vector<NiahCell>* niah,
                            const std::vector<CopyCell>* copy) {
  PlotOptions o;
  if (niah != nullptr) {
    std::map<std::string, std::pair<int64_t, int64_t>> acc;  // (variant, divisor) sums
    std::vector<std::string> variants;
    std::vector<int32_t> divisors;
    Axes(*niah, &variants, &divisors);
    std::vector<PlotSeries> series;
    for (const std::string& v : variants) {
      PlotSeries s;
      s.name = v;
      for (int32_t d : divisors) {
        int64_t n = 0, ok = 0;
        bool drop = false;
        for (const NiahCell& c : *niah) {
          if (c.variant != v || c.kind != NeedleKind::kSingle || !c.status.ok()) continue;
          if (v != "full" && c.budget_divisor != d) continue;
          n += c.trials;
          ok += c.correct;
          drop = c.mode == RetrievalMode::kDrop;
        }
        if (n == 0) continue;
        s.x.push_back(1.0 / d);
        s.y.push_back(double(ok) / n);
        s.dashed = drop || v == "full";
      }
      if (!s.x.empty()) series.push_back(std::move(s));
    }
    // A heatmap per variant: a row per (needle kind, context, budget), a column per depth.
    std::vector<NeedleKind> kinds;
    std::vector<int64_t> contexts;
    std::vector<double> depths;
    for (const NiahCell& c : *niah) {
      if (std::find(kinds.begin(), kinds.end(), c.kind) == kinds.end()) kinds.push_back(c.kind);
      if (std::find(contexts.begin(), contexts.end(), c.context) == contexts.end())
        contexts.push_back(c.context);
      if (std::find(depths.begin(), depths.end(), c.depth) == depths.end())
        depths.push_back(c.depth);
    }
    std::vector<std::string> cols;
    for (double d : depths) cols.push_back(absl::StrFormat("%.2f", d));
    for (const std::string& v : variants) {
      std::vector<std::string> rows;
      std::vector<std::vector<double>> values;
      const std::vector<int32_t> ds = v == "full" ? std::vector<int32_t>{0} : divisors;
      for (NeedleKind k : kinds) {
        for (int64_t ctx : contexts) {
          for (int32_t d : ds) {
            std::vector<double> row;
            for (double dp : depths) {
              double value = std::nan("");
              for (const NiahCell& c : *niah) {
                if (c.variant == v && c.kind == k && c.context == ctx && c.budget_divisor == d &&
                    c.depth == dp && c.trials > 0) {
                  value = double(c.correct) / c.trials;
                }
              }
              row.push_back(value);
            }
            rows.push_back(absl::StrCat(std::string(NeedleKindName(k)),
                                        contexts.size() > 1 ? absl::StrCat(" ", ctx) : "", " ",
                                        BudgetName(d)));
            values.push_back(std::move(row));
          }
        }
      }
      HeatmapOptions h;
      h.title = absl::StrCat("pass-key accuracy: ", v);
      h.x_label = "needle depth (0: the context's start)";
      h.y_label = "needle, budget";
      h.height = std::max(300, 120 + 40 * static_cast<int>(rows.size()));
      std::string file = v;
      for (char& ch : file) {
        if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-') ch = '_';
      }
      KVTIER_RETURN_IF_ERROR(
          WriteHeatmap(absl::StrCat(prefix, "-niah-", file, ".png"), h, rows, cols, values));
    }
    o.log_x = true;
    o.title = "pass-key accuracy vs working-set budget (single needle, every depth)";
    o.x_label = "working-set budget / context";
    o.y_label = "exact-match accuracy";
    if (!series.empty()) KVTIER_RETURN_IF_ERROR(WriteLinePlot(prefix + "-niah.png", o, series));
  }
  if (copy != nullptr) {
    std::vector<std::string> variants;
    std::vector<int32_t> divisors;
    Axes(*copy, &variants, &divisors);
    const int32_t div = std::find(divisors.begin(), divisors.end(), 16) != divisors.end()
                            ? 16
                            : (divisors.empty() ? 0 : divisors.front());
    std::vector<PlotSeries> series;
    PlotSeries first{"first occurrence", {}, {}, true};
    for (const std::string& v : variants) {
      PlotSeries s;
      s.name = v == "full" ? v : absl::StrCat(v, "@1/", div);
      for (const CopyCell& c : *copy) {
        if (c.variant != v || !c.status.ok() || c.trials == 0) continue;
        if (v != "full" && c.budget_divisor != div) continue;
        s.x.push_back(static_cast<double>(c.distance));
        s.y.push_back(c.repeat_loss);
        s.dashed = c.mode == RetrievalMode::kDrop;
        if (v == "full") {
          first.x.push_back(static_cast<double>(c.distance));
          first.y.push_back(c.first_loss);
        }
      }
      if (!s.x.empty()) series.push_back(std::move(s));
    }
    if (!first.x.empty()) series.insert(series.begin(), first);
    o = PlotOptions();
    o.log_x = true;
    o.title = "loss on a repeated passage vs distance to its first occurrence";
    o.x_label = "distance (tokens)";
    o.y_label = "loss (nats/token)";
    if (!series.empty()) KVTIER_RETURN_IF_ERROR(WriteLinePlot(prefix + "-copy.png", o, series));
  }
  return absl::OkStatus();
}

int RunTaskCommand(const EvalFlags& f, const std::vector<EvalVariant>& variants) {
  const char* cmd = "eval";
  std::vector<NeedleKind> kinds;
  for (absl::string_view n : absl::StrSplit(f.needles, ',', absl::SkipEmpty())) {
    NeedleKind k;
    if (!ParseNeedleKind(std::string_view(n.data(), n.size()), &k)) {
      std::cerr << "kvtier-run eval: --needles: unknown '" << n
                << "' (single, multikey, multivalue)\n";
      return 2;
    }
    kinds.push_back(k);
  }
  for (int32_t d : f.divisors) {
    if (d < 2) {
      std::cerr << "kvtier-run eval: --budget-divisors " << d << ": each must be at least 2\n";
      return 2;
    }
  }
  Loaded in;
  if (int rc = Load(f.m, cmd, &in); rc != 0) return rc;
  Engine& e = *in.engine;
  const int64_t model_context = e.config().context > 0 ? e.config().context : 4096;
  TaskOptions task;
  task.budget_divisors = f.divisors;
  task.page_size = f.m.page_size;
  if (!SplitOf(f, &task.split)) return 2;
  task.seed = f.seed;
  const absl::Time started = absl::Now();
  absl::Time last = absl::InfinitePast();
  auto progress = [&](const std::string& name, int64_t done, int64_t total) {
    if (f.m.quiet || (absl::Now() - last < absl::Milliseconds(500) && done < total)) return;
    last = absl::Now();
    std::fprintf(stderr, "\r%s: prompt %lld/%lld (%.0f s)%s", name.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 absl::ToDoubleSeconds(absl::Now() - started), done == total ? "\n" : "");
  };
  std::ostringstream head;
  head << "{\"bench\": \"kvtier-run eval --task " << f.task << "\", \"commit\": \""
       << KVTIER_GIT_COMMIT << "\", \"model\": \"" << JsonEscape(e.config().ToString())
       << "\", \"device\": \"" << JsonEscape(e.device().Describe()) << "\", \"kv_dtype\": \""
       << f.m.kv_dtype << "\", \"page_size\": " << f.m.page_size << ", \"summary\": \""
       << (f.summary.empty() ? "default" : f.summary) << "\", \"split\": \""
       << (f.split.empty() ? "default" : f.split)
       << "\", \"text_tokens\": " << in.ids.size() << ", \"seed\": " << f.seed
       << ", \"tau\": " << f.tau;
  std::string body;
  absl::Status failed;
  std::vector<NiahCell> niah;
  std::vector<CopyCell> copy;
  if (f.task == "niah") {
    NiahOptions o;
    o.task = task;
    // By default the model's context less the longest answer (a multivalue one lists 4 keys).
    const bool multivalue =
        std::find(kinds.begin(), kinds.end(), NeedleKind::kMultiValue) != kinds.end();
    o.contexts = f.contexts.empty() ? std::vector<int64_t>{model_context - (multivalue ? 48 : 16)}
                                    : f.contexts;
    o.depths = f.depths;
    if (f.trials > 0) o.trials = f.trials;
    o.kinds = kinds;
    if (!f.m.quiet) {
      std::fprintf(stderr,
                   "model: %s\nniah: contexts %s, %d depths, %d trials, needles %s, budgets 1/%s, "
                   "%zu variants\n",
                   e.config().ToString().c_str(), absl::StrJoin(o.contexts, ",").c_str(), o.depths,
                   o.trials, f.needles.c_str(), absl::StrJoin(f.divisors, ",1/").c_str(),
                   variants.size());
    }
    absl::StatusOr<std::vector<NiahCell>> r = RunNiah(e, in.ids, o, variants, progress);
    if (!r.ok()) {
      std::cerr << "\nkvtier-run eval: " << r.status() << "\n";
      return absl::IsInvalidArgument(r.status()) ? 2 : 1;
    }
    niah = *std::move(r);
    PrintNiah(niah, std::cout);
    head << ", \"contexts\": [" << absl::StrJoin(o.contexts, ", ") << "], \"depths\": " << o.depths
         << ", \"trials\": " << o.trials;
    for (size_t i = 0; i < niah.size(); ++i) {
      absl::StrAppend(&body, i ? ",\n  " : "\n  ", NiahJson(niah[i]));
      if (!niah[i].status.ok() && failed.ok()) failed = niah[i].status;
    }
  } else {
    CopyOptions o;
    o.task = task;
    o.passage = f.passage;
    if (f.trials > 0) o.trials = f.trials;
    o.distances = f.distances;
    o.context = f.context;
    const int64_t copy_context = o.context > 0 ? o.context : model_context;
    if (o.distances.empty()) {
      for (int64_t d : {int64_t{512}, int64_t{1024}, int64_t{2048}, copy_context * 3 / 4}) {
        if (1 + d + f.passage <= copy_context && (o.distances.empty() || d > o.distances.back())) {
          o.distances.push_back(d);
        }
      }
    }
    if (!f.m.quiet) {
      std::fprintf(
          stderr,
          "model: %s\ncopy: distances %s, passage %d, %d trials, budgets 1/%s, %zu variants\n",
          e.config().ToString().c_str(), absl::StrJoin(o.distances, ",").c_str(), o.passage,
          o.trials, absl::StrJoin(f.divisors, ",1/").c_str(), variants.size());
    }
    absl::StatusOr<std::vector<CopyCell>> r = RunCopy(e, in.ids, o, variants, progress);
    if (!r.ok()) {
      std::cerr << "\nkvtier-run eval: " << r.status() << "\n";
      return absl::IsInvalidArgument(r.status()) ? 2 : 1;
    }
    copy = *std::move(r);
    PrintCopy(copy, std::cout);
    head << ", \"passage\": " << o.passage << ", \"trials\": " << o.trials;
    for (size_t i = 0; i < copy.size(); ++i) {
      absl::StrAppend(&body, i ? ",\n  " : "\n  ", CopyJson(copy[i]));
      if (!copy[i].status.ok() && failed.ok()) failed = copy[i].status;
    }
  }
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    out << head.str() << ", \"results\": [" << body << "]}\n";
    if (!out) {
      std::cerr << "kvtier-run eval: cannot write --json " << f.json << "\n";
      return 1;
    }
  }
  if (!f.plot.empty()) {
    absl::Status st =
        WriteTaskPlots(f.plot, niah.empty() ? nullptr : &niah, copy.empty() ? nullptr : &copy);
    if (!st.ok()) {
      std::cerr << "kvtier-run eval: --plot: " << st << "\n";
      return 1;
    }
  }
  if (!failed.ok()) {
    std::cerr << "kvtier-run eval: a run failed: " << failed << "\n";
    return absl::IsInvalidArgument(failed) ? 2 : 1;
  }
  return 0;
}

}  // namespace

int RunEvalCommand(const EvalFlags& f) {
  std::vector<EvalVariant> variants;
  std::vector<std::string> names = VariantNames();
  if (!f.variants.empty()) names = absl::StrSplit(f.variants, ',', absl::SkipEmpty());
  for (const std::string& n : names) {
    absl::StatusOr<EvalVariant> v = MakeVariant(n, f);
    if (!v.ok()) {
      std::cerr << "kvtier-run eval: " << v.status().message() << "\n";
      return 2;
    }
    variants.push_back(*std::move(v));
  }
  if (f.task != "ppl") return RunTaskCommand(f, variants);
  Loaded in;
  if (int rc = Load(f.m, "eval", &in); rc != 0) return rc;
  Engine& e = *in.engine;
  const int64_t text_tokens = static_cast<int64_t>(in.ids.size());
  int64_t context =
      f.context > 0 ? f.context : std::min<int64_t>(e.config().context, text_tokens - 1);
  if (f.prefill > 0) context = f.prefill + f.steps;
  EvalOptions o;
  o.steps = f.steps;
  o.prefill_tokens = context - f.steps;
  o.page_size = f.m.page_size;
  if (!SplitOf(f, &o.split)) return 2;
  o.recall_every = f.recall_every;
  o.budgets = f.budgets;
  if (o.budgets.empty()) {
    const int64_t unit = 4 * int64_t{f.m.page_size};
    for (int div : {32, 16, 8, 4}) {
      const int64_t b = context / div / unit * unit;
      if (b >= unit && (o.budgets.empty() || b > o.budgets.back())) {
        o.budgets.push_back(static_cast<int32_t>(b));
      }
    }
  }
  if (!f.m.quiet) {
    std::fprintf(stderr,
                 "model: %s\ndevice: %s; KV %s, page %d\ntext: %lld tokens; context %lld = "
                 "prefill %lld + %lld scored steps; budgets %s; %zu variants\n",
                 e.config().ToString().c_str(), e.device().Describe().c_str(), f.m.kv_dtype.c_str(),
                 f.m.page_size, static_cast<long long>(text_tokens),
                 static_cast<long long>(context), static_cast<long long>(o.prefill_tokens),
                 static_cast<long long>(o.steps), absl::StrJoin(o.budgets, ",").c_str(),
                 variants.size());
  }
  const int64_t runs = 1 + static_cast<int64_t>(variants.size() * o.budgets.size());
  int64_t run_index = 0;
  std::string current;
  const absl::Time started = absl::Now();
  absl::Time last = absl::InfinitePast();
  int64_t current_done = 0, current_total = 0;
  auto progress = [&](const std::string& run, int64_t done, int64_t total) {
    if (run != current) {
      // A run that stopped short failed (reported at the end): keep its line.
      if (!f.m.quiet && current_done > 0 && current_done < current_total) std::fputc('\n', stderr);
      current = run;
      ++run_index;
    }
    current_done = done;
    current_total = total;
    if (f.m.quiet || (absl::Now() - last < absl::Milliseconds(500) && done < total)) return;
    last = absl::Now();
    std::fprintf(stderr, "\r[%lld/%lld] %-28s step %lld/%lld  (%.0f s)%s",
                 static_cast<long long>(run_index), static_cast<long long>(runs), run.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total),
                 absl::ToDoubleSeconds(absl::Now() - started), done == total ? "\n" : "");
  };
  absl::StatusOr<std::vector<EvalResult>> rs = RunEval(e, in.ids, o, variants, progress);
  if (!rs.ok()) {
    std::cerr << "\nkvtier-run eval: " << rs.status() << "\n";
    return absl::IsInvalidArgument(rs.status()) ? 2 : 1;
  }
  // Failed runs are reported, not fatal: the rest of the table, the JSON and the plots are
  // still written, and the exit status says that something failed.
  int failed_rc = 0;
  for (const EvalResult& r : *rs) {
    if (r.status.ok()) continue;
    std::cerr << (failed_rc == 0 ? "\n" : "") << "kvtier-run eval: " << r.variant << "@"
              << r.budget_tokens << " failed: " << r.status << "\n";
    const int rc = absl::IsInvalidArgument(r.status) ? 2 : 1;
    failed_rc = failed_rc == 0 ? rc : std::min(failed_rc, rc);
  }
  PrintTable(*rs, context, std::cout);
  if (!f.json.empty()) {
    std::ostringstream j;
    j << "{\"bench\": \"kvtier-run eval\", \"commit\": \"" << KVTIER_GIT_COMMIT
      << "\", \"model\": \"" << JsonEscape(e.config().ToString()) << "\", \"device\": \""
      << JsonEscape(e.device().Describe()) << "\", \"kv_dtype\": \"" << f.m.kv_dtype
      << "\", \"page_size\": " << f.m.page_size << ", \"summary\": \""
      << (f.summary.empty() ? "default" : f.summary) << "\", \"split\": \""
      << (f.split.empty() ? "default" : f.split) << "\", \"text_tokens\": " << text_tokens
      << ", \"context\": " << context << ", \"prefill_tokens\": " << o.prefill_tokens
      << ", \"steps\": " << o.steps << ", \"recall_every\": " << o.recall_every
      << ", \"tau\": " << f.tau << ", \"results\": [";
    for (size_t i = 0; i < rs->size(); ++i)
      j << (i ? ",\n  " : "\n  ") << ResultJson((*rs)[i], rs->front());
    j << "]}\n";
    std::ofstream out(f.json);
    out << j.str();
    if (!out) {
      std::cerr << "kvtier-run eval: cannot write --json " << f.json << "\n";
      return 1;
    }
  }
  if (!f.plot.empty()) {
    if (absl::Status st = WritePlots(f.plot, *rs, context); !st.ok()) {
      std::cerr << "kvtier-run eval: --plot: " << st << "\n";
      return 1;
    }
  }
  return failed_rc;
}

CLI::App* AddTraceCommand(CLI::App& app, TraceFlags* t) {
  CLI::App* c =
      app.add_subcommand("trace", "dump a real decode trace of the model (docs/trace-format.md)");
  c->add_option("--model", t->m.model, "GGUF file")->required();
  c->add_option("--text", t->m.text_file, "text: the prefill, then one decode step per token")
      ->required();
  c->add_option("--out", t->out, "the trace file to write")->required();
  c->add_option("--steps", t->steps, "decode steps")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  c->add_option("--prefill", t->prefill, "prefill tokens (0: the text's tokens minus the steps)");
  c->add_option("--dtype", t->dtype, "the trace's dtype: fp16, bf16 or fp32");
  c->add_option("--page-size", t->m.page_size, "the page size recorded in the trace");
  c->add_option("--device", t->m.device, "cpu, cuda or auto");
  c->add_option("--threads", t->m.threads, "CPU threads (0: all cores)");
  c->add_flag("--quiet", t->m.quiet, "no progress on stderr");
  return c;
}

int RunTraceCommand(const TraceFlags& t) {
  DType dt;
  if (!ParseDType(t.dtype, &dt)) {
    std::cerr << "kvtier-run trace: --dtype: unknown '" << t.dtype << "' (fp16, bf16, fp32)\n";
    return 2;
  }
  ModelFlags m = t.m;
  m.kv_dtype = "fp32";  // the decoder's KV dtype does not matter: the dense path is F32
  Loaded in;
  if (int rc = Load(m, "trace", &in); rc != 0) return rc;
  Engine& e = *in.engine;
  const LlamaConfig& c = e.config();
  const int64_t text_tokens = static_cast<int64_t>(in.ids.size());
  const int64_t prefill = t.prefill > 0 ? t.prefill : text_tokens - t.steps;
  if (prefill < 1 || prefill + t.steps > text_tokens) {
    std::cerr << absl::StrFormat(
        "kvtier-run trace: --prefill %d + --steps %d need %d tokens; the text has %d\n", prefill,
        t.steps, prefill + t.steps, text_tokens);
    return 2;
  }
  TraceHeader h;
  h.layers = c.layers;
  h.q_heads = c.q_heads;
  h.kv_heads = c.kv_heads;
  h.head_dim = c.head_dim;
  h.page_size = t.m.page_size;
  h.dtype = dt;
  h.prefill_tokens = prefill;
  h.steps = t.steps;
  absl::StatusOr<std::unique_ptr<TraceWriter>> w = TraceWriter::Create(t.out, h);
  if (!w.ok()) {
    std::cerr << "kvtier-run trace: " << w.status() << "\n";
    return absl::IsInvalidArgument(w.status()) ? 2 : 1;
  }
  // The dense forward feeds the writer: prompt chunks' K/V, then each step's q, k, v.
  int64_t step = -1;
  Decoder& dec = e.decoder();
  dec.SetLayerObserver([&](const LayerRows& r) -> absl::Status {
    if (step < 0) return (*w)->WritePrefill(r.layer, r.positions[0], r.rows, r.k, r.v);
    return (*w)->WriteStep(step, r.layer, r.q, r.k, r.v);
  });
  absl::Status st;
  absl::StatusOr<std::unique_ptr<DenseKv>> kv = DenseKv::Create(c, e.device(), prefill + t.steps);
  std::vector<float> logits;
  if (!kv.ok()) st = kv.status();
  if (st.ok()) {
    st = dec.PrefillDense(**kv, std::vector<int32_t>(in.ids.begin(), in.ids.begin() + prefill),
                          &logits);
  }
  for (step = 0; st.ok() && step < t.steps; ++step) {
    st = dec.StepDense(**kv, in.ids[prefill + step], &logits);
    if (!t.m.quiet && (step % 16 == 15 || step + 1 == t.steps)) {
      std::fprintf(stderr, "\rtrace: step %lld/%lld", static_cast<long long>(step + 1),
                   static_cast<long long>(t.steps));
    }
  }
  dec.SetLayerObserver({});
  if (st.ok()) st = (*w)->Close();
  if (!st.ok()) {
    std::cerr << "\nkvtier-run trace: " << st << "\n";
    return 1;
  }
  if (!t.m.quiet) {
    std::fprintf(stderr,
                 "\nwrote %s: %d layers, Hq %d, Hkv %d, d %d, page %d, %s, T = %lld, N = %lld\n",
                 t.out.c_str(), h.layers, h.q_heads, h.kv_heads, h.head_dim, h.page_size,
                 t.dtype.c_str(), static_cast<long long>(prefill), static_cast<long long>(t.steps));
  }
  return 0;
}

}  // namespace kvtier::engine
