#include "engine/decoder.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::engine {

absl::StatusOr<std::unique_ptr<DenseKv>> DenseKv::Create(const LlamaConfig& c, Device& device,
                                                         int64_t capacity) {
  auto kv = std::make_unique<DenseKv>();
  kv->capacity_ = capacity;
  kv->row_ = int64_t{c.kv_heads} * c.head_dim;
  const size_t bytes = static_cast<size_t>(c.layers * capacity * kv->row_) * sizeof(float);
  KVTIER_ASSIGN_OR_RETURN(kv->k_, device.Allocate(bytes));
  KVTIER_ASSIGN_OR_RETURN(kv->v_, device.Allocate(bytes));
  return kv;
}

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::Create(const LlamaConfig& config,
                                                         const LlamaWeights& weights, Math& math,
                                                         Stream& stream,
                                                         const DecoderOptions& options) {
  if (options.prefill_chunk < 1 || options.prefill_chunk > 8192 || options.max_batch < 1 ||
      options.max_batch > 1024 || options.observe_window < 0 || options.observe_window > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "decoder options: prefill_chunk = %d must be in [1, 8192], max_batch = %d in [1, "
        "1024], observe_window = %d in [0, 1024]",
        options.prefill_chunk, options.max_batch, options.observe_window));
  }
  std::unique_ptr<Decoder> d(new Decoder(config, weights, math, stream, options));
  KVTIER_RETURN_IF_ERROR(d->Init());
  return d;
}

absl::Status Decoder::Init() {
  const LlamaConfig& c = config_;
  Device& dev = math_.device();
  rows_ = std::max(options_.prefill_chunk, options_.max_batch);
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  const size_t f = sizeof(float);
  const size_t e = DTypeSize(options_.kv_dtype);
  struct Item {
    DeviceBuffer* buf;
    size_t bytes;
  };
  const Item items[] = {
      {&ids_, rows_ * sizeof(int32_t)},
      {&positions_, rows_ * sizeof(int32_t)},
      {&x_, rows_ * c.dim * f},
      {&h_, rows_ * c.dim * f},
      {&q_, rows_ * qd * f},
      {&k_, rows_ * kvd * f},
      {&v_, rows_ * kvd * f},
      {&attn_, rows_ * qd * f},
      {&gate_, rows_ * c.ffn * f},
      {&up_, rows_ * c.ffn * f},
      {&logits_, static_cast<size_t>(options_.max_batch) * c.vocab * f},
      {&q_kv_, rows_ * qd * e},
      {&k_kv_, rows_ * kvd * e},
      {&v_kv_, rows_ * kvd * e},
      {&out_kv_, rows_ * qd * e},
      {&observe_, std::max<size_t>(1, size_t(c.layers) * options_.observe_window * qd * e)},
      {&delta_, rows_ * c.layers * f},
  };
  for (const Item& it : items) {
    KVTIER_ASSIGN_OR_RETURN(*it.buf, dev.Allocate(it.bytes));
  }
  host_delta_.resize(rows_ * c.layers);
  host_ids_.reserve(rows_);
  host_positions_.reserve(rows_);
  return absl::OkStatus();
}

absl::Status Decoder::UploadStep() {
  Device& dev = math_.device();
  KVTIER_RETURN_IF_ERROR(
      dev.Copy(stream_, ids_.data(), host_ids_.data(), host_ids_.size() * sizeof(int32_t)));
  KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, positions_.data(), host_positions_.data(),
                                  host_positions_.size() * sizeof(int32_t)));
  // The Math on the CPU reads them right away; a GPU copy from pageable memory has been
  // staged when it returns, but the host vectors are rewritten next step.
  return stream_.Synchronize();
}

