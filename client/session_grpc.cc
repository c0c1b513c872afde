#include "client/session_grpc.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/convert.h"
#include "client/rpc_util.h"
#include "core/status.h"

namespace kvtier {

namespace {

// Bytes an OffloadRequest needs beyond K and V: ids, tags and lengths.
constexpr uint64_t kOffloadOverheadBytes = 1024;

// The sequence of a GRPC session: its host tier, working set and attention are in the
// daemon. Every call has finished its work when it returns.
class RemoteSequence final : public Sequence {
 public:
  RemoteSequence(std::shared_ptr<Connection> conn, const SessionInfo& info,
                 const SequenceOptions& resolved)
      : conn_(std::move(conn)), info_(info), resolved_(resolved) {
    const auto layers = static_cast<size_t>(info_.geometry.num_layers);
    layers_.resize(layers);
    for (size_t l = 0; l < layers && l < info_.committed_tokens.size(); ++l) {
      layers_[l].tokens = static_cast<int32_t>(
          std::min<int64_t>(info_.committed_tokens[l], std::numeric_limits<int32_t>::max()));
    }
    // A reattached session continues the daemon's step numbering.
    for (size_t l = 0; l < layers && l < info_.steps_run.size(); ++l) {
      layers_[l].steps = info_.steps_run[l];
    }
  }

  absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) override;
  absl::Status Decode(int32_t layer, const void* q, void* out, float* lse) override;
  absl::Status ReportSignals(const StepSignals& signals) override;
  absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n,
                              int64_t first_position) override;
  absl::Status Wait() override { return CheckOpen("Wait"); }  // every call has finished
  // The daemon's session stays open: Session::Close closes it.
  absl::Status Close() override {
    closed_ = true;
    return absl::OkStatus();
  }
  // Closed by Session::Suspend: calls say so.
  void Suspend() {
    closed_ = true;
    suspended_ = true;
  }
  SequenceStats Stats() override;
  StepStats LastStep(int32_t layer) override {
    return ValidLayer(layer) ? layers_[static_cast<size_t>(layer)].last : StepStats{};
  }
  const Geometry& geometry() const override { return info_.geometry; }
  const SequenceOptions& options() const override { return resolved_; }
  int32_t num_tokens(int32_t layer) const override {
    return ValidLayer(layer) ? layers_[static_cast<size_t>(layer)].tokens : 0;
  }

  absl::Status CheckOpen(std::string_view what) const {
    return suspended_ ? CheckSessionOpen(false, true, what, info_.id)
                      : CheckSessionOpen(closed_, what, info_.id);
  }
  absl::Status CheckCall(int32_t layer, std::string_view what) const {
    KVTIER_RETURN_IF_ERROR(CheckOpen(what));
    if (!ValidLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: layer = %d must be in [0, %d)", what,
                                                        layer, info_.geometry.num_layers));
    }
    return absl::OkStatus();
  }

 private:
  struct Layer {
    int32_t tokens = 0;  // as the daemon last reported
    int64_t steps = 0;
    StepStats last;
  };

  bool ValidLayer(int32_t layer) const { return layer >= 0 && layer < info_.geometry.num_layers; }
  size_t token_bytes() const {
    const Geometry& g = info_.geometry;
    return static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  }
  size_t q_bytes() const {
    const Geometry& g = info_.geometry;
    return static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  }
  absl::Status KeepStep(int32_t layer, const v1::StepReply& reply, bool want_output);
  // Step on the daemon, numbered; resynchronises the count once when the daemon says the
  // step this session thought lost did run.
  absl::StatusOr<v1::StepReply> RunStep(int32_t layer, const void* q, bool want_output);

  std::shared_ptr<Connection> conn_;
  const SessionInfo info_;
  const SequenceOptions resolved_;
  std::vector<Layer> layers_;
  SequenceStats stats_;  // as GetStats last said
  bool closed_ = false;
  bool suspended_ = false;  // closed by Session::Suspend
};

class GrpcSession final : public Session {
 public:
  GrpcSession(std::shared_ptr<Connection> conn, const SessionInfo& info,
              const SequenceOptions& resolved)
      : conn_(conn), info_(info), sequence_(std::move(conn), info, resolved) {}

