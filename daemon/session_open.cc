// SessionManager::OpenSession: a request resolved into a SessionSpec and checked against
// the daemon's limits (ResolveSpec), the tenant's session limit (ReserveSession), the
// idempotency of request ids (ClaimRequestId), and the session made in the tenant's arena.
#include <sys/random.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/session_manager.h"
#include "daemon/session_manager_internal.h"
#include "offload/cold_pages.h"
#include "offload/policy/config.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

using session_internal::Printable;

namespace {

constexpr size_t kMaxLabelBytes = 256;

// 128 random bits from the kernel, as 32 lower-case hex digits.
std::string NewSessionId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    KVTIER_CHECK(n > 0 || errno == EINTR);  // getrandom cannot fail for 16 bytes otherwise
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool PageSizeSupported(int32_t p) {
  return std::find(std::begin(kSupportedPageSizes), std::end(kSupportedPageSizes), p) !=
         std::end(kSupportedPageSizes);
}

}  // namespace

// ---- OpenSession --------------------------------------------------------------------------

absl::StatusOr<SessionSpec> SessionManager::ResolveSpec(const Caller& caller,
                                                        const OpenSessionParams& p) const {
  const auto bad = [](std::string msg) { return absl::InvalidArgumentError(std::move(msg)); };
  if (p.tenant != caller.tenant) {
    return absl::PermissionDeniedError(
        absl::StrFormat("tenant = '%s': sessions may be opened only for the caller's tenant '%s'",
                        Printable(p.tenant), caller.tenant));
  }
  const Geometry& g = p.geometry;
  // Before Validate, whose range is the library's, not what this daemon serves.
  if (!PageSizeSupported(g.page_size)) {
    return bad(absl::StrFormat("geometry.page_size = %d: the daemon serves page sizes %s",
                               g.page_size, absl::StrJoin(kSupportedPageSizes, ", ")));
  }
  KVTIER_RETURN_IF_ERROR(g.Validate());
  if (static_cast<uint32_t>(g.num_layers) > config_.max_layers) {
    return bad(absl::StrFormat("geometry.num_layers = %d: must be at most max_layers = %d",
                               g.num_layers, config_.max_layers));
  }
  const int64_t max_tokens =
      p.max_tokens != 0 ? p.max_tokens
                        : std::min(config_.default_max_tokens, config_.max_tokens_per_session);
  // This daemon's limits; the options' own rules are ResolveSequenceOptions's, below.
  if (max_tokens > config_.max_tokens_per_session) {
    return bad(absl::StrFormat("max_tokens = %d: must be at most max_tokens_per_session = %d",
                               max_tokens, config_.max_tokens_per_session));
  }
  // The working set never needs to be larger than the capacity, rounded up to whole budgets.
  const int64_t quantum = int64_t{4} * g.page_size;
  const int64_t cap = (max_tokens + quantum - 1) / quantum * quantum;
  const int64_t budget =
      p.budget_tokens != 0 ? p.budget_tokens : std::min<int64_t>(kDefaultBudgetTokens, cap);
  if (budget > cap) {
    return bad(absl::StrFormat(
        "budget_tokens = %d: must be at most %d (max_tokens = %d rounded up to a multiple of "
        "4 × page_size) in this service",
        budget, cap, max_tokens));
  }
  // The protocol's options as SequenceOptions (zero and unset: the defaults), then resolved.
  SequenceOptions given;
  given.mode = p.mode;
  given.max_tokens = static_cast<int32_t>(max_tokens);
  KVTIER_RETURN_IF_ERROR(given.SetBudgetTokens(static_cast<int32_t>(budget), g.page_size));
  // A split given replaces the budget's default one part by part; the selected pages are the
  // rest, which the resolver judges below (as in-process).
  if (p.sink_pages.has_value() || p.recent_pages.has_value()) {
    KVTIER_RETURN_IF_ERROR(given.SplitBudget(p.sink_pages.value_or(given.sink_pages),
                                             p.recent_pages.value_or(given.recent_pages)));
  }
  given.correction_threshold = p.correction_threshold.value_or(kDefaultCorrectionThreshold);
  if (!p.correction_trigger.empty() &&
      !ParseCorrectionTrigger(p.correction_trigger, &given.correction_trigger)) {
    return bad(absl::StrFormat(
        "retrieval.correction_trigger = '%s': must be one of cosine, mass (empty: cosine)",
        Printable(p.correction_trigger)));
  }
  given.correction_max_loss = p.correction_max_loss.value_or(kDefaultCorrectionMaxLoss);
  if (!p.summary.empty() && !ParseSummaryMode(p.summary, &given.summary)) {
    return bad(absl::StrFormat(
        "retrieval.summary = '%s': must be one of key-codes, center-mad, minmax (empty: %s)",
        Printable(p.summary), SummaryModeName(SequenceOptions().summary)));
  }
  SessionSpec spec;
  spec.tenant = caller.tenant;
  spec.label = p.label;
  spec.geometry = g;
  spec.transport = p.transport;
  spec.budget_tokens = static_cast<int32_t>(budget);
  KVTIER_ASSIGN_OR_RETURN(spec.sequence, ResolveSequenceOptions(given, g.page_size));
  const bool selects = p.mode == RetrievalMode::kSpeculative || p.mode == RetrievalMode::kSync;
  PolicyConfig& pc = spec.sequence.policy;
  if (!p.budget_policy.empty()) pc.budget = p.budget_policy;
  if (!p.residency_policy.empty()) pc.residency = p.residency_policy;
  if (!p.host_drop.empty()) pc.host_drop = p.host_drop;
  pc.params = p.policy_params;
  if (absl::Status st = policy::ValidatePolicyConfig(pc); !st.ok()) {
    // The message quotes what the client sent: keep it, minus control characters.
    std::string msg(st.message());
    for (char& ch : msg) {
      if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
    }
    return bad(std::move(msg));
  }
  spec.host_pages = spec.max_pages();
  if (pc.host_drop == "demote") {
    // The session's Retriever moves pages to the cold tier and back: the daemon's own (GRPC),
    // or the engine's through DemotePages and PromotePages (SHM).
    if (!selects) {
      return bad(absl::StrFormat(
          "policy.host_drop = 'demote': mode %s has no host tier (SPECULATIVE or SYNC only)",
          RetrievalModeName(p.mode)));
    }
    const ColdStore* store = ColdStoreOf(caller.tenant);
    if (store == nullptr || store->options().quota_bytes == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "policy.host_drop = 'demote': tenant '%s' has no cold tier (configure [cold_tier] "
          "and tenant.cold_quota_bytes)",
          caller.tenant));
    }
  } else if (pc.host_drop != "refuse") {
    // A session's stored pages are committed to its region's directory, which a drop would
    // have to take back: not offered until the commit protocol has a decommit.
    return bad(
        "policy.host_drop = 'evict': sessions refuse when the tenant arena is full "
        "(host_drop = refuse) or demote pages to the cold tier (host_drop = demote)");
  }
  if (p.host_tokens != 0) {
    const int64_t host_pages = (int64_t{p.host_tokens} + g.page_size - 1) / g.page_size;
    if (host_pages > spec.max_pages()) {
      return bad(absl::StrFormat("retrieval.host_tokens = %d: must be at most max_tokens = %d",
                                 p.host_tokens, max_tokens));
    }
    if (host_pages < spec.max_pages() && pc.host_drop != "demote") {
      return bad(absl::StrFormat(
          "retrieval.host_tokens = %d is below max_tokens = %d: the pages past it need "
          "policy.host_drop = 'demote'",
          p.host_tokens, max_tokens));
    }
    const SequenceOptions& so = spec.sequence;
    const int64_t need = DemoteFloorPages(g, so);
    const int64_t need_per_layer = (need + g.num_layers - 1) / g.num_layers;
    if (host_pages < need_per_layer) {
      return bad(absl::StrFormat(
          "retrieval.host_tokens = %d: the host tier must hold at least %d tokens per layer "
          "(sink %d + recent %d + 1 pages per layer, and 2 × %d KV heads × %d selected pages "
          "over the %d layers, at page_size %d)",
          p.host_tokens, need_per_layer * g.page_size, so.sink_pages, so.recent_pages,
          g.num_kv_heads, so.selected_pages, g.num_layers, g.page_size));
    }
    spec.host_pages = static_cast<int32_t>(host_pages);
  }
  if (p.label.size() > kMaxLabelBytes) {
    return bad(absl::StrFormat("label: %d bytes, at most %d", p.label.size(), kMaxLabelBytes));
  }
  if (p.request_id.size() > kMaxRequestIdBytes ||
      !std::all_of(p.request_id.begin(), p.request_id.end(),
                   [](char c) { return c >= 0x20 && c <= 0x7e; })) {
    return bad(absl::StrFormat("request_id = '%s': at most %d bytes of printable ASCII",
                               Printable(p.request_id), kMaxRequestIdBytes));
  }
  if (p.transport == Transport::kShm && !config_.shm) {
    return absl::FailedPreconditionError(
        "transport = SHM: this daemon serves no attach socket (server.shm = false); use GRPC");
  }
  return spec;
}