absl::Status Decoder::Observe(int32_t layer, int64_t m, const float* k, const float* v) {
  const LlamaConfig& c = config_;
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  host_q_.resize(m * qd);
  host_k_.resize(m * kvd);
  host_v_.resize(m * kvd);
  Device& dev = math_.device();
  KVTIER_RETURN_IF_ERROR(math_.Fence());
  KVTIER_RETURN_IF_ERROR(
      dev.Copy(stream_, host_q_.data(), q_.data(), host_q_.size() * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, host_k_.data(), k, host_k_.size() * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, host_v_.data(), v, host_v_.size() * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(stream_.Synchronize());
  LayerRows r;
  r.layer = layer;
  r.rows = m;
  r.positions = host_positions_.data();
  r.q = host_q_.data();
  r.k = host_k_.data();
  r.v = host_v_.data();
  return observer_(r);
}

absl::StatusOr<float*> Decoder::LastHidden(const Sequence* seq) {
  auto it = last_hidden_.find(seq);
  if (it == last_hidden_.end()) {
    const size_t bytes = size_t(config_.layers) * config_.dim * sizeof(float);
    KVTIER_ASSIGN_OR_RETURN(DeviceBuffer b, math_.device().Allocate(bytes));
    it = last_hidden_.emplace(seq, std::move(b)).first;
  }
  return it->second.as<float>();
}

absl::Status Decoder::HiddenDelta(int32_t layer, const float* x, int64_t m, float* prev,
                                  int64_t row0, bool first_token) {
  const int64_t d = config_.dim;
  const int64_t n_layers = config_.layers;
  float* prev_l = prev + layer * d;
  float* out = delta_.as<float>() + row0 * n_layers + layer;
  if (first_token) KVTIER_RETURN_IF_ERROR(math_.Copy(prev_l, x, d));
  KVTIER_RETURN_IF_ERROR(math_.RowDistance(x, prev_l, out, 1, d, n_layers));
  if (m > 1)
    KVTIER_RETURN_IF_ERROR(math_.RowDistance(x + d, x, out + n_layers, m - 1, d, n_layers));
  return math_.Copy(prev_l, x + (m - 1) * d, d);
}

absl::Status Decoder::Forward(int64_t m, const std::function<float*(int32_t)>& k_rows,
                              const std::function<float*(int32_t)>& v_rows,
                              const AttentionFn& attention, const AfterLayerFn& after_layer,
                              int64_t logit_rows, std::vector<float>* logits) {
  const LlamaConfig& c = config_;
  const LlamaWeights& w = weights_;
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  float* x = x_.as<float>();
  float* h = h_.as<float>();
  KVTIER_RETURN_IF_ERROR(math_.Embed(ids_.as<int32_t>(), w.embed.as<float>(), x, m, c.dim));
  for (int32_t l = 0; l < c.layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    float* k = k_rows ? k_rows(l) : k_.as<float>();
    float* v = v_rows ? v_rows(l) : v_.as<float>();
    KVTIER_RETURN_IF_ERROR(math_.RmsNorm(x, lw.attn_norm.as<float>(), h, m, c.dim, c.eps));
    KVTIER_RETURN_IF_ERROR(
        math_.MatMul(h, lw.wq.as<float>(), lw.bq.as<float>(), q_.as<float>(), m, qd, c.dim));
    KVTIER_RETURN_IF_ERROR(math_.MatMul(h, lw.wk.as<float>(), lw.bk.as<float>(), k, m, kvd, c.dim));
    KVTIER_RETURN_IF_ERROR(math_.MatMul(h, lw.wv.as<float>(), lw.bv.as<float>(), v, m, kvd, c.dim));
    RopeArgs r;
    r.positions = positions_.as<int32_t>();
    r.inv_freq = w.inv_freq.as<float>();
    r.m = m;
    r.head_dim = c.head_dim;
    r.rot_dim = c.rope_dim;
    r.neox = c.rope_neox;
    r.x = q_.as<float>();
    r.heads = c.q_heads;
    KVTIER_RETURN_IF_ERROR(math_.Rope(r));
    r.x = k;
    r.heads = c.kv_heads;
    KVTIER_RETURN_IF_ERROR(math_.Rope(r));
    if (observer_) KVTIER_RETURN_IF_ERROR(Observe(l, m, k, v));
    KVTIER_RETURN_IF_ERROR(attention(l, m));
    KVTIER_RETURN_IF_ERROR(
        math_.MatMul(attn_.as<float>(), lw.wo.as<float>(), nullptr, h, m, c.dim, qd));
    KVTIER_RETURN_IF_ERROR(math_.Add(x, h, m * c.dim));
    KVTIER_RETURN_IF_ERROR(math_.RmsNorm(x, lw.ffn_norm.as<float>(), h, m, c.dim, c.eps));
    KVTIER_RETURN_IF_ERROR(
        math_.MatMul(h, lw.w_gate.as<float>(), nullptr, gate_.as<float>(), m, c.ffn, c.dim));
    KVTIER_RETURN_IF_ERROR(
        math_.MatMul(h, lw.w_up.as<float>(), nullptr, up_.as<float>(), m, c.ffn, c.dim));
    KVTIER_RETURN_IF_ERROR(math_.SiluMul(gate_.as<float>(), up_.as<float>(), m * c.ffn));
    KVTIER_RETURN_IF_ERROR(
        math_.MatMul(gate_.as<float>(), lw.w_down.as<float>(), nullptr, h, m, c.dim, c.ffn));
    KVTIER_RETURN_IF_ERROR(math_.Add(x, h, m * c.dim));
    if (after_layer) KVTIER_RETURN_IF_ERROR(after_layer(l, x));
  }
  const float* last = x + (m - logit_rows) * c.dim;
  KVTIER_RETURN_IF_ERROR(
      math_.RmsNorm(last, w.output_norm.as<float>(), h, logit_rows, c.dim, c.eps));
  KVTIER_RETURN_IF_ERROR(
      math_.MatMul(h, w.output_matrix(), nullptr, logits_.as<float>(), logit_rows, c.vocab, c.dim));
  logits->resize(static_cast<size_t>(logit_rows * c.vocab));
  KVTIER_RETURN_IF_ERROR(
      math_.device().Copy(stream_, logits->data(), logits_.data(), logits->size() * sizeof(float)));
  if (after_layer) {  // the hidden-state changes come back with the logits: one wait
    KVTIER_RETURN_IF_ERROR(math_.device().Copy(stream_, host_delta_.data(), delta_.data(),
                                               m * c.layers * sizeof(float)));
  }
  return stream_.Synchronize();
}

absl::Status Decoder::PrefillInto(Sequence* seq, DenseKv& kv, const std::vector<int32_t>& ids,
                                  std::vector<float>* logits,
                                  const std::function<void(int64_t, int64_t)>& progress,
                                  PrefillRecord* record) {
  const LlamaConfig& c = config_;
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n < 1) return absl::InvalidArgumentError("prefill: the prompt has no tokens");
  const int64_t start = kv.length();
  if (start + n > kv.capacity()) {
    return absl::OutOfRangeError(absl::StrFormat(
        "prefill: %d prompt tokens after %d exceed the KV capacity %d", n, start, kv.capacity()));
  }
  for (int32_t id : ids) {
    if (id < 0 || id >= c.vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("prefill: token id %d outside the vocabulary [0, %d)", id, c.vocab));
    }
  }
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  const DType dt = options_.kv_dtype;
  const size_t e = DTypeSize(dt);
  const int64_t window = std::min<int64_t>(options_.observe_window, n);
  // Every sequence's policies get the signals (a remote one's in kvtierd); the dense
  // baseline has none.
  Sequence* const signaled = seq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  float* prev = nullptr;  // the sequence's last hidden states
  if (signaled != nullptr && options_.report_hidden_delta) {
    KVTIER_ASSIGN_OR_RETURN(prev, LastHidden(seq));
  }
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(options_.prefill_chunk, n - done);
    const int64_t pos0 = start + done;
    host_ids_.assign(ids.begin() + done, ids.begin() + done + m);
    host_positions_.resize(m);
    for (int64_t i = 0; i < m; ++i) host_positions_[i] = static_cast<int32_t>(pos0 + i);
    KVTIER_RETURN_IF_ERROR(UploadStep());
    auto attention = [&](int32_t l, int64_t rows) -> absl::Status {
      CausalAttentionArgs a;
      a.q = q_.as<float>();
      a.k = kv.k(l, 0);
      a.v = kv.v(l, 0);
      a.out = attn_.as<float>();
      a.m = rows;
      a.first_pos = pos0;
      a.q_heads = c.q_heads;
      a.kv_heads = c.kv_heads;
      a.head_dim = c.head_dim;
      a.scale = scale;
      KVTIER_RETURN_IF_ERROR(math_.CausalAttention(a));
      if (seq == nullptr) return absl::OkStatus();
      KVTIER_RETURN_IF_ERROR(math_.ToDType(kv.k(l, pos0), k_kv_.data(), dt, rows * kvd));
      KVTIER_RETURN_IF_ERROR(math_.ToDType(kv.v(l, pos0), v_kv_.data(), dt, rows * kvd));
      KVTIER_RETURN_IF_ERROR(
          seq->Append(l, k_kv_.data(), v_kv_.data(), static_cast<int32_t>(rows)));
      // The prompt's last `window` queries, for ObserveQueries.
      const int64_t first_obs = n - window;  // relative to the prompt
      const int64_t lo = std::max(done, first_obs), hi = done + rows;
      if (signaled != nullptr && lo < hi) {
        auto* dst = static_cast<uint8_t*>(observe_.data()) +
                    ((l * options_.observe_window) + (lo - first_obs)) * qd * e;
        KVTIER_RETURN_IF_ERROR(
            math_.ToDType(q_.as<float>() + (lo - done) * qd, dst, dt, (hi - lo) * qd));
      }
      // k_kv_/v_kv_ are rewritten by the next layer: the append must have read them.
      return math_.Fence();
    };
    AfterLayerFn after_layer;
    if (signaled != nullptr && options_.report_hidden_delta) {
      after_layer = [&](int32_t l, const float* x) {
        return HiddenDelta(l, x, m, prev, 0, /*first_token=*/pos0 == 0);
      };
    }
    KVTIER_RETURN_IF_ERROR(Forward(
        m, [&](int32_t l) { return kv.k(l, pos0); }, [&](int32_t l) { return kv.v(l, pos0); },
        attention, after_layer, 1, logits));
    if (after_layer) {
      KVTIER_RETURN_IF_ERROR(ReportHiddenDelta(*signaled, pos0, m));
      if (record != nullptr) {
        record->delta_.insert(record->delta_.end(), host_delta_.begin(),
                              host_delta_.begin() + m * c.layers);
      }
    }
    done += m;
    kv.set_length(start + done);
    if (progress) progress(done, n);
  }
  if (record != nullptr) {
    // The observed queries and last hidden states, copied before another prefill reuses
    // the scratch (F32 copies: the query rows are an even count of 2- or 4-byte values).
    const int64_t obs_floats = int64_t{c.layers} * options_.observe_window * qd * int64_t(e) / 4;
    KVTIER_ASSIGN_OR_RETURN(record->observe_, math_.device().Allocate(obs_floats * sizeof(float)));
    KVTIER_RETURN_IF_ERROR(
        math_.Copy(record->observe_.as<float>(), observe_.as<float>(), obs_floats));
    record->window_ = window;
    if (prev != nullptr) {
      const int64_t hidden = int64_t{c.layers} * c.dim;
      KVTIER_ASSIGN_OR_RETURN(record->last_hidden_,
                              math_.device().Allocate(hidden * sizeof(float)));
      KVTIER_RETURN_IF_ERROR(math_.Copy(record->last_hidden_.as<float>(), prev, hidden));
    }
    record->logits_ = *logits;
    KVTIER_RETURN_IF_ERROR(math_.Fence());
  }
  if (signaled != nullptr && window > 0) {
    for (int32_t l = 0; l < c.layers; ++l) {
      const auto* q =
          static_cast<const uint8_t*>(observe_.data()) + l * options_.observe_window * qd * e;
      KVTIER_RETURN_IF_ERROR(Observe(*signaled, l, q, window, start + n - window));
    }
  }
  if (signaled != nullptr && options_.report_logits) {
    StepSignals s;
    s.first_position = start;
    s.num_tokens = static_cast<int32_t>(n);
    s.logits = std::span<const float>(*logits);
    KVTIER_RETURN_IF_ERROR(signaled->ReportSignals(s));
  }
  return absl::OkStatus();
}

