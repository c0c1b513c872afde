#include "bench/decode_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "bench/synthetic_kv.h"
#include "core/status.h"
#include "kvtier/dtype.h"
#include "offload/host_arena.h"
#include "offload/page_pool.h"
#include "offload/sequence_batch.h"

namespace kvtier::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Targets the report prints (not asserted). These two are GPU targets (attention on the
// device, recall over PCIe in the background): on the cpu backend they are reported as not
// applicable.
constexpr double kSpeculativeOverResidentMax = 1.15;
constexpr double kSyncOverSpeculativeMin = 5.0;
// A batched layer-step of B sequences against B lone ones (batch 1): a cpu backend target.
constexpr double kBatchedOverLoneMax = 0.5;
constexpr int32_t kMaxBatch = 1024;

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// "driver 12.4" and "runtime 12.4" out of the cuda backend's Describe() line.
void ParseCudaVersions(const std::string& describe, std::string* driver, std::string* cuda) {
  for (absl::string_view part : absl::StrSplit(describe, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (absl::ConsumePrefix(&part, "driver ")) *driver = std::string(part);
    if (absl::ConsumePrefix(&part, "runtime ")) *cuda = std::string(part);
  }
}

std::string Bytes(double bytes) {
  if (bytes >= double(1 << 30)) return absl::StrFormat("%.2f GiB", bytes / double(1 << 30));
  if (bytes >= double(1 << 20)) return absl::StrFormat("%.1f MiB", bytes / double(1 << 20));
  return absl::StrFormat("%.1f KiB", bytes / 1024.0);
}

// One mode's time at one batch size, µs per layer step.
struct Timing {
  double mean_us = 0;    // wall / (steps × layers)
  double median_us = 0;  // median over steps of the step's wall / layers
  Spread per_step;       // the same per-step samples: median, p10/p90, min/max
};

// Retriever counters summed over the sequences, over the timed steps.
struct Counters {
  int64_t steps = 0;
  int64_t recalled_pages = 0;
  int64_t recalled_bytes = 0;
  int64_t correction_pages = 0;
  int64_t checked_heads = 0;
  int64_t corrected_heads = 0;
  int64_t host_waits = 0;      // blocking host calls inside the sequences' calls
  int64_t graph_launches = 0;  // captured layer-steps launched (--graphs)
  void Add(const SequenceStats& s, int64_t sign) {
    host_waits += sign * s.host_waits;
    graph_launches += sign * s.graph_launches;
    steps += sign * s.steps;
    recalled_pages += sign * s.recalled_pages;
    recalled_bytes += sign * s.recalled_bytes;
    correction_pages += sign * s.correction_pages;
    checked_heads += sign * s.checked_heads;
    corrected_heads += sign * s.corrected_heads;
  }
  double correction_rate() const {
    return checked_heads == 0 ? 0.0 : static_cast<double>(corrected_heads) / checked_heads;
  }
};

struct RetrieverRun {
  Timing timing;
  Counters counters;
  std::set<std::string> strategies;  // SequenceStats::recall_strategy of the sequences
};

struct BatchResult {
  int32_t batch = 0;
  Timing dense, resident, resident_per_seq, speculative, sync, batched;
  Counters spec_counters, sync_counters, batched_counters;
  bool has_sync = false;
  bool has_batched = false;
};

class StepBench {
 public:
  explicit StepBench(const StepBenchOptions& o) : o_(o), g_(o.geometry) {}
  absl::StatusOr<JsonObject> Run(std::ostream& log);

 private:
  absl::Status Check() const;
  absl::Status Setup(std::ostream& log);
  absl::Status Upload(void* dst, const std::vector<uint8_t>& src) {
    KVTIER_RETURN_IF_ERROR(be_->Copy(*compute_, dst, src.data(), src.size()));
    return compute_->Synchronize();  // `src` may go out of scope after this
  }
  // Pointers into the per-step inputs, [step][layer][batch][heads][d].
  const void* Q(int32_t step, int32_t layer, int32_t b) const {
    return q_all_.as<uint8_t>() + ((int64_t{step} * g_.num_layers + layer) * Bmax_ + b) * q_bytes_;
  }
  const void* TokK(int32_t step, int32_t layer, int32_t b) const {
    return tok_k_.as<uint8_t>() +
           ((int64_t{step} * g_.num_layers + layer) * Bmax_ + b) * row_bytes_;
  }
  const void* TokV(int32_t step, int32_t layer, int32_t b) const {
    return tok_v_.as<uint8_t>() +
           ((int64_t{step} * g_.num_layers + layer) * Bmax_ + b) * row_bytes_;
  }
  // Runs the warm-up steps, then times o_.steps steps (step(i) runs all layers of step i).
  // `after_warmup` runs untimed before the first timed step; `finish` inside the timer after
  // the last one (and in its sample), so work the timed steps left running is counted.
  absl::StatusOr<Timing> TimeSteps(const std::function<absl::Status(int32_t)>& step,
                                   const std::function<absl::Status()>& after_warmup,
                                   const std::function<absl::Status()>& finish = nullptr);
  absl::Status Dense(int32_t step, int32_t B);
  absl::Status Resident(int32_t step, int32_t B, bool per_sequence);
  // `batched`: the B sequences are members of one SequenceBatch stepped together.
  absl::StatusOr<RetrieverRun> Retrievers(int32_t B, RetrievalMode mode, bool batched = false);
  JsonObject Report(const std::vector<BatchResult>& results, std::ostream& log) const;

  const StepBenchOptions o_;
  const Geometry g_;
  int32_t Bmax_ = 0, T_ = 0, S_ = 0, N_ = 0, max_tokens_ = 0;
  size_t q_bytes_ = 0, row_bytes_ = 0, kv_seq_bytes_ = 0, ws_seq_bytes_ = 0;
  size_t pool_bytes_ = 0, device_bytes_ = 0;
  SequenceOptions ro_;  // shape of the working set (SetBudgetTokens)
  std::set<std::string> strategies_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Stream> compute_;
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<PagePool> pool_;
  std::vector<DeviceBuffer> dense_k_, dense_v_, ws_k_, ws_v_, out_;  // per layer
  DeviceBuffer seq_len_, table_, partial_page_, partial_len_, q_all_, tok_k_, tok_v_;
};

absl::Status StepBench::Check() const {
  KVTIER_RETURN_IF_ERROR(g_.Validate());
  if (o_.batches.empty()) return absl::InvalidArgumentError("--batch: give at least one size");
  for (int32_t b : o_.batches) {
    if (b < 1 || b > kMaxBatch) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--batch: %d must be in [1, %d]", b, kMaxBatch));
    }
  }
  if (o_.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (o_.warmup < 0) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (!(o_.step_cosine > 0.0 && o_.step_cosine <= 1.0)) {
    return absl::InvalidArgumentError("--step-cosine must be in (0, 1]");
  }
  if (!(o_.jump_probability >= 0.0 && o_.jump_probability <= 1.0)) {
    return absl::InvalidArgumentError("--jump-probability must be in [0, 1]");
  }
  if (o_.context <= o_.budget_tokens) {  // the budget itself: SetBudgetTokens
    return absl::InvalidArgumentError(absl::StrFormat(
        "--context = %d must exceed --budget = %d (else the whole context is resident)", o_.context,
        o_.budget_tokens));
  }
  if (int64_t{o_.context} + o_.warmup + o_.steps > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("--context + --warmup + --steps must be at most 2^30");
  }
  return absl::OkStatus();
}

absl::Status StepBench::Setup(std::ostream& log) {
  KVTIER_RETURN_IF_ERROR(Check());
  KVTIER_RETURN_IF_ERROR(ro_.SetBudgetTokens(o_.budget_tokens, g_.page_size));
  const int32_t L = g_.num_layers, Hq = g_.num_q_heads, Hkv = g_.num_kv_heads, d = g_.head_dim,
                p = g_.page_size;
  const size_t e = g_.element_bytes();
  Bmax_ = *std::max_element(o_.batches.begin(), o_.batches.end());
  T_ = o_.context;
  S_ = ro_.budget_pages();
  N_ = o_.warmup + o_.steps;
  max_tokens_ = T_ + N_;
  q_bytes_ = size_t{1} * Hq * d * e;
  row_bytes_ = size_t{1} * Hkv * d * e;
  kv_seq_bytes_ = size_t{1} * T_ * row_bytes_;
  ws_seq_bytes_ = size_t{1} * S_ * p * row_bytes_;

  // The host tier: every sequence's pages of every layer, for the largest batch (the modes
  // and batch sizes run one after the other and free their pages).
  const int64_t pages_per_layer = (max_tokens_ + p - 1) / p;
  const int64_t slots = int64_t{Bmax_} * L * pages_per_layer;
  const size_t stride = (g_.host_page_bytes() + PagePool::kSlotAlignment - 1) /
                        PagePool::kSlotAlignment * PagePool::kSlotAlignment;
  pool_bytes_ = static_cast<size_t>(slots) * stride;
  // Backend memory: dense K/V, resident working sets, outputs, per-step inputs, and the
  // Retrievers' own working sets, summaries and key codes (estimated).
  device_bytes_ = size_t{1} * L * Bmax_ * (2 * kv_seq_bytes_ + 4 * ws_seq_bytes_ + q_bytes_) +
                  size_t{1} * N_ * L * Bmax_ * (q_bytes_ + 2 * row_bytes_) +
                  size_t{1} * L * Bmax_ * pages_per_layer *
                      (g_.summary_bytes() +
                       (SequenceOptions().summary == SummaryMode::kKeyCodes ? g_.key_code_bytes() : 0));
  const size_t staging =
      3 * kv_seq_bytes_ + size_t{1} * N_ * L * Bmax_ * (q_bytes_ + 2 * row_bytes_);

  DeviceOptions bo;
  bo.cpu_threads = o_.threads;
  KVTIER_ASSIGN_OR_RETURN(be_, CreateBackend(o_.backend, bo));
  const size_t host_need =
      pool_bytes_ + staging + (be_->kind() == DeviceKind::kCpu ? device_bytes_ : 0);
  const int64_t avail = HostMemAvailable();
  if (avail > 0 && static_cast<double>(host_need) > 0.9 * static_cast<double>(avail)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "step bench: needs about %s of host memory (host tier %s%s), %s available; lower "
        "--context, --batch or --layers",
        Bytes(double(host_need)), Bytes(double(pool_bytes_)),
        be_->kind() == DeviceKind::kCpu ? ", cpu backend buffers " + Bytes(double(device_bytes_))
                                        : std::string(),
        Bytes(double(avail))));
  }
  KVTIER_ASSIGN_OR_RETURN(compute_, be_->CreateStream());

  ArenaOptions ao;
  ao.bytes = pool_bytes_;
  ao.name = "kvtier-step-bench";
  ao.lock = false;
  KVTIER_ASSIGN_OR_RETURN(arena_, HostArena::Create(ao));
  KVTIER_RETURN_IF_ERROR(arena_->RegisterWith(*be_));
  KVTIER_ASSIGN_OR_RETURN(pool_, PagePool::CreateInArena(*arena_, g_.host_page_bytes()));

  // Per layer: synthetic K/V of one sequence (sink, recent and heavy pages, so selection has
  // structure), the same for every sequence of the batch; the base query of the layer.
  log << absl::StrFormat("step bench: preparing %d layers x %d sequences x %d tokens...\n", L,
                         Bmax_, T_);
  std::mt19937_64 rng(o_.seed * 0x9e3779b97f4a7c15ULL + 17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<uint8_t> q_host(static_cast<size_t>(N_) * L * Bmax_ * q_bytes_);
  const float sigma =
      static_cast<float>(std::sqrt((1.0 / (o_.step_cosine * o_.step_cosine) - 1.0) / d));
  const int32_t G = g_.group_size();
  for (int32_t l = 0; l < L; ++l) {
    SyntheticKvOptions so;
    so.batch = 1;
    so.tokens = T_;
    so.seed = o_.seed + static_cast<uint64_t>(l) * 1000003;
    SyntheticKv kv = MakeSyntheticKv(g_, so);
    for (auto* v : {&dense_k_, &dense_v_, &ws_k_, &ws_v_, &out_}) {
      const size_t bytes = v == &out_                         ? Bmax_ * q_bytes_
                           : v == &dense_k_ || v == &dense_v_ ? Bmax_ * kv_seq_bytes_
                                                              : Bmax_ * ws_seq_bytes_;
      KVTIER_ASSIGN_OR_RETURN(DeviceBuffer buf, be_->Allocate(bytes));
      v->push_back(std::move(buf));
    }
    for (int32_t b = 0; b < Bmax_; ++b) {
      uint8_t* dk = dense_k_[l].as<uint8_t>() + b * kv_seq_bytes_;
      uint8_t* dv = dense_v_[l].as<uint8_t>() + b * kv_seq_bytes_;
      KVTIER_RETURN_IF_ERROR(be_->Copy(*compute_, dk, kv.k.data(), kv_seq_bytes_));
      KVTIER_RETURN_IF_ERROR(be_->Copy(*compute_, dv, kv.v.data(), kv_seq_bytes_));
      // The resident working set: slot s holds page s (NHD pages are contiguous in both).
      KVTIER_RETURN_IF_ERROR(
          be_->Copy(*compute_, ws_k_[l].as<uint8_t>() + b * ws_seq_bytes_, dk, ws_seq_bytes_));
      KVTIER_RETURN_IF_ERROR(
          be_->Copy(*compute_, ws_v_[l].as<uint8_t>() + b * ws_seq_bytes_, dv, ws_seq_bytes_));
    }
    KVTIER_RETURN_IF_ERROR(be_->Memset(*compute_, out_[l].data(), 0, Bmax_ * q_bytes_));
    KVTIER_RETURN_IF_ERROR(compute_->Synchronize());  // before `kv` goes away

    // Queries of (layer, sequence) over the steps: the layer's base query plus a per-sequence
    // offset, then the drift (and the jumps) step by step.
    std::vector<float> cur(static_cast<size_t>(Hq) * d), norm(static_cast<size_t>(Hq));
    for (int32_t b = 0; b < Bmax_; ++b) {
      for (int32_t h = 0; h < Hq; ++h) {
        double n2 = 0;
        for (int32_t i = 0; i < d; ++i) {
          float& x = cur[static_cast<size_t>(h * d + i)];
          x = LoadAsFloat(kv.q, g_.dtype, int64_t{h} * d + i) + 0.3f * normal(rng);
          n2 += double(x) * x;
        }
        norm[static_cast<size_t>(h)] = static_cast<float>(std::sqrt(n2));
      }
      for (int32_t s = 0; s < N_; ++s) {
        if (s > 0) {
          for (int32_t kh = 0; kh < Hkv; ++kh) {
            const bool jump = unit(rng) < o_.jump_probability;
            for (int32_t h = kh * G; h < (kh + 1) * G; ++h) {
              float* x = &cur[static_cast<size_t>(h * d)];
              const float r = norm[static_cast<size_t>(h)];
              double n2 = 0;
              for (int32_t i = 0; i < d; ++i) {
                x[i] = jump ? normal(rng) : x[i] / r + sigma * normal(rng);
                n2 += double(x[i]) * x[i];
              }
              const float scale = r / static_cast<float>(std::sqrt(n2));
              for (int32_t i = 0; i < d; ++i) x[i] *= scale;
            }
          }
        }
        const int64_t base = ((int64_t{s} * L + l) * Bmax_ + b) * Hq * d;
        for (int64_t i = 0; i < int64_t{Hq} * d; ++i) {
          StoreElement(q_host, g_.dtype, base + i, cur[static_cast<size_t>(i)]);
        }
      }
    }
  }
  KVTIER_ASSIGN_OR_RETURN(q_all_, be_->Allocate(q_host.size()));
  KVTIER_RETURN_IF_ERROR(Upload(q_all_.data(), q_host));
  // The decode tokens' K/V rows: noise.
  for (DeviceBuffer* buf : {&tok_k_, &tok_v_}) {
    std::vector<uint8_t> rows(static_cast<size_t>(N_) * L * Bmax_ * row_bytes_);
    const int64_t n = static_cast<int64_t>(rows.size() / e);
    for (int64_t i = 0; i < n; ++i) StoreElement(rows, g_.dtype, i, normal(rng));
    KVTIER_ASSIGN_OR_RETURN(*buf, be_->Allocate(rows.size()));
    KVTIER_RETURN_IF_ERROR(Upload(buf->data(), rows));
  }
  // The resident working sets' tables: every slot full (slot s holds page s), no partial page.
  std::vector<int32_t> table(static_cast<size_t>(Bmax_) * Hkv * S_);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i % S_);
  const std::vector<int32_t> seq_len(static_cast<size_t>(Bmax_), T_),
      partial_page(static_cast<size_t>(Bmax_), -1), partial_len(static_cast<size_t>(Bmax_), 0);
  auto upload_ints = [&](DeviceBuffer* dst, const std::vector<int32_t>& v) -> absl::Status {
    std::vector<uint8_t> raw(v.size() * sizeof(int32_t));
    std::memcpy(raw.data(), v.data(), raw.size());
    KVTIER_ASSIGN_OR_RETURN(*dst, be_->Allocate(raw.size()));
    return Upload(dst->data(), raw);
  };
  KVTIER_RETURN_IF_ERROR(upload_ints(&table_, table));
  KVTIER_RETURN_IF_ERROR(upload_ints(&seq_len_, seq_len));
  KVTIER_RETURN_IF_ERROR(upload_ints(&partial_page_, partial_page));
  return upload_ints(&partial_len_, partial_len);
}

