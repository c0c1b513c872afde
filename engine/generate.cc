#include "engine/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace kvtier::engine {

Engine::~Engine() {
  // Weights and scratch are device memory: release them before the device.
  decoder_.reset();
  weights_ = LlamaWeights();
  math_.reset();
  stream_.reset();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  std::unique_ptr<Engine> e(new Engine());
  KVTIER_ASSIGN_OR_RETURN(e->file_, GgufFile::Open(options.model_path));
  KVTIER_ASSIGN_OR_RETURN(e->config_, LlamaConfig::FromGguf(*e->file_));
  KVTIER_ASSIGN_OR_RETURN(e->tokenizer_, LoadTokenizer(*e->file_));
  if (e->tokenizer_->vocab_size() > e->config_.vocab) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF: the tokenizer has %d tokens but token_embd.weight only %d rows",
                        e->tokenizer_->vocab_size(), e->config_.vocab));
  }
  DeviceOptions dopt;
  dopt.cpu_threads = options.threads;
  KVTIER_ASSIGN_OR_RETURN(e->device_, CreateDevice(options.device, dopt));
  KVTIER_ASSIGN_OR_RETURN(e->stream_, e->device_->CreateStream());
  KVTIER_ASSIGN_OR_RETURN(e->math_, CreateMath(*e->device_, *e->stream_, options.threads));
  KVTIER_ASSIGN_OR_RETURN(e->weights_,
                          LoadWeights(*e->file_, e->config_, *e->device_, *e->stream_));
  KVTIER_ASSIGN_OR_RETURN(e->decoder_, Decoder::Create(e->config_, e->weights_, *e->math_,
                                                       *e->stream_, options.decoder));
  return e;
}

bool ParsePlacement(std::string_view name, Placement* out) {
  if (name == "local" || name == "in-process") {
    *out = Placement::kInProcess;
  } else if (name == "shm") {
    *out = Placement::kShm;
  } else if (name == "grpc") {
    *out = Placement::kGrpc;
  } else {
    return false;
  }
  return true;
}

std::string_view PlacementName(Placement p) {
  switch (p) {
    case Placement::kInProcess:
      return "in-process";
    case Placement::kShm:
      return "shm";
    case Placement::kGrpc:
      return "grpc";
  }
  return "?";
}

bool ParseMode(std::string_view name, RetrievalMode* out) {
  for (RetrievalMode m : {RetrievalMode::kFull, RetrievalMode::kSync, RetrievalMode::kSpeculative,
                          RetrievalMode::kDrop}) {
    if (name == RetrievalModeName(m)) {
      *out = m;
      return true;
    }
  }
  return false;
}