absl::Status Decoder::Prefill(Sequence& seq, const std::vector<int32_t>& ids,
                              std::vector<float>* logits,
                              const std::function<void(int64_t, int64_t)>& progress,
                              PrefillRecord* record) {
  if (seq.num_tokens(0) != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("prefill: the sequence already holds %d tokens; prefill starts a sequence",
                        seq.num_tokens(0)));
  }
  if (record != nullptr && !record->empty()) {
    if (record->ids_ != ids) {
      return absl::InvalidArgumentError(
          absl::StrFormat("prefill: the record holds another prompt (%d tokens; this one has %d)",
                          record->ids_.size(), ids.size()));
    }
    return Replay(seq, *record, logits);
  }
  if (seq.local() == nullptr) record = nullptr;  // a remote sequence's prefill is not kept
  // The prompt's own dense K/V, for the prefill's attention (and the record).
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<DenseKv> scratch,
      DenseKv::Create(config_, math_.device(), static_cast<int64_t>(ids.size())));
  if (record == nullptr) return PrefillInto(&seq, *scratch, ids, logits, progress);
  record->Clear();
  absl::Status s = PrefillInto(&seq, *scratch, ids, logits, progress, record);
  if (!s.ok()) {
    record->Clear();
    return s;
  }
  record->ids_ = ids;
  record->kv_ = std::move(scratch);
  return absl::OkStatus();
}