  const std::string& id() const override { return info_.id; }
  Transport transport() const override { return Transport::kGrpc; }
  uint64_t epoch() const override { return info_.epoch; }
  Sequence& sequence() override { return sequence_; }
  absl::Status Flush() override { return CheckOpen("Flush"); }  // Offload commits
  absl::StatusOr<std::vector<FetchedPage>> FetchPages(int32_t layer,
                                                      const std::vector<int64_t>& pages) override;
  absl::StatusOr<SessionInfo> Info() override { return LookupSessionInfo(*conn_, info_.id); }
  absl::Status Close() override {
    if (closed_) return absl::OkStatus();
    closed_ = true;
    (void)sequence_.Close();
    if (suspended_) return absl::OkStatus();  // left for Client::Reattach
    return CloseSessionById(*conn_, info_.id);
  }
  // Offload commits before it returns: nothing to flush.
  absl::Status Suspend() override {
    if (closed_) return CheckSessionOpen(closed_, "Suspend", info_.id);
    if (suspended_) return absl::OkStatus();
    released_ = true;
    sequence_.Suspend();
    KVTIER_RETURN_IF_ERROR(SuspendSessionById(*conn_, info_.id).status());
    suspended_ = true;
    return absl::OkStatus();
  }

 private:
  absl::Status CheckOpen(std::string_view what) const {
    return CheckSessionOpen(closed_, released_, what, info_.id);
  }

  std::shared_ptr<Connection> conn_;
  const SessionInfo info_;
  RemoteSequence sequence_;
  bool closed_ = false;
  bool released_ = false;   // the sequence is closed by Suspend
  bool suspended_ = false;  // the daemon suspended it
};

absl::Status RemoteSequence::Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "Append"));
  if (k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("Append: k and v must be non-null");
  }
  if (n_tokens < 1) {
    return absl::OutOfRangeError(absl::StrFormat("Append: n_tokens = %d must be >= 1", n_tokens));
  }
  Layer& l = layers_[static_cast<size_t>(layer)];
  KVTIER_ASSIGN_OR_RETURN(const int32_t chunk,
                          OffloadChunkTokens(info_.geometry, conn_->max_message_bytes(),
                                             conn_->capabilities().max_tokens_per_offload,
                                             kOffloadOverheadBytes + info_.id.size()));
  const auto* ks = static_cast<const char*>(k);
  const auto* vs = static_cast<const char*>(v);
  const size_t tb = token_bytes();
  auto ctx = conn_->Context();
  v1::OffloadReply reply;
  auto writer = conn_->stub().Offload(ctx.get(), &reply);
  v1::OffloadRequest req;
  req.set_session_id(info_.id);
  req.set_layer(static_cast<uint32_t>(layer));
  int32_t sent = 0;
  while (sent < n_tokens) {
    const int32_t m = std::min(chunk, n_tokens - sent);
    const size_t off = static_cast<size_t>(sent) * tb;
    // The daemon refuses a chunk that does not continue the layer: never a token twice.
    req.set_start_token(static_cast<uint64_t>(l.tokens) + static_cast<uint64_t>(sent));
    req.set_num_tokens(static_cast<uint32_t>(m));
    req.set_k(ks + off, static_cast<size_t>(m) * tb);
    req.set_v(vs + off, static_cast<size_t>(m) * tb);
    req.set_commit(sent + m == n_tokens);
    if (!writer->Write(req)) break;  // the stream broke: Finish says why
    sent += m;
  }
  writer->WritesDone();
  if (absl::Status st = FromGrpcStatus(writer->Finish()); !st.ok()) {
    // The commits the stream made before it broke stand: learn how far the layer got, so
    // num_tokens() says where the engine resumes.
    if (absl::StatusOr<SessionInfo> now = LookupSessionInfo(*conn_, info_.id);
        now.ok() && static_cast<size_t>(layer) < now->committed_tokens.size()) {
      l.tokens = static_cast<int32_t>(
          std::min<int64_t>(now->committed_tokens[layer], std::numeric_limits<int32_t>::max()));
    }
    return st;
  }
  if (sent != n_tokens) {
    return absl::InternalError(absl::StrFormat(
        "Append: the Offload stream ended after %d of %d tokens with OK", sent, n_tokens));
  }
  if (reply.layer_tokens_size() > layer) {
    l.tokens = static_cast<int32_t>(
        std::min<uint64_t>(reply.layer_tokens(layer), std::numeric_limits<int32_t>::max()));
  } else {
    l.tokens += n_tokens;
  }
  return absl::OkStatus();
}

