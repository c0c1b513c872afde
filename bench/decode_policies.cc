#include "bench/decode_policies.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/decode_replay.h"
#include "bench/synthetic_kv.h"
#include "core/plot.h"
#include "core/status.h"
#include "kernels/registry.h"
#include "offload/host_arena.h"
#include "offload/page_pool.h"

namespace kvtier::bench {
namespace {

constexpr char kSpeculativeConf[] = "speculative+conf";

// What the report says about the signals (they are not a model's).
constexpr char kProxyNote[] =
    "synthetic stand-ins for engine signals (a trace has no logits or hidden states): logits "
    "over 1024 tokens with token 0 at 12*(1 - min(1, drift/0.3)) and the rest N(0,1) from a "
    "fixed seed, drift = mean over replayed layers and query heads of 1 - cos(q_t, q_t-1); "
    "hidden_delta[l] = |q_l(t) - q_l(t-1)| (query change as the hidden-state change), "
    "reported from the first observation token on";

// Peak logit and the drift at which the synthetic distribution is flat.
constexpr float kPeakLogit = 12.0f;
constexpr double kFlatDrift = 0.3;

// splitmix64: the synthetic logits' noise, the same bits on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t x = state_;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  // N(0, 1) by Box–Muller.
  float Normal() {
    const double u1 = (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(Next() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * std::numbers::pi * u2));
  }

 private:
  uint64_t state_;
};

// One run of the sweep.
struct RunSpec {
  std::string policy;         // a PolicyReplayNames() entry, or "full"
  int32_t budget_tokens = 0;  // 0: full (every token resident)
  RetrievalMode mode = RetrievalMode::kDrop;
  PolicyConfig config;
};

struct RunResult {
  RunSpec spec;
  double memory_bytes = 0;     // mean resident K+V bytes over the measured steps
  double memory_fraction = 0;  // mean of resident / full mode's resident, per step
  double rel_error = 0;        // mean over (measured step, layer)
  double rel_error_p95 = 0;
  double rel_error_max = 0;
  SequenceStats stats;  // at the end of the run
  double seconds = 0;
};

// The policy configuration of a run name at a working set of `budget_tokens`.
absl::StatusOr<RunSpec> MakeSpec(const std::string& name, int32_t budget_tokens) {
  RunSpec s;
  s.policy = name;
  s.budget_tokens = budget_tokens;
  PolicyConfig& c = s.config;
  if (name == "window") {
    // The defaults: sinks + sliding window.
  } else if (name == "h2o") {
    c.residency = "h2o";
  } else if (name == "conf-kv") {
    c.budget = "confidence";
    c.residency = "attention";
  } else if (name == "epikv" || name == "epikv-kv") {
    c.residency = "epiphany";
    c.params["epiphany.signal"] = name == "epikv" ? "hidden_delta" : "key_variance";
  } else if (name == "xkv") {
    c.budget = "xkv";
    c.residency = "attention";
  } else if (name == "kv-compress") {
    c.budget = "kv_compress";
    c.residency = "kv_compress";
  } else if (name == kSpeculativeConf) {
    s.mode = RetrievalMode::kSpeculative;
    c.budget = "confidence";
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("--policy-list: unknown policy '%s'; one of %s", name,
                        absl::StrJoin(PolicyReplayNames(), ", ")));
  }
  return s;
}

// p-quantile (nearest rank) of `v`, which it sorts.
double Quantile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

class PolicyReplay {
 public:
  PolicyReplay(const PolicyReplayOptions& o, std::ostream& log) : o_(o), log_(log) {}
  absl::StatusOr<JsonObject> Run();

 private:
  absl::Status Setup();
  absl::Status LoadTrace();
  absl::StatusOr<RunResult> RunOne(const RunSpec& spec);
  void PrintRow(const RunResult& r) const;
  absl::Status Plot() const;
  JsonObject Report(double wall_seconds) const;

  size_t q_bytes() const {
    return static_cast<size_t>(g_.num_q_heads) * g_.head_dim * g_.element_bytes();
  }
  size_t kv_bytes() const {
    return static_cast<size_t>(g_.num_kv_heads) * g_.head_dim * g_.element_bytes();
  }
  int32_t L() const { return g_.num_layers; }
  int32_t measured() const { return N_ - w_; }