namespace {

// The options a spec's sequences run with on `engine`.
absl::StatusOr<SequenceOptions> OptionsOf(Engine& engine, const SequenceSpec& spec) {
  SequenceOptions o = spec.options;
  o.compute_stream = &engine.stream();
  // Full mode keeps every page resident and ignores the budget, but the daemon still checks
  // it against max_tokens: give it the largest one that fits.
  const int32_t unit = 4 * spec.page_size;
  if (o.mode == RetrievalMode::kFull && o.budget_pages() * spec.page_size > o.max_tokens &&
      o.max_tokens >= unit) {
    KVTIER_RETURN_IF_ERROR(o.SetBudgetTokens(o.max_tokens / unit * unit, spec.page_size));
  }
  return o;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SequenceBatch>> EngineBatch(Engine& engine, const SequenceSpec& spec,
                                                           int32_t max_batch) {
  if (spec.placement != Placement::kInProcess) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a sequence batch holds in-process sequences, not %s ones", PlacementName(spec.placement)));
  }
  KVTIER_ASSIGN_OR_RETURN(SequenceOptions o, OptionsOf(engine, spec));
  const Geometry g =
      engine.config().KvGeometry(engine.decoder().options().kv_dtype, spec.page_size);
  return NewSequenceBatch(g, o, max_batch, engine.device());
}

absl::StatusOr<std::unique_ptr<EngineSequence>> EngineSequence::Open(Engine& engine,
                                                                     const SequenceSpec& spec,
                                                                     Client* client,
                                                                     SequenceBatch* batch) {
  auto s = std::unique_ptr<EngineSequence>(new EngineSequence());
  s->engine_ = &engine;
  const Geometry g =
      engine.config().KvGeometry(engine.decoder().options().kv_dtype, spec.page_size);
  KVTIER_ASSIGN_OR_RETURN(SequenceOptions o, OptionsOf(engine, spec));
  if (spec.placement == Placement::kInProcess) {
    if (batch != nullptr) {
      KVTIER_ASSIGN_OR_RETURN(s->local_, batch->NewSequence());
    } else {
      KVTIER_ASSIGN_OR_RETURN(s->local_, NewLocalSequence(g, o, engine.device()));
    }
    return s;
  }
  if (client == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence placement %s needs a kvtierd connection", PlacementName(spec.placement)));
  }
  SessionOptions so;
  so.geometry = g;
  so.sequence = o;
  so.transport = spec.placement == Placement::kShm ? Transport::kShm : Transport::kGrpc;
  so.device = &engine.device();
  so.label = spec.label;
  KVTIER_ASSIGN_OR_RETURN(s->session_, client->OpenSession(so));
  return s;
}

EngineSequence::~EngineSequence() {
  if (session_ || local_) engine_->decoder().Forget(&sequence());
}

absl::Status EngineSequence::Close() {
  engine_->decoder().Forget(&sequence());
  if (session_) return session_->Close();
  return local_->Close();
}

namespace {

// Greedy: the first index of the maximum (as torch.argmax). Otherwise a sample from the
// softmax of logits / temperature over the top_k.
int32_t Sample(const float* logits, int32_t vocab, const GenerateOptions& o, std::mt19937_64& rng) {
  if (o.temperature <= 0.0f) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  const int32_t k = std::clamp(o.top_k, 1, vocab);
  std::vector<int32_t> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  std::vector<double> p(k);
  const double mx = logits[idx[0]];
  for (int32_t i = 0; i < k; ++i) p[i] = std::exp((logits[idx[i]] - mx) / o.temperature);
  std::discrete_distribution<int32_t> dist(p.begin(), p.end());
  return idx[dist(rng)];
}

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

absl::Status CheckOptions(const GenerateOptions& o) {
  if (o.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("generate: max_new_tokens = %d must be at least 1", o.max_new_tokens));
  }
  if (o.prompt_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("generate: prompt_steps = %d must not be negative", o.prompt_steps));
  }
  return absl::OkStatus();
}

// The prompt's tokens the prefill takes, and those decode steps feed after it (at least one
// token is prefilled).
size_t PrefillCount(const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  const size_t steps = std::min<size_t>(o.prompt_steps, prompt.empty() ? 0 : prompt.size() - 1);
  return prompt.size() - steps;
}

// Keeps the logits row (when asked), samples the next token of sequence `index` into `r`
// and streams it. True when `r` is complete (max_new_tokens, or its EOS).
bool TakeToken(const float* row, int32_t vocab, int32_t eos, int32_t index,
               const GenerateOptions& o, std::mt19937_64& rng, GenerateResult& r,
               const TokenFn& on_token) {
  if (o.keep_logits) r.logits.emplace_back(row, row + vocab);
  const int32_t t = Sample(row, vocab, o, rng);
  r.tokens.push_back(t);
  if (on_token) on_token(index, t);
  return static_cast<int32_t>(r.tokens.size()) >= o.max_new_tokens || (o.stop_at_eos && t == eos);
}

}  // namespace

