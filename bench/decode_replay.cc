#include "bench/decode_replay.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "bench/synthetic_kv.h"
#include "core/status.h"
#include "engine/eval_metrics.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/registry.h"

namespace kvtier::bench {

absl::Status OpenReplayTrace(const std::string& path, const SyntheticTraceOptions& synthetic,
                             int32_t layers, std::unique_ptr<TraceSource>* trace, Geometry* g) {
  if (path.empty()) {
    KVTIER_ASSIGN_OR_RETURN(*trace, MakeSyntheticTrace(synthetic));
  } else {
    KVTIER_ASSIGN_OR_RETURN(*trace, OpenTraceFile(path));
  }
  *g = (*trace)->geometry();
  if (layers < kEveryLayer || layers > g->num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--layers = %d: must be in [1, %d] or all (the trace has %d layers)",
                        layers, g->num_layers, g->num_layers));
  }
  if (layers > 0) g->num_layers = layers;
  return absl::OkStatus();
}

namespace {

// One layer's accuracy sums over the scored steps.
struct LayerScore {
  double mass_pages = 0;   // Σ attention mass recall over pages
  double mass_tokens = 0;  // Σ attention mass recall over tokens
  int64_t mass_samples = 0;
  double rel_error = 0;
  int64_t error_samples = 0;
  int64_t corrected_heads = 0;
};

// One retrieval mode under test: a local sequence with its own host tier, or a session's.
struct ModeRun {
  std::string name;
  RetrievalMode mode = RetrievalMode::kFull;
  float tau = 0.0f;
  std::unique_ptr<Session> session;      // with ReplayBenchOptions::open_session
  std::unique_ptr<LocalSequence> local;  // otherwise
  Sequence* seq = nullptr;
  std::vector<DeviceBuffer> out;               // per layer [Hq][d]
  std::vector<std::vector<uint8_t>> out_host;  // per layer
  std::vector<std::vector<int32_t>> tables;    // per layer [Hkv][S], after BeginStep
  // Local sequences: per layer, a device copy of the slot table attention used, taken
  // before EndStep rewrites it and read back into `tables` after the step (untimed).
  std::vector<DeviceBuffer> table_copies;
  std::unique_ptr<Event> done;
  std::vector<LayerScore> layers;  // per layer
  SequenceStats base;              // Stats() when the step range began
  // Per timed step (scored, unprofiled), µs: the critical path (what the engine thread waits
  // for, the drain left out); the wall time from the step's first Append to the end of its
  // drain (everything the step made the machine do); the drain alone.
  std::vector<double> critical_us, wall_us, drain_us;
};

// The counters of `now` accumulated since `base` (same sequence, earlier snapshot).
SequenceStats Since(const SequenceStats& now, const SequenceStats& base) {
  SequenceStats d = now;
  d.steps -= base.steps;
  d.recalled_pages -= base.recalled_pages;
  d.recalled_bytes -= base.recalled_bytes;
  d.correction_pages -= base.correction_pages;
  d.checked_heads -= base.checked_heads;
  d.corrected_heads -= base.corrected_heads;
  d.profiled_steps -= base.profiled_steps;
  d.select_us -= base.select_us;
  d.recall_us -= base.recall_us;
  d.attention_us -= base.attention_us;
  return d;
}

double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// held[i] = 1 for the tokens i < held->size() whose page KV head h's slot table holds (the
// page being filled included: it sits in the recent region like any other).
void HeldTokens(const std::vector<int32_t>& table, int32_t num_kv_heads, int32_t h,
                int32_t page_size, std::vector<uint8_t>* held) {
  std::fill(held->begin(), held->end(), 0);
  const int64_t n = static_cast<int64_t>(held->size());
  const size_t S = table.size() / num_kv_heads;
  for (size_t s = 0; s < S; ++s) {
    const int64_t page = table[h * S + s];
    if (page < 0 || page * page_size >= n) continue;
    std::fill(held->begin() + page * page_size, held->begin() + std::min(n, (page + 1) * page_size),
              1);
  }
}

class Replay {
 public:
  Replay(const ReplayBenchOptions& o, std::ostream& log) : o_(o), log_(log) {}
  absl::StatusOr<JsonObject> Run();
  // After Run: every mode's timing samples.
  std::vector<ReplayModeTimes> Times() const;