  const PolicyReplayOptions o_;
  std::ostream& log_;
  std::unique_ptr<TraceSource> trace_;
  Geometry g_;     // the replayed geometry (the first `layers` layers of the trace's)
  int32_t T_ = 0;  // prefill tokens
  int32_t N_ = 0;  // trace steps, the first w_ of them the prompt's tail
  int32_t w_ = 0;
  std::vector<int32_t> budgets_;  // those below the context
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> io_;

  // The trace in backend memory, shared (read-only) by every run.
  std::vector<DeviceBuffer> prefill_k_, prefill_v_;     // [layer]: T tokens
  std::vector<DeviceBuffer> obs_q_, obs_k_, obs_v_;     // [layer]: w tokens
  std::vector<DeviceBuffer> step_q_, step_k_, step_v_;  // [(s − w)·L + l]

  // Synthetic signals per trace step.
  std::vector<double> drift_;               // [step]
  std::vector<std::vector<float>> logits_;  // [step][vocab]
  std::vector<float> hidden_delta_;         // [step·L + l]

  // The reference: full mode's outputs and resident bytes per measured step.
  std::vector<std::vector<float>> ref_out_;  // [(s − w)·L + l][Hq·d]
  std::vector<double> full_bytes_;           // [s − w]

  std::vector<RunResult> results_;
};

absl::Status PolicyReplay::Setup() {
  KVTIER_RETURN_IF_ERROR(OpenReplayTrace(o_.trace_path, o_.synthetic, o_.layers, &trace_, &g_));
  T_ = trace_->prefill_tokens();
  N_ = trace_->num_steps();
  w_ = o_.observation_tokens;
  if (w_ < 1 || w_ > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("observation tokens = %d: must be in [1, 4096]", w_));
  }
  if (N_ <= w_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--steps = %d: the trace needs more than the %d observation steps (the prompt's tail)", N_,
        w_));
  }
  if (o_.vocab < 2) return absl::InvalidArgumentError("vocab: must be >= 2");
  for (const std::string& p : o_.policies) {
    KVTIER_RETURN_IF_ERROR(MakeSpec(p, 0).status());
  }
  if (o_.policies.empty()) return absl::InvalidArgumentError("--policy-list: give at least one");
  const int32_t quantum = 4 * g_.page_size;
  for (int32_t b : o_.budgets) {
    if (b <= 0 || b % quantum != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--budgets: %d tokens: each must be a positive multiple of 4 pages (%d tokens at p = "
          "%d)",
          b, quantum, g_.page_size));
    }
    if (b >= T_) {
      log_ << absl::StrFormat("  budget %d skipped: not below the context (%d tokens)\n", b, T_);
      continue;
    }
    budgets_.push_back(b);
  }
  if (budgets_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--budgets: none is below the context (%d tokens)", T_));
  }
  std::sort(budgets_.begin(), budgets_.end());
  budgets_.erase(std::unique(budgets_.begin(), budgets_.end()), budgets_.end());
  DeviceOptions bo;
  bo.cpu_threads = o_.threads;
  KVTIER_ASSIGN_OR_RETURN(backend_, CreateBackend(o_.backend, bo));
  KVTIER_ASSIGN_OR_RETURN(io_, backend_->CreateStream());
  return absl::OkStatus();
}

