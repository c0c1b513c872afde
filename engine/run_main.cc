// kvtier-run: generates text from a Llama-family GGUF model whose KV cache lives in kvtier
// (docs/architecture.md#the-engine).
//
//   kvtier-run generate --model engine/model/kvtier-tiny.gguf --prompt-file P.txt -n 64
//       --modes speculative,full --budget 512 [--connect unix:///run/kvtier/kvtierd.sock
//       --transport shm|grpc] [--config run.toml]
//   kvtier-run info --model M.gguf
//   kvtier-run eval --model M.gguf --text held_out.txt [--steps 256 --budgets 128,256,...]
//   kvtier-run trace --model M.gguf --text T.txt --steps 64 --out T.kvtrace
//
// Each mode of --modes generates from the same prompt in turn (kvtier's full, sync,
// speculative and drop modes, and `dense`: the same model over a plain dense KV cache of
// the engine's own, the baseline); the first mode's text streams to stdout, progress and
// the summary (speed, KV held on the device side, agreement with the reference mode) go to
// stderr, and --json writes everything.
#include <toml++/toml.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/json.h"
#include "core/status.h"
#include "engine/generate.h"
#include "engine/run_eval.h"

// The commit the binary was built from (engine/CMakeLists.txt passes git describe).
#ifndef KVTIER_GIT_COMMIT
#define KVTIER_GIT_COMMIT "unknown"
#endif

namespace kvtier::engine {
namespace {

struct Flags {
  std::string model;
  std::string prompt;
  std::vector<std::string> prompt_files;
  int32_t n = 64;
  std::string modes = "speculative";
  std::string reference;  // the mode others are compared with; empty: full or dense if run
  int32_t budget = 512;
  int32_t page_size = 32;
  float tau = kDefaultCorrectionThreshold;
  std::string trigger = "cosine";
  float max_loss = kDefaultCorrectionMaxLoss;
  std::string kv_dtype = "fp16";
  std::string device = "cpu";
  int threads = 0;
  std::string connect;
  std::string transport = "shm";
  std::string tenant = "default";
  std::string token;
  float temperature = 0.0f;
  int32_t top_k = 40;
  uint64_t seed = 1;
  int32_t prompt_steps = 0;
  int32_t batch = 1;
  int32_t prefill_chunk = 256;
  std::string budget_policy = "fixed";
  std::string residency_policy = "none";
  std::string host_drop = "refuse";
  std::vector<std::string> policy_params;
  std::string json;
  bool quiet = false;
  bool no_stream = false;
};

// Reads the keys of a TOML config file into `f` (flags given on the command line win,
// since they are parsed after). Unknown keys are errors, naming the key.
absl::Status ReadConfig(const std::string& path, Flags* f) {
  toml::parse_result parsed = toml::parse_file(path);
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrFormat("--config %s: %s (line %d)", path,
                                                      std::string(parsed.error().description()),
                                                      parsed.error().source().begin.line));
  }
  const toml::table& t = parsed.table();
  for (const auto& [key_node, node] : t) {
    const std::string key(key_node.str());
    auto str = [&](std::string* out) -> absl::Status {
      if (auto v = node.value<std::string>()) {
        *out = *v;
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrFormat("--config %s: %s must be a string", path, key));
    };
    auto num = [&](auto* out) -> absl::Status {
      using T = std::remove_pointer_t<decltype(out)>;
      if (auto v = node.value<double>()) {
        *out = static_cast<T>(*v);
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrFormat("--config %s: %s must be a number", path, key));
    };
    absl::Status st;
    if (key == "model")
      st = str(&f->model);
    else if (key == "prompt")
      st = str(&f->prompt);
    else if (key == "modes" || key == "mode")
      st = str(&f->modes);
    else if (key == "reference")
      st = str(&f->reference);
    else if (key == "kv_dtype")
      st = str(&f->kv_dtype);
    else if (key == "device")
      st = str(&f->device);
    else if (key == "connect")
      st = str(&f->connect);
    else if (key == "transport")
      st = str(&f->transport);
    else if (key == "tenant")
      st = str(&f->tenant);
    else if (key == "n")
      st = num(&f->n);
    else if (key == "budget")
      st = num(&f->budget);
    else if (key == "page_size")
      st = num(&f->page_size);
    else if (key == "tau")
      st = num(&f->tau);
    else if (key == "trigger")
      st = str(&f->trigger);
    else if (key == "max_loss")
      st = num(&f->max_loss);
    else if (key == "threads")
      st = num(&f->threads);
    else if (key == "temperature")
      st = num(&f->temperature);
    else if (key == "top_k")
      st = num(&f->top_k);
    else if (key == "batch")
      st = num(&f->batch);
    else if (key == "prompt_steps")
      st = num(&f->prompt_steps);
    else if (key == "prefill_chunk")
      st = num(&f->prefill_chunk);
    else if (key == "policy" && node.is_table()) {
      for (const auto& [pk, pv] : *node.as_table()) {
        const std::string k(pk.str());
        auto v = pv.value<std::string>();
        if (k == "params" && pv.is_table()) {
          for (const auto& [qk, qv] : *pv.as_table()) {
            auto s = qv.value<std::string>();
            auto d = qv.value<double>();
            if (!s && !d) {
              return absl::InvalidArgumentError(absl::StrFormat(
                  "--config %s: policy.params.%s must be a string or a number", path, qk.str()));
            }
            f->policy_params.push_back(
                absl::StrCat(std::string(qk.str()), "=", s ? *s : absl::StrCat(*d)));
          }
        } else if (!v) {
          return absl::InvalidArgumentError(
              absl::StrFormat("--config %s: policy.%s must be a string", path, k));
        } else if (k == "budget") {
          f->budget_policy = *v;
        } else if (k == "residency") {
          f->residency_policy = *v;
        } else if (k == "host_drop") {
          f->host_drop = *v;
        } else {
          return absl::InvalidArgumentError(absl::StrFormat(
              "--config %s: unknown key policy.%s (budget, residency, host_drop, params)", path,
              k));
        }
      }
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--config %s: unknown key '%s' (model, prompt, modes, reference, n, budget, "
          "page_size, tau, trigger, max_loss, kv_dtype, device, threads, connect, transport, "
          "tenant, temperature, "
          "top_k, batch, prefill_chunk, [policy])",
          path, key));
    }
    KVTIER_RETURN_IF_ERROR(st);
  }
  return absl::OkStatus();
}