absl::StatusOr<Timing> StepBench::TimeSteps(const std::function<absl::Status(int32_t)>& step,
                                            const std::function<absl::Status()>& after_warmup,
                                            const std::function<absl::Status()>& finish) {
  for (int32_t s = 0; s < o_.warmup; ++s) {
    KVTIER_RETURN_IF_ERROR(step(s));
    KVTIER_RETURN_IF_ERROR(compute_->Synchronize());
  }
  if (after_warmup) KVTIER_RETURN_IF_ERROR(after_warmup());
  KVTIER_RETURN_IF_ERROR(compute_->Synchronize());
  std::vector<double> per_step;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point prev = t0;
  for (int32_t i = 0; i < o_.steps; ++i) {
    KVTIER_RETURN_IF_ERROR(step(o_.warmup + i));
    KVTIER_RETURN_IF_ERROR(compute_->Synchronize());
    if (finish && i + 1 == o_.steps) KVTIER_RETURN_IF_ERROR(finish());
    const Clock::time_point now = Clock::now();
    per_step.push_back(Us(now - prev) / g_.num_layers);
    prev = now;
  }
  Timing t;
  t.mean_us = Us(prev - t0) / (double(o_.steps) * g_.num_layers);
  t.per_step = SpreadOf(std::move(per_step));
  t.median_us = t.per_step.median;
  return t;
}