absl::Status PolicyReplay::LoadTrace() {
  auto upload = [&](const void* src, size_t bytes) -> absl::StatusOr<DeviceBuffer> {
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, backend_->Allocate(bytes));
    KVTIER_RETURN_IF_ERROR(backend_->Copy(*io_, b.data(), src, bytes));
    KVTIER_RETURN_IF_ERROR(io_->Synchronize());  // `src` may go after this
    return b;
  };
  std::vector<uint8_t> k, v, q;
  for (int32_t l = 0; l < L(); ++l) {
    KVTIER_RETURN_IF_ERROR(trace_->Prefill(l, &k, &v));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dk, upload(k.data(), k.size()));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dv, upload(v.data(), v.size()));
    prefill_k_.push_back(std::move(dk));
    prefill_v_.push_back(std::move(dv));
  }
  // Steps: the first w_ go into one prompt-tail block per layer, the rest one buffer each.
  std::vector<std::vector<uint8_t>> oq(L()), ok(L()), ov(L());
  std::vector<std::vector<float>> prev(L()), cur(L());
  const int64_t nq = int64_t{g_.num_q_heads} * g_.head_dim;
  drift_.assign(N_, 0.0);
  hidden_delta_.assign(static_cast<size_t>(N_) * L(), 0.0f);
  step_q_.resize(static_cast<size_t>(measured()) * L());
  step_k_.resize(step_q_.size());
  step_v_.resize(step_q_.size());
  for (int32_t s = 0; s < N_; ++s) {
    double drift = 0;
    for (int32_t l = 0; l < L(); ++l) {
      KVTIER_RETURN_IF_ERROR(trace_->Step(s, l, &q, &k, &v));
      cur[l].resize(nq);
      for (int64_t i = 0; i < nq; ++i) cur[l][i] = LoadAsFloat(q, g_.dtype, i);
      if (s > 0) {
        double delta = 0;
        for (int32_t h = 0; h < g_.num_q_heads; ++h) {
          const float* a = cur[l].data() + int64_t{h} * g_.head_dim;
          const float* b = prev[l].data() + int64_t{h} * g_.head_dim;
          double ab = 0, aa = 0, bb = 0;
          for (int32_t i = 0; i < g_.head_dim; ++i) {
            ab += double{a[i]} * b[i];
            aa += double{a[i]} * a[i];
            bb += double{b[i]} * b[i];
            delta += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
          }
          drift += 1.0 - (aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0);
        }
        hidden_delta_[static_cast<size_t>(s) * L() + l] = static_cast<float>(std::sqrt(delta));
      }
      std::swap(prev[l], cur[l]);
      if (s < w_) {
        oq[l].insert(oq[l].end(), q.begin(), q.end());
        ok[l].insert(ok[l].end(), k.begin(), k.end());
        ov[l].insert(ov[l].end(), v.begin(), v.end());
      } else {
        const size_t i = static_cast<size_t>(s - w_) * L() + l;
        KVTIER_ASSIGN_OR_RETURN(step_q_[i], upload(q.data(), q.size()));
        KVTIER_ASSIGN_OR_RETURN(step_k_[i], upload(k.data(), k.size()));
        KVTIER_ASSIGN_OR_RETURN(step_v_[i], upload(v.data(), v.size()));
      }
    }
    drift_[s] = s > 0 ? drift / (static_cast<double>(L()) * g_.num_q_heads) : 0.0;
  }
  for (int32_t l = 0; l < L(); ++l) {
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dq, upload(oq[l].data(), oq[l].size()));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dk, upload(ok[l].data(), ok[l].size()));
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer dv, upload(ov[l].data(), ov[l].size()));
    obs_q_.push_back(std::move(dq));
    obs_k_.push_back(std::move(dk));
    obs_v_.push_back(std::move(dv));
  }
  // The next-token logits after each step: peaked while the queries are stable.
  logits_.resize(N_);
  for (int32_t s = 0; s < N_; ++s) {
    Rng rng(o_.synthetic.seed * 0x2545f4914f6cdd1dull + static_cast<uint64_t>(s) + 1);
    std::vector<float>& z = logits_[s];
    z.resize(o_.vocab);
    for (float& x : z) x = rng.Normal();
    z[0] = kPeakLogit * static_cast<float>(1.0 - std::min(1.0, drift_[s] / kFlatDrift));
  }
  return absl::OkStatus();
}

