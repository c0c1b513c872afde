// SessionManager's data path: Step (a GRPC session's layer-step), ReportSignals (its engine's
// signals for the policies), Fetch (StartFetch and its FetchCursor) and Offload
// (NewOffloadStream and its OffloadStream).
#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "daemon/session_manager.h"
#include "daemon/session_manager_internal.h"

namespace kvtier::daemon {

using session_internal::Printable;

// ---- Step ---------------------------------------------------------------------------------

absl::StatusOr<StepResult> SessionManager::Step(const Caller& caller, std::string_view session_id,
                                                int64_t layer, std::string_view q, bool want_output,
                                                uint64_t step) {
  InflightCall call(this);
  return Tally(caller, DoStep(caller, session_id, layer, q, want_output, step));
}

absl::StatusOr<StepResult> SessionManager::DoStep(const Caller& caller, std::string_view session_id,
                                                  int64_t layer, std::string_view q,
                                                  bool want_output, uint64_t step) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<TenantSession> s, Find(caller, session_id));
  const Geometry& g = s->spec().geometry;
  if (s->spec().transport != Transport::kGrpc) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s uses SHM: steps run in the engine (Step is for GRPC sessions)", s->id()));
  }
  if (layer < 0 || layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", layer, g.num_layers));
  }
  const size_t q_bytes = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  if (q.size() != q_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q: %d bytes; expected %d (num_q_heads %d × head_dim %d × %d-byte %s)", q.size(), q_bytes,
        g.num_q_heads, g.head_dim, g.element_bytes(), DTypeName(g.dtype)));
  }
  return s->Step(static_cast<int32_t>(layer), q, want_output, step, caller);
}

// ---- ReportSignals --------------------------------------------------------------------------

absl::StatusOr<bool> SessionManager::ReportSignals(const Caller& caller,
                                                   std::string_view session_id,
                                                   const EngineSignals& signals) {
  InflightCall call(this);
  return Tally(caller, DoReportSignals(caller, session_id, signals));
}

absl::StatusOr<bool> SessionManager::DoReportSignals(const Caller& caller,
                                                     std::string_view session_id,
                                                     const EngineSignals& e) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<TenantSession> s, Find(caller, session_id));
  const Geometry& g = s->spec().geometry;
  if (s->spec().transport != Transport::kGrpc) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s uses SHM: its policies run in the engine, which reports to its own "
        "sequence (ReportSignals is for GRPC sessions)",
        s->id()));
  }
  constexpr int64_t kMaxVocab = int64_t{1} << 22;
  constexpr int32_t kMaxLayers = 1024, kMaxObserved = 1024;
  const int64_t max_tokens = s->spec().sequence.max_tokens;
  if (e.logit_summary.has_value()) {
    const LogitSummary& ls = *e.logit_summary;
    if (!(ls.normalized_entropy >= 0 && ls.normalized_entropy <= 1) || !(ls.margin >= 0) ||
        !std::isfinite(ls.margin) || !(ls.top_mass >= 0 && ls.top_mass <= 1)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "logit_summary = {normalized_entropy %g, margin %g, top_mass %g}: the entropy and top "
          "mass must be in [0, 1] and the margin finite and >= 0",
          ls.normalized_entropy, ls.margin, ls.top_mass));
    }
  }
  if (e.num_tokens == 0) {
    if (!e.logits.empty() || !e.hidden_delta.empty() || e.logit_summary.has_value()) {
      return absl::InvalidArgumentError(
          "num_tokens = 0 with logits or hidden_delta: the signals need their tokens");
    }
    if (e.observe_q.empty()) {
      return absl::InvalidArgumentError(
          "nothing to report: num_tokens = 0 and observe_q is empty");
    }
  } else {
    if (e.num_tokens < 0 || e.num_tokens > max_tokens || e.first_position < 0 ||
        e.first_position > max_tokens - e.num_tokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "first_position = %d, num_tokens = %d: the tokens must lie in [0, max_tokens = %d)",
          e.first_position, e.num_tokens, max_tokens));
    }
    if (static_cast<int64_t>(e.logits.size()) > kMaxVocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "logits: %d values; at most %d", e.logits.size(), kMaxVocab));
    }
    if (!e.hidden_delta.empty() &&
        (e.num_layers < 1 || e.num_layers > kMaxLayers ||
         e.hidden_delta.size() != static_cast<size_t>(e.num_tokens) * e.num_layers)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "hidden_delta: %d values; it must hold num_tokens × num_layers = %d × %d, with "
          "num_layers in [1, %d]",
          e.hidden_delta.size(), e.num_tokens, e.num_layers, kMaxLayers));
    }
  }
  if (!e.observe_q.empty()) {
    if (e.observe_layer < 0 || e.observe_layer >= g.num_layers) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "observe_layer = %d: must be < num_layers = %d", e.observe_layer, g.num_layers));
    }
    const size_t row = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
    const size_t n = e.observe_q.size() / row;
    if (e.observe_q.size() % row != 0 || n > static_cast<size_t>(kMaxObserved) ||
        e.observe_first_position < 0 ||
        e.observe_first_position > max_tokens - static_cast<int64_t>(n)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "observe_q: %d bytes at observe_first_position = %d; it must be n rows of %d bytes "
          "(num_q_heads %d × head_dim %d × %d-byte %s), n in [1, %d], within max_tokens = %d",
          e.observe_q.size(), e.observe_first_position, row, g.num_q_heads, g.head_dim,
          g.element_bytes(), DTypeName(g.dtype), kMaxObserved, max_tokens));
    }
  }
  return s->ReportSignals(e, caller);
}