absl::Status StepBench::Dense(int32_t step, int32_t B) {
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    DenseAttentionArgs a;
    a.shape = KvShapeOf(g_);
    a.batch = B;
    a.max_tokens = T_;
    a.q = Q(step, l, 0);
    a.k = dense_k_[l].data();
    a.v = dense_v_[l].data();
    a.seq_len = seq_len_.as<int32_t>();
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
    a.out = out_[l].data();
    KVTIER_RETURN_IF_ERROR(be_->DenseAttention(*compute_, a));
  }
  return absl::OkStatus();
}

absl::Status StepBench::Resident(int32_t step, int32_t B, bool per_sequence) {
  const int32_t launches = per_sequence ? B : 1;
  const int32_t batch = per_sequence ? 1 : B;
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    for (int32_t b = 0; b < launches; ++b) {
      SparseAttentionArgs a;
      a.shape = KvShapeOf(g_);
      a.batch = batch;
      a.kv.num_slots = S_;
      a.q = Q(step, l, b);
      a.kv.k_cache = ws_k_[l].as<uint8_t>() + b * ws_seq_bytes_;
      a.kv.v_cache = ws_v_[l].as<uint8_t>() + b * ws_seq_bytes_;
      a.kv.slot_table = table_.as<int32_t>() + int64_t{b} * g_.num_kv_heads * S_;
      a.kv.partial_page = partial_page_.as<int32_t>() + b;
      a.kv.partial_len = partial_len_.as<int32_t>() + b;
      a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(g_.head_dim));
      a.out = out_[l].as<uint8_t>() + b * q_bytes_;
      KVTIER_RETURN_IF_ERROR(be_->SparseAttention(*compute_, a));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RetrieverRun> StepBench::Retrievers(int32_t B, RetrievalMode mode, bool batched) {
  SequenceOptions ro = ro_;
  ro.mode = mode;
  ro.max_tokens = max_tokens_;
  ro.correction_threshold = o_.tau;
  ro.recall = o_.recall;
  // Graph capture applies to speculative mode recalling zero-copy; the sequence ignores it
  // elsewhere, and the report's graph_launches says whether graphs ran.
  ro.capture_graphs = o_.graphs && mode == RetrievalMode::kSpeculative;
  ro.deadline = absl::Minutes(5);
  ro.compute_stream = compute_.get();
  std::vector<std::unique_ptr<LocalSequence>> rs;
  std::unique_ptr<SequenceBatch> batch;
  std::vector<LocalSequence*> members;
  if (batched) {
    KVTIER_ASSIGN_OR_RETURN(batch, NewSequenceBatchOverPool(g_, ro, B, *be_, pool_.get()));
  }
  for (int32_t b = 0; b < B; ++b) {
    if (batched) {
      KVTIER_ASSIGN_OR_RETURN(auto r, batch->NewSequence());
      members.push_back(r.get());
      rs.push_back(std::move(r));
    } else {
      KVTIER_ASSIGN_OR_RETURN(auto r, Retriever::Create(g_, ro, *be_, pool_.get()));
      rs.push_back(std::move(r));
    }
  }
  // Prefill: the context of every layer, from the dense K/V (not timed).
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      KVTIER_RETURN_IF_ERROR(rs[b]->Append(l, dense_k_[l].as<uint8_t>() + b * kv_seq_bytes_,
                                           dense_v_[l].as<uint8_t>() + b * kv_seq_bytes_, T_));
    }
  }
  for (auto& r : rs) KVTIER_RETURN_IF_ERROR(r->Wait());
  auto step = [&](int32_t s) -> absl::Status {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      if (batched) {
        for (int32_t b = 0; b < B; ++b) {
          KVTIER_RETURN_IF_ERROR(rs[b]->Append(l, TokK(s, l, b), TokV(s, l, b), 1));
        }
        // One launch of each op for the B sequences (their queries are consecutive rows).
        KVTIER_RETURN_IF_ERROR(batch->BeginStep(l, members, Q(s, l, 0)).status());
        KVTIER_RETURN_IF_ERROR(batch->Attend(l, members, Q(s, l, 0), out_[l].data(), nullptr));
        KVTIER_RETURN_IF_ERROR(batch->EndStep(l, members, Q(s, l, 0)));
        continue;
      }
      for (int32_t b = 0; b < B; ++b) {
        LocalSequence& r = *rs[b];
        const void* q = Q(s, l, b);
        KVTIER_RETURN_IF_ERROR(r.Append(l, TokK(s, l, b), TokV(s, l, b), 1));
        KVTIER_RETURN_IF_ERROR(r.BeginStep(l, q).status());
        KVTIER_RETURN_IF_ERROR(r.Attend(l, q, out_[l].as<uint8_t>() + b * q_bytes_, nullptr));
        KVTIER_RETURN_IF_ERROR(r.EndStep(l, q));
      }
    }
    return absl::OkStatus();
  };
  RetrieverRun run;
  // Counters over the timed steps only: drain the warm-up's background work, snapshot.
  auto drain = [&]() -> absl::Status {
    for (auto& r : rs) {
      KVTIER_RETURN_IF_ERROR(r->Wait());
      run.counters.Add(r->Stats(), -1);
    }
    return absl::OkStatus();
  };
  // The background work of the last timed step is waited for inside the timer: the steps
  // before it already paid for their predecessors' by sharing the device (or the cores).
  auto finish = [&]() -> absl::Status {
    for (auto& r : rs) KVTIER_RETURN_IF_ERROR(r->Wait());
    return absl::OkStatus();
  };
  KVTIER_ASSIGN_OR_RETURN(run.timing, TimeSteps(step, drain, finish));
  for (auto& r : rs) {
    KVTIER_RETURN_IF_ERROR(r->Wait());
    const SequenceStats st = r->Stats();
    run.counters.Add(st, +1);
    run.strategies.insert(std::string(RecallStrategyName(st.recall_strategy)));
  }
  for (auto& r : rs) KVTIER_RETURN_IF_ERROR(r->Close());
  return run;
}

