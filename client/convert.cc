#include "client/convert.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {

std::string RandomRequestId() {
  absl::BitGen bits;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(bits),
                         absl::Uniform<uint64_t>(bits));
}

absl::StatusOr<v1::OpenSessionRequest> BuildOpenSessionRequest(std::string_view tenant,
                                                               const SessionOptions& options) {
  const Geometry& g = options.geometry;
  KVTIER_RETURN_IF_ERROR(g.Validate());
  const SequenceOptions& r = options.sequence;
  // The options' rules are the resolver's. max_tokens 0 leaves the capacity to the daemon,
  // which resolves the options again once it has filled it in.
  SequenceOptions given = r;
  if (given.max_tokens == 0) given.max_tokens = kMaxSequenceTokens;
  KVTIER_RETURN_IF_ERROR(ResolveSequenceOptions(given, g.page_size).status());
  // What the protocol carries: the budget in tokens (a multiple of 4 pages, as
  // SetBudgetTokens takes it) and its sink and recent pages; the selected pages are the rest.
  const int64_t budget_tokens = int64_t{r.budget_pages()} * g.page_size;
  SequenceOptions split;
  if (budget_tokens > std::numeric_limits<int32_t>::max() ||
      !split.SetBudgetTokens(static_cast<int32_t>(budget_tokens), g.page_size).ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence sink_pages = %d, selected_pages = %d, recent_pages = %d: the protocol "
        "carries the budget in tokens, a positive multiple of 4 pages (%d tokens at p = %d); "
        "these %d pages are %d tokens",
        r.sink_pages, r.selected_pages, r.recent_pages, 4 * g.page_size, g.page_size,
        r.budget_pages(), budget_tokens));
  }
  v1::OpenSessionRequest req;
  req.set_tenant(std::string(tenant));
  *req.mutable_geometry() = GeometryToProto(g);
  v1::RetrievalOptions* ro = req.mutable_retrieval();
  ro->set_mode(ModeToProto(r.mode));
  ro->set_budget_tokens(static_cast<uint32_t>(budget_tokens));
  ro->set_max_tokens(static_cast<uint32_t>(r.max_tokens));
  ro->set_correction_threshold(r.correction_threshold);
  ro->set_correction_trigger(std::string(CorrectionTriggerName(r.correction_trigger)));
  ro->set_correction_max_loss(r.correction_max_loss);
  ro->set_summary(std::string(SummaryModeName(r.summary)));
  ro->set_sink_pages(static_cast<uint32_t>(r.sink_pages));
  ro->set_recent_pages(static_cast<uint32_t>(r.recent_pages));
  if (options.host_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "host_tokens = %d: must be >= 0 (0: max_tokens)", options.host_tokens));
  }
  ro->set_host_tokens(static_cast<uint32_t>(options.host_tokens));
  // The policies, whole: a GRPC session's run in kvtierd, and the daemon judges them for every
  // session (an SHM session's also run in the engine's sequence; what a full host tier does
  // is the daemon's business either way: it sizes the region and moves demoted pages).
  v1::PolicyOptions* po = req.mutable_policy();
  if (r.policy.budget != "fixed") po->set_budget_policy(r.policy.budget);
  if (r.policy.residency != "none") po->set_residency_policy(r.policy.residency);
  po->set_host_drop(r.policy.host_drop);
  for (const auto& [key, value] : r.policy.params) (*po->mutable_params())[key] = value;
  req.set_transport(TransportToProto(options.transport));
  req.set_label(options.label);
  req.set_request_id(options.request_id.empty() ? RandomRequestId() : options.request_id);
  return req;
}

absl::StatusOr<SequenceOptions> SequenceOptionsForSession(const SequenceOptions& local,
                                                          const SessionInfo& info) {
  SequenceOptions o = local;
  o.mode = info.mode;
  if (info.budget_tokens != 0) {
    if (absl::Status st = o.SetBudgetTokens(info.budget_tokens, info.geometry.page_size);
        !st.ok()) {
      return absl::InternalError(absl::StrCat(
          "session ", info.id, ": the daemon resolved an unusable budget: ", st.message()));
    }
    const int32_t pages = o.budget_pages();
    if (!o.SplitBudget(info.sink_pages, info.recent_pages).ok() || o.sink_pages < 0 ||
        o.recent_pages < 1 || o.selected_pages < 0) {
      return absl::InternalError(absl::StrFormat(
          "session %s: the daemon resolved an unusable split: %d sink and %d recent of %d pages",
          info.id, info.sink_pages, info.recent_pages, pages));
    }
  }
  if (info.max_tokens != 0) o.max_tokens = info.max_tokens;
  o.correction_threshold = info.correction_threshold;
  o.correction_trigger = info.correction_trigger;
  o.correction_max_loss = info.correction_max_loss;
  o.summary = info.summary;
  return o;
}