void PrefillRecord::Clear() {
  ids_.clear();
  kv_.reset();
  observe_ = DeviceBuffer();
  window_ = 0;
  delta_.clear();
  logits_.clear();
  last_hidden_ = DeviceBuffer();
}

absl::Status Decoder::Replay(Sequence& seq, const PrefillRecord& r, std::vector<float>* logits) {
  const LlamaConfig& c = config_;
  const int64_t n = static_cast<int64_t>(r.ids_.size());
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  const DType dt = options_.kv_dtype;
  const size_t e = DTypeSize(dt);
  DenseKv& kv = *r.kv_;
  // The same chunks as the recorded prefill: each layer's Append, then the chunk's hidden
  // deltas.
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(options_.prefill_chunk, n - done);
    for (int32_t l = 0; l < c.layers; ++l) {
      KVTIER_RETURN_IF_ERROR(math_.ToDType(kv.k(l, done), k_kv_.data(), dt, m * kvd));
      KVTIER_RETURN_IF_ERROR(math_.ToDType(kv.v(l, done), v_kv_.data(), dt, m * kvd));
      KVTIER_RETURN_IF_ERROR(seq.Append(l, k_kv_.data(), v_kv_.data(), static_cast<int32_t>(m)));
      KVTIER_RETURN_IF_ERROR(math_.Fence());
    }
    if (options_.report_hidden_delta && !r.delta_.empty()) {
      StepSignals s;
      s.first_position = done;
      s.num_tokens = static_cast<int32_t>(m);
      s.hidden_delta = std::span<const float>(r.delta_.data() + done * c.layers, m * c.layers);
      s.num_layers = c.layers;
      KVTIER_RETURN_IF_ERROR(seq.ReportSignals(s));
    }
    done += m;
  }
  if (options_.report_hidden_delta && r.last_hidden_.size() > 0) {
    KVTIER_ASSIGN_OR_RETURN(float* prev, LastHidden(&seq));
    KVTIER_RETURN_IF_ERROR(math_.Copy(prev, r.last_hidden_.as<float>(), int64_t{c.layers} * c.dim));
  }
  if (r.window_ > 0) {
    for (int32_t l = 0; l < c.layers; ++l) {
      const auto* q =
          static_cast<const uint8_t*>(r.observe_.data()) + l * options_.observe_window * qd * e;
      KVTIER_RETURN_IF_ERROR(Observe(seq, l, q, r.window_, n - r.window_));
    }
  }
  *logits = r.logits_;
  if (options_.report_logits) {
    StepSignals s;
    s.first_position = 0;
    s.num_tokens = static_cast<int32_t>(n);
    s.logits = std::span<const float>(*logits);
    KVTIER_RETURN_IF_ERROR(seq.ReportSignals(s));
  }
  return stream_.Synchronize();
}