JsonObject StepBench::Report(const std::vector<BatchResult>& results, std::ostream& log) const {
  const std::string device = be_->Describe();
  std::string driver, cuda;
  if (be_->kind() == DeviceKind::kCuda) ParseCudaVersions(device, &driver, &cuda);
  const std::string strategy = strategies_.empty() ? std::string(RecallStrategyName(o_.recall))
                                                   : absl::StrJoin(strategies_, "+");
  const int64_t layer_steps = int64_t{o_.steps} * g_.num_layers;
  // The 1.15x and 5x targets are about a GPU; the batched one about the cpu backend.
  const bool gpu = be_->kind() != DeviceKind::kCpu;
  const std::string gpu_only =
      absl::StrFormat("a GPU target, n/a on the %s backend", DeviceKindName(be_->kind()));
  log << absl::StrFormat(
      "kvtier-bench decode: step  device=%s  commit=%s\n"
      "  shape %s, context %d, budget %d tokens (%d sink + %d selected + %d recent pages),\n"
      "  %d layers per decode step, %d timed steps after %d warm-up, recall %s (asked %s),\n"
      "  queries: step cosine %.3f, jump probability %.3f; tau %.2f\n"
      "  host tier %s (registered), backend buffers %s\n",
      device, Commit(), g_.ToString(), T_, o_.budget_tokens, ro_.sink_pages, ro_.selected_pages,
      ro_.recent_pages, g_.num_layers, o_.steps, o_.warmup, strategy, RecallStrategyName(o_.recall),
      o_.step_cosine, o_.jump_probability, o_.tau, Bytes(double(pool_bytes_)),
      Bytes(double(device_bytes_)));

  JsonObject dense_us, resident_us, resident_seq_us, spec_us, sync_us, dense_med, resident_med,
      resident_seq_med, spec_med, sync_med, batched_us, batched_med, ratios, correction, stats,
      spread;
  // Batch 1's speculative step: the lone sequence a batch is compared with.
  double lone_us = NAN;
  for (const BatchResult& r : results) {
    if (r.batch == 1) lone_us = r.speculative.mean_us;
  }
  for (const BatchResult& r : results) {
    const std::string key = absl::StrCat(r.batch);
    const double spec_over_res = r.speculative.mean_us / r.resident.mean_us;
    const double spec_over_res_seq = r.speculative.mean_us / r.resident_per_seq.mean_us;
    const double sync_over_spec = r.has_sync ? r.sync.mean_us / r.speculative.mean_us : NAN;
    const double dense_over_spec = r.dense.mean_us / r.speculative.mean_us;
    const double per_seq_step = double(layer_steps) * r.batch;
    log << absl::StrFormat(
        "\n  batch %d                   us/layer-step   median      p10-p90 (per step)\n", r.batch);
    JsonObject batch_spread;
    auto line = [&](const char* name, const Timing& t, const std::string& extra) {
      log << absl::StrFormat("    %-24s %12.1f %8.1f %15s%s\n", name, t.mean_us, t.median_us,
                             absl::StrFormat("%.1f-%.1f", t.per_step.p10, t.per_step.p90), extra);
    };
    line("dense (full KV)", r.dense, "");
    line("resident (ideal)", r.resident, "");
    line("resident, per sequence", r.resident_per_seq, "   (one launch per sequence)");
    line("speculative", r.speculative,
         absl::StrFormat(
             "   correction rate %.3f, %.1f head-pages recalled/seq-layer-step%s",
             r.spec_counters.correction_rate(),
             double(r.spec_counters.recalled_pages) / per_seq_step,
             o_.graphs ? absl::StrFormat(", %d graph launches", r.spec_counters.graph_launches)
                       : std::string()));
    if (r.has_sync) {
      line("sync", r.sync,
           absl::StrFormat("   %.1f head-pages recalled/seq-layer-step",
                           double(r.sync_counters.recalled_pages) / per_seq_step));
    }
    log << absl::StrFormat(
        "    speculative / resident   %6.2fx  (%s); vs per-sequence resident %.2fx\n",
        spec_over_res,
        gpu ? absl::StrFormat("target <= %.2fx: %s", kSpeculativeOverResidentMax,
                              spec_over_res <= kSpeculativeOverResidentMax ? "met" : "MISSED")
            : absl::StrFormat("target <= %.2fx is %s", kSpeculativeOverResidentMax, gpu_only),
        spec_over_res_seq);
    if (r.has_sync) {
      log << absl::StrFormat(
          "    sync / speculative       %6.2fx  (%s)\n", sync_over_spec,
          gpu ? absl::StrFormat("target >= %.1fx: %s", kSyncOverSpeculativeMin,
                                sync_over_spec >= kSyncOverSpeculativeMin ? "met" : "MISSED")
              : absl::StrFormat("target >= %.1fx is %s", kSyncOverSpeculativeMin, gpu_only));
    }
    log << absl::StrFormat("    dense / speculative      %6.2fx\n", dense_over_spec);
    const double batched_over_seq = r.has_batched ? r.batched.mean_us / r.speculative.mean_us : NAN;
    const double batched_over_lone = r.has_batched ? r.batched.mean_us / (r.batch * lone_us) : NAN;
    if (r.has_batched) {
      line("speculative, batched", r.batched,
           absl::StrFormat("   one launch per op for the batch; correction rate %.3f",
                           r.batched_counters.correction_rate()));
      log << absl::StrFormat(
          "    batched / sequential     %6.2fx  (the same %d sequences, one "
          "by one, this run)\n",
          batched_over_seq, r.batch);
      if (r.batch > 1 && std::isfinite(lone_us)) {
        log << absl::StrFormat(
            "    batched / (%d x batch 1)  %6.2fx  (%s)\n", r.batch, batched_over_lone,
            gpu ? absl::StrFormat("the target <= %.2fx is a cpu backend one", kBatchedOverLoneMax)
                : absl::StrFormat("target <= %.2fx on the cpu backend: %s", kBatchedOverLoneMax,
                                  batched_over_lone <= kBatchedOverLoneMax ? "met" : "MISSED"));
      }
      batched_us.Add(key, r.batched.mean_us);
      batched_med.Add(key, r.batched.median_us);
    }
    log << absl::StrFormat(
        "    host waits per layer-step: speculative %.3f%s\n",
        double(r.spec_counters.host_waits) / std::max<double>(1, double(r.spec_counters.steps)),
        r.has_batched ? absl::StrFormat(", batched %.3f",
                                        double(r.batched_counters.host_waits) /
                                            std::max<double>(1, double(r.batched_counters.steps)))
                      : std::string());

    dense_us.Add(key, r.dense.mean_us);
    resident_us.Add(key, r.resident.mean_us);
    resident_seq_us.Add(key, r.resident_per_seq.mean_us);
    spec_us.Add(key, r.speculative.mean_us);
    dense_med.Add(key, r.dense.median_us);
    resident_med.Add(key, r.resident.median_us);
    resident_seq_med.Add(key, r.resident_per_seq.median_us);
    spec_med.Add(key, r.speculative.median_us);
    if (r.has_sync) {
      sync_us.Add(key, r.sync.mean_us);
      sync_med.Add(key, r.sync.median_us);
    }
    JsonObject ratio;
    // A target's *_target_met only where the target applies (GPU targets on a GPU backend,
    // the batched one on the cpu backend).
    ratio.Add("speculative_over_resident", spec_over_res)
        .Add("speculative_over_resident_per_seq", spec_over_res_seq)
        .Add("dense_over_speculative", dense_over_spec);
    if (gpu) ratio.Add("speculative_target_met", spec_over_res <= kSpeculativeOverResidentMax);
    if (r.has_sync) {
      ratio.Add("sync_over_speculative", sync_over_spec);
      if (gpu) ratio.Add("sync_target_met", sync_over_spec >= kSyncOverSpeculativeMin);
    }
    if (r.has_batched) {
      ratio.Add("batched_over_sequential", batched_over_seq);
      if (r.batch > 1 && std::isfinite(lone_us)) {
        ratio.Add("batched_over_lone", batched_over_lone);
        if (!gpu) ratio.Add("batched_target_met", batched_over_lone <= kBatchedOverLoneMax);
      }
    }
    batch_spread.AddObject("dense", SpreadJson(r.dense.per_step))
        .AddObject("resident", SpreadJson(r.resident.per_step))
        .AddObject("resident_per_seq", SpreadJson(r.resident_per_seq.per_step))
        .AddObject("speculative", SpreadJson(r.speculative.per_step));
    if (r.has_batched)
      batch_spread.AddObject("speculative_batched", SpreadJson(r.batched.per_step));
    if (r.has_sync) batch_spread.AddObject("sync", SpreadJson(r.sync.per_step));
    spread.AddObject(key, batch_spread);
    ratios.AddObject(key, ratio);
    correction.Add(key, r.spec_counters.correction_rate());
    auto counters = [&](const Counters& c) {
      JsonObject j;
      j.Add("layer_steps", c.steps)
          .Add("recalled_pages", c.recalled_pages)
          .Add("recalled_bytes", c.recalled_bytes)
          .Add("correction_pages", c.correction_pages)
          .Add("checked_heads", c.checked_heads)
          .Add("corrected_heads", c.corrected_heads)
          .Add("host_waits", c.host_waits)
          .Add("graph_launches", c.graph_launches)
          .Add("recalled_pages_per_seq_layer_step", double(c.recalled_pages) / per_seq_step);
      return j;
    };
    JsonObject st;
    st.AddObject("speculative", counters(r.spec_counters));
    if (r.has_batched) st.AddObject("batched", counters(r.batched_counters));
    if (r.has_sync) st.AddObject("sync", counters(r.sync_counters));
    stats.AddObject(key, st);
  }

  JsonObject sizes;
  std::vector<std::string> batch_names;
  for (int32_t b : o_.batches) batch_names.push_back(absl::StrCat(b));
  sizes.Add("context", T_)
      .Add("budget_tokens", o_.budget_tokens)
      .Add("sink_pages", ro_.sink_pages)
      .Add("selected_pages", ro_.selected_pages)
      .Add("recent_pages", ro_.recent_pages)
      .Add("layers", g_.num_layers)
      .Add("steps", o_.steps)
      .Add("warmup", o_.warmup)
      .Add("batches", absl::StrJoin(batch_names, ","))
      .Add("q_heads", g_.num_q_heads)
      .Add("kv_heads", g_.num_kv_heads)
      .Add("head_dim", g_.head_dim)
      .Add("page_size", g_.page_size)
      .Add("dtype", DTypeName(g_.dtype))
      .Add("host_tier_bytes", static_cast<int64_t>(pool_bytes_))
      .Add("backend_bytes", static_cast<int64_t>(device_bytes_));
  // Targets that do not apply to this backend are null.
  JsonObject targets;
  targets.Add("gpu_targets_apply", gpu)
      .Add("speculative_over_resident_max", gpu ? kSpeculativeOverResidentMax : NAN)
      .Add("batched_over_lone_max_cpu", gpu ? NAN : kBatchedOverLoneMax)
      .Add("sync_over_speculative_min", gpu ? kSyncOverSpeculativeMin : NAN);

  JsonObject j;
  j.Add("bench", "step").Add("device", device);
  if (!driver.empty()) j.Add("driver", driver);
  if (!cuda.empty()) j.Add("cuda", cuda);
  j.Add("host", HostCpu())
      .Add("commit", Commit())
      .Add("time", UtcNow())
      .Add("geometry", g_.ToString())
      .AddObject("sizes", sizes)
      .Add("recall_strategy", strategy)
      .Add("recall_requested", RecallStrategyName(o_.recall))
      .Add("capture_graphs", o_.graphs)
      .Add("tau", static_cast<double>(o_.tau))
      .Add("step_cosine", o_.step_cosine)
      .Add("jump_probability", o_.jump_probability)
      .Add("seed", static_cast<int64_t>(o_.seed))
      .AddObject("dense_us", dense_us)
      .AddObject("resident_us", resident_us)
      .AddObject("resident_per_seq_us", resident_seq_us)
      .AddObject("speculative_us", spec_us)
      .AddObject("sync_us", sync_us)
      .AddObject("speculative_batched_us", batched_us)
      .AddObject("dense_median_us", dense_med)
      .AddObject("resident_median_us", resident_med)
      .AddObject("resident_per_seq_median_us", resident_seq_med)
      .AddObject("speculative_median_us", spec_med)
      .AddObject("sync_median_us", sync_med)
      .AddObject("speculative_batched_median_us", batched_med)
      .AddObject("per_step_spread_us", spread)
      .AddObject("ratios", ratios)
      .AddObject("targets", targets)
      .AddObject("correction_rate", correction)
      .AddObject("retriever_stats", stats);
  return j;
}