 private:
  absl::Status Setup();
  absl::Status ResolveSteps();
  absl::Status ResolveBudget();
  absl::Status CreateBackendOrExplain();
  absl::Status AddMode(std::string name, RetrievalMode mode, float tau);
  absl::Status Prefill();
  absl::Status Step(int32_t step, bool scored, bool profiled);
  // Runs one layer of the step; adds its critical-path time (µs) to *critical_us.
  absl::Status RunLayer(ModeRun& m, int32_t layer, double* critical_us);
  // After the step's drain: the attention outputs and slot tables of a local sequence's
  // layers, for the accuracy metrics (untimed).
  absl::Status ReadBack(ModeRun& m);
  void Score(int32_t step);
  void ScoreMass(size_t mi, int32_t tokens);
  // `mass` gets the mode's mean attention-mass recall over pages (NaN without samples).
  JsonObject ModeReport(const ModeRun& m, double* mass) const;
  JsonObject Report() const;

  const ReplayBenchOptions o_;
  std::ostream& log_;
  std::unique_ptr<TraceSource> trace_;
  Geometry g_;         // the replayed geometry (first `layers` layers of the trace's)
  int32_t T_ = 0;      // prefill tokens
  int32_t N_ = 0;      // steps of the trace
  int32_t begin_ = 0;  // the scored steps: [begin_, end_); end_ is also the last run + 1
  int32_t end_ = 0;
  SequenceOptions split_;  // sink/selected/recent pages of every mode
  int32_t budget_tokens_ = 0;
  int32_t max_tokens_ = 0;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> io_;
  std::vector<ModeRun> modes_;           // modes_[0] is full: the reference
  std::vector<DeviceBuffer> q_, k_, v_;  // per layer, this step's inputs
  std::vector<std::vector<uint8_t>> q_host_;
  std::vector<int32_t> mass_layers_;
  std::vector<std::vector<float>> k_float_;  // per mass layer: all keys so far, [t][Hkv][d]
  ThreadPool pool_{2};
};

absl::Status Replay::AddMode(std::string name, RetrievalMode mode, float tau) {
  ModeRun m;
  m.name = std::move(name);
  m.mode = mode;
  m.tau = tau;
  SequenceOptions ro;
  ro.mode = mode;
  ro.sink_pages = split_.sink_pages;
  ro.selected_pages = split_.selected_pages;
  ro.recent_pages = split_.recent_pages;
  ro.max_tokens = max_tokens_;
  ro.correction_threshold = tau;
  ro.recall = o_.recall;
  ro.deadline = absl::Minutes(5);
  const bool host_tier = mode == RetrievalMode::kSpeculative || mode == RetrievalMode::kSync;
  if (host_tier && o_.open_session) {
    KVTIER_ASSIGN_OR_RETURN(m.session, o_.open_session(m.name, g_, ro, *backend_));
    m.seq = &m.session->sequence();
  } else {
    KVTIER_ASSIGN_OR_RETURN(m.local, NewLocalSequence(g_, ro, *backend_));
    m.seq = m.local.get();
  }
  const size_t q_bytes = static_cast<size_t>(g_.num_q_heads) * g_.head_dim * g_.element_bytes();
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, backend_->Allocate(q_bytes));
    m.out.push_back(std::move(b));
  }
  m.out_host.assign(g_.num_layers, std::vector<uint8_t>(q_bytes));
  m.tables.resize(g_.num_layers);
  if (m.seq->local() != nullptr) {
    // Room for a slot per page of the longest sequence: no mode holds more.
    const size_t table_bytes = static_cast<size_t>(g_.num_kv_heads) *
                               ((max_tokens_ + g_.page_size - 1) / g_.page_size) * sizeof(int32_t);
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, backend_->Allocate(table_bytes));
      m.table_copies.push_back(std::move(b));
    }
  }
  m.layers.resize(g_.num_layers);
  KVTIER_ASSIGN_OR_RETURN(m.done, backend_->CreateEvent());
  modes_.push_back(std::move(m));
  return absl::OkStatus();
}

