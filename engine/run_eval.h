// kvtier-run's evaluation subcommands (docs/eval.md):
//   eval   quality of every mode and policy against full KV on held-out text (eval.h):
//          a table on stderr, JSON and PNG plots;
//   trace  a real decode trace of the model in the documented trace format
//          (docs/trace-format.md), for kvtier-bench decode and outside tools.
#ifndef KVTIER_ENGINE_RUN_EVAL_H_
#define KVTIER_ENGINE_RUN_EVAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "engine/generate.h"

namespace kvtier::engine {

// What eval and trace share: the model and where it runs.
struct ModelFlags {
  std::string model;
  std::string text_file;
  std::string kv_dtype = "fp16";
  std::string device = "cpu";
  int threads = 0;
  int32_t prefill_chunk = 256;
  int32_t page_size = 32;
  bool quiet = false;
};

struct EvalFlags {
  ModelFlags m;
  // ppl: teacher-forced perplexity and KL against full KV (eval.h); niah and copy: the
  // retrieval tasks (eval_tasks.h).
  std::string task = "ppl";
  int64_t prefill = 0;  // 0: the context left after the steps
  int64_t steps = 256;
  int64_t context = 0;  // 0: the model's (or the text's, when shorter)
  std::vector<int32_t> budgets;  // empty: 1/32, 1/16, 1/8, 1/4 of the context
  std::string variants;          // empty: all
  float tau = kDefaultCorrectionThreshold;  // the library's
  float max_loss = -1;  // < 0: the library default
  std::string summary;  // page summaries of every variant: minmax, center-mad, empty: the default
  std::string split;  // the budget's sink : selected : recent parts; empty: the library's
  int32_t recall_every = 4;
  std::string json;
  std::string plot;  // PNG path prefix: <plot>-ppl.png, <plot>-kl.png, <plot>-recall.png
  // niah and copy: budgets as fractions 1/d of each prompt's context.
  std::vector<int32_t> divisors = {32, 16, 8, 4};
  std::vector<int64_t> contexts;   // niah: prompt lengths (empty: the model's context)
  int32_t depths = 10;             // niah
  int32_t trials = 0;              // niah: 3, copy: 2 when 0
  std::string needles = "single,multikey";  // niah
  std::vector<int64_t> distances;  // copy (empty: 512, 1024, 2048 and 3/4 of the context)
  int32_t passage = 128;           // copy
  uint64_t seed = 1;
};

struct TraceFlags {
  ModelFlags m;
  int64_t prefill = 0;  // 0: the text's tokens minus the steps
  int64_t steps = 64;
  std::string out;
  std::string dtype = "fp16";
};

// Registers the subcommands on `app`; the flags are written into `f` / `t`.
CLI::App* AddEvalCommand(CLI::App& app, EvalFlags* f);
CLI::App* AddTraceCommand(CLI::App& app, TraceFlags* t);
// The engine's options from the flags every subcommand shares; INVALID_ARGUMENT naming
// --kv-dtype or --device for a name it does not know.
absl::StatusOr<EngineOptions> EngineOptionsFrom(const std::string& model,
                                                const std::string& kv_dtype,
                                                const std::string& device, int threads,
                                                int32_t prefill_chunk, int32_t max_batch);

// The whole file at `path` (prompts, texts); NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadText(const std::string& path);

// Process exit codes: 0 done, 1 runtime failure, 2 bad flags or input.
int RunEvalCommand(const EvalFlags& f);
int RunTraceCommand(const TraceFlags& t);

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_RUN_EVAL_H_