absl::StatusOr<JsonObject> StepBench::Run(std::ostream& log) {
  KVTIER_RETURN_IF_ERROR(Setup(log));
  std::vector<BatchResult> results;
  for (int32_t B : o_.batches) {
    BatchResult r;
    r.batch = B;
    log << absl::StrFormat("step bench: batch %d: dense, resident, speculative%s...\n", B,
                           o_.sync ? ", sync" : "");
    KVTIER_ASSIGN_OR_RETURN(r.dense, TimeSteps([&](int32_t s) { return Dense(s, B); }, nullptr));
    KVTIER_ASSIGN_OR_RETURN(r.resident,
                            TimeSteps([&](int32_t s) { return Resident(s, B, false); }, nullptr));
    KVTIER_ASSIGN_OR_RETURN(r.resident_per_seq,
                            TimeSteps([&](int32_t s) { return Resident(s, B, true); }, nullptr));
    KVTIER_ASSIGN_OR_RETURN(RetrieverRun spec, Retrievers(B, RetrievalMode::kSpeculative));
    r.speculative = spec.timing;
    r.spec_counters = spec.counters;
    strategies_.insert(spec.strategies.begin(), spec.strategies.end());
    // A batch recalls zero-copy: measured whenever the asked strategy allows it.
    if (o_.recall == RecallStrategy::kAuto || o_.recall == RecallStrategy::kZeroCopy) {
      KVTIER_ASSIGN_OR_RETURN(RetrieverRun bat,
                              Retrievers(B, RetrievalMode::kSpeculative, /*batched=*/true));
      r.batched = bat.timing;
      r.batched_counters = bat.counters;
      r.has_batched = true;
    }
    if (o_.sync) {
      KVTIER_ASSIGN_OR_RETURN(RetrieverRun sync, Retrievers(B, RetrievalMode::kSync));
      r.sync = sync.timing;
      r.sync_counters = sync.counters;
      r.has_sync = true;
    }
    results.push_back(r);
  }
  return Report(results, log);
}

}  // namespace

absl::StatusOr<JsonObject> RunStepBench(const StepBenchOptions& o, std::ostream& log) {
  StepBench bench(o);
  return bench.Run(log);
}

}  // namespace kvtier::bench