absl::Status Replay::ResolveSteps() {
  N_ = trace_->num_steps();
  if (N_ < 1) return absl::InvalidArgumentError("replay: the trace has no decode steps");
  begin_ = o_.step_begin;
  end_ = o_.step_end < 0 ? N_ : o_.step_end;
  if (begin_ < 0 || begin_ >= end_ || end_ > N_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--step-range = %d:%d: must satisfy 0 <= A < B <= %d, the trace's decode "
                        "steps (half-open: steps A .. B-1 are scored)",
                        o_.step_begin, end_, N_));
  }
  if (o_.profile_steps < 0 || o_.profile_steps >= end_ - begin_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--profile-steps = %d: must be in [0, %d) (the steps in range)",
                        o_.profile_steps, end_ - begin_));
  }
  return absl::OkStatus();
}

// The working-set split of every mode, from --budget or --sink/--selected/--recent.
absl::Status Replay::ResolveBudget() {
  const int32_t p = g_.page_size;
  if (o_.pages.has_value()) {
    const ReplayBudgetPages& b = *o_.pages;
    if (b.sink < 0 || b.selected < 0 || b.recent < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--sink = %d, --selected = %d, --recent = %d pages: sink and selected must be >= 0 "
          "and recent >= 1 (it holds the page being filled)",
          b.sink, b.selected, b.recent));
    }
    const int64_t tokens = (int64_t{b.sink} + b.selected + b.recent) * p;
    if (tokens > INT32_MAX || (o_.budget_tokens != 0 && o_.budget_tokens != tokens)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--budget = %d tokens disagrees with --sink %d + --selected %d + --recent %d pages "
          "(%d tokens at page size %d): give one or the other",
          o_.budget_tokens, b.sink, b.selected, b.recent, tokens, p));
    }
    split_.sink_pages = b.sink;
    split_.selected_pages = b.selected;
    split_.recent_pages = b.recent;
  } else {
    if (o_.budget_tokens <= 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--budget = %d tokens: must be positive", o_.budget_tokens));
    }
    if (o_.budget_tokens % (4 * p) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--budget = %d tokens is not a multiple of 4 pages (%d tokens at page size %d), which "
          "the default split (SequenceOptions::SetBudgetTokens) needs; give the split in "
          "pages instead with --sink/--selected/--recent",
          o_.budget_tokens, 4 * p, p));
    }
    KVTIER_RETURN_IF_ERROR(split_.SetBudgetTokens(o_.budget_tokens, p));
  }
  budget_tokens_ = split_.budget_pages() * p;
  if (budget_tokens_ > T_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--budget = %d tokens (%d pages): must be at most the trace's %d prefill tokens, or the "
        "working set holds the whole context",
        budget_tokens_, split_.budget_pages(), T_));
  }
  if (o_.open_session && o_.pages.has_value()) {
    // kvtierd sessions take a budget in tokens and split it themselves.
    SequenceOptions daemon;
    if (!daemon.SetBudgetTokens(budget_tokens_, p).ok() || daemon.sink_pages != split_.sink_pages ||
        daemon.recent_pages != split_.recent_pages) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--sink/--selected/--recent = %d/%d/%d pages: kvtierd sessions (--connect) split the "
          "budget as SequenceOptions::SetBudgetTokens does (%d/%d/%d); give --budget alone",
          split_.sink_pages, split_.selected_pages, split_.recent_pages, daemon.sink_pages,
          daemon.selected_pages, daemon.recent_pages));
    }
  }
  return absl::OkStatus();
}

absl::Status Replay::CreateBackendOrExplain() {
  DeviceOptions bo;
  bo.cpu_threads = o_.threads;
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(o_.backend, bo);
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("--backend ", std::string(DeviceKindName(o_.backend)), ": ",
                                     backend.status().message()));
  }
  backend_ = *std::move(backend);
  KVTIER_ASSIGN_OR_RETURN(io_, backend_->CreateStream());
  return absl::OkStatus();
}