absl::Status Decoder::PrefillDense(DenseKv& kv, const std::vector<int32_t>& ids,
                                   std::vector<float>* logits,
                                   const std::function<void(int64_t, int64_t)>& progress) {
  return PrefillInto(nullptr, kv, ids, logits, progress);
}

absl::Status Decoder::Step(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& tokens,
                           std::vector<float>* logits) {
  const LlamaConfig& c = config_;
  const int64_t b = static_cast<int64_t>(seqs.size());
  if (b < 1 || b > options_.max_batch || tokens.size() != seqs.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step: %d sequences and %d tokens: need the same count in [1, max_batch = %d]", b,
        tokens.size(), options_.max_batch));
  }
  host_positions_.resize(b);
  for (int64_t i = 0; i < b; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("step: token id %d outside the vocabulary [0, %d)", tokens[i], c.vocab));
    }
    if (seqs[i]->num_tokens(0) < 1) {
      return absl::FailedPreconditionError("step: prefill the sequence first");
    }
    host_positions_[i] = seqs[i]->num_tokens(0);
  }
  host_ids_ = tokens;
  KVTIER_RETURN_IF_ERROR(UploadStep());
  const int64_t qd = int64_t{c.q_heads} * c.head_dim;
  const int64_t kvd = int64_t{c.kv_heads} * c.head_dim;
  const DType dt = options_.kv_dtype;
  const size_t e = DTypeSize(dt);
  const bool host_memory = math_.device().kind() == DeviceKind::kCpu;
  std::vector<uint8_t> staging;  // remote sequences on a GPU engine: host copies
  // Local sequences step through their batch (a sequence made alone is its own batch of
  // one), one batch step per run of consecutive sequences of the same batch, so members of
  // one batch launch each op once. Remote sequences read host memory: on a device whose
  // memory the host cannot read, q, k and v are staged out and the output back in.
  auto attention = [&](int32_t l, int64_t rows) -> absl::Status {
    KVTIER_RETURN_IF_ERROR(math_.ToDType(q_.as<float>(), q_kv_.data(), dt, rows * qd));
    KVTIER_RETURN_IF_ERROR(math_.ToDType(k_.as<float>(), k_kv_.data(), dt, rows * kvd));
    KVTIER_RETURN_IF_ERROR(math_.ToDType(v_.as<float>(), v_kv_.data(), dt, rows * kvd));
    const auto row = [&](const DeviceBuffer& buf, int64_t i, int64_t width) {
      return static_cast<uint8_t*>(buf.data()) + i * width * e;
    };
    for (int64_t i = 0; i < rows;) {
      Sequence& s = *seqs[i];
      if (LocalSequence* local = s.local(); local != nullptr) {
        SequenceBatch* batch = local->batch();
        std::vector<LocalSequence*> run;
        for (int64_t j = i; j < rows; ++j) {
          LocalSequence* m = seqs[j]->local();
          if (m == nullptr || m->batch() != batch) break;
          KVTIER_RETURN_IF_ERROR(m->Append(l, row(k_kv_, j, kvd), row(v_kv_, j, kvd), 1));
          run.push_back(m->stepped());
        }
        KVTIER_RETURN_IF_ERROR(batch->BeginStep(l, run, row(q_kv_, i, qd)).status());
        KVTIER_RETURN_IF_ERROR(
            batch->Attend(l, run, row(q_kv_, i, qd), row(out_kv_, i, qd), nullptr));
        KVTIER_RETURN_IF_ERROR(batch->EndStep(l, run, row(q_kv_, i, qd)));
        i += static_cast<int64_t>(run.size());
        continue;
      }
      uint8_t* q = row(q_kv_, i, qd);
      uint8_t* k = row(k_kv_, i, kvd);
      uint8_t* v = row(v_kv_, i, kvd);
      uint8_t* out = row(out_kv_, i, qd);
      // The CPU Math wrote q, k and v before returning; a remote call reads them now.
      uint8_t *hq = q, *hk = k, *hv = v, *ho = out;
      const size_t qb = qd * e, kb = kvd * e;
      Device& dev = math_.device();
      if (!host_memory) {
        staging.resize(2 * qb + 2 * kb);
        hq = staging.data();
        hk = hq + qb;
        hv = hk + kb;
        ho = hv + kb;
        KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, hq, q, qb));
        KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, hk, k, kb));
        KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, hv, v, kb));
        KVTIER_RETURN_IF_ERROR(stream_.Synchronize());
      }
      KVTIER_RETURN_IF_ERROR(s.Append(l, hk, hv, 1));
      KVTIER_RETURN_IF_ERROR(s.Decode(l, hq, ho, nullptr));
      if (!host_memory) {
        KVTIER_RETURN_IF_ERROR(dev.Copy(stream_, out, ho, qb));
        KVTIER_RETURN_IF_ERROR(stream_.Synchronize());
      }
      ++i;
    }
    // Attention ran on the compute stream (a worker thread on the CPU).
    KVTIER_RETURN_IF_ERROR(math_.Fence());
    return math_.FromDType(out_kv_.data(), dt, attn_.as<float>(), rows * qd);
  };
  // The sequences' last hidden states, for their hidden-state changes.
  std::vector<float*> prev(b, nullptr);
  AfterLayerFn after_layer;
  if (options_.report_hidden_delta) {
    for (int64_t i = 0; i < b; ++i) {
      KVTIER_ASSIGN_OR_RETURN(prev[i], LastHidden(seqs[i]));
    }
    after_layer = [&](int32_t l, const float* x) -> absl::Status {
      for (int64_t i = 0; i < b; ++i) {
        if (prev[i] != nullptr) {
          KVTIER_RETURN_IF_ERROR(HiddenDelta(l, x + i * c.dim, 1, prev[i], i, false));
        }
      }
      return absl::OkStatus();
    };
  }
  KVTIER_RETURN_IF_ERROR(Forward(b, nullptr, nullptr, attention, after_layer, b, logits));
  for (int64_t i = 0; i < b; ++i) {
    if (!options_.report_logits && !after_layer) continue;
    StepSignals s;
    s.first_position = host_positions_[i];
    s.num_tokens = 1;
    if (options_.report_logits) {
      s.logits = std::span<const float>(logits->data() + i * c.vocab, c.vocab);
    }
    if (after_layer) {
      s.hidden_delta = std::span<const float>(host_delta_.data() + i * c.layers, c.layers);
      s.num_layers = c.layers;
    }
    KVTIER_RETURN_IF_ERROR(seqs[i]->ReportSignals(s));
  }
  return absl::OkStatus();
}