absl::Status RemoteSequence::KeepStep(int32_t layer, const v1::StepReply& reply, bool want_output) {
  const Geometry& g = info_.geometry;
  const int64_t slots = reply.num_slots();
  if (slots < 1 || reply.slot_table_size() != g.num_kv_heads * slots) {
    return absl::DataLossError(absl::StrFormat(
        "Step: the reply's slot_table has %d entries; num_kv_heads × num_slots = %d × %d",
        reply.slot_table_size(), g.num_kv_heads, slots));
  }
  if (want_output && (reply.output().size() != q_bytes() || reply.lse_size() != g.num_q_heads)) {
    return absl::DataLossError(absl::StrFormat(
        "Step: the reply's output has %d bytes and %d lse values; expected %d and %d",
        reply.output().size(), reply.lse_size(), q_bytes(), g.num_q_heads));
  }
  Layer& l = layers_[static_cast<size_t>(layer)];
  l.tokens = static_cast<int32_t>(reply.num_tokens());
  l.last = StepStats{};
  l.last.step = l.steps;  // 0-based, as a local sequence counts
  l.steps = static_cast<int64_t>(reply.step());
  l.last.corrected_heads = static_cast<int32_t>(reply.corrected_heads());
  l.last.num_slots = static_cast<int32_t>(slots);
  l.last.slot_table.assign(reply.slot_table().begin(), reply.slot_table().end());
  return absl::OkStatus();
}

absl::StatusOr<v1::StepReply> RemoteSequence::RunStep(int32_t layer, const void* q,
                                                      bool want_output) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  v1::StepRequest req;
  req.set_session_id(info_.id);
  req.set_layer(static_cast<uint32_t>(layer));
  req.set_q(q, q_bytes());
  req.set_want_output(want_output);
  // Numbered, so a retry of a step whose reply was lost (DEADLINE_EXCEEDED, UNAVAILABLE)
  // gets that step's reply instead of running another.
  req.set_step(static_cast<uint64_t>(l.steps) + 1);
  v1::StepReply reply;
  auto ctx = conn_->Context();
  absl::Status st = FromGrpcStatus(conn_->stub().Step(ctx.get(), req, &reply));
  if (st.ok() || st.code() != absl::StatusCode::kFailedPrecondition) {
    KVTIER_RETURN_IF_ERROR(st);
    return reply;
  }
  // The step this session thought lost did run (with the q of the failed call), and the
  // engine has moved on with another q: count it, and run this one as the next.
  const auto& trailers = ctx->GetServerTrailingMetadata();
  auto it = trailers.find("x-kvtier-steps-run");
  int64_t run = 0;
  if (it == trailers.end() ||
      !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &run) ||
      run != l.steps + 1) {
    return st;
  }
  l.steps = run;
  req.set_step(static_cast<uint64_t>(run) + 1);
  reply.Clear();
  auto retry = conn_->Context();
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().Step(retry.get(), req, &reply)));
  return reply;
}

absl::Status RemoteSequence::Decode(int32_t layer, const void* q, void* out, float* lse) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "Decode"));
  if (q == nullptr) return absl::InvalidArgumentError("Decode: q must be non-null");
  const bool want_output = out != nullptr;
  KVTIER_ASSIGN_OR_RETURN(const v1::StepReply reply, RunStep(layer, q, want_output));
  KVTIER_RETURN_IF_ERROR(KeepStep(layer, reply, want_output));
  if (want_output) {
    std::memcpy(out, reply.output().data(), reply.output().size());
    if (lse != nullptr) std::copy(reply.lse().begin(), reply.lse().end(), lse);
  }
  return absl::OkStatus();
}