absl::StatusOr<RunResult> PolicyReplay::RunOne(const RunSpec& spec) {
  const absl::Time start = absl::Now();
  RunResult res;
  res.spec = spec;
  SequenceOptions ro;
  ro.mode = spec.mode;
  if (spec.budget_tokens > 0) {
    KVTIER_RETURN_IF_ERROR(ro.SetBudgetTokens(spec.budget_tokens, g_.page_size));
  }
  ro.max_tokens = T_ + N_;
  ro.recall = o_.recall;
  ro.deadline = absl::Minutes(5);
  ro.policy = spec.config;
  // Declared before the Retriever, so they outlive it.
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<PagePool> pool;
  if (spec.mode == RetrievalMode::kSpeculative || spec.mode == RetrievalMode::kSync) {
    const int64_t pages = int64_t{L()} * ((ro.max_tokens + g_.page_size - 1) / g_.page_size);
    ArenaOptions ao;
    ao.bytes = static_cast<size_t>(pages) * g_.host_page_bytes();
    ao.name = "kvtier-policy-replay";
    ao.lock = false;
    KVTIER_ASSIGN_OR_RETURN(arena, HostArena::Create(ao));
    KVTIER_RETURN_IF_ERROR(arena->RegisterWith(*backend_));
    KVTIER_ASSIGN_OR_RETURN(pool, PagePool::CreateInArena(*arena, g_.host_page_bytes()));
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Retriever> r,
                          Retriever::Create(g_, ro, *backend_, pool.get()));

  // The prompt: prefill, then the observation tokens, whose queries every Retriever sees.
  for (int32_t l = 0; l < L(); ++l) {
    KVTIER_RETURN_IF_ERROR(r->Append(l, prefill_k_[l].data(), prefill_v_[l].data(), T_));
    KVTIER_RETURN_IF_ERROR(r->Append(l, obs_k_[l].data(), obs_v_[l].data(), w_));
  }
  KVTIER_RETURN_IF_ERROR(r->Wait());
  for (int32_t l = 0; l < L(); ++l) {
    KVTIER_RETURN_IF_ERROR(r->ObserveQueries(l, obs_q_[l].data(), w_, T_));
  }
  StepSignals prompt;
  prompt.first_position = T_;
  prompt.num_tokens = w_;
  prompt.logits = logits_[w_ - 1];
  prompt.hidden_delta = std::span<const float>(hidden_delta_).first(static_cast<size_t>(w_) * L());
  prompt.num_layers = L();
  KVTIER_RETURN_IF_ERROR(r->ReportSignals(prompt));

  // Decode, measured.
  std::vector<DeviceBuffer> out(L());
  for (DeviceBuffer& b : out) {
    KVTIER_ASSIGN_OR_RETURN(b, backend_->Allocate(q_bytes()));
  }
  std::vector<std::vector<uint8_t>> out_host(L(), std::vector<uint8_t>(q_bytes()));
  const bool reference = spec.budget_tokens == 0;
  const int64_t n = int64_t{g_.num_q_heads} * g_.head_dim;
  std::vector<double> errors;
  double bytes_sum = 0, fraction_sum = 0;
  for (int32_t s = w_; s < N_; ++s) {
    const int32_t m = s - w_;
    for (int32_t l = 0; l < L(); ++l) {
      const size_t i = static_cast<size_t>(m) * L() + l;
      KVTIER_RETURN_IF_ERROR(r->Append(l, step_k_[i].data(), step_v_[i].data(), 1));
      KVTIER_RETURN_IF_ERROR(r->BeginStep(l, step_q_[i].data()).status());
      KVTIER_RETURN_IF_ERROR(r->Attend(l, step_q_[i].data(), out[l].data(), nullptr));
      KVTIER_RETURN_IF_ERROR(
          backend_->Copy(r->compute_stream(), out_host[l].data(), out[l].data(), q_bytes()));
      KVTIER_RETURN_IF_ERROR(r->EndStep(l, step_q_[i].data()));
    }
    KVTIER_RETURN_IF_ERROR(r->Wait());
    for (int32_t l = 0; l < L(); ++l) {
      const size_t i = static_cast<size_t>(m) * L() + l;
      if (reference) {
        ref_out_.resize(std::max(ref_out_.size(), i + 1));
        ref_out_[i].resize(n);
        for (int64_t e = 0; e < n; ++e) ref_out_[i][e] = LoadAsFloat(out_host[l], g_.dtype, e);
      }
      double err = 0, norm = 0;
      for (int64_t e = 0; e < n; ++e) {
        const double x = ref_out_[i][e];
        const double d = LoadAsFloat(out_host[l], g_.dtype, e) - x;
        err += d * d;
        norm += x * x;
      }
      errors.push_back(norm > 0 ? std::sqrt(err / norm) : 0.0);
    }
    const SequenceStats st = r->Stats();
    const double bytes = static_cast<double>(st.resident_bytes);
    if (reference) full_bytes_.push_back(bytes);
    bytes_sum += bytes;
    fraction_sum += full_bytes_[m] > 0 ? bytes / full_bytes_[m] : 0.0;

    StepSignals sig;
    sig.first_position = int64_t{T_} + s;
    sig.num_tokens = 1;
    sig.logits = logits_[s];
    sig.hidden_delta =
        std::span<const float>(hidden_delta_).subspan(static_cast<size_t>(s) * L(), L());
    sig.num_layers = L();
    KVTIER_RETURN_IF_ERROR(r->ReportSignals(sig));
  }
  KVTIER_RETURN_IF_ERROR(r->Wait());
  res.stats = r->Stats();
  KVTIER_RETURN_IF_ERROR(r->Close());
  r.reset();
  res.memory_bytes = bytes_sum / measured();
  res.memory_fraction = fraction_sum / measured();
  double sum = 0;
  for (double e : errors) sum += e;
  res.rel_error = sum / static_cast<double>(errors.size());
  res.rel_error_max = *std::max_element(errors.begin(), errors.end());
  res.rel_error_p95 = Quantile(errors, 0.95);
  res.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return res;
}