absl::Status Decoder::StepDense(DenseKv& kv, int32_t token, std::vector<float>* logits) {
  if (kv.length() < 1) return absl::FailedPreconditionError("step: prefill the cache first");
  if (kv.length() >= kv.capacity()) {
    return absl::OutOfRangeError(
        absl::StrFormat("step: the dense KV cache is full (%d tokens)", kv.capacity()));
  }
  return PrefillInto(nullptr, kv, {token}, logits, {});
}

absl::Status Decoder::Observe(Sequence& seq, int32_t layer, const void* q, int64_t n,
                             int64_t first_position) {
  if (seq.local() != nullptr || math_.device().kind() == DeviceKind::kCpu) {
    return seq.ObserveQueries(layer, q, static_cast<int32_t>(n), first_position);
  }
  // A remote sequence reads host memory: the rows come out of the device first.
  const size_t bytes = static_cast<size_t>(n) * config_.q_heads * config_.head_dim *
                       DTypeSize(options_.kv_dtype);
  std::vector<uint8_t> host(bytes);
  KVTIER_RETURN_IF_ERROR(math_.device().Copy(stream_, host.data(), q, bytes));
  KVTIER_RETURN_IF_ERROR(stream_.Synchronize());
  return seq.ObserveQueries(layer, host.data(), static_cast<int32_t>(n), first_position);
}

absl::Status Decoder::ReportHiddenDelta(Sequence& seq, int64_t first_position, int64_t m) {
  const int32_t n_layers = config_.layers;
  StepSignals s;
  s.first_position = first_position;
  s.num_tokens = static_cast<int32_t>(m);
  s.hidden_delta = std::span<const float>(host_delta_.data(), m * n_layers);
  s.num_layers = n_layers;
  return seq.ReportSignals(s);
}

}  // namespace kvtier::engine