absl::Status Replay::Setup() {
  int32_t layers = o_.layers.value_or(o_.trace_path.empty() ? kDefaultSyntheticLayers : 0);
  if (layers == kEveryLayer) layers = 0;
  KVTIER_RETURN_IF_ERROR(OpenReplayTrace(o_.trace_path, o_.synthetic, layers, &trace_, &g_));
  T_ = trace_->prefill_tokens();
  KVTIER_RETURN_IF_ERROR(ResolveSteps());
  if (o_.taus.empty()) return absl::InvalidArgumentError("--tau: give at least one threshold");
  if (o_.mass_layers < kEveryLayer) {
    return absl::InvalidArgumentError("--mass-layers must be >= 0 or all");
  }
  KVTIER_RETURN_IF_ERROR(ResolveBudget());
  max_tokens_ = T_ + end_;
  KVTIER_RETURN_IF_ERROR(CreateBackendOrExplain());

  KVTIER_RETURN_IF_ERROR(AddMode("full", RetrievalMode::kFull, 0.0f));
  for (size_t i = 0; i < o_.taus.size(); ++i) {
    const std::string name =
        i == 0 ? "speculative" : absl::StrFormat("speculative_tau%.2f", o_.taus[i]);
    KVTIER_RETURN_IF_ERROR(AddMode(name, RetrievalMode::kSpeculative, o_.taus[i]));
  }
  if (o_.sync) KVTIER_RETURN_IF_ERROR(AddMode("sync", RetrievalMode::kSync, 0.0f));
  if (o_.drop) KVTIER_RETURN_IF_ERROR(AddMode("drop", RetrievalMode::kDrop, 0.0f));

  const int32_t nm =
      o_.mass_layers == kEveryLayer ? g_.num_layers : std::min(o_.mass_layers, g_.num_layers);
  for (int32_t i = 0; i < nm; ++i) mass_layers_.push_back(i * g_.num_layers / nm);
  k_float_.resize(mass_layers_.size());
  const size_t q_bytes = static_cast<size_t>(g_.num_q_heads) * g_.head_dim * g_.element_bytes();
  const size_t kv_bytes = static_cast<size_t>(g_.num_kv_heads) * g_.head_dim * g_.element_bytes();
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    for (auto* vec : {&q_, &k_, &v_}) {
      KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, backend_->Allocate(vec == &q_ ? q_bytes : kv_bytes));
      vec->push_back(std::move(b));
    }
  }
  q_host_.assign(g_.num_layers, {});
  return absl::OkStatus();
}

absl::Status Replay::Prefill() {
  std::vector<uint8_t> k, v;
  const int64_t row = int64_t{g_.num_kv_heads} * g_.head_dim;
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    KVTIER_RETURN_IF_ERROR(trace_->Prefill(l, &k, &v));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dk, backend_->Allocate(k.size()));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dv, backend_->Allocate(v.size()));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, dk.data(), k.data(), k.size()));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, dv.data(), v.data(), v.size()));
    KVTIER_RETURN_IF_ERROR(io_->Synchronize());
    for (ModeRun& m : modes_) {
      KVTIER_RETURN_IF_ERROR(m.seq->Append(l, dk.data(), dv.data(), T_));
    }
    for (ModeRun& m : modes_) KVTIER_RETURN_IF_ERROR(m.seq->Wait());
    const auto it = std::find(mass_layers_.begin(), mass_layers_.end(), l);
    if (it != mass_layers_.end()) {
      std::vector<float>& kf = k_float_[it - mass_layers_.begin()];
      kf.resize(static_cast<size_t>(max_tokens_) * row);
      for (int64_t i = 0; i < int64_t{T_} * row; ++i) kf[i] = LoadAsFloat(k, g_.dtype, i);
    }
  }
  return absl::OkStatus();
}