// ---- Fetch --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FetchCursor>> SessionManager::StartFetch(
    const Caller& caller, std::string_view session_id, int64_t layer, std::vector<int64_t> pages) {
  return Tally(caller, DoStartFetch(caller, session_id, layer, std::move(pages)));
}

absl::StatusOr<std::unique_ptr<FetchCursor>> SessionManager::DoStartFetch(
    const Caller& caller, std::string_view session_id, int64_t layer, std::vector<int64_t> pages) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<TenantSession> s, Find(caller, session_id));
  const int32_t num_layers = s->spec().geometry.num_layers;
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", layer, num_layers));
  }
  const int32_t l = static_cast<int32_t>(layer);
  // A page named twice is sent once: a request cannot make the daemon copy more pages than
  // the layer has.
  absl::flat_hash_set<int64_t> seen;
  pages.erase(std::remove_if(pages.begin(), pages.end(),
                             [&seen](int64_t p) { return !seen.insert(p).second; }),
              pages.end());
  KVTIER_ASSIGN_OR_RETURN(std::vector<int64_t> committed, s->CommittedPages(l, pages));
  return std::unique_ptr<FetchCursor>(
      new FetchCursor(this, std::move(s), l, std::move(committed), caller.deadline));
}

FetchCursor::FetchCursor(SessionManager* manager, std::shared_ptr<TenantSession> session,
                         int32_t layer, std::vector<int64_t> pages, absl::Time deadline)
    : manager_(manager),
      inflight_(manager),
      session_(std::move(session)),
      layer_(layer),
      pages_(std::move(pages)),
      deadline_(deadline) {}

absl::StatusOr<std::vector<PageData>> FetchCursor::Next(uint64_t max_message_bytes) {
  if (done()) return std::vector<PageData>();
  const uint64_t per_page =
      session_->spec().geometry.host_page_bytes() + SessionManager::kPageOverheadBytes;
  if (per_page > max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Fetch: one page takes %d bytes in a message (%d of data) but max_message_bytes = %d",
        per_page, session_->spec().geometry.host_page_bytes(), max_message_bytes));
  }
  const size_t n = std::min<size_t>(pages_.size() - next_, max_message_bytes / per_page);
  KVTIER_ASSIGN_OR_RETURN(std::vector<PageData> out,
                          session_->ReadPages(layer_, pages_.data() + next_, n, deadline_));
  next_ += n;
  manager_->fetched_pages_.Add({session_->tenant()}, out.size());
  return out;
}

// ---- Offload ------------------------------------------------------------------------------

std::unique_ptr<OffloadStream> SessionManager::NewOffloadStream(const Caller& caller) {
  return std::unique_ptr<OffloadStream>(new OffloadStream(this, caller));
}

OffloadStream::OffloadStream(SessionManager* manager, Caller caller)
    : manager_(manager), caller_(std::move(caller)), inflight_(manager) {}

OffloadStream::~OffloadStream() { Discard(); }

absl::Status OffloadStream::Bind(std::string_view session_id) {
  KVTIER_ASSIGN_OR_RETURN(session_, manager_->Find(caller_, session_id));
  if (session_->spec().transport != Transport::kGrpc) {
    const std::string id = session_->id();
    session_.reset();
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s uses SHM: its engine writes pages into the arena (Offload is for GRPC "
        "sessions)",
        id));
  }
  staged_tokens_.assign(session_->spec().geometry.num_layers, 0);
  return absl::OkStatus();
}