struct ModeRun {
  std::string mode;
  std::vector<GenerateResult> results;  // one per sequence of the batch
  SequenceStats stats;                  // summed over the batch
  int64_t full_kv_bytes = 0;            // the whole cache, all sequences, at the end
  int64_t device_kv_bytes = 0;          // held on the device side at the end; −1: unknown
  std::string text;                     // sequence 0's
};

int64_t FullKvBytes(const LlamaConfig& c, DType dt, int64_t tokens) {
  return tokens * c.layers * c.kv_heads * c.head_dim * 2 * static_cast<int64_t>(DTypeSize(dt));
}

absl::StatusOr<ModeRun> RunMode(Engine& engine, const Flags& f, const std::string& mode,
                                const std::vector<std::vector<int32_t>>& prompts, Client* client,
                                bool stream_text) {
  ModeRun run;
  run.mode = mode;
  GenerateOptions g;
  g.max_new_tokens = f.n;
  g.temperature = f.temperature;
  g.top_k = f.top_k;
  g.seed = f.seed;
  g.prompt_steps = f.prompt_steps;
  const Tokenizer& tok = engine.tokenizer();
  Utf8Stream utf8;
  auto on_token = [&](int32_t b, int32_t t) {
    if (b != 0 || !stream_text) return;
    std::cout << utf8.Push(tok.TokenBytes(t)) << std::flush;
  };
  absl::Time last_progress = absl::InfinitePast();
  absl::Time started = absl::Now();
  auto progress = [&](int64_t done, int64_t total) {
    if (f.quiet || (absl::Now() - last_progress < absl::Milliseconds(500) && done < total)) return;
    last_progress = absl::Now();
    const double s = absl::ToDoubleSeconds(absl::Now() - started);
    std::fprintf(stderr, "\r[%s] prefill %lld/%lld tokens (%.0f%%), %.0f tokens/s%s", mode.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), 100.0 * done / total,
                 s > 0 ? done / s : 0.0, done == total ? "\n" : "");
  };
  int64_t total_tokens = 0;
  for (const auto& p : prompts) total_tokens += static_cast<int64_t>(p.size()) + f.n;
  const DType dt = engine.decoder().options().kv_dtype;
  if (mode == "dense") {
    if (prompts.size() != 1) {
      return absl::InvalidArgumentError("--modes dense runs one prompt (--batch 1)");
    }
    KVTIER_ASSIGN_OR_RETURN(GenerateResult r,
                            GenerateDense(engine, prompts[0], g, on_token, progress));
    run.results.push_back(std::move(r));
    // The dense loop holds the whole cache in F32 on the device side.
    run.full_kv_bytes = FullKvBytes(engine.config(), dt, total_tokens);
    run.device_kv_bytes = FullKvBytes(engine.config(), DType::kF32, total_tokens);
  } else {
    SequenceSpec spec;
    if (!ParseMode(mode, &spec.options.mode)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--modes: unknown mode '%s' (full, sync, speculative, drop, dense)", mode));
    }
    spec.page_size = f.page_size;
    if (spec.options.mode != RetrievalMode::kFull) {
      KVTIER_RETURN_IF_ERROR(spec.options.SetBudgetTokens(f.budget, f.page_size));
    }
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
    const int64_t need = longest + f.n + f.page_size;
    spec.options.max_tokens =
        static_cast<int32_t>((need + f.page_size - 1) / f.page_size * f.page_size);
    spec.options.correction_threshold = f.tau;
    if (!ParseCorrectionTrigger(f.trigger, &spec.options.correction_trigger)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--trigger: unknown '%s' (cosine, mass)", f.trigger));
    }
    spec.options.correction_max_loss = f.max_loss;
    spec.options.policy.budget = f.budget_policy;
    spec.options.policy.residency = f.residency_policy;
    spec.options.policy.host_drop = f.host_drop;
    for (const std::string& kv : f.policy_params) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      spec.options.policy.params[p.first] = p.second;
    }
    if (!f.connect.empty() && !ParsePlacement(f.transport, &spec.placement)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--transport: unknown '%s' (shm, grpc)", f.transport));
    }
    // In-process sequences of a batch decode as one SequenceBatch (one launch of each op per
    // layer for the batch); what a batch cannot hold (a DMA recall strategy, a policy-managed
    // drop-mode working set) decodes sequence by sequence.
    std::unique_ptr<SequenceBatch> batch;
    if (spec.placement == Placement::kInProcess && prompts.size() > 1) {
      absl::StatusOr<std::unique_ptr<SequenceBatch>> made =
          EngineBatch(engine, spec, static_cast<int32_t>(prompts.size()));
      if (made.ok()) batch = *std::move(made);
    }
    std::vector<std::unique_ptr<EngineSequence>> owned;
    std::vector<Sequence*> seqs;
    for (size_t b = 0; b < prompts.size(); ++b) {
      absl::StatusOr<std::unique_ptr<EngineSequence>> s =
          EngineSequence::Open(engine, spec, client, batch.get());
      if (!s.ok() && batch != nullptr && b == 0 && absl::IsInvalidArgument(s.status())) {
        batch.reset();
        s = EngineSequence::Open(engine, spec, client);
      }
      if (!s.ok()) return s.status();
      seqs.push_back(&(*s)->sequence());
      owned.push_back(*std::move(s));
    }
    KVTIER_ASSIGN_OR_RETURN(run.results, Generate(engine, seqs, prompts, g, on_token, progress));
    for (Sequence* s : seqs) {
      const SequenceStats st = s->Stats();
      run.stats.steps += st.steps;
      run.stats.recalled_bytes += st.recalled_bytes;
      run.stats.checked_heads += st.checked_heads;
      run.stats.corrected_heads += st.corrected_heads;
      run.stats.resident_bytes += st.resident_bytes;
      run.stats.resident_head_pages += st.resident_head_pages;
      run.stats.selection_bytes += st.selection_bytes;
    }
    run.full_kv_bytes = FullKvBytes(engine.config(), dt, total_tokens);
    // A GRPC session's working set is in kvtierd, whose step replies do not carry it: −1.
    run.device_kv_bytes = seqs[0]->local() == nullptr ? -1 : run.stats.resident_bytes;
    for (auto& s : owned) KVTIER_RETURN_IF_ERROR(s->Close());
  }
  if (stream_text) std::cout << utf8.Flush() << std::flush;
  run.text = tok.Decode(run.results[0].tokens);
  return run;
}