absl::Status Replay::RunLayer(ModeRun& m, int32_t l, double* critical_us) {
  LocalSequence* r = m.seq->local();
  if (r == nullptr) {
    // A remote sequence: one call runs the whole step and returns the output on the host.
    const absl::Time t0 = absl::Now();
    KVTIER_RETURN_IF_ERROR(m.seq->Append(l, k_[l].data(), v_[l].data(), 1));
    KVTIER_RETURN_IF_ERROR(m.seq->Decode(l, q_[l].data(), m.out_host[l].data(), nullptr));
    *critical_us += absl::ToDoubleMicroseconds(absl::Now() - t0);
    m.tables[l] = m.seq->LastStep(l).slot_table;
    return absl::OkStatus();
  }
  const absl::Time t0 = absl::Now();
  KVTIER_RETURN_IF_ERROR(r->Append(l, k_[l].data(), v_[l].data(), 1));
  KVTIER_ASSIGN_OR_RETURN(WorkingSetView view, r->BeginStep(l, q_[l].data()));
  KVTIER_RETURN_IF_ERROR(r->Attend(l, q_[l].data(), m.out[l].data(), nullptr));
  // The engine needs the attention output before the layer's next op.
  KVTIER_RETURN_IF_ERROR(r->compute_stream().Record(*m.done));
  KVTIER_RETURN_IF_ERROR(m.done->Wait(absl::Minutes(5)));
  // For the accuracy metrics: the slot table attention used, copied on the device before
  // EndStep's work rewrites it (stream order), read back after the step (ReadBack), so no
  // host wait of the benchmark's own is inside the step.
  const size_t table_bytes =
      static_cast<size_t>(g_.num_kv_heads) * view.num_slots * sizeof(int32_t);
  if (table_bytes > m.table_copies[l].size()) {
    return absl::InternalError(
        absl::StrFormat("layer %d: %d slots, more than the context's pages", l, view.num_slots));
  }
  m.tables[l].resize(static_cast<size_t>(g_.num_kv_heads) * view.num_slots);
  KVTIER_RETURN_IF_ERROR(
      backend_->Copy(r->compute_stream(), m.table_copies[l].data(), view.slot_table, table_bytes));
  KVTIER_RETURN_IF_ERROR(r->EndStep(l, q_[l].data()));
  *critical_us += absl::ToDoubleMicroseconds(absl::Now() - t0);
  return absl::OkStatus();
}

absl::Status Replay::ReadBack(ModeRun& m) {
  if (m.seq->local() == nullptr) return absl::OkStatus();  // Decode returned it on the host
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    KVTIER_RETURN_IF_ERROR(
        backend_->Copy(*io_, m.out_host[l].data(), m.out[l].data(), m.out_host[l].size()));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, m.tables[l].data(), m.table_copies[l].data(),
                                          m.tables[l].size() * sizeof(int32_t)));
  }
  return io_->Synchronize();
}

// Decodes one step in every mode. Steps before the range (scored = false) only grow the
// sequences: not timed, not scored.
absl::Status Replay::Step(int32_t step, bool scored, bool profiled) {
  std::vector<uint8_t> k, v;
  const int64_t row = int64_t{g_.num_kv_heads} * g_.head_dim;
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    KVTIER_RETURN_IF_ERROR(trace_->Step(step, l, &q_host_[l], &k, &v));
    KVTIER_RETURN_IF_ERROR(
        backend_->Copy(*io_, q_[l].data(), q_host_[l].data(), q_host_[l].size()));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, k_[l].data(), k.data(), k.size()));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, v_[l].data(), v.data(), v.size()));
    KVTIER_RETURN_IF_ERROR(io_->Synchronize());
    const auto it = std::find(mass_layers_.begin(), mass_layers_.end(), l);
    if (it != mass_layers_.end()) {
      float* dst = k_float_[it - mass_layers_.begin()].data() + int64_t{T_ + step} * row;
      for (int64_t i = 0; i < row; ++i) dst[i] = LoadAsFloat(k, g_.dtype, i);
    }
  }
  for (ModeRun& m : modes_) {
    if (LocalSequence* local = m.seq->local(); local != nullptr) local->SetProfiling(profiled);
    double critical_us = 0;
    const absl::Time start = absl::Now();
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      KVTIER_RETURN_IF_ERROR(RunLayer(m, l, &critical_us));
    }
    // Drain the background work before the next mode runs. The critical path leaves it out
    // (in an engine the last layers' recalls overlap the next step's first layers); the wall
    // time keeps it, since on the cpu backend that work runs on the cores the next step
    // needs, so leaving it out would hide real work.
    const absl::Time drain = absl::Now();
    KVTIER_RETURN_IF_ERROR(m.seq->Wait());
    const absl::Time end = absl::Now();
    if (!scored) continue;
    KVTIER_RETURN_IF_ERROR(ReadBack(m));
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      m.layers[l].corrected_heads += m.seq->LastStep(l).corrected_heads;
    }
    if (!profiled) {
      m.critical_us.push_back(critical_us);
      m.wall_us.push_back(absl::ToDoubleMicroseconds(end - start));
      m.drain_us.push_back(absl::ToDoubleMicroseconds(end - drain));
    }
  }
  if (scored) Score(step);
  return absl::OkStatus();
}