absl::Status SessionManager::ReserveSession(const Tenant& tenant) {
  MutexLock lock(&mu_);
  uint32_t count = opening_[tenant.name()];
  // Cold sessions hold no host memory and do not count.
  for (const auto& [id, e] : sessions_) count += e.session != nullptr && e.tenant == tenant.name();
  if (count >= config_.max_sessions_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("tenant '%s' has %d sessions: max_sessions_per_tenant = %d", tenant.name(),
                        count, config_.max_sessions_per_tenant));
  }
  ++opening_[tenant.name()];
  return absl::OkStatus();
}

absl::StatusOr<SessionRecord> SessionManager::OpenSession(const Caller& caller,
                                                          const OpenSessionParams& params) {
  InflightCall call(this);
  return Tally(caller, DoOpenSession(caller, params));
}

namespace {

// Everything that defines a session but its label, for comparing a retried request.
std::string RequestFingerprint(const OpenSessionParams& p) {
  std::string f = absl::StrFormat(
      "%s|%s|%d|%d|%d|%d|%g|%s|%d|%g|%s|%d|%d|%d|%d|%s|%s|%s|%d", p.geometry.ToString(),
      RetrievalModeName(p.mode), p.budget_tokens, p.max_tokens, p.host_tokens, p.correction_threshold.has_value(),
      p.correction_threshold.value_or(0.0f), p.correction_trigger,
      p.correction_max_loss.has_value(), p.correction_max_loss.value_or(0.0f), p.summary,
      p.sink_pages.has_value(), p.sink_pages.value_or(0), p.recent_pages.has_value(),
      p.recent_pages.value_or(0),
      p.budget_policy, p.residency_policy, p.host_drop, static_cast<int>(p.transport));
  for (const auto& [k, v] : p.policy_params) absl::StrAppend(&f, "|", k, "=", v);
  return f;
}

}  // namespace