// Positions where two generations agree, and the first where they differ (−1: never).
std::pair<double, int64_t> Agreement(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  int64_t same = 0, first_diff = -1;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] == b[i]) {
      ++same;
    } else if (first_diff < 0) {
      first_diff = static_cast<int64_t>(i);
    }
  }
  if (first_diff < 0 && a.size() != b.size()) first_diff = static_cast<int64_t>(n);
  return {n == 0 ? 0.0 : static_cast<double>(same) / n, first_diff};
}

int RunGenerate(const Flags& f) {
  absl::StatusOr<EngineOptions> eo =
      EngineOptionsFrom(f.model, f.kv_dtype, f.device, f.threads, f.prefill_chunk, f.batch);
  if (!eo.ok()) {
    std::cerr << "kvtier-run: " << eo.status().message() << "\n";
    return 2;
  }
  const DType dt = eo->decoder.kv_dtype;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Open(*eo);
  if (!engine.ok()) {
    std::cerr << "kvtier-run: " << engine.status() << "\n";
    return 1;
  }
  Engine& e = **engine;
  // The prompts: --prompt, or each --prompt-file; --batch copies them up to the batch size.
  std::vector<std::string> texts;
  if (!f.prompt.empty()) texts.push_back(f.prompt);
  for (const std::string& p : f.prompt_files) {
    absl::StatusOr<std::string> text = ReadText(p);
    if (!text.ok()) {
      std::cerr << "kvtier-run: --prompt-file: " << text.status().message() << "\n";
      return 2;
    }
    texts.push_back(*std::move(text));
  }
  if (texts.empty()) {
    std::cerr << "kvtier-run: give --prompt or --prompt-file\n";
    return 2;
  }
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t b = 0; b < std::max<int32_t>(f.batch, static_cast<int32_t>(texts.size())); ++b) {
    prompts.push_back(e.tokenizer().Encode(texts[b % texts.size()]));
  }
  const int64_t longest =
      static_cast<int64_t>(std::max_element(prompts.begin(), prompts.end(), [](auto& a, auto& b) {
                             return a.size() < b.size();
                           })->size());
  if (!f.quiet) {
    std::fprintf(stderr,
                 "model: %s\ndevice: %s; KV %s, page %d; %zu prompt(s), longest %lld tokens\n",
                 e.config().ToString().c_str(), e.device().Describe().c_str(),
                 std::string(DTypeName(dt)).c_str(), f.page_size, prompts.size(),
                 static_cast<long long>(longest));
    if (longest + f.n > e.config().context) {
      std::fprintf(stderr, "note: %lld tokens exceed the model's trained context %d\n",
                   static_cast<long long>(longest + f.n), e.config().context);
    }
  }
  std::unique_ptr<Client> client;
  if (!f.connect.empty()) {
    ClientOptions co;
    co.tenant = f.tenant;
    co.token = f.token;
    co.client_name = "kvtier-run";
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(f.connect, co);
    if (!c.ok()) {
      std::cerr << "kvtier-run: --connect " << f.connect << ": " << c.status() << "\n";
      return 1;
    }
    client = *std::move(c);
  }
  std::vector<std::string> modes = absl::StrSplit(f.modes, ',', absl::SkipEmpty());
  // Flags every mode needs are checked before any mode runs.
  CorrectionTrigger trigger;
  if (!ParseCorrectionTrigger(f.trigger, &trigger)) {
    std::cerr << "kvtier-run: --trigger: unknown '" << f.trigger << "' (cosine, mass)\n";
    return 2;
  }
  {  // --tau, --trigger and --max-loss by the options' one resolver
    SequenceOptions check;
    check.correction_threshold = f.tau;
    check.correction_trigger = trigger;
    check.correction_max_loss = f.max_loss;
    if (absl::Status st = ResolveSequenceOptions(check, kDefaultPageSize).status(); !st.ok()) {
      std::cerr << "kvtier-run: " << st.message() << " (--tau, --max-loss)\n";
      return 2;
    }
  }
  for (const std::string& m : modes) {
    RetrievalMode mode;
    if (m != "dense" && !ParseMode(m, &mode)) {
      std::cerr << "kvtier-run: --modes: unknown mode '" << m
                << "' (full, sync, speculative, drop, dense)\n";
      return 2;
    }
    SequenceOptions check;
    if (m != "dense" && mode != RetrievalMode::kFull) {
      if (absl::Status st = check.SetBudgetTokens(f.budget, f.page_size); !st.ok()) {
        std::cerr << "kvtier-run: --budget: " << st.message() << "\n";
        return 2;
      }
    }
  }
  std::vector<ModeRun> runs;
  for (size_t i = 0; i < modes.size(); ++i) {
    const bool stream = i == 0 && !f.no_stream;
    if (!f.quiet) {
      std::fprintf(
          stderr, "--- %s%s\n", modes[i].c_str(),
          modes[i] == "dense" ? "" : absl::StrFormat(" (budget %d tokens)", f.budget).c_str());
    }
    absl::StatusOr<ModeRun> run = RunMode(e, f, modes[i], prompts, client.get(), stream);
    if (!run.ok()) {
      std::cerr << "\nkvtier-run: " << modes[i] << ": " << run.status() << "\n";
      return 1;
    }
    if (stream) std::cout << "\n";
    runs.push_back(*std::move(run));
  }
  // The reference: --reference, else full, else dense, else none.
  const ModeRun* ref = nullptr;
  for (const char* name : {f.reference.c_str(), "full", "dense"}) {
    for (const ModeRun& r : runs) {
      if (ref == nullptr && !std::string(name).empty() && r.mode == name) ref = &r;
    }
  }
  std::ostringstream json;
  json << "{\"commit\": \"" << KVTIER_GIT_COMMIT << "\", \"threads\": " << f.threads
       << ", \"model\": \"" << JsonEscape(f.model) << "\", \"config\": \""
       << JsonEscape(e.config().ToString()) << "\", \"device\": \""
       << JsonEscape(e.device().Describe()) << "\", \"kv_dtype\": \"" << DTypeName(dt)
       << "\", \"budget_tokens\": " << f.budget << ", \"page_size\": " << f.page_size
       << ", \"prompts\": " << prompts.size() << ", \"prompt_tokens\": " << longest
       << ", \"new_tokens\": " << f.n << ", \"runs\": [";
  for (size_t i = 0; i < runs.size(); ++i) {
    const ModeRun& r = runs[i];
    const GenerateResult& g0 = r.results[0];
    int64_t prompt_total = 0, generated = 0;
    for (const GenerateResult& g : r.results) {
      prompt_total += g.prompt_tokens;
      generated += static_cast<int64_t>(g.tokens.size());
    }
    // The first token of each sequence comes from the prefill's logits.
    const int64_t decoded = generated - static_cast<int64_t>(r.results.size());
    const double prefill_tps = prompt_total / std::max(g0.prefill_seconds, 1e-9);
    const double decode_tps = decoded / std::max(g0.decode_seconds, 1e-9);
    const double held =
        r.full_kv_bytes > 0 ? static_cast<double>(r.device_kv_bytes) / r.full_kv_bytes : 0;
    std::pair<double, int64_t> agree{1.0, -1};
    if (ref != nullptr && ref != &r) agree = Agreement(ref->results[0].tokens, g0.tokens);
    if (!f.quiet) {
      std::fprintf(stderr, "%-12s prefill %8.1f tokens/s  decode %7.2f tokens/s  ", r.mode.c_str(),
                   prefill_tps, decode_tps);
      if (r.device_kv_bytes < 0) {
        std::fprintf(stderr, "KV working set in kvtierd (not reported over gRPC)");
      } else {
        std::fprintf(stderr, "KV on device %9.2f MiB of %9.2f MiB (%.3f)",
                     r.device_kv_bytes / 1048576.0, r.full_kv_bytes / 1048576.0, held);
        if (r.stats.selection_bytes > 0) {
          std::fprintf(stderr, " + summaries and key codes %.2f MiB",
                       r.stats.selection_bytes / 1048576.0);
        }
      }
      if (r.stats.checked_heads > 0) {
        std::fprintf(stderr, "  corrections %.3f", r.stats.correction_rate());
      }
      if (ref != nullptr && ref != &r) {
        std::fprintf(stderr, "  agreement with %s %.3f (first difference at %lld)",
                     ref->mode.c_str(), agree.first, static_cast<long long>(agree.second));
      }
      std::fprintf(stderr, "\n");
    }
    json << (i ? ", " : "") << "{\"mode\": \"" << r.mode
         << "\", \"prefill_tokens_per_s\": " << prefill_tps
         << ", \"decode_tokens_per_s\": " << decode_tps
         << ", \"prefill_seconds\": " << g0.prefill_seconds
         << ", \"decode_seconds\": " << g0.decode_seconds << ", \"decoded_tokens\": " << decoded
         << ", \"device_kv_bytes\": " << r.device_kv_bytes
         << ", \"full_kv_bytes\": " << r.full_kv_bytes
         << ", \"selection_bytes\": " << r.stats.selection_bytes
         << ", \"correction_rate\": " << r.stats.correction_rate()
         << ", \"recalled_bytes\": " << r.stats.recalled_bytes << ", \"agreement\": " << agree.first
         << ", \"first_difference\": " << agree.second << ", \"tokens\": ["
         << absl::StrJoin(g0.tokens, ", ") << "], \"text\": \"" << JsonEscape(r.text) << "\"}";
  }
  json << "]}\n";
  if (modes.size() > 1 && !f.quiet) {
    for (const ModeRun& r : runs) {
      std::fprintf(stderr, "\n=== %s ===\n%s\n", r.mode.c_str(), r.text.c_str());
    }
  }
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    out << json.str();
    if (!out) {
      std::cerr << "kvtier-run: cannot write --json " << f.json << "\n";
      return 1;
    }
  }
  return 0;
}