// Accuracy of every mode at this step against exact attention and the full mode's output.
void Replay::Score(int32_t step) {
  const int64_t n = int64_t{g_.num_q_heads} * g_.head_dim;
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    const std::vector<uint8_t>& ref = modes_[0].out_host[l];
    double ref_norm = 0;
    for (int64_t i = 0; i < n; ++i) ref_norm += std::pow(LoadAsFloat(ref, g_.dtype, i), 2);
    for (ModeRun& m : modes_) {
      double err = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float diff = LoadAsFloat(m.out_host[l], g_.dtype, i) - LoadAsFloat(ref, g_.dtype, i);
        err += static_cast<double>(diff) * diff;
      }
      m.layers[l].rel_error += ref_norm > 0 ? std::sqrt(err / ref_norm) : 0.0;
      ++m.layers[l].error_samples;
    }
  }
  for (size_t mi = 0; mi < mass_layers_.size(); ++mi) ScoreMass(mi, T_ + step + 1);
}

// Attention mass recall of every mode's working set on mass layer `mi`, per query head,
// over the first `tokens` tokens (the step's own included).
void Replay::ScoreMass(size_t mi, int32_t tokens) {
  const int32_t l = mass_layers_[mi];
  const std::vector<float>& kf = k_float_[mi];
  const int32_t G = g_.group_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
  const size_t nm = modes_.size();
  std::vector<engine::MassRecall> recall(static_cast<size_t>(g_.num_q_heads) * nm);
  pool_.ParallelFor(g_.num_q_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(g_.head_dim), p;
    std::vector<uint8_t> held(tokens);
    for (int64_t hq = begin; hq < end; ++hq) {
      for (int32_t i = 0; i < g_.head_dim; ++i) {
        q[i] = LoadAsFloat(q_host_[l], g_.dtype, hq * g_.head_dim + i);
      }
      const int32_t h = static_cast<int32_t>(hq) / G;
      engine::AttentionProbs(q.data(), kf.data(), tokens, g_.num_kv_heads, g_.head_dim, h, scale,
                             &p);
      for (size_t k = 0; k < nm; ++k) {
        HeldTokens(modes_[k].tables[l], g_.num_kv_heads, h, g_.page_size, &held);
        recall[hq * nm + k] = engine::AttentionMassRecall(p, held, budget_tokens_, g_.page_size);
      }
    }
  });
  for (int32_t hq = 0; hq < g_.num_q_heads; ++hq) {
    for (size_t k = 0; k < nm; ++k) {
      LayerScore& s = modes_[k].layers[l];
      s.mass_pages += recall[hq * nm + k].pages;
      s.mass_tokens += recall[hq * nm + k].tokens;
      ++s.mass_samples;
    }
  }
}

