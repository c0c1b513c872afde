#include "bench/replay_bench.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/synthetic_kv.h"
#include "core/status.h"
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
  if (layers < 0 || layers > g->num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--layers = %d: must be in [0, %d] (0 = all layers of the trace)", layers, g->num_layers));
  }
  if (layers > 0) g->num_layers = layers;
  return absl::OkStatus();
}
namespace {

float Dot(const float* a, const float* b, int32_t n) {
  float s[4] = {0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

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
  std::unique_ptr<Event> done;
  double mass_recall_sum = 0;
  int64_t mass_samples = 0;
  double rel_error_sum = 0;
  int64_t error_samples = 0;
  double critical_us = 0;
  int64_t critical_steps = 0;
};

class Replay {
 public:
  Replay(const ReplayBenchOptions& o, std::ostream& log) : o_(o), log_(log) {}
  absl::StatusOr<JsonObject> Run();

 private:
  absl::Status Setup();
  absl::Status AddMode(std::string name, RetrievalMode mode, float tau);
  absl::Status Prefill();
  absl::Status Step(int32_t step, bool profiled);
  absl::Status RunLayer(ModeRun& m, int32_t layer, bool timed, double* us);
  void Score(int32_t step);
  JsonObject Report() const;

  const ReplayBenchOptions o_;
  std::ostream& log_;
  std::unique_ptr<TraceSource> trace_;
  Geometry g_;     // the replayed geometry (first `layers` layers of the trace's)
  int32_t T_ = 0;  // prefill tokens
  int32_t N_ = 0;  // steps
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
  KVTIER_RETURN_IF_ERROR(ro.SetBudgetTokens(o_.budget_tokens, g_.page_size));
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
  KVTIER_ASSIGN_OR_RETURN(m.done, backend_->CreateEvent());
  modes_.push_back(std::move(m));
  return absl::OkStatus();
}

absl::Status Replay::Setup() {
  KVTIER_RETURN_IF_ERROR(OpenReplayTrace(o_.trace_path, o_.synthetic, o_.layers, &trace_, &g_));
  T_ = trace_->prefill_tokens();
  N_ = trace_->num_steps();
  if (N_ < 1) return absl::InvalidArgumentError("replay: the trace has no decode steps");
  if (o_.taus.empty()) return absl::InvalidArgumentError("--tau: give at least one threshold");
  if (o_.profile_steps < 0 || o_.profile_steps >= N_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--profile-steps = %d: must be in [0, %d) (steps of the trace)", o_.profile_steps, N_));
  }
  if (o_.mass_layers < 0) return absl::InvalidArgumentError("--mass-layers must be >= 0");
  max_tokens_ = T_ + N_;
  DeviceOptions bo;
  bo.cpu_threads = o_.threads;
  KVTIER_ASSIGN_OR_RETURN(backend_, CreateBackend(o_.backend, bo));
  KVTIER_ASSIGN_OR_RETURN(io_, backend_->CreateStream());

  KVTIER_RETURN_IF_ERROR(AddMode("full", RetrievalMode::kFull, 0.0f));
  for (size_t i = 0; i < o_.taus.size(); ++i) {
    const std::string name =
        i == 0 ? "speculative" : absl::StrFormat("speculative_tau%.2f", o_.taus[i]);
    KVTIER_RETURN_IF_ERROR(AddMode(name, RetrievalMode::kSpeculative, o_.taus[i]));
  }
  if (o_.sync) KVTIER_RETURN_IF_ERROR(AddMode("sync", RetrievalMode::kSync, 0.0f));
  if (o_.drop) KVTIER_RETURN_IF_ERROR(AddMode("drop", RetrievalMode::kDrop, 0.0f));

  const int32_t nm = std::min(o_.mass_layers, g_.num_layers);
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

absl::Status Replay::RunLayer(ModeRun& m, int32_t l, bool timed, double* us) {
  LocalSequence* r = m.seq->local();
  if (r == nullptr) {
    // A remote sequence: one call runs the whole step and returns the output on the host.
    const absl::Time t0 = absl::Now();
    KVTIER_RETURN_IF_ERROR(m.seq->Append(l, k_[l].data(), v_[l].data(), 1));
    KVTIER_RETURN_IF_ERROR(m.seq->Decode(l, q_[l].data(), m.out_host[l].data(), nullptr));
    if (timed) *us += absl::ToDoubleMicroseconds(absl::Now() - t0);
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
  const absl::Time t1 = absl::Now();
  // Not timed: read back the output and the slot tables for the accuracy metrics.
  m.tables[l].resize(static_cast<size_t>(g_.num_kv_heads) * view.num_slots);
  KVTIER_RETURN_IF_ERROR(backend_->Copy(r->compute_stream(), m.out_host[l].data(), m.out[l].data(),
                                        m.out_host[l].size()));
  KVTIER_RETURN_IF_ERROR(backend_->Copy(r->compute_stream(), m.tables[l].data(), view.slot_table,
                                        m.tables[l].size() * sizeof(int32_t)));
  KVTIER_RETURN_IF_ERROR(r->compute_stream().Record(*m.done));
  KVTIER_RETURN_IF_ERROR(m.done->Wait(absl::Minutes(5)));
  const absl::Time t2 = absl::Now();
  KVTIER_RETURN_IF_ERROR(r->EndStep(l, q_[l].data()));
  if (timed) *us += absl::ToDoubleMicroseconds((t1 - t0) + (absl::Now() - t2));
  return absl::OkStatus();
}

absl::Status Replay::Step(int32_t step, bool profiled) {
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
    double us = 0;
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      KVTIER_RETURN_IF_ERROR(RunLayer(m, l, !profiled, &us));
    }
    // Drain the background work before the next mode runs (not timed: in an engine the last
    // layers' recalls overlap the next step's first layers).
    KVTIER_RETURN_IF_ERROR(m.seq->Wait());
    if (!profiled) {
      m.critical_us += us;
      ++m.critical_steps;
    }
  }
  Score(step);
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
      m.rel_error_sum += ref_norm > 0 ? std::sqrt(err / ref_norm) : 0.0;
      ++m.error_samples;
    }
  }
  // Exact page masses per query head, then each mode's working-set share of the oracle's.
  const int32_t tokens = T_ + step + 1;
  const int32_t p = g_.page_size;
  const int32_t pages = (tokens + p - 1) / p;
  const int32_t budget_pages = o_.budget_tokens / p;
  const int32_t G = g_.group_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
  for (size_t mi = 0; mi < mass_layers_.size(); ++mi) {
    const int32_t l = mass_layers_[mi];
    const std::vector<float>& kf = k_float_[mi];
    std::vector<std::vector<double>> mass(g_.num_q_heads, std::vector<double>(pages, 0.0));
    pool_.ParallelFor(g_.num_q_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(g_.head_dim), logit(tokens);
      for (int64_t hq = begin; hq < end; ++hq) {
        for (int32_t i = 0; i < g_.head_dim; ++i) {
          q[i] = LoadAsFloat(q_host_[l], g_.dtype, hq * g_.head_dim + i);
        }
        const int32_t h = static_cast<int32_t>(hq) / G;
        float mx = -INFINITY;
        for (int32_t t = 0; t < tokens; ++t) {
          logit[t] = scale * Dot(q.data(), &kf[(int64_t{t} * g_.num_kv_heads + h) * g_.head_dim],
                                 g_.head_dim);
          mx = std::max(mx, logit[t]);
        }
        double z = 0;
        for (int32_t t = 0; t < tokens; ++t) {
          const double e = std::exp(static_cast<double>(logit[t] - mx));
          mass[hq][t / p] += e;
          z += e;
        }
        for (double& x : mass[hq]) x /= z;
      }
    });
    for (int32_t hq = 0; hq < g_.num_q_heads; ++hq) {
      std::vector<double> sorted = mass[hq];
      const int32_t top = std::min(budget_pages, pages);
      std::partial_sort(sorted.begin(), sorted.begin() + top, sorted.end(), std::greater<>());
      double oracle = 0;
      for (int32_t i = 0; i < top; ++i) oracle += sorted[i];
      for (ModeRun& m : modes_) {
        const int32_t S = static_cast<int32_t>(m.tables[l].size()) / g_.num_kv_heads;
        double held = 0;
        for (int32_t s = 0; s < S; ++s) {
          const int32_t page = m.tables[l][(hq / G) * S + s];
          if (page >= 0 && page < pages) held += mass[hq][page];
        }
        m.mass_recall_sum += oracle > 0 ? std::min(1.0, held / oracle) : 1.0;
        ++m.mass_samples;
      }
    }
  }
}