int Info(const std::string& model) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(model);
  if (!file.ok()) {
    std::cerr << "kvtier-run: " << file.status() << "\n";
    return 1;
  }
  absl::StatusOr<LlamaConfig> c = LlamaConfig::FromGguf(**file);
  if (!c.ok()) {
    std::cerr << "kvtier-run: " << c.status() << "\n";
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(**file);
  std::cout << c->ToString() << "\n"
            << "GGUF version " << (*file)->version() << ", " << (*file)->tensors().size()
            << " tensors, " << (*file)->Keys().size() << " metadata keys\n"
            << "tokenizer: "
            << (tok.ok()
                    ? absl::StrCat((*tok)->vocab_size(), " tokens, pre-tokenizer ", (*tok)->pre())
                    : std::string(tok.status().message()))
            << "\n";
  return tok.ok() ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) {
  using kvtier::engine::Flags;
  Flags f;
  // --config is read before the other flags, so that flags given override it.
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--config") {
      absl::Status st = kvtier::engine::ReadConfig(argv[i + 1], &f);
      if (!st.ok()) {
        std::cerr << "kvtier-run: " << st.message() << "\n";
        return 2;
      }
    }
  }
  CLI::App app{"kvtier-run: a Llama-family decoder whose KV cache lives in kvtier"};
  app.require_subcommand(1);
  std::string config;
  CLI::App* gen = app.add_subcommand("generate", "prompt in, streamed text out");
  gen->add_option("--config", config, "TOML file with any of the flags below (flags win)");
  gen->add_option("--model", f.model, "GGUF file (llama or qwen2 architecture)")
      ->required(f.model.empty());
  gen->add_option("--prompt", f.prompt, "prompt text");
  gen->add_option("--prompt-file", f.prompt_files, "prompt file (repeat for a batch of prompts)");
  gen->add_option("-n,--new-tokens", f.n, "tokens to generate per prompt")
      ->check(CLI::Range(1, 1 << 20));
  gen->add_option("--modes", f.modes,
                  "comma-separated: full, sync, speculative, drop, dense (the plain dense loop)");
  gen->add_option("--reference", f.reference,
                  "mode the others are compared with (default: full, else dense)");
  gen->add_option("--prompt-steps", f.prompt_steps,
                  "the prompt's last N tokens go through decode steps (the working set), not the "
                  "prefill: e.g. a question after a long context")
      ->check(CLI::Range(0, 1 << 20));
  gen->add_option("--budget", f.budget,
                  "working set in tokens (sync/speculative/drop), a multiple of 4 pages");
  gen->add_option("--page-size", f.page_size, "tokens per page");
  gen->add_option("--tau", f.tau, "speculative correction threshold τ (the cosine trigger)");
  gen->add_option("--trigger", f.trigger,
                  "speculative correction trigger: cosine (mean query cosine < τ) or mass (the "
                  "stale selection's estimated mass loss > --max-loss)");
  gen->add_option("--max-loss", f.max_loss, "the mass trigger's tolerated relative loss");
  gen->add_option("--kv-dtype", f.kv_dtype, "fp16, bf16 or fp32");
  gen->add_option("--device", f.device, "cpu, cuda or auto");
  gen->add_option("--threads", f.threads, "CPU threads (0: all cores)");
  gen->add_option("--connect", f.connect,
                  "kvtierd address (unix:///path or host:port); empty: in-process");
  gen->add_option("--transport", f.transport, "shm or grpc (with --connect)");
  gen->add_option("--tenant", f.tenant, "kvtierd tenant");
  gen->add_option("--token", f.token, "the tenant's token");
  gen->add_option("--temperature", f.temperature, "0: greedy");
  gen->add_option("--top-k", f.top_k, "sampling: top-k");
  gen->add_option("--seed", f.seed, "sampling seed");
  gen->add_option("--batch", f.batch, "sequences decoded together (prompts repeat to fill it)")
      ->check(CLI::Range(1, 1024));
  gen->add_option("--prefill-chunk", f.prefill_chunk, "prompt tokens per forward pass");
  gen->add_option("--budget-policy", f.budget_policy, "fixed, confidence, xkv, kv_compress, ...");
  gen->add_option("--residency-policy", f.residency_policy, "none, h2o, attention, epiphany, ...");
  gen->add_option("--host-drop", f.host_drop,
                  "refuse, evict (local sequences only) or demote (kvtierd with a cold tier)");
  gen->add_option("--policy-param", f.policy_params, "KEY=VALUE (repeatable)");
  gen->add_option("--json", f.json, "write the results as JSON");
  gen->add_flag("--quiet", f.quiet, "no progress or summary on stderr");
  gen->add_flag("--no-stream", f.no_stream, "do not stream the text to stdout");
  std::string info_model;
  CLI::App* info = app.add_subcommand("info", "print a GGUF model's configuration");
  info->add_option("--model", info_model, "GGUF file")->required();
  kvtier::engine::EvalFlags eval_flags;
  CLI::App* eval = kvtier::engine::AddEvalCommand(app, &eval_flags);
  kvtier::engine::TraceFlags trace_flags;
  CLI::App* trace = kvtier::engine::AddTraceCommand(app, &trace_flags);
  CLI11_PARSE(app, argc, argv);
  if (*info) return kvtier::engine::Info(info_model);
  if (*eval) return kvtier::engine::RunEvalCommand(eval_flags);
  if (*trace) return kvtier::engine::RunTraceCommand(trace_flags);
  return kvtier::engine::RunGenerate(f);
}