// One mode's report: the means over the scored steps, and per layer.
JsonObject Replay::ModeReport(const ModeRun& m, double* mass) const {
  const SequenceStats st = Since(m.seq->Stats(), m.base);
  const Spread wall = SpreadOf(m.wall_us);
  const double steps = end_ - begin_;
  const double profiled_steps =
      std::max<double>(1.0, static_cast<double>(st.profiled_steps) / g_.num_layers);
  const double checked_per_layer = static_cast<double>(st.checked_heads) / g_.num_layers;
  LayerScore all;
  std::vector<JsonObject> layers;
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    const LayerScore& s = m.layers[l];
    JsonObject j;
    j.Add("layer", l);
    if (s.mass_samples > 0) {
      j.Add("attn_mass_recall_pages", s.mass_pages / s.mass_samples)
          .Add("attn_mass_recall_tokens", s.mass_tokens / s.mass_samples);
    }
    j.Add("rel_error", s.error_samples ? s.rel_error / s.error_samples : 0.0)
        .Add("correction_rate",
             checked_per_layer > 0 ? s.corrected_heads / checked_per_layer : 0.0);
    layers.push_back(std::move(j));
    all.mass_pages += s.mass_pages;
    all.mass_tokens += s.mass_tokens;
    all.mass_samples += s.mass_samples;
    all.rel_error += s.rel_error;
    all.error_samples += s.error_samples;
  }
  JsonObject j;
  *mass = all.mass_samples > 0 ? all.mass_pages / all.mass_samples : NAN;
  if (all.mass_samples > 0) {
    j.Add("attn_mass_recall_pages", all.mass_pages / all.mass_samples)
        .Add("attn_mass_recall_tokens", all.mass_tokens / all.mass_samples);
  }
  j.Add("rel_error", all.error_samples ? all.rel_error / all.error_samples : 0.0)
      .Add("correction_rate", st.correction_rate())
      .Add("recall_bytes_per_step", static_cast<double>(st.recalled_bytes) / steps)
      .Add("critical_path_us_per_step", Mean(m.critical_us))
      .AddObject("critical_path_us", SpreadJson(SpreadOf(m.critical_us)))
      .Add("wall_us_per_step", Mean(m.wall_us))
      .AddObject("wall_us", SpreadJson(wall))
      .Add("drain_us_per_step", Mean(m.drain_us))
      .Add("select_us_per_step", st.select_us / profiled_steps)
      .Add("recall_us_per_step", st.recall_us / profiled_steps)
      .Add("attention_us_per_step", st.attention_us / profiled_steps)
      .Add("recalled_head_pages", st.recalled_pages)
      .Add("correction_head_pages", st.correction_pages)
      .Add("corrected_heads", st.corrected_heads)
      .Add("checked_heads", st.checked_heads);
  if (m.mode == RetrievalMode::kSpeculative) j.Add("tau", static_cast<double>(m.tau));
  j.AddArray("layers", layers);

  const auto mean = [](double sum, int64_t n) { return n > 0 ? sum / n : NAN; };
  log_ << absl::StrFormat(
      "%-22s %9.4f %9.4f %10.4f %9.3f %13.1f %13.2f %11.2f %15s %8.2f/%6.2f/%7.2f\n", m.name,
      mean(all.mass_pages, all.mass_samples), mean(all.mass_tokens, all.mass_samples),
      mean(all.rel_error, all.error_samples), st.correction_rate(),
      static_cast<double>(st.recalled_bytes) / steps / 1024, Mean(m.critical_us) / 1000,
      wall.median / 1000, absl::StrFormat("%.2f-%.2f", wall.p10 / 1000, wall.p90 / 1000),
      st.select_us / profiled_steps / 1000, st.recall_us / profiled_steps / 1000,
      st.attention_us / profiled_steps / 1000);
  return j;
}

// The accuracy target of docs/benchmarks.md#targets.
constexpr double kMassRecallTarget = 0.95;

JsonObject Replay::Report() const {
  JsonObject modes;
  log_ << absl::StrFormat("%-22s %9s %9s %10s %9s %13s %13s %11s %15s %24s\n", "mode", "mass_pg",
                          "mass_tok", "rel_error", "corr_rate", "recall KiB/st", "critical ms/st",
                          "wall ms/st", "wall p10-p90", "select/recall/attn ms/st");
  const ModeRun* spec = nullptr;
  const ModeRun* sync = nullptr;
  // Modes whose selection falls short of the accuracy target, said out loud (long contexts
  // on a fixed budget are where it happens).
  std::vector<std::string> below;
  std::string quality;
  for (const ModeRun& m : modes_) {
    double mass = NAN;
    modes.AddObject(m.name, ModeReport(m, &mass));
    // The target is the retrieval modes' (drop is the eviction baseline it is compared with).
    if (!std::isnan(mass) && mass < kMassRecallTarget &&
        (m.mode == RetrievalMode::kSpeculative || m.mode == RetrievalMode::kSync)) {
      below.push_back(m.name);
      quality += absl::StrFormat("%s%s %.3f", quality.empty() ? "" : ", ", m.name, mass);
    }
    if (m.name == "speculative") spec = &m;
    if (m.name == "sync") sync = &m;
  }
  JsonObject j;
  j.Add("bench", "replay")
      .Add("device", backend_->Describe())
      .Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("geometry", g_.ToString())
      .Add("trace", o_.trace_path.empty() ? std::string("synthetic") : o_.trace_path)
      .Add("prefill_tokens", T_)
      .Add("trace_steps", N_)
      .Add("step_begin", begin_)
      .Add("step_end", end_)
      .Add("steps", end_ - begin_)
      .Add("trace_layers", trace_->geometry().num_layers)
      .Add("layers", g_.num_layers)
      .Add("budget_tokens", budget_tokens_)
      .Add("sink_pages", split_.sink_pages)
      .Add("selected_pages", split_.selected_pages)
      .Add("recent_pages", split_.recent_pages)
      .Add("recall", std::string(RecallStrategyName(o_.recall)))
      .Add("profiled_steps", o_.profile_steps)
      .Add("mass_layers", static_cast<int32_t>(mass_layers_.size()));
  if (o_.trace_path.empty()) {
    j.Add("step_cosine", o_.synthetic.step_cosine)
        .Add("jump_probability", o_.synthetic.jump_probability)
        .Add("seed", static_cast<int64_t>(o_.synthetic.seed));
  }
  if (spec != nullptr && sync != nullptr && Mean(spec->critical_us) > 0) {
    // The wall ratio is the one to quote: it counts the background work each step made.
    const Spread spec_wall = SpreadOf(spec->wall_us), sync_wall = SpreadOf(sync->wall_us);
    const double wall = spec_wall.median > 0 ? sync_wall.median / spec_wall.median : NAN;
    const double critical = Mean(sync->critical_us) / Mean(spec->critical_us);
    j.Add("sync_over_speculative_wall", wall).Add("sync_over_speculative_critical_path", critical);
    log_ << absl::StrFormat(
        "wall per step (drained background work included): sync / speculative = %.2fx "
        "(medians; speculative %.2f ms, p10-p90 %.2f-%.2f)\n"
        "critical path only (background work drained outside the timer%s): sync / "
        "speculative = %.2fx (means)\n",
        wall, spec_wall.median / 1000, spec_wall.p10 / 1000, spec_wall.p90 / 1000,
        backend_->kind() == DeviceKind::kCpu
            ? "; on the cpu backend it runs on the same cores, so this leaves real work out"
            : "",
        critical);
  }
  j.Add("attn_mass_recall_target", kMassRecallTarget);
  j.Add("quality_below_target", absl::StrJoin(below, ","));  // modes, "" when none
  if (!below.empty()) {
    log_ << absl::StrFormat(
        "QUALITY BELOW TARGET: attention-mass recall (pages) %s < %.2f at %d tokens of context "
        "with a budget of %d tokens (%.1f%% of the context)\n",
        quality, kMassRecallTarget, T_, budget_tokens_, 100.0 * budget_tokens_ / std::max(1, T_));
  }
  j.AddObject("modes", modes);
  return j;
}