absl::StatusOr<std::optional<SessionRecord>> SessionManager::ClaimRequestId(
    const std::string& key, const std::string& fingerprint) {
  std::optional<Entry> existing;
  {
    MutexLock lock(&mu_);
    auto [it, fresh] = requests_.try_emplace(key, RequestEntry{"", fingerprint});
    if (fresh) return std::optional<SessionRecord>();
    if (it->second.session_id.empty()) {
      return absl::AbortedError(
          "an OpenSession with this request_id is in progress; retry when it has answered");
    }
    if (it->second.fingerprint != fingerprint) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "request_id opened session %s with other parameters; a retry must repeat the request "
          "(only the label may differ)",
          it->second.session_id));
    }
    auto s = sessions_.find(it->second.session_id);
    if (s != sessions_.end()) existing = s->second;
  }
  if (!existing.has_value()) return std::optional<SessionRecord>();  // closed meanwhile
  return std::optional<SessionRecord>(existing->Record());
}

absl::StatusOr<SessionRecord> SessionManager::DoOpenSession(const Caller& caller,
                                                            const OpenSessionParams& params) {
  if (draining()) return absl::UnavailableError("kvtierd is draining: no new sessions");
  KVTIER_ASSIGN_OR_RETURN(SessionSpec spec, ResolveSpec(caller, params));
  Tenant* tenant = FindTenant(caller.tenant);
  if (tenant == nullptr) return absl::PermissionDeniedError("unknown tenant");
  const std::string request_key =
      params.request_id.empty() ? "" : absl::StrCat(caller.tenant, "/", params.request_id);
  if (!request_key.empty()) {
    KVTIER_ASSIGN_OR_RETURN(std::optional<SessionRecord> again,
                            ClaimRequestId(request_key, RequestFingerprint(params)));
    if (again.has_value()) return *std::move(again);
  }
  absl::Cleanup unclaim = [&] {
    if (request_key.empty()) return;
    MutexLock lock(&mu_);
    auto it = requests_.find(request_key);
    if (it != requests_.end() && it->second.session_id.empty()) requests_.erase(it);
  };
  KVTIER_RETURN_IF_ERROR(caller.CheckLive("OpenSession"));
  KVTIER_RETURN_IF_ERROR(ReserveSession(*tenant));
  absl::Cleanup unreserve = [&] {
    MutexLock lock(&mu_);
    --opening_[tenant->name()];
  };
  const Geometry& g = spec.geometry;
  KVTIER_ASSIGN_OR_RETURN(RegionLayout layout,
                          ComputeRegionLayout(g, spec.max_pages(), spec.host_slots()));
  KVTIER_ASSIGN_OR_RETURN(RegionLease lease,
                          AllocateRegion(*tenant, layout.total_bytes, ColdDeadline(caller)));
  std::string id = NewSessionId();
  // host_drop = demote: the session's pages past its host tier go to the tenant's cold store.
  ColdStore* demote_to = spec.demotes_pages() ? ColdStoreOf(spec.tenant) : nullptr;
  KVTIER_ASSIGN_OR_RETURN(
      std::shared_ptr<TenantSession> session,
      TenantSession::Create(id, std::move(spec), std::move(lease), backend_.get(), tenant,
                            demote_to, config_.cold_tier.operation_timeout));
  // The point of no return is the table below: a caller that is no longer live gets no
  // session, and the one made for it goes away with this reference.
  if (absl::Status live = caller.CheckLive("OpenSession"); !live.ok()) {
    (void)session->Close();
    return absl::Status(live.code(),
                        absl::StrCat(live.message(), "; the session it made was closed again"));
  }
  std::move(unreserve).Cancel();
  std::move(unclaim).Cancel();
  {
    MutexLock lock(&mu_);
    --opening_[tenant->name()];
    Entry e;
    e.seq = next_seq_++;
    e.tenant = tenant->name();
    e.session = session;
    e.request_key = request_key;
    e.params = params;
    sessions_.emplace(id, std::move(e));
    if (!request_key.empty()) requests_[request_key].session_id = id;
  }
  session_events_.Add({"opened", caller.tenant, std::string(TransportName(params.transport))});
  SaveSessionTable(caller.tenant);
  SessionRecord r = session->Record();
  LogLimited(spdlog::level::info, "session opened",
             "session {} opened: tenant '{}', {} {}, {} {} tokens per layer, budget {}, "
             "region {} bytes at {}",
             id, r.spec.tenant, r.spec.geometry.ToString(), RetrievalModeName(r.spec.sequence.mode),
             r.spec.transport == Transport::kGrpc ? "GRPC" : "SHM", r.spec.sequence.max_tokens,
             r.spec.budget_tokens, r.region_bytes, r.region_offset);
  return r;
}

}  // namespace kvtier::daemon