JsonObject Replay::Report() const {
  JsonObject modes;
  log_ << absl::StrFormat("%-22s %9s %10s %9s %13s %13s %24s\n", "mode", "mass_rec", "rel_error",
                          "corr_rate", "recall KiB/st", "critical ms/st",
                          "select/recall/attn ms/st");
  const ModeRun* spec = nullptr;
  const ModeRun* sync = nullptr;
  for (const ModeRun& m : modes_) {
    const SequenceStats st = m.seq->Stats();
    const double steps = N_;
    const double profiled_steps =
        std::max<double>(1.0, static_cast<double>(st.profiled_steps) / g_.num_layers);
    const double mass = m.mass_samples ? m.mass_recall_sum / m.mass_samples : 0.0;
    const double err = m.error_samples ? m.rel_error_sum / m.error_samples : 0.0;
    const double crit = m.critical_steps ? m.critical_us / m.critical_steps : 0.0;
    const double recall_bytes = static_cast<double>(st.recalled_bytes) / steps;
    JsonObject j;
    j.Add("attn_mass_recall", mass)
        .Add("rel_error", err)
        .Add("correction_rate", st.correction_rate())
        .Add("recall_bytes_per_step", recall_bytes)
        .Add("critical_path_us_per_step", crit)
        .Add("select_us_per_step", st.select_us / profiled_steps)
        .Add("recall_us_per_step", st.recall_us / profiled_steps)
        .Add("attention_us_per_step", st.attention_us / profiled_steps)
        .Add("recalled_head_pages", st.recalled_pages)
        .Add("correction_head_pages", st.correction_pages)
        .Add("corrected_heads", st.corrected_heads)
        .Add("checked_heads", st.checked_heads);
    if (m.mode == RetrievalMode::kSpeculative) j.Add("tau", static_cast<double>(m.tau));
    modes.AddObject(m.name, j);
    log_ << absl::StrFormat("%-22s %9.4f %10.4f %9.3f %13.1f %13.2f %8.2f/%6.2f/%7.2f\n", m.name,
                            mass, err, st.correction_rate(), recall_bytes / 1024, crit / 1000,
                            st.select_us / profiled_steps / 1000,
                            st.recall_us / profiled_steps / 1000,
                            st.attention_us / profiled_steps / 1000);
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
      .Add("steps", N_)
      .Add("layers", g_.num_layers)
      .Add("budget_tokens", o_.budget_tokens)
      .Add("recall", std::string(RecallStrategyName(o_.recall)))
      .Add("profiled_steps", o_.profile_steps)
      .Add("mass_layers", static_cast<int32_t>(mass_layers_.size()));
  if (o_.trace_path.empty()) {
    j.Add("step_cosine", o_.synthetic.step_cosine)
        .Add("jump_probability", o_.synthetic.jump_probability)
        .Add("seed", static_cast<int64_t>(o_.synthetic.seed));
  }
  if (spec != nullptr && sync != nullptr && spec->critical_us > 0) {
    const double ratio = (sync->critical_us / std::max<int64_t>(1, sync->critical_steps)) /
                         (spec->critical_us / std::max<int64_t>(1, spec->critical_steps));
    j.Add("sync_over_speculative_critical_path", ratio);
    log_ << absl::StrFormat("critical path: sync / speculative = %.2fx\n", ratio);
  }
  j.AddObject("modes", modes);
  return j;
}

absl::StatusOr<JsonObject> Replay::Run() {
  KVTIER_RETURN_IF_ERROR(Setup());
  log_ << absl::StrFormat(
      "kvtier-bench replay: %s, commit %s\n  geometry %s (%d layers replayed), prefill %d "
      "tokens, %d steps, budget %d tokens, %d profiled steps\n",
      backend_->Describe(), Commit(), trace_->geometry().ToString(), g_.num_layers, T_, N_,
      o_.budget_tokens, o_.profile_steps);
  const absl::Time start = absl::Now();
  KVTIER_RETURN_IF_ERROR(Prefill());
  log_ << absl::StrFormat("  prefill done in %s\n", absl::FormatDuration(absl::Now() - start));
  for (int32_t step = 0; step < N_; ++step) {
    KVTIER_RETURN_IF_ERROR(Step(step, /*profiled=*/step >= N_ - o_.profile_steps));
  }
  log_ << absl::StrFormat("  decode done in %s\n", absl::FormatDuration(absl::Now() - start));
  return Report();
}

}  // namespace

absl::StatusOr<JsonObject> RunReplayBench(const ReplayBenchOptions& o, std::ostream& log) {
  if (o.budget_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--budget = %d tokens: must be positive", o.budget_tokens));
  }
  Replay replay(o, log);
  return replay.Run();
}

}  // namespace kvtier::bench