absl::StatusOr<SessionInfo> SessionInfoFromProto(const v1::SessionInfo& p) {
  SessionInfo info;
  info.id = p.session_id();
  info.tenant = p.tenant();
  info.label = p.label();
  KVTIER_ASSIGN_OR_RETURN(info.transport, TransportFromProto(p.transport()));
  KVTIER_ASSIGN_OR_RETURN(info.geometry, GeometryFromProto(p.geometry()));
  KVTIER_ASSIGN_OR_RETURN(info.mode, ModeFromProto(p.retrieval().mode()));
  KVTIER_ASSIGN_OR_RETURN(info.budget_tokens,
                          ToInt32(p.retrieval().budget_tokens(), "retrieval.budget_tokens"));
  KVTIER_ASSIGN_OR_RETURN(info.max_tokens,
                          ToInt32(p.retrieval().max_tokens(), "retrieval.max_tokens"));
  // The split as resolved; a daemon that sends none splits as SetBudgetTokens does.
  SequenceOptions split;
  if (info.budget_tokens != 0) {
    (void)split.SetBudgetTokens(info.budget_tokens, info.geometry.page_size);
  }
  info.sink_pages = split.sink_pages;
  info.recent_pages = split.recent_pages;
  if (p.retrieval().has_sink_pages()) {
    KVTIER_ASSIGN_OR_RETURN(info.sink_pages,
                            ToInt32(p.retrieval().sink_pages(), "retrieval.sink_pages"));
  }
  if (p.retrieval().has_recent_pages()) {
    KVTIER_ASSIGN_OR_RETURN(info.recent_pages,
                            ToInt32(p.retrieval().recent_pages(), "retrieval.recent_pages"));
  }
  if (p.retrieval().has_correction_threshold()) {
    info.correction_threshold = p.retrieval().correction_threshold();
  }
  if (!p.retrieval().correction_trigger().empty() &&
      !ParseCorrectionTrigger(p.retrieval().correction_trigger(), &info.correction_trigger)) {
    return absl::InvalidArgumentError(absl::StrCat("retrieval.correction_trigger = '",
                                                   p.retrieval().correction_trigger(),
                                                   "': must be one of cosine, mass"));
  }
  if (p.retrieval().has_correction_max_loss()) {
    info.correction_max_loss = p.retrieval().correction_max_loss();
  }
  if (!p.retrieval().summary().empty() &&
      !ParseSummaryMode(p.retrieval().summary(), &info.summary)) {
    return absl::InvalidArgumentError(absl::StrCat("retrieval.summary = '",
                                                   p.retrieval().summary(),
                                                   "': must be one of key-codes, center-mad, minmax"));
  }
  info.closing = p.state() == v1::SESSION_STATE_CLOSING;
  info.suspended = p.state() == v1::SESSION_STATE_SUSPENDED;
  info.cold = p.state() == v1::SESSION_STATE_COLD;
  info.epoch = p.epoch();
  info.committed_tokens.reserve(static_cast<size_t>(p.committed_tokens_size()));
  for (uint64_t t : p.committed_tokens()) {
    if (t > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("committed_tokens = ", t, ": out of range"));
    }
    info.committed_tokens.push_back(static_cast<int64_t>(t));
  }
  for (uint64_t n : p.steps_run()) {
    if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("steps_run = ", n, ": out of range"));
    }
    info.steps_run.push_back(static_cast<int64_t>(n));
  }
  info.region_offset = p.region_offset();
  info.region_bytes = p.region_bytes();
  info.created_unix_ms = p.created_unix_ms();
  return info;
}

Capabilities CapabilitiesFromHello(const v1::HelloReply& r) {
  Capabilities c;
  c.protocol_version = r.protocol_version();
  c.server_version = r.server_version();
  for (uint32_t p : r.page_sizes()) c.page_sizes.push_back(static_cast<int32_t>(p));
  for (int t : r.dtypes()) {
    if (auto d = DTypeFromProto(t); d.ok()) c.dtypes.push_back(*d);  // skip unknown ones
  }
  c.layouts.assign(r.layouts().begin(), r.layouts().end());
  c.backends.assign(r.backends().begin(), r.backends().end());
  for (int m : r.modes()) {
    if (m == v1::MODE_UNSPECIFIED) continue;
    if (auto mode = ModeFromProto(m); mode.ok()) c.modes.push_back(*mode);
  }
  c.max_message_bytes = r.limits().max_message_bytes();
  c.max_sessions_per_tenant = r.limits().max_sessions_per_tenant();
  c.max_tokens_per_session = r.limits().max_tokens_per_session();
  c.max_tokens_per_offload = r.limits().max_tokens_per_offload();
  c.tenant = r.tenant();
  c.shm_available = r.shm_available();
  c.attach_socket = r.attach_socket();
  c.tenant_quota_bytes = r.tenant_quota_bytes();
  return c;
}

SequenceStats StatsFromProto(const v1::SessionStats& s) {
  SequenceStats r;
  CountersFromProto(s, &r);
  return r;
}

}  // namespace kvtier