void PolicyReplay::PrintRow(const RunResult& r) const {
  const std::string budget =
      r.spec.budget_tokens > 0 ? absl::StrCat(r.spec.budget_tokens) : std::string("all");
  log_ << absl::StrFormat("%-17s %6s %9.2f %8.4f %10.3e %10.3e %10.3e %7d %9d %6.1f\n",
                          r.spec.policy, budget, r.memory_bytes / (1 << 20), r.memory_fraction,
                          r.rel_error, r.rel_error_p95, r.rel_error_max, r.stats.budget_changes,
                          r.stats.evicted_head_pages, r.seconds);
  log_.flush();
}

absl::Status PolicyReplay::Plot() const {
  std::vector<PlotSeries> series;
  for (const std::string& p : o_.policies) {
    PlotSeries ps;
    ps.name = p;
    ps.dashed = p == "window" || p == "h2o";
    for (const RunResult& r : results_) {
      if (r.spec.policy != p) continue;
      ps.x.push_back(r.memory_fraction);
      ps.y.push_back(r.rel_error);
    }
    series.push_back(std::move(ps));
  }
  PlotOptions po;
  po.title = absl::StrFormat("kvtier policy sweep: context %d, %d layers, %d steps (%s)", T_, L(),
                             measured(), o_.trace_path.empty() ? "synthetic trace" : "trace");
  po.x_label = "resident KV / full KV";
  po.y_label = "attention rel. error vs full (mean)";
  po.log_y = true;
  return WriteLinePlot(o_.plot_path, po, series);
}

JsonObject PolicyReplay::Report(double wall_seconds) const {
  std::vector<JsonObject> runs;
  for (const RunResult& r : results_) {
    const SequenceStats& st = r.stats;
    JsonObject j;
    j.Add("policy", r.spec.policy)
        .Add("mode", std::string(RetrievalModeName(r.spec.mode)))
        .Add("budget_policy", r.spec.config.budget)
        .Add("residency_policy", r.spec.config.residency)
        .Add("budget_tokens", r.spec.budget_tokens)
        .Add("memory_bytes", r.memory_bytes)
        .Add("memory_fraction", r.memory_fraction)
        .Add("rel_error", r.rel_error)
        .Add("rel_error_p95", r.rel_error_p95)
        .Add("rel_error_max", r.rel_error_max)
        .Add("budget_changes", st.budget_changes)
        .Add("evicted_head_pages", st.evicted_head_pages)
        .Add("resident_head_pages", st.resident_head_pages)
        .Add("host_tier_bytes", st.offloaded_pages * static_cast<int64_t>(g_.host_page_bytes()))
        .Add("recall_bytes_per_step", static_cast<double>(st.recalled_bytes) / measured())
        .Add("correction_rate", st.correction_rate())
        .Add("seconds", r.seconds);
    runs.push_back(std::move(j));
  }
  JsonObject sizes;
  sizes.Add("context", T_)
      .Add("observation_tokens", w_)
      .Add("steps", N_)
      .Add("measured_steps", measured())
      .Add("layers", L())
      .Add("geometry", g_.ToString())
      .Add("full_kv_bytes", full_bytes_.empty() ? 0.0 : full_bytes_.back());
  double drift_sum = 0, drift_max = 0;
  for (int32_t s = w_; s < N_; ++s) {
    drift_sum += drift_[s];
    drift_max = std::max(drift_max, drift_[s]);
  }
  JsonObject j;
  j.Add("bench", "policies")
      .Add("device", backend_->Describe())
      .Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("trace", o_.trace_path.empty() ? std::string("synthetic") : o_.trace_path)
      .AddObject("sizes", sizes)
      .Add("proxies", kProxyNote)
      .Add("mean_drift", drift_sum / measured())
      .Add("max_drift", drift_max);
  if (o_.trace_path.empty()) {
    j.Add("step_cosine", o_.synthetic.step_cosine)
        .Add("jump_probability", o_.synthetic.jump_probability)
        .Add("seed", static_cast<int64_t>(o_.synthetic.seed));
  }
  j.Add("wall_seconds", wall_seconds).AddArray("runs", runs);
  return j;
}