absl::Status OffloadStream::Validate(const OffloadChunk& c) const {
  const SessionSpec& spec = session_->spec();
  const Geometry& g = spec.geometry;
  if (c.session_id != session_->id()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session_id = '%s': this stream is about session %s; every message must name it",
        Printable(c.session_id), session_->id()));
  }
  if (c.layer < 0 || c.layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", c.layer, g.num_layers));
  }
  const uint32_t max_tokens = manager_->config_.max_tokens_per_offload;
  if (c.num_tokens < 1 || c.num_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_tokens = %d: must be in [1, max_tokens_per_offload = %d]", c.num_tokens, max_tokens));
  }
  const uint64_t bytes =
      static_cast<uint64_t>(c.num_tokens) * g.num_kv_heads * g.head_dim * g.element_bytes();
  for (const auto& [name, data] : {std::pair<const char*, const std::string*>{"k", &c.k},
                                   std::pair<const char*, const std::string*>{"v", &c.v}}) {
    if (data->size() != bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d bytes; num_tokens = %d needs %d (num_tokens × num_kv_heads %d × head_dim %d × "
          "%d-byte %s)",
          name, data->size(), c.num_tokens, bytes, g.num_kv_heads, g.head_dim, g.element_bytes(),
          DTypeName(g.dtype)));
    }
  }
  const int32_t l = static_cast<int32_t>(c.layer);
  const uint64_t end = session_->LayerTokens(l) + staged_tokens_[l];
  if (c.start_token.has_value() && *c.start_token != end) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "start_token = %d: layer %d ends at token %d (%d held, %d staged by this stream); a "
        "chunk must start there",
        *c.start_token, l, end, session_->LayerTokens(l), staged_tokens_[l]));
  }
  if (end + c.num_tokens > static_cast<uint64_t>(spec.sequence.max_tokens)) {
    return absl::OutOfRangeError(
        absl::StrFormat("layer %d would hold %d tokens: the session's max_tokens is %d", l,
                        end + c.num_tokens, spec.sequence.max_tokens));
  }
  return absl::OkStatus();
}

void OffloadStream::Discard() {
  staged_.clear();
  std::fill(staged_tokens_.begin(), staged_tokens_.end(), 0);
  if (staged_bytes_ > 0) {
    if (Tenant* t = manager_->FindTenant(caller_.tenant); t != nullptr) t->Release(staged_bytes_);
    staged_bytes_ = 0;
  }
}

absl::Status OffloadStream::ApplyStaged() {
  commit_due_ = false;
  if (staged_.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<uint64_t>> tokens =
      session_->Apply(staged_, caller_, absl::StrFormat("the commit at message %d", messages_));
  if (!tokens.ok()) return tokens.status();
  result_.layer_tokens = *std::move(tokens);
  for (int64_t n : staged_tokens_) result_.committed_tokens += static_cast<uint64_t>(n);
  Discard();  // applied: the Retriever holds the tokens now, and the bytes go back
  return absl::OkStatus();
}

absl::Status OffloadStream::Fail(const absl::Status& st, std::string_view where) {
  uint64_t staged = 0;
  for (int64_t n : staged_tokens_) staged += static_cast<uint64_t>(n);
  Discard();
  failed_ = absl::Status(
      st.code(), absl::StrFormat("Offload %s: %s (this stream's commits before it, %d tokens, "
                                 "stand; its %d uncommitted tokens were discarded)",
                                 where, st.message(), result_.committed_tokens, staged));
  st.ForEachPayload([this](absl::string_view url, const absl::Cord& payload) {
    failed_.SetPayload(url, payload);
  });
  (void)manager_->Tally(caller_, failed_);
  return failed_;
}

absl::Status OffloadStream::Add(OffloadChunk chunk) {
  if (!failed_.ok()) return failed_;
  ++messages_;
  absl::Status st = [&]() -> absl::Status {
    if (session_ == nullptr) KVTIER_RETURN_IF_ERROR(Bind(chunk.session_id));
    KVTIER_RETURN_IF_ERROR(Validate(chunk));
    const uint64_t bytes = chunk.k.size() + chunk.v.size();
    Tenant* tenant = manager_->FindTenant(caller_.tenant);
    if (tenant == nullptr) return absl::PermissionDeniedError("unknown tenant");
    KVTIER_RETURN_IF_ERROR(tenant->Charge(bytes));
    staged_bytes_ += bytes;
    staged_tokens_[chunk.layer] += chunk.num_tokens;
    commit_due_ = chunk.commit;
    staged_.push_back(std::move(chunk));
    return absl::OkStatus();
  }();
  return st.ok() ? st : Fail(st, absl::StrFormat("message %d", messages_));
}

absl::Status OffloadStream::Commit() {
  if (!failed_.ok()) return failed_;
  absl::Status st = ApplyStaged();
  return st.ok() ? st : Fail(st, absl::StrFormat("message %d", messages_));
}

absl::StatusOr<OffloadResult> OffloadStream::Finish() {
  if (!failed_.ok()) return failed_;
  if (absl::Status st = ApplyStaged(); !st.ok()) {
    return Fail(st, absl::StrFormat("stream end (after message %d)", messages_));
  }
  if (session_ != nullptr && result_.layer_tokens.empty()) {
    for (int32_t l = 0; l < session_->spec().geometry.num_layers; ++l) {
      result_.layer_tokens.push_back(session_->LayerTokens(l));
    }
  }
  return result_;
}

absl::Status OffloadStream::Break(const absl::Status& why, bool at_next_message) {
  if (!failed_.ok()) return failed_;
  return Fail(why, at_next_message ? absl::StrFormat("message %d", messages_ + 1)
                                   : absl::StrFormat("stream (after message %d)", messages_));
}

}  // namespace kvtier::daemon