// The daemon judges the sizes (with the limits it names) and drops a retry's repeat. A
// session without policies reads no signal: nothing is sent.
absl::Status RemoteSequence::ReportSignals(const StepSignals& s) {
  KVTIER_RETURN_IF_ERROR(CheckOpen("ReportSignals"));
  if (s.num_tokens < 1 || s.first_position < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ReportSignals: num_tokens = %d must be >= 1 and first_position = %d >= 0",
        s.num_tokens, s.first_position));
  }
  if (resolved_.policy.is_default()) return absl::OkStatus();
  v1::ReportSignalsRequest req;
  req.set_session_id(info_.id);
  req.set_first_position(static_cast<uint64_t>(s.first_position));
  req.set_num_tokens(static_cast<uint32_t>(s.num_tokens));
  req.mutable_logits()->Add(s.logits.begin(), s.logits.end());
  if (s.logit_summary.has_value()) {
    v1::LogitSummary* ls = req.mutable_logit_summary();
    ls->set_normalized_entropy(s.logit_summary->normalized_entropy);
    ls->set_margin(s.logit_summary->margin);
    ls->set_top_mass(s.logit_summary->top_mass);
  }
  if (!s.hidden_delta.empty()) {
    req.mutable_hidden_delta()->Add(s.hidden_delta.begin(), s.hidden_delta.end());
    req.set_num_layers(static_cast<uint32_t>(std::max(s.num_layers, 0)));
  }
  v1::ReportSignalsReply reply;
  auto ctx = conn_->Context();
  return FromGrpcStatus(conn_->stub().ReportSignals(ctx.get(), req, &reply));
}

absl::Status RemoteSequence::ObserveQueries(int32_t layer, const void* q, int32_t n,
                                            int64_t first_position) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "ObserveQueries"));
  if (q == nullptr || n < 1 || first_position < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ObserveQueries: q must be non-null, n = %d >= 1 and first_position = %d >= 0", n,
        first_position));
  }
  if (resolved_.policy.is_default()) return absl::OkStatus();
  v1::ReportSignalsRequest req;
  req.set_session_id(info_.id);
  req.set_observe_layer(static_cast<uint32_t>(layer));
  req.set_observe_q(q, q_bytes() * static_cast<size_t>(n));
  req.set_observe_first_position(static_cast<uint64_t>(first_position));
  v1::ReportSignalsReply reply;
  auto ctx = conn_->Context();
  return FromGrpcStatus(conn_->stub().ReportSignals(ctx.get(), req, &reply));
}

SequenceStats RemoteSequence::Stats() {
  if (closed_) return stats_;
  v1::GetStatsRequest req;
  req.set_session_id(info_.id);
  v1::GetStatsReply reply;
  auto ctx = conn_->Context();
  if (conn_->stub().GetStats(ctx.get(), req, &reply).ok() && reply.has_session()) {
    stats_ = StatsFromProto(reply.session());
  }
  return stats_;
}

absl::StatusOr<std::vector<FetchedPage>> GrpcSession::FetchPages(
    int32_t layer, const std::vector<int64_t>& pages) {
  KVTIER_RETURN_IF_ERROR(CheckOpen("FetchPages"));
  if (layer < 0 || layer >= info_.geometry.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("FetchPages: layer = %d must be in [0, %d)",
                                                      layer, info_.geometry.num_layers));
  }
  return FetchPagesById(*conn_, info_.id, info_.geometry, layer, pages);
}

}  // namespace

absl::StatusOr<int32_t> OffloadChunkTokens(const Geometry& g, uint64_t max_message_bytes,
                                           uint32_t max_tokens_per_offload, uint64_t overhead) {
  const uint64_t per_token =
      2 * static_cast<uint64_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  const uint64_t fit =
      max_message_bytes > overhead ? (max_message_bytes - overhead) / per_token : 0;
  if (fit < 1) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "max_message_bytes = %d: one token's K and V (%d bytes) plus %d bytes of message "
        "overhead do not fit",
        max_message_bytes, per_token, overhead));
  }
  uint64_t chunk = std::min<uint64_t>(fit, std::numeric_limits<int32_t>::max());
  if (max_tokens_per_offload != 0) chunk = std::min<uint64_t>(chunk, max_tokens_per_offload);
  return static_cast<int32_t>(chunk);
}

absl::StatusOr<std::unique_ptr<Session>> NewGrpcSession(std::shared_ptr<Connection> conn,
                                                        const SessionInfo& info,
                                                        const SessionOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(const SequenceOptions resolved,
                          SequenceOptionsForSession(options.sequence, info));
  auto session = std::make_unique<GrpcSession>(std::move(conn), info, resolved);
  return std::unique_ptr<Session>(std::move(session));
}

}  // namespace kvtier