absl::StatusOr<JsonObject> PolicyReplay::Run() {
  const absl::Time start = absl::Now();
  KVTIER_RETURN_IF_ERROR(Setup());
  KVTIER_RETURN_IF_ERROR(LoadTrace());
  std::vector<std::string> budget_names;
  for (int32_t b : budgets_) budget_names.push_back(absl::StrCat(b));
  log_ << absl::StrFormat(
      "kvtier-bench decode: policies: %s, commit %s\n"
      "  geometry %s (%d layers replayed), prompt %d + %d tokens (the last %d observed), %d "
      "measured steps\n"
      "  budgets %s tokens; drop mode unless named; memory = resident K+V (working set)\n"
      "  SIGNALS ARE SYNTHETIC STAND-INS: logits (V = %d) peak at token 0 by %.0f*(1 - "
      "min(1, drift/%.1f)),\n"
      "  drift = mean 1 - cos(q_t, q_t-1) over layers and query heads; hidden_delta[l] = "
      "|q_l(t) - q_l(t-1)|\n",
      backend_->Describe(), std::string(Commit()), trace_->geometry().ToString(), L(), T_, w_, w_,
      measured(), absl::StrJoin(budget_names, ","), o_.vocab, kPeakLogit, kFlatDrift);
  double drift_sum = 0, drift_max = 0;
  for (int32_t s = w_; s < N_; ++s) {
    drift_sum += drift_[s];
    drift_max = std::max(drift_max, drift_[s]);
  }
  log_ << absl::StrFormat("  drift over the measured steps: mean %.3f, max %.3f\n",
                          drift_sum / measured(), drift_max);
  log_ << absl::StrFormat("%-17s %6s %9s %8s %10s %10s %10s %7s %9s %6s\n", "policy", "budget",
                          "mem MiB", "mem frac", "rel_err", "err p95", "err max", "bud_chg",
                          "evicted", "run s");
  RunSpec full;
  full.policy = "full";
  full.mode = RetrievalMode::kFull;
  KVTIER_ASSIGN_OR_RETURN(RunResult ref, RunOne(full));
  PrintRow(ref);
  results_.push_back(std::move(ref));
  for (const std::string& p : o_.policies) {
    for (int32_t b : budgets_) {
      SequenceOptions ro;  // refuses a budget the working set's split cannot express
      KVTIER_RETURN_IF_ERROR(ro.SetBudgetTokens(b, g_.page_size));
      KVTIER_ASSIGN_OR_RETURN(RunSpec spec, MakeSpec(p, b));
      absl::StatusOr<RunResult> r = RunOne(spec);
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrFormat("%s at %d tokens: %s", p, b,
                                                               std::string(r.status().message())));
      }
      PrintRow(*r);
      results_.push_back(*std::move(r));
    }
  }
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  log_ << absl::StrFormat("  sweep done in %.1f s\n", wall);
  if (!o_.plot_path.empty()) {
    KVTIER_RETURN_IF_ERROR(Plot());
    log_ << "  plot written (--plot)\n";
  }
  return Report(wall);
}

}  // namespace

const std::vector<std::string>& PolicyReplayNames() {
  static const auto* names = new std::vector<std::string>{
      "window", "h2o", "conf-kv", "epikv", "epikv-kv", "xkv", "kv-compress", kSpeculativeConf};
  return *names;
}

absl::StatusOr<JsonObject> RunPolicyReplay(const PolicyReplayOptions& o, std::ostream& log) {
  PolicyReplay replay(o, log);
  return replay.Run();
}

}  // namespace kvtier::bench