std::vector<ReplayModeTimes> Replay::Times() const {
  std::vector<ReplayModeTimes> times;
  for (const ModeRun& m : modes_) times.push_back({m.name, m.critical_us, m.wall_us, m.drain_us});
  return times;
}

absl::StatusOr<JsonObject> Replay::Run() {
  KVTIER_RETURN_IF_ERROR(Setup());
  log_ << absl::StrFormat(
      "kvtier-bench decode: replay: %s, commit %s\n  geometry %s (%d layers replayed), prefill %d "
      "tokens, steps %d..%d of %d scored, budget %d tokens (sink %d + selected %d + recent %d "
      "pages), %d profiled steps\n",
      backend_->Describe(), Commit(), trace_->geometry().ToString(), g_.num_layers, T_, begin_,
      end_ - 1, N_, budget_tokens_, split_.sink_pages, split_.selected_pages, split_.recent_pages,
      o_.profile_steps);
  if (g_.num_layers == trace_->geometry().num_layers) {
    log_ << absl::StrFormat("  replaying all %d layers of the trace\n", g_.num_layers);
  }
  const absl::Time start = absl::Now();
  KVTIER_RETURN_IF_ERROR(Prefill());
  log_ << absl::StrFormat("  prefill done in %s\n", absl::FormatDuration(absl::Now() - start));
  for (int32_t step = 0; step < end_; ++step) {
    if (step == begin_) {
      for (ModeRun& m : modes_) m.base = m.seq->Stats();
    }
    KVTIER_RETURN_IF_ERROR(
        Step(step, /*scored=*/step >= begin_, /*profiled=*/step >= end_ - o_.profile_steps));
  }
  log_ << absl::StrFormat("  decode done in %s\n", absl::FormatDuration(absl::Now() - start));
  return Report();
}

}  // namespace

absl::StatusOr<JsonObject> RunReplayBench(const ReplayBenchOptions& o, std::ostream& log,
                                          std::vector<ReplayModeTimes>* times) {
  Replay replay(o, log);
  KVTIER_ASSIGN_OR_RETURN(JsonObject report, replay.Run());
  if (times != nullptr) *times = replay.Times();
  return report;
}

}  // namespace kvtier::bench