absl::StatusOr<std::vector<GenerateResult>> Generate(
    Engine& engine, const std::vector<Sequence*>& seqs,
    const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
    const TokenFn& on_token, const ProgressFn& progress) {
  if (seqs.empty() || seqs.size() != prompts.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("generate: %d sequences and %d prompts: need one prompt per sequence",
                        seqs.size(), prompts.size()));
  }
  KVTIER_RETURN_IF_ERROR(CheckOptions(options));
  const int32_t vocab = engine.config().vocab;
  const int32_t eos = engine.tokenizer().eos();
  std::mt19937_64 rng(options.seed);
  std::vector<GenerateResult> results(seqs.size());
  std::vector<float> logits;
  absl::Time t0 = absl::Now();
  int64_t total_prompt = 0, done_prompt = 0;
  for (const auto& p : prompts) total_prompt += static_cast<int64_t>(p.size());
  std::vector<bool> finished(seqs.size(), false);
  auto take = [&](size_t b, const float* row) {
    if (TakeToken(row, vocab, eos, static_cast<int32_t>(b), options, rng, results[b], on_token)) {
      finished[b] = true;
    }
  };
  for (size_t b = 0; b < seqs.size(); ++b) {
    results[b].prompt_tokens = static_cast<int64_t>(prompts[b].size());
    const size_t prefilled = PrefillCount(prompts[b], options);
    KVTIER_RETURN_IF_ERROR(engine.decoder().Prefill(
        *seqs[b], std::vector<int32_t>(prompts[b].begin(), prompts[b].begin() + prefilled), &logits,
        [&](int64_t done, int64_t) {
          if (progress) progress(done_prompt + done, total_prompt);
        }));
    for (size_t i = prefilled; i < prompts[b].size(); ++i) {
      KVTIER_RETURN_IF_ERROR(engine.decoder().Step({seqs[b]}, {prompts[b][i]}, &logits));
    }
    done_prompt += static_cast<int64_t>(prompts[b].size());
    if (progress) progress(done_prompt, total_prompt);
    take(b, logits.data());
  }
  const double prefill = Seconds(t0);
  t0 = absl::Now();
  int64_t steps = 0;
  const size_t max_batch = static_cast<size_t>(engine.decoder().options().max_batch);
  for (;;) {
    std::vector<size_t> active;
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (!finished[b]) active.push_back(b);
    }
    if (active.empty()) break;
    for (size_t first = 0; first < active.size(); first += max_batch) {
      const size_t n = std::min(max_batch, active.size() - first);
      std::vector<Sequence*> batch;
      std::vector<int32_t> tokens;
      for (size_t i = 0; i < n; ++i) {
        batch.push_back(seqs[active[first + i]]);
        tokens.push_back(results[active[first + i]].tokens.back());
      }
      KVTIER_RETURN_IF_ERROR(engine.decoder().Step(batch, tokens, &logits));
      for (size_t i = 0; i < n; ++i) take(active[first + i], logits.data() + i * vocab);
      ++steps;
    }
  }
  for (Sequence* s : seqs) KVTIER_RETURN_IF_ERROR(s->Wait());
  const double decode = Seconds(t0);
  for (GenerateResult& r : results) {
    r.prefill_seconds = prefill;
    r.decode_seconds = decode;
    r.decode_steps = steps;
  }
  return results;
}

absl::StatusOr<GenerateResult> GenerateDense(Engine& engine, const std::vector<int32_t>& prompt,
                                             const GenerateOptions& options,
                                             const TokenFn& on_token, const ProgressFn& progress) {
  KVTIER_RETURN_IF_ERROR(CheckOptions(options));
  const int32_t vocab = engine.config().vocab;
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<DenseKv> kv,
      DenseKv::Create(engine.config(), engine.device(),
                      static_cast<int64_t>(prompt.size()) + options.max_new_tokens));
  std::mt19937_64 rng(options.seed);
  GenerateResult r;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  std::vector<float> logits;
  absl::Time t0 = absl::Now();
  const size_t prefilled = PrefillCount(prompt, options);
  KVTIER_RETURN_IF_ERROR(engine.decoder().PrefillDense(
      *kv, std::vector<int32_t>(prompt.begin(), prompt.begin() + prefilled), &logits, progress));
  for (size_t i = prefilled; i < prompt.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(engine.decoder().StepDense(*kv, prompt[i], &logits));
  }
  r.prefill_seconds = Seconds(t0);
  t0 = absl::Now();
  const int32_t eos = engine.tokenizer().eos();
  while (!TakeToken(logits.data(), vocab, eos, 0, options, rng, r, on_token)) {
    KVTIER_RETURN_IF_ERROR(engine.decoder().StepDense(*kv, r.tokens.back(), &logits));
    ++r.decode_steps;
  }
  r.decode_seconds = Seconds(t0);
  return r;
}

}  // namespace kvtier::engine
